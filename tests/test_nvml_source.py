"""The NVML source against the fake pynvml, rendered and read back with prometheus_client's parser.

Fake boundary: tests/harness/fake_pynvml.py stands in for the GPU driver
(there is no GPU here). Everything above pynvml is real: the source, the
renderer, and for the engine mapping a real process tree with a listening
socket. The exporter as a process, on this GPU-less host, is tested at the end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import psutil
import pynvml
import pytest

from batchlens.config import Engine, load_config
from batchlens.exporter.gpu_metrics import CLOCK_EVENT_REASONS, GPU_METRICS
from batchlens.exporter.nvml_source import NvmlSource
from batchlens.exporter.pci_bus import nvidia_gpus
from batchlens.exporter.render import render
from batchlens.exporter.sampler import Sampler, SourceError
from batchlens.exporter.server import Exporter
from batchlens.exporter.snapshot import Snapshot, SnapshotStore, SourceState
from harness.exporter import ExporterProcess, Samples, one, parse_samples, pick
from harness.fake_pynvml import (
    GIB,
    GPM_DRAM,
    GPM_OCCUPANCY,
    GPM_SM,
    GPM_TENSOR,
    OLD_DRIVER_MISSING,
    FakeGpu,
    FakeNvml,
    FakeProcess,
    a100_80gb,
    h100_mig,
    h100_sxm,
    t4,
)
from harness.fake_sysfs import BRIDGE, GPU_3D, GPU_VGA, INTEL, NVIDIA, gpu_host, pci_bus
from harness.procs import free_port

DOCS = Path(__file__).parent.parent / "docs" / "gpu-metrics.md"


class Rig:
    """A fake driver and a source over it; each scrape comes one 5 s interval after the last. ``sysfs``: the
    host's PCI bus (harness.fake_sysfs); by default none that can be read. Closed after each test (its Xid
    waiter is a thread)."""

    made: ClassVar[list[Rig]] = []

    def __init__(self, gpus: list[FakeGpu], engines=(), sysfs: Path = Path("/nonexistent/sys"), **driver):
        self.gpus = gpus
        self.fake = FakeNvml(gpus, **driver)
        self.nvml = self.fake.module()
        self.src = NvmlSource(list(engines), nvml=self.nvml, sysfs=sysfs)
        Rig.made.append(self)

    def sample(self, models: dict[str, str] | None = None):
        self.fake.advance(5)
        return self.src.sample_now(models or {})

    def scrape(self, models: dict[str, str] | None = None) -> Samples:
        state = SourceState("nvml", (), True, self.sample(models), 1.0, 0.01, {})
        return parse_samples(render(Snapshot(1, (state,))).decode())


@pytest.fixture(autouse=True)
def close_rigs() -> Iterator[None]:
    yield
    while Rig.made:
        Rig.made.pop().src.close()


def labels(gpu: FakeGpu, index: int, *, mig: str = "", name: str = "", uuid: str = "", engine="", model="") -> dict:
    return {
        "gpu": str(index),
        "uuid": uuid or gpu.uuid,
        "gpu_name": name or gpu.name,
        "mig_instance": mig,
        "vllm_instance": engine,
        "model_name": model,
    }


def value(samples: Samples, name: str, lbl: dict) -> float:
    key = (name, frozenset(lbl.items()))
    assert key in samples, f"no {name}{lbl}; have {sorted(str(dict(k[1])) for k in samples if k[0] == name)[:4]}"
    return samples[key]


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_an_a100_without_gpm_exports_what_nvml_reports() -> None:
    gpu = a100_80gb(
        util_gpu=87,
        util_mem=73,
        memory_used=60 * GIB,
        sm_mhz=1410,
        mem_mhz=1593,
        power_mw=312_500,
        energy_mj=5_000_250,
        temperature=61,
        pcie_tx=123_456,
        pcie_rx=654_321,
        nvlink_tx_kib=1000,
        nvlink_rx_kib=2000,
        clock_events=0x4 | 0x8,  # software power cap, hardware slowdown
        ecc_corrected=3,
        ecc_uncorrected=1,
    )
    samples = Rig([gpu]).scrape()
    lbl = labels(gpu, 0)
    expected = {
        "batchlens_gpu_sm_busy_ratio": 0.87,
        "batchlens_gpu_memory_busy_ratio": 0.73,
        "batchlens_gpu_memory_total_bytes": 80 * GIB,
        "batchlens_gpu_memory_used_bytes": 60 * GIB,
        "batchlens_gpu_memory_reserved_bytes": 512 * 1024**2,
        "batchlens_gpu_memory_free_bytes": 80 * GIB - 60 * GIB - 512 * 1024**2,
        "batchlens_gpu_sm_clock_hertz": 1410e6,
        "batchlens_gpu_memory_clock_hertz": 1593e6,
        "batchlens_gpu_sm_clock_max_hertz": 1410e6,
        "batchlens_gpu_memory_clock_max_hertz": 1593e6,
        "batchlens_gpu_power_watts": 312.5,
        "batchlens_gpu_energy_joules_total": 5000.25,
        "batchlens_gpu_temperature_celsius": 61,
        "batchlens_gpu_pcie_transmit_bytes_total": 123_456,
        "batchlens_gpu_pcie_receive_bytes_total": 654_321,
        "batchlens_gpu_nvlink_transmit_bytes_total": 1000 * 1024,
        "batchlens_gpu_nvlink_receive_bytes_total": 2000 * 1024,
        "batchlens_gpu_memory_bandwidth_peak_bytes_per_second": 5120 * 1593e6 * 2 / 8,
    }
    assert {name: value(samples, name, lbl) for name in expected} == pytest.approx(expected)
    active = {dict(k)["reason"]: v for k, v in pick(samples, "batchlens_gpu_clock_event_active").items()}
    assert active == {reason: float(reason in ("sw_power_cap", "hw_slowdown")) for _, reason in CLOCK_EVENT_REASONS}
    assert value(samples, "batchlens_gpu_ecc_errors_total", {**lbl, "type": "corrected"}) == 3
    assert value(samples, "batchlens_gpu_ecc_errors_total", {**lbl, "type": "uncorrected"}) == 1
    info = {**lbl, "architecture": "ampere", "bandwidth_basis": "bus", "mig_mode": "disabled"}
    assert value(samples, "batchlens_gpu_info", info) == 1
    assert value(samples, "batchlens_source_up", up_labels(gpu, 0)) == 1
    assert value(samples, "batchlens_nvml_info", {"driver_version": "570.86.15", "nvml_version": "12.570.86.15"}) == 1
    # No GPM before Hopper: neither a bandwidth ratio nor an estimate from one.
    assert not names(samples) & {
        "batchlens_gpu_dram_bandwidth_ratio",
        "batchlens_gpu_memory_bandwidth_bytes_per_second",
    }


def test_h100_gpm_compares_each_tick_with_the_previous_one() -> None:
    gpu = h100_sxm(gpm={GPM_DRAM: 64.0, GPM_SM: 80.0, GPM_OCCUPANCY: 35.0, GPM_TENSOR: 55.0})
    rig = Rig([gpu])
    first = rig.scrape()  # one sample taken, nothing to compare it with yet: no value, and no waiting for one
    assert "batchlens_gpu_dram_bandwidth_ratio" not in names(first)
    second = rig.scrape()
    lbl = labels(gpu, 0)
    peak = 5120 * 2619e6 * 2 / 8
    assert value(second, "batchlens_gpu_dram_bandwidth_ratio", lbl) == pytest.approx(0.64)
    assert value(second, "batchlens_gpu_sm_active_ratio", lbl) == pytest.approx(0.80)
    assert value(second, "batchlens_gpu_sm_occupancy_ratio", lbl) == pytest.approx(0.35)
    assert value(second, "batchlens_gpu_tensor_active_ratio", lbl) == pytest.approx(0.55)
    assert value(second, "batchlens_gpu_memory_bandwidth_peak_bytes_per_second", lbl) == pytest.approx(peak)
    assert value(second, "batchlens_gpu_memory_bandwidth_bytes_per_second", lbl) == pytest.approx(0.64 * peak)
    # The next interval has other rates: the value covers it alone, not the time since the first sample.
    gpu.gpm = {GPM_DRAM: 10.0, GPM_SM: 20.0, GPM_OCCUPANCY: 5.0, GPM_TENSOR: 0.0}
    third = rig.scrape()
    assert value(third, "batchlens_gpu_dram_bandwidth_ratio", lbl) == pytest.approx(0.10)
    assert value(third, "batchlens_gpu_tensor_active_ratio", lbl) == pytest.approx(0.0)
    assert rig.fake.calls["nvmlGpmSampleAlloc"] == 2, "two samples, reused in turn"


def test_h100_in_mig_mode_exports_each_instance_with_its_gpm() -> None:
    gpu = h100_mig()
    gpu.mig[0].gpm = {GPM_DRAM: 30.0, GPM_SM: 50.0}
    gpu.mig[1].gpm = {GPM_DRAM: 70.0, GPM_SM: 90.0}
    rig = Rig([gpu])
    rig.scrape()
    samples = rig.scrape()
    mig = [labels(gpu, 0, mig=str(m.gpu_instance), name=m.name, uuid=m.uuid) for m in gpu.mig]
    assert value(samples, "batchlens_gpu_memory_used_bytes", mig[0]) == 10 * GIB
    assert value(samples, "batchlens_gpu_memory_used_bytes", mig[1]) == 30 * GIB
    assert value(samples, "batchlens_gpu_dram_bandwidth_ratio", mig[0]) == pytest.approx(0.30)
    assert value(samples, "batchlens_gpu_dram_bandwidth_ratio", mig[1]) == pytest.approx(0.70)
    assert value(samples, "batchlens_gpu_sm_active_ratio", mig[1]) == pytest.approx(0.90)
    whole = labels(gpu, 0)
    assert value(samples, "batchlens_gpu_memory_total_bytes", whole) == 80 * GIB
    info = {**whole, "architecture": "hopper", "bandwidth_basis": "bus", "mig_mode": "enabled"}
    assert value(samples, "batchlens_gpu_info", info) == 1
    # MIG mode has no utilization rates, for the GPU or its instances; asked once each, then never again.
    assert not pick(samples, "batchlens_gpu_sm_busy_ratio")
    rig.scrape()
    assert rig.fake.calls["nvmlDeviceGetUtilizationRates"] == 3
    # One up series for the physical GPU, not one per instance.
    assert list(pick(samples, "batchlens_source_up", source="nvml", gpu="0").values()) == [1]


def test_a_t4_without_nvlink_or_mig_is_asked_for_neither_again() -> None:
    gpu = t4(pcie_tx=10, pcie_rx=20)
    rig = Rig([gpu])
    for _ in range(3):
        samples = rig.scrape()
    assert not names(samples) & {
        "batchlens_gpu_nvlink_transmit_bytes_total",
        "batchlens_gpu_nvlink_receive_bytes_total",
    }
    assert value(samples, "batchlens_gpu_pcie_receive_bytes_total", labels(gpu, 0)) == 20
    assert rig.fake.fields_asked[pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF] == 1
    assert rig.fake.fields_asked[pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0] == 3
    assert rig.fake.calls["nvmlDeviceGetMigMode"] == 1
    info = {**labels(gpu, 0), "architecture": "turing", "bandwidth_basis": "bus", "mig_mode": "unsupported"}
    assert value(samples, "batchlens_gpu_info", info) == 1
    assert "batchlens_gpu_ecc_errors_total" not in names(samples)  # ECC is off


def test_an_old_driver_gets_the_older_calls_and_one_log_line_each(caplog) -> None:
    gpu = h100_sxm(temperature=55, clock_events=0x1, processes=[FakeProcess(4242, 3 * GIB)])
    rig = Rig([gpu], missing=OLD_DRIVER_MISSING)
    with caplog.at_level(logging.INFO, "batchlens.exporter"):
        for _ in range(3):
            samples = rig.scrape()
    lbl = labels(gpu, 0)
    assert value(samples, "batchlens_gpu_memory_used_bytes", lbl) == 0
    assert "batchlens_gpu_memory_reserved_bytes" not in names(samples)  # v1 has no reserved memory
    assert value(samples, "batchlens_gpu_temperature_celsius", lbl) == 55
    assert value(samples, "batchlens_gpu_clock_event_active", {**lbl, "reason": "gpu_idle"}) == 1
    process = {"gpu": "0", "pid": "4242", "vllm_instance": ""}
    assert value(samples, "batchlens_gpu_process_memory_bytes", process) == 3 * GIB
    assert "batchlens_gpu_dram_bandwidth_ratio" not in names(samples)  # no GPM query on this driver
    for symbol in OLD_DRIVER_MISSING:
        assert rig.fake.calls[symbol] == 1, symbol
        assert sum(symbol in r.getMessage() for r in caplog.records) == 1, symbol


def test_a_static_entry_that_names_no_gpu_is_warned_about_once(caplog) -> None:
    engines = [Engine(name="typo", url="http://10.0.0.9:8000", gpus=[0, "GPU-does-not-exist"])]
    rig = Rig([h100_sxm(0)], engines)
    with caplog.at_level(logging.WARNING, "batchlens.exporter"):
        rig.scrape()
        rig.scrape()
    assert [r.getMessage() for r in caplog.records if "no such GPU" in r.getMessage()] == [
        "nvml: engine typo lists GPU 'GPU-does-not-exist' under gpus:, but this host has no such GPU "
        "(it has 0, GPU-h100-0000-0)"
    ]


def test_a_process_with_unknown_memory_is_mapped_but_has_no_memory_series(server_with_child) -> None:
    port, proc = server_with_child
    worker = psutil.Process(proc.pid).children()[0].pid
    gpu = h100_sxm(processes=[FakeProcess(worker, None)])
    rig = Rig([gpu], [Engine(name="deepseek-a", url=f"http://127.0.0.1:{port}")])
    samples = rig.scrape({"deepseek-a": "deepseek-v3"})
    assert value(samples, "batchlens_gpu_sm_busy_ratio", labels(gpu, 0, engine="deepseek-a", model="deepseek-v3")) == 0
    assert not pick(samples, "batchlens_gpu_process_memory_bytes")


def test_gpus_map_to_engines_through_a_real_process_tree(server_with_child) -> None:
    port, proc = server_with_child
    worker = psutil.Process(proc.pid).children()[0].pid
    stranger = os.getpid()  # a CUDA process of no engine
    gpus = [
        h100_sxm(0, processes=[FakeProcess(worker, 70 * GIB)]),
        h100_sxm(1, processes=[FakeProcess(stranger, 1 * GIB)]),
        h100_sxm(2),
    ]
    engines = [
        Engine(name="deepseek-a", url=f"http://127.0.0.1:{port}"),
        Engine(name="pinned", url="http://10.0.0.9:8000", gpus=["GPU-h100-0000-2"]),
    ]
    rig = Rig(gpus, engines)
    samples = rig.scrape({"deepseek-a": "deepseek-v3", "pinned": "llama"})
    mapped = labels(gpus[0], 0, engine="deepseek-a", model="deepseek-v3")
    assert value(samples, "batchlens_gpu_memory_busy_ratio", mapped) == 0
    assert value(samples, "batchlens_gpu_memory_busy_ratio", labels(gpus[1], 1)) == 0
    assert value(samples, "batchlens_gpu_memory_busy_ratio", labels(gpus[2], 2, engine="pinned", model="llama")) == 0
    per_process = pick(samples, "batchlens_gpu_process_memory_bytes").items()
    memory = {(dict(k)["pid"], dict(k)["vllm_instance"]): v for k, v in per_process}
    assert memory == {(str(worker), "deepseek-a"): 70 * GIB, (str(stranger), ""): 1 * GIB}

    # The worker exits: its series goes with it, and the GPU is no longer the engine's.
    gpus[0].processes = []
    samples = rig.scrape()
    assert [dict(k)["pid"] for k in pick(samples, "batchlens_gpu_process_memory_bytes")] == [str(stranger)]
    assert value(samples, "batchlens_gpu_memory_busy_ratio", labels(gpus[0], 0)) == 0


def test_on_a_headless_node_vllms_gpu_processes_are_the_engines_and_each_gpu_wears_its_rank(tmp_path) -> None:
    """``vllm serve --headless --data-parallel-start-rank 8``: engine cores, no API server to walk up to. Real
    processes titled as vLLM titles its ranks' (``exec -a``); the driver is the fake NVML."""
    cores = [subprocess.Popen(["bash", "-c", f"exec -a VLLM::EngineCore_DP{rank} sleep 60"]) for rank in (8, 9)]
    try:
        deadline = time.monotonic() + 10
        while not all(psutil.Process(c.pid).cmdline()[:1] == [f"VLLM::EngineCore_DP{r}"]
                      for c, r in zip(cores, (8, 9), strict=True)):  # fmt: skip
            assert time.monotonic() < deadline, "the stand-ins never took their titles"
            time.sleep(0.05)
        gpus = [h100_sxm(i, processes=[FakeProcess(core.pid, 70 * GIB)]) for i, core in enumerate(cores)]
        gpus.append(h100_sxm(2, processes=[FakeProcess(os.getpid(), 1 * GIB)]))  # a CUDA process of no vLLM
        rig = Rig(gpus)
        rig.src = NvmlSource([], nvml=rig.nvml, headless_engine="deepseek")
        samples = rig.scrape({"deepseek": "deepseek-v3"})
        for index, rank in ((0, "8"), (1, "9")):
            ranked = {**labels(gpus[index], index, engine="deepseek", model="deepseek-v3"), "dp_rank": rank}
            assert value(samples, "batchlens_gpu_memory_busy_ratio", ranked) == 0
        assert value(samples, "batchlens_gpu_memory_busy_ratio", labels(gpus[2], 2)) == 0  # not vLLM's: unmapped
    finally:
        for core in cores:
            core.kill()
            core.wait()


