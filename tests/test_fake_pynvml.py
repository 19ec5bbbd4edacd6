"""The fake pynvml (tests/harness/fake_pynvml.py) against the real nvidia-ml-py.

The GPU tests are only as good as the fake's likeness to pynvml: these tests
hold it to pynvml's function names and signatures, its structs, constants and
error classes, so that a pynvml upgrade that changes them fails here first.
"""

from __future__ import annotations

import inspect

import pynvml
import pytest

from harness.fake_pynvml import FAKED, FakeNvml, h100_sxm


@pytest.mark.parametrize("name", FAKED)
def test_every_faked_function_has_pynvmls_name_and_signature(name: str) -> None:
    module = FakeNvml([]).module()
    assert hasattr(pynvml, name), f"pynvml has no {name}"
    assert inspect.signature(getattr(module, name)) == inspect.signature(getattr(pynvml, name))


def test_constants_structs_and_errors_are_pynvmls_own() -> None:
    module = FakeNvml([]).module()
    for name in ("NVML_GPM_METRIC_DRAM_BW_UTIL", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "nvmlMemory_v2"):
        assert getattr(module, name) == getattr(pynvml, name)
    for name in ("NVMLError", "NVMLError_GpuIsLost", "NVMLError_NotSupported", "c_nvmlGpmMetricsGet_t"):
        assert getattr(module, name) is getattr(pynvml, name)


def test_functions_pynvml_has_but_the_fake_does_not_are_absent_not_real() -> None:
    """A call the fake does not model must fail loudly, never reach the real (absent) library."""
    module = FakeNvml([]).module()
    assert not hasattr(module, "nvmlDeviceGetPcieThroughput")


def test_errors_are_raised_as_pynvml_raises_them() -> None:
    fake = FakeNvml(
        [h100_sxm(unsupported={"nvmlDeviceGetPowerUsage"})], missing=frozenset({"nvmlDeviceGetTemperatureV"})
    )
    n = fake.module()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        n.nvmlDeviceGetCount()
    n.nvmlInit()
    handle = n.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        n.nvmlDeviceGetPowerUsage(handle)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        n.nvmlDeviceGetTemperatureV(handle, n.NVML_TEMPERATURE_GPU)
    fake.gpus[0].failure = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        n.nvmlDeviceGetUtilizationRates(handle)


def test_gpm_metrics_are_rates_between_two_samples() -> None:
    fake = FakeNvml([h100_sxm(gpm={pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 40.0})])
    n = fake.module()
    n.nvmlInit()
    handle = n.nvmlDeviceGetHandleByIndex(0)
    first, second = n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()
    n.nvmlGpmSampleGet(handle, first)
    fake.advance(2)
    n.nvmlGpmSampleGet(handle, second)
    req = pynvml.c_nvmlGpmMetricsGet_t()
    req.version, req.numMetrics, req.sample1, req.sample2 = pynvml.NVML_GPM_METRICS_GET_VERSION, 1, first, second
    req.metrics[0].metricId = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    n.nvmlGpmMetricsGet(req)
    assert (req.metrics[0].nvmlReturn, req.metrics[0].value) == (pynvml.NVML_SUCCESS, 40.0)
    req.sample1, req.sample2 = second, first  # the wrong way round is an error, as on a real driver
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        n.nvmlGpmMetricsGet(req)


def test_events_come_through_the_set_they_were_registered_in_and_a_wait_without_one_times_out() -> None:
    fake = FakeNvml([h100_sxm(0), h100_sxm(1, event_types=0)])
    n = fake.module()
    n.nvmlInit()
    first, second = n.nvmlDeviceGetHandleByIndex(0), n.nvmlDeviceGetHandleByIndex(1)
    events = n.nvmlEventSetCreate()
    assert isinstance(events, pynvml.c_nvmlEventSet_t)
    assert n.nvmlDeviceGetSupportedEventTypes(first) & pynvml.nvmlEventTypeXidCriticalError
    n.nvmlDeviceRegisterEvents(first, pynvml.nvmlEventTypeXidCriticalError, events)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        n.nvmlDeviceRegisterEvents(second, pynvml.nvmlEventTypeXidCriticalError, events)
    fake.xid(1, 79)  # not registered: never delivered
    fake.xid(0, 48)
    data = n.nvmlEventSetWait(events, 1000)
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 48)
    assert n.nvmlDeviceGetUUID(data.device) == "GPU-h100-0000-0"
    with pytest.raises(pynvml.NVMLError_Timeout):
        n.nvmlEventSetWait(events, 10)
    n.nvmlEventSetFree(events)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        n.nvmlEventSetWait(events, 10)


def test_a_driver_that_goes_away_fails_every_call_and_init_until_it_is_back() -> None:
    fake = FakeNvml([h100_sxm(remapped_rows=(2, 0, 1, 0))])
    n = fake.module()
    n.nvmlInit()
    handle = n.nvmlDeviceGetHandleByIndex(0)
    assert n.nvmlDeviceGetRemappedRows(handle) == (2, 0, 1, 0)
    fake.unload()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        n.nvmlDeviceGetRemappedRows(handle)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        n.nvmlInit()
    fake.load()
    n.nvmlInit()
    assert n.nvmlDeviceGetCount() == 1