@pytest.mark.parametrize("failure", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_UNKNOWN])
def test_a_gpu_lost_mid_run_goes_down_alone_names_its_engine_and_comes_back(failure: int) -> None:
    gpus = [h100_sxm(0, util_gpu=50), h100_sxm(1, util_gpu=60)]
    rig = Rig(gpus, [Engine(name="deepseek", url="http://10.0.0.9:8000", gpus=[1])])
    rig.scrape()
    gpus[1].failure = failure
    assert [reason for reason, _ in rig.sample().soft_errors] == ["gpu_lost"]
    samples = rig.scrape()
    # The lost GPU's engine, from its last reading: the page says whose P99 is about to suffer.
    lost = {"source": "nvml", "gpu": "1", "uuid": gpus[1].uuid, "vllm_instance": "deepseek"}
    assert value(samples, "batchlens_source_up", lost) == 0
    assert value(samples, "batchlens_source_up", {**up_labels(gpus[0], 0)}) == 1
    assert value(samples, "batchlens_gpu_sm_busy_ratio", labels(gpus[0], 0)) == 0.5
    assert not any(dict(k).get("gpu") == "1" for name, k in samples if name != "batchlens_source_up")
    gpus[1].failure = None
    samples = rig.scrape()
    assert value(samples, "batchlens_source_up", lost) == 1
    assert value(samples, "batchlens_gpu_sm_busy_ratio", labels(gpus[1], 1, engine="deepseek")) == 0.6


@pytest.mark.parametrize("call", ["nvmlDeviceGetPowerUsage", "nvmlDeviceGetComputeRunningProcesses_v3"])
def test_an_exception_outside_nvml_on_one_gpu_takes_that_gpu_down_alone(call: str, caplog) -> None:
    """A binding's own error (ctypes, a name that does not decode: no NVMLError) on one GPU took every GPU's
    series with it; in the process list, after the GPU's readings, it left them exported beside its
    source_up 0. The fault is injected into the fake module's one call, for GPU 1 alone."""
    gpus = [h100_sxm(0, util_gpu=50), h100_sxm(1, util_gpu=60)]
    rig = Rig(gpus)
    working = getattr(rig.nvml, call)

    def broken(handle):
        if handle.gpu is gpus[1]:
            raise ValueError("a binding bug")
        return working(handle)

    setattr(rig.nvml, call, broken)
    with caplog.at_level(logging.ERROR, "batchlens"):
        assert [reason for reason, _ in rig.sample().soft_errors] == ["gpu_error"]
        samples = rig.scrape()
    assert value(samples, "batchlens_source_up", up_labels(gpus[1], 1)) == 0
    assert value(samples, "batchlens_gpu_sm_busy_ratio", labels(gpus[0], 0)) == 0.5
    assert not any(dict(k).get("gpu") == "1" for name, k in samples if name != "batchlens_source_up")
    assert [r.exc_info is not None for r in caplog.records] == [True], "the traceback, once, not every tick"
    setattr(rig.nvml, call, working)
    assert value(rig.scrape(), "batchlens_gpu_sm_busy_ratio", labels(gpus[1], 1)) == 0.6


def up_labels(gpu: FakeGpu, index: int, engine: str = "") -> dict[str, str]:
    return {"source": "nvml", "gpu": str(index), "uuid": gpu.uuid, "vllm_instance": engine}


def test_a_gpu_lost_before_its_first_reading_is_down_without_a_uuid() -> None:
    gpus = [h100_sxm(0), h100_sxm(1, failure=pynvml.NVML_ERROR_GPU_IS_LOST)]
    samples = Rig(gpus).scrape()
    assert value(samples, "batchlens_source_up", {"source": "nvml", "gpu": "1", "uuid": "", "vllm_instance": ""}) == 0
    assert value(samples, "batchlens_source_up", up_labels(gpus[0], 0)) == 1


def test_other_nvml_errors_are_counted_and_skip_only_that_value() -> None:
    gpu = h100_sxm(errors={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NO_PERMISSION})
    rig = Rig([gpu])
    assert [reason for reason, _ in rig.sample().soft_errors] == ["no_permission"]
    samples = rig.scrape()
    assert "batchlens_gpu_power_watts" not in names(samples)
    assert value(samples, "batchlens_gpu_temperature_celsius", labels(gpu, 0)) == 40
    assert rig.fake.calls["nvmlDeviceGetPowerUsage"] == 2, "a permission error is not remembered: it may clear"
    gpu.errors.clear()
    assert rig.sample().soft_errors == ()


def test_a_utilization_over_100_percent_is_no_reading() -> None:
    gpu = h100_sxm(util_gpu=250, util_mem=0xFFFFFFFF)
    samples = Rig([gpu]).scrape()
    assert "batchlens_gpu_sm_busy_ratio" not in names(samples) and "batchlens_gpu_memory_busy_ratio" not in names(
        samples
    )
    assert value(samples, "batchlens_gpu_temperature_celsius", labels(gpu, 0)) == 40, "the rest of the GPU stands"


def test_a_misreported_memory_clock_takes_the_data_sheets_peak(caplog) -> None:
    gpu = FakeGpu(
        name="NVIDIA H200", uuid="GPU-h200", architecture=9, bus_width=6144, max_sm_mhz=1980, max_mem_mhz=1600
    )
    with caplog.at_level(logging.INFO, "batchlens.exporter"):
        samples = Rig([gpu]).scrape()
    assert value(samples, "batchlens_gpu_memory_bandwidth_peak_bytes_per_second", labels(gpu, 0)) == 4.8e12
    info = {**labels(gpu, 0), "architecture": "hopper", "bandwidth_basis": "datasheet", "mig_mode": "unsupported"}
    assert value(samples, "batchlens_gpu_info", info) == 1
    assert "using the data sheet's 4800 GB/s" in caplog.text


def test_without_an_nvml_library_the_source_is_up_with_no_gpus_and_says_so_once(caplog) -> None:
    """A CPU host is a state, not an outage: no error counted, so BatchlensSourceDown stays quiet."""
    rig = Rig([], library=False)

    async def ticks():
        sampler = Sampler(rig.src, SnapshotStore(), interval=0.01, deadline=5)
        return [await sampler.tick() for _ in range(5)]

    with caplog.at_level(logging.DEBUG, "batchlens.exporter"):
        states = asyncio.run(ticks())
    assert [s.up for s in states] == [True] * 5 and not states[-1].errors
    [metric] = rig.src.sample_now({}).metrics
    assert (metric.name, [s.value for s in metric.samples]) == ("batchlens_nvml_driver_present", [0.0])
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no NVIDIA driver on this host" in warnings[0].getMessage()
    rig.fake.library = True  # a driver loaded later is found on the next tick
    assert any(
        m.name == "batchlens_gpu_info" or m.name == "batchlens_nvml_info" for m in rig.src.sample_now({}).metrics
    )


def test_a_driver_that_refuses_nvml_is_down_with_the_reason() -> None:
    rig = Rig([h100_sxm(0)], errors={"nvmlInit_v2": pynvml.NVML_ERROR_NO_PERMISSION})
    with pytest.raises(SourceError) as raised:
        rig.sample()
    assert raised.value.reason == "no_permission" and "NVML is not available" in str(raised.value)


def test_a_driver_that_cannot_count_its_gpus_is_down_and_nvml_released() -> None:
    rig = Rig([h100_sxm(0)], errors={"nvmlDeviceGetCount_v2": pynvml.NVML_ERROR_DRIVER_NOT_LOADED})
    with pytest.raises(SourceError) as raised:
        rig.sample()
    assert raised.value.reason == "driver_not_loaded" and not rig.fake.initialized
    rig.fake.errors.clear()
    assert (
        value(
            rig.scrape(),
            "batchlens_source_up",
            up_labels(rig.gpus[0], 0),
        )
        == 1
    )


def test_close_frees_gpm_samples_and_shuts_nvml_down() -> None:
    rig = Rig([h100_sxm(0), h100_mig(1)])
    rig.scrape()
    rig.scrape()
    rig.src.close()
    assert rig.fake.calls["nvmlGpmSampleFree"] == rig.fake.calls["nvmlGpmSampleAlloc"] == 8
    assert not rig.fake.initialized


def test_sigterm_ends_the_exporter_while_an_nvml_call_is_stuck_in_the_driver() -> None:
    """A wedged driver never returns from a call; the process once waited on that thread at exit, forever, until
    the kubelet killed it. The exporter runs in a child process over the fake module, whose power reading hangs."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading
        from harness.fake_pynvml import FakeNvml, h100_sxm
        module = FakeNvml([h100_sxm(0)]).module()
        entered = threading.Event()
        def stuck(handle):
            entered.set()
            threading.Event().wait()
        module.nvmlDeviceGetPowerUsage = stuck
        sys.modules["pynvml"] = module  # what the exporter imports
        from batchlens.config import Config
        from batchlens.exporter.server import serve
        threading.Thread(target=lambda: (entered.wait(), os.kill(os.getpid(), signal.SIGTERM)), daemon=True).start()
        serve(Config.model_validate({{"exporter": {{"listen": "127.0.0.1:{free_port()}", "interval_seconds": 0.2}}}}))
    """)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    try:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the exporter did not exit within 30 s of SIGTERM while an NVML call hung")
    assert done.returncode == 0, done.stderr
    assert "a call is stuck in the driver" in done.stderr, done.stderr


def test_every_gpu_metric_is_documented() -> None:
    text = DOCS.read_text()
    documented = [spec.name for spec in GPU_METRICS] + [
        "batchlens_gpu_info",
        "batchlens_gpu_clock_event_active",
        "batchlens_gpu_ecc_errors_total",
        "batchlens_gpu_process_memory_bytes",
        "batchlens_gpu_pod_info",
        "batchlens_nvml_info",
        "batchlens_gpu_xid_errors_total",
        "batchlens_pci_nvidia_gpus",
    ]
    assert [name for name in documented if f"`{name}`" not in text] == []


def test_clock_event_reasons_are_nvmls_flags() -> None:
    flags = {
        "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
        "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
        "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
        "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
        "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
        "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
        "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
        "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
    }
    assert {reason: bit for bit, reason in CLOCK_EVENT_REASONS} == flags


def test_the_exporter_labels_an_engines_gpus_with_the_model_its_metrics_name(upstreams, vllm_exposition) -> None:
    """The exporter in process: a fake vLLM (served by this process) and a fake GPU whose process is this one."""
    url = upstreams.add("deepseek", text=vllm_exposition)
    gpu = h100_sxm(util_mem=42, processes=[FakeProcess(os.getpid(), 10 * GIB)])
    overrides = {"engines": [{"name": "deepseek", "url": url}], "exporter": {"interval_seconds": 0.2}}
    exporter = Exporter(load_config(None, overrides, {}), environ={}, nvml=FakeNvml([gpu]).module())
    mapped = labels(gpu, 0, engine="deepseek", model="/tmp/tinymodel")

    async def run() -> Samples:
        await exporter.start()
        try:
            for _ in range(100):
                samples = parse_samples(exporter.body().decode())
                if ("batchlens_gpu_memory_busy_ratio", frozenset(mapped.items())) in samples:
                    return samples
                await asyncio.sleep(0.1)
            pytest.fail(f"no GPU series labelled {mapped}: {sorted(k for k in samples if 'gpu' in k[0])[:3]}")
        finally:
            await exporter.stop()

    samples = asyncio.run(run())
    assert value(samples, "batchlens_gpu_memory_busy_ratio", mapped) == 0.42
    engine = {"vllm_instance": "deepseek", "model_name": "/tmp/tinymodel", "engine": "0"}
    assert value(samples, "batchlens_kv_blocks_total", engine) > 0  # the same labels on the engine's own series


@pytest.mark.slow
def test_the_exporter_on_this_host_reports_nvml_as_the_real_library_finds_it(tmp_path) -> None:
    """No fake here: the real pynvml, on whatever this machine has (no GPU, in CI)."""
    try:
        pynvml.nvmlInit()
        has_gpu = True
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        has_gpu = False
    exporter = ExporterProcess(tmp_path, [], interval=0.3)
    key = ("batchlens_source_up", frozenset({("source", "nvml")}))
    try:
        if has_gpu:
            samples = exporter.wait_for(lambda s: bool(pick(s, "batchlens_gpu_memory_total_bytes")), what="GPU metrics")
        else:  # several ticks without a driver, to show it is said once and counts as no failure
            exporter.wait_for(lambda s: s.get(key) == 1, what="the nvml source up without a driver")
            time.sleep(1.5)
            samples = exporter.wait_for(lambda s: s.get(key) == 1, what="the nvml source still up")
    finally:
        assert exporter.stop() == 0
    log = exporter.process.log_path.read_text()
    assert "Traceback" not in log
    if has_gpu:
        assert samples[key] == 1
    else:
        # No driver is a state, not an outage: BatchlensSourceDown must not page for ever on a CPU host.
        assert samples[key] == 1 and samples[("batchlens_nvml_driver_present", frozenset())] == 0
        assert not pick(samples, "batchlens_source_errors_total", source="nvml")
        assert not pick(samples, "batchlens_gpu_memory_total_bytes")
        assert log.count("no NVIDIA driver on this host") == 1, log


def test_xids_are_counted_per_gpu_and_code_by_a_waiter_of_their_own() -> None:
    """The known codes by number, the rest as ``other``; each labelled with the GPU and the engine it served,
    a lost one's too (an Xid 79 is a GPU falling off the bus). Only the waiter thread ever waits on the set."""
    gpus = [h100_sxm(0), h100_sxm(1)]
    rig = Rig(gpus, [Engine(name="deepseek", url="http://10.0.0.9:8000", gpus=[0, 1])])
    rig.scrape()
    for index, code in ((1, 48), (1, 79), (1, 79), (0, 13), (0, 999)):
        rig.fake.xid(index, code)
    expected = {("1", "48"): 1, ("1", "79"): 2, ("0", "13"): 1, ("0", "other"): 1}
    deadline = time.monotonic() + 10
    while (counted := xids(rig.scrape())) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert counted == expected
    gpus[1].failure = pynvml.NVML_ERROR_GPU_IS_LOST
    [series] = pick(rig.scrape(), "batchlens_gpu_xid_errors_total", gpu="1", xid="79")
    assert dict(series) == {"gpu": "1", "uuid": gpus[1].uuid, "vllm_instance": "deepseek", "xid": "79"}
    assert rig.fake.waits_in == {"nvml-xid-events"}


def xids(samples: Samples) -> dict[tuple[str, str], float]:
    return {(dict(k)["gpu"], dict(k)["xid"]): v for k, v in pick(samples, "batchlens_gpu_xid_errors_total").items()}


def test_a_gpu_without_xid_events_is_said_and_the_others_are_still_watched(caplog) -> None:
    gpus = [t4(0, event_types=0), h100_sxm(1)]
    with caplog.at_level(logging.WARNING, "batchlens.exporter"):
        rig = Rig(gpus)
        rig.scrape()
    assert "GPU 0 delivers no Xid events" in caplog.text
    rig.fake.xid(0, 79)  # registered nowhere: never delivered
    rig.fake.xid(1, 79)
    deadline = time.monotonic() + 10
    while not xids(rig.scrape()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert xids(rig.scrape()) == {("1", "79"): 1}
    assert not any(r.levelno >= logging.ERROR and "Traceback" in r.getMessage() for r in caplog.records)


def test_remapped_rows_are_four_gauges_where_the_gpu_remaps_rows() -> None:
    gpus = [h100_sxm(0, remapped_rows=(3, 1, 1, 0)), t4(1)]  # a T4 has no row remapping: NOT_SUPPORTED
    samples = Rig(gpus).scrape()
    remapped = {name: value(samples, name, labels(gpus[0], 0)) for name in (
        "batchlens_gpu_remapped_rows_correctable", "batchlens_gpu_remapped_rows_uncorrectable",
        "batchlens_gpu_row_remapping_pending", "batchlens_gpu_row_remapping_failed")}  # fmt: skip
    assert list(remapped.values()) == [3, 1, 1, 0]
    assert not pick(samples, "batchlens_gpu_row_remapping_pending", gpu="1")


def test_a_driver_that_goes_away_mid_run_is_said_and_the_bus_still_counts_its_gpus(tmp_path, caplog) -> None:
    """The driver unloaded under a running exporter: no GPU series, driver_present 0 beside the bus's count of
    2 GPUs (a page: BatchlensGpuDriverGone), one error line; back with its GPUs when the driver is."""
    gpus = [h100_sxm(0), h100_sxm(1)]
    rig = Rig(gpus, sysfs=gpu_host(tmp_path, 2))
    samples = rig.scrape()
    assert (one(samples, "batchlens_nvml_driver_present"), one(samples, "batchlens_pci_nvidia_gpus")) == (1, 2)
    rig.fake.unload()
    with caplog.at_level(logging.WARNING, "batchlens.exporter"):
        gone = [rig.scrape() for _ in range(3)]
    for samples in gone:
        assert (one(samples, "batchlens_nvml_driver_present"), one(samples, "batchlens_pci_nvidia_gpus")) == (0, 2)
        assert not pick(samples, "batchlens_gpu_info")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "the NVIDIA driver went away" in said[0], said
    rig.fake.load()
    back = rig.scrape()
    assert one(back, "batchlens_nvml_driver_present") == 1 and len(pick(back, "batchlens_gpu_info")) == 2


def test_no_driver_on_a_node_whose_bus_holds_gpus_is_said_as_a_fault_not_as_a_cpu_host(tmp_path, caplog) -> None:
    rig = Rig([], library=False, sysfs=gpu_host(tmp_path, 8))
    with caplog.at_level(logging.WARNING, "batchlens.exporter"):
        samples = rig.scrape()
    assert (one(samples, "batchlens_nvml_driver_present"), one(samples, "batchlens_pci_nvidia_gpus")) == (0, 8)
    [said] = caplog.records
    assert said.levelno == logging.ERROR and "the PCI bus holds 8 NVIDIA GPUs" in said.getMessage()


def test_the_bus_counts_nvidia_gpus_of_no_driver_or_nvidias_and_nothing_else(tmp_path) -> None:
    bus = pci_bus(tmp_path, [(NVIDIA, GPU_3D, None), (NVIDIA, GPU_VGA, "nvidia"), (NVIDIA, GPU_3D, "vfio-pci"),
                             (NVIDIA, BRIDGE, None), (INTEL, GPU_VGA, None)])  # fmt: skip
    assert nvidia_gpus(bus) == 2  # the one passed through to a VM is not this host's to serve
    assert nvidia_gpus(tmp_path / "nowhere") is None
    assert nvidia_gpus(pci_bus(tmp_path / "cpu", [(INTEL, BRIDGE, None)])) == 0
