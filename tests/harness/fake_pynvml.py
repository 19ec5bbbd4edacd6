"""A fake of nvidia-ml-py's ``pynvml`` module, in process: the tests' one stand-in for a GPU.

The boundary: :meth:`FakeNvml.module` returns a module built from the real
``pynvml``. Every constant, ctypes struct and ``NVMLError_*`` class in it is
pynvml's own; every function it fakes has pynvml's name and signature
(tests/test_fake_pynvml.py checks both). Only what the functions answer comes
from :class:`FakeGpu` specs instead of a driver, including the errors a driver
gives: a missing C symbol raises ``NVMLError_FunctionNotFound``, an unsupported
call ``NVMLError_NotSupported``, a lost GPU ``NVMLError_GpuIsLost``.

GPM follows the real protocol: samples are opaque ctypes pointers, and
``nvmlGpmMetricsGet`` computes each metric from two samples' counters and the
time between them (advance it with :meth:`FakeNvml.advance`).

Events follow it too: an event set is an opaque ctypes pointer, a GPU delivers
only the types it registered there, and ``nvmlEventSetWait`` blocks (really,
on a condition) until :meth:`FakeNvml.xid` raises one or its timeout passes
(``NVMLError_Timeout``). The driver can go away under a running program and
come back (:meth:`FakeNvml.unload`, :meth:`FakeNvml.load`).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import threading
import time
import types
from collections import Counter, deque
from dataclasses import dataclass, field

import pynvml as real

NO_INSTANCE = 0xFFFFFFFF
ALL_LINKS = 0xFFFFFFFF
GPM_DRAM, GPM_SM, GPM_OCCUPANCY, GPM_TENSOR = (
    real.NVML_GPM_METRIC_DRAM_BW_UTIL,
    real.NVML_GPM_METRIC_SM_UTIL,
    real.NVML_GPM_METRIC_SM_OCCUPANCY,
    real.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
)
GIB = 1024**3


def error(code: int) -> real.NVMLError:
    return real.NVMLError(code)  # pynvml maps the code to its NVMLError_* subclass


@dataclass
class FakeProcess:
    pid: int
    used_bytes: int | None  # None: the driver reports NVML_VALUE_NOT_AVAILABLE
    gpu_instance: int = NO_INSTANCE


@dataclass(eq=False)  # a device is itself: its handles hash by it, as the driver's pointers by address
class FakeMig:
    gpu_instance: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    gpm: dict[int, float] = field(default_factory=dict)  # metric id -> percent over the next interval
    unsupported: set[str] = field(default_factory=lambda: {"nvmlDeviceGetUtilizationRates"})
    gpm_counters: Counter = field(default_factory=Counter)


@dataclass(eq=False)
class FakeGpu:
    name: str
    uuid: str
    architecture: int
    bus_width: int
    max_sm_mhz: int
    max_mem_mhz: int
    sm_mhz: int = 1200
    mem_mhz: int = 1500
    util_gpu: int = 0
    util_mem: int = 0
    memory_total: int = 80 * GIB
    memory_used: int = 0
    memory_reserved: int = 512 * 1024**2
    power_mw: int = 100_000
    energy_mj: int = 1_000_000
    temperature: int = 40
    pcie_tx: int | None = 0
    pcie_rx: int | None = 0
    nvlink_tx_kib: int | None = None  # None: no NVLink (the field answers NOT_SUPPORTED)
    nvlink_rx_kib: int | None = None
    clock_events: int = 0
    ecc_enabled: bool = False
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    gpm: dict[int, float] | None = None  # None: no GPM (before Hopper)
    mig: list[FakeMig] | None = None  # None: MIG unsupported
    mig_enabled: bool = False
    max_mig_devices: int = 7
    processes: list[FakeProcess] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # C symbols that answer NOT_SUPPORTED
    errors: dict[str, int] = field(default_factory=dict)  # C symbol -> the NVML_ERROR_* code it answers
    failure: int | None = None  # an NVML_ERROR_* code every call on this GPU answers (GPU_IS_LOST, say)
    gpm_counters: Counter = field(default_factory=Counter)
    # What `batchlens doctor` reads: the PCIe link, NVLink states, the NUMA node and the PCI address.
    pcie_gen: int = 4
    pcie_gen_max: int = 4  # this GPU in this slot
    pcie_gen_gpu_max: int = 4  # the GPU alone
    pcie_width: int = 16
    pcie_width_max: int = 16
    nvlinks: list[bool] | None = None  # each link's state; None: no NVLink (NOT_SUPPORTED)
    numa_node: int | None = 0  # None: the driver cannot say (nvmlDeviceGetNumaNodeId is NOT_SUPPORTED)
    bus_id: str = "00000000:3B:00.0"
    # (correctable, uncorrectable, pending, failure) as nvmlDeviceGetRemappedRows answers; None: NOT_SUPPORTED
    remapped_rows: tuple[int, int, int, int] | None = None
    event_types: int = real.nvmlEventTypeXidCriticalError  # what nvmlDeviceGetSupportedEventTypes answers


@dataclass(frozen=True)
class FakeHandle:
    gpu: FakeGpu
    mig: FakeMig | None = None


@dataclass
class FakeEventSet:
    storage: object  # the struct the set's pointer points to, kept alive
    registered: dict[str, int] = field(default_factory=dict)  # GPU uuid -> the event types it delivers here
    ready: deque = field(default_factory=deque)  # (FakeGpu, event type, event data)


@dataclass(frozen=True)
class GpmData:
    device: str
    time: float
    counters: dict[int, float]


class FakeNvml:
    """A driver with GPUs. ``missing`` names C symbols this driver lacks (an older driver); ``errors``
    makes a C symbol fail with an NVML_ERROR_* code."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        library: bool = True,
        missing: frozenset[str] = frozenset(),
        errors: dict[str, int] | None = None,
        driver_version: str = "570.86.15",
        cuda_version: int = 12080,
        topology: dict[tuple[int, int], int] | None = None,
    ):
        self.gpus = gpus
        self.library = library
        self.missing = set(missing)
        self.errors = dict(errors or {})  # C symbol -> the NVML_ERROR_* code it answers, on any device
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.topology = dict(topology or {})  # (i, j) with i < j -> NVML_TOPOLOGY_*; NODE when absent
        self.initialized = False
        self.clock = 1000.0
        self.calls: Counter[str] = Counter()  # C symbol -> calls that reached the "driver"
        self.fields_asked: Counter[tuple[int, int]] = Counter()  # (field id, scope id) -> times asked
        self.seconds_in_driver = 0.0
        self._gpm: dict[int, GpmData | None] = {}
        self._gpm_keep: dict[int, object] = {}
        self.driver_loaded = True
        self.waits_in: set[str] = set()  # the threads that waited on an event set, by name
        self._event_sets: dict[int, FakeEventSet] = {}
        self._events = threading.Condition()

    # -- what tests drive -------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Let time pass: GPM counters grow at each device's rate."""
        self.clock += seconds
        for gpu in self.gpus:
            for metric, percent in (gpu.gpm or {}).items():
                gpu.gpm_counters[metric] += percent * seconds
            for mig in gpu.mig or []:
                for metric, percent in mig.gpm.items():
                    mig.gpm_counters[metric] += percent * seconds

    def xid(self, index: int, code: int) -> None:
        """GPU ``index`` reports Xid ``code``: every event set it registered Xid events in gets it."""
        gpu = self.gpus[index]
        with self._events:
            for events in self._event_sets.values():
                if events.registered.get(gpu.uuid, 0) & real.nvmlEventTypeXidCriticalError:
                    events.ready.append((gpu, real.nvmlEventTypeXidCriticalError, code))
            self._events.notify_all()

    def unload(self) -> None:
        """The driver goes away (unloaded, its container restarted): every call says so until :meth:`load`."""
        self.driver_loaded = False

    def load(self) -> None:
        self.driver_loaded = True

    def module(self) -> types.ModuleType:
        """A ``pynvml`` module backed by this fake driver."""
        module = types.ModuleType("pynvml", "fake pynvml (tests/harness/fake_pynvml.py)")
        for name, value in vars(real).items():
            if not inspect.isfunction(value):
                setattr(module, name, value)  # constants, structs, NVMLError_* classes
        for name in FAKED:
            method = getattr(self, name)
            setattr(module, name, method if name in UNTIMED else self._timed(method))
        return module

    def _timed(self, method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds_in_driver += time.perf_counter() - started

        return call

    def _enter(self, symbol: str, handle: FakeHandle | None = None) -> FakeHandle:
        self.calls[symbol] += 1
        if not self.driver_loaded:
            raise error(real.NVML_ERROR_DRIVER_NOT_LOADED)
        if not self.initialized:
            raise error(real.NVML_ERROR_UNINITIALIZED)
        if symbol in self.missing:
            raise error(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        if symbol in self.errors:
            raise error(self.errors[symbol])
        if handle is not None:
            if handle.gpu.failure is not None:
                raise error(handle.gpu.failure)
            if symbol in (handle.mig or handle.gpu).unsupported:
                raise error(real.NVML_ERROR_NOT_SUPPORTED)
            if symbol in handle.gpu.errors:
                raise error(handle.gpu.errors[symbol])
        return handle

    # -- the faked pynvml functions, with pynvml's signatures ---------------

    def nvmlInit(self):
        if not self.library:
            raise error(real.NVML_ERROR_LIBRARY_NOT_FOUND)
        if not self.driver_loaded:
            raise error(real.NVML_ERROR_DRIVER_NOT_LOADED)
        if "nvmlInit_v2" in self.errors:  # the driver is there but refuses (NO_PERMISSION, DRIVER_NOT_LOADED...)
            raise error(self.errors["nvmlInit_v2"])
        self.initialized = True

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.initialized = False

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self):
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_version

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle):
        return self._enter("nvmlDeviceGetCurrPcieLinkGeneration", handle).gpu.pcie_gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle):
        return self._enter("nvmlDeviceGetMaxPcieLinkGeneration", handle).gpu.pcie_gen_max

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, handle):
        return self._enter("nvmlDeviceGetGpuMaxPcieLinkGeneration", handle).gpu.pcie_gen_gpu_max

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle):
        return self._enter("nvmlDeviceGetCurrPcieLinkWidth", handle).gpu.pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle):
        return self._enter("nvmlDeviceGetMaxPcieLinkWidth", handle).gpu.pcie_width_max

    def nvmlDeviceGetNvLinkState(self, device, link):
        gpu = self._enter("nvmlDeviceGetNvLinkState", device).gpu
        if gpu.nvlinks is None:
            raise error(real.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.nvlinks):
            raise error(real.NVML_ERROR_INVALID_ARGUMENT)
        return real.NVML_FEATURE_ENABLED if gpu.nvlinks[link] else real.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNumaNodeId(self, handle):
        gpu = self._enter("nvmlDeviceGetNumaNodeId", handle).gpu
        if gpu.numa_node is None:
            raise error(real.NVML_ERROR_NOT_SUPPORTED)
        return gpu.numa_node

    def nvmlDeviceGetPciInfo(self, handle):
        gpu = self._enter("nvmlDeviceGetPciInfo_v3", handle).gpu
        return real.nvmlPciInfo_t(busId=gpu.bus_id.encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, device1, device2):
        first = self._enter("nvmlDeviceGetTopologyCommonAncestor", device1).gpu
        second = self._enter("nvmlDeviceGetTopologyCommonAncestor", device2).gpu
        i, j = sorted((self.gpus.index(first), self.gpus.index(second)))
        return self.topology.get((i, j), real.NVML_TOPOLOGY_NODE)

    def nvmlSystemGetNVMLVersion(self):
        self._enter("nvmlSystemGetNVMLVersion")
        return "12." + self.driver_version

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount_v2")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex_v2")
        if not 0 <= index < len(self.gpus):
            raise error(real.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.failure is not None:
            raise error(gpu.failure)
        return FakeHandle(gpu)

    def nvmlDeviceGetUUID(self, handle):
        h = self._enter("nvmlDeviceGetUUID", handle)
        return (h.mig or h.gpu).uuid

    def nvmlDeviceGetName(self, handle):
        h = self._enter("nvmlDeviceGetName", handle)
        return (h.mig or h.gpu).name

    def nvmlDeviceGetArchitecture(self, device):
        return self._enter("nvmlDeviceGetArchitecture", device).gpu.architecture

    def nvmlDeviceGetMemoryBusWidth(self, device):
        return self._enter("nvmlDeviceGetMemoryBusWidth", device).gpu.bus_width

    def nvmlDeviceGetMaxClockInfo(self, handle, type):
        gpu = self._enter("nvmlDeviceGetMaxClockInfo", handle).gpu
        return {real.NVML_CLOCK_SM: gpu.max_sm_mhz, real.NVML_CLOCK_MEM: gpu.max_mem_mhz}[type]

    def nvmlDeviceGetClockInfo(self, handle, type):
        gpu = self._enter("nvmlDeviceGetClockInfo", handle).gpu
        return {real.NVML_CLOCK_SM: gpu.sm_mhz, real.NVML_CLOCK_MEM: gpu.mem_mhz}[type]

    def nvmlDeviceGetUtilizationRates(self, handle):
        gpu = self._enter("nvmlDeviceGetUtilizationRates", handle).gpu
        return real.c_nvmlUtilization_t(gpu=gpu.util_gpu, memory=gpu.util_mem)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        h = self._enter("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo", handle)
        if h.mig is not None:
            total, used, reserved = h.mig.memory_total, h.mig.memory_used, 0
        else:
            total, used, reserved = h.gpu.memory_total, h.gpu.memory_used, h.gpu.memory_reserved
        if not version:
            return real.c_nvmlMemory_t(total=total, free=total - used, used=used)
        return real.c_nvmlMemory_v2_t(
            version=version, total=total, reserved=reserved, free=total - used - reserved, used=used
        )

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._enter("nvmlDeviceGetPowerUsage", handle).gpu.power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self._enter("nvmlDeviceGetTotalEnergyConsumption", handle).gpu.energy_mj

    def nvmlDeviceGetTemperatureV(self, handle, sensor, version=real.nvmlTemperature_v1):
        return self._enter("nvmlDeviceGetTemperatureV", handle).gpu.temperature

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._enter("nvmlDeviceGetTemperature", handle).gpu.temperature

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        gpu = self._enter("nvmlDeviceGetFieldValues", handle).gpu
        known = {
            (real.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0): gpu.pcie_tx,
            (real.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0): gpu.pcie_rx,
            (real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS): gpu.nvlink_tx_kib,
            (real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS): gpu.nvlink_rx_kib,
        }
        values = (real.c_nvmlFieldValue_t * len(fieldIds))()
        for i, field_id in enumerate(fieldIds):
            fid, scope = field_id if isinstance(field_id, tuple) else (field_id, 0)
            self.fields_asked[fid, scope] += 1
            values[i].fieldId, values[i].scopeId = fid, scope
            value = known.get((fid, scope))
            if value is None:
                values[i].nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
            else:
                values[i].nvmlReturn = real.NVML_SUCCESS
                values[i].valueType = real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                values[i].value.ullVal = value
        return values

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._enter("nvmlDeviceGetCurrentClocksEventReasons", handle).gpu.clock_events

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", handle).gpu.clock_events

    def nvmlDeviceGetEccMode(self, handle):
        gpu = self._enter("nvmlDeviceGetEccMode", handle).gpu
        mode = real.NVML_FEATURE_ENABLED if gpu.ecc_enabled else real.NVML_FEATURE_DISABLED
        return [mode, mode]

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):
        gpu = self._enter("nvmlDeviceGetTotalEccErrors", handle).gpu
        if not gpu.ecc_enabled:
            raise error(real.NVML_ERROR_NOT_SUPPORTED)
        corrected = errorType == real.NVML_MEMORY_ERROR_TYPE_CORRECTED
        return gpu.ecc_corrected if corrected else gpu.ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, device):
        gpu = self._enter("nvmlDeviceGetRemappedRows", device).gpu
        if gpu.remapped_rows is None:
            raise error(real.NVML_ERROR_NOT_SUPPORTED)
        return gpu.remapped_rows

    def nvmlDeviceGetSupportedEventTypes(self, handle):
        return self._enter("nvmlDeviceGetSupportedEventTypes", handle).gpu.event_types

    def nvmlEventSetCreate(self):
        self._enter("nvmlEventSetCreate")
        storage = real.struct_c_nvmlEventSet_t()
        self._event_sets[ctypes.addressof(storage)] = FakeEventSet(storage)
        return real.c_nvmlEventSet_t(storage)

    def _event_set(self, eventSet) -> FakeEventSet:
        events = self._event_sets.get(ctypes.addressof(eventSet.contents))
        if events is None:
            raise error(real.NVML_ERROR_INVALID_ARGUMENT)  # not created, or freed
        return events

    def nvmlDeviceRegisterEvents(self, handle, eventTypes, eventSet):
        gpu = self._enter("nvmlDeviceRegisterEvents", handle).gpu
        if eventTypes & ~gpu.event_types:
            raise error(real.NVML_ERROR_NOT_SUPPORTED)
        events = self._event_set(eventSet)
        events.registered[gpu.uuid] = events.registered.get(gpu.uuid, 0) | eventTypes

    def nvmlEventSetWait(self, eventSet, timeoutms):
        self._enter("nvmlEventSetWait_v2")
        self.waits_in.add(threading.current_thread().name)
        events = self._event_set(eventSet)
        with self._events:
            self._events.wait_for(lambda: events.ready, timeout=timeoutms / 1000)
            if not events.ready:
                raise error(real.NVML_ERROR_TIMEOUT)
            gpu, event_type, data = events.ready.popleft()
        if gpu.failure is not None:
            raise error(gpu.failure)
        data = real.c_nvmlEventData_t(eventType=event_type, eventData=data, gpuInstanceId=NO_INSTANCE,
                                      computeInstanceId=NO_INSTANCE)  # fmt: skip
        event = real.nvmlStructToFriendlyObject(data)
        event.device = FakeHandle(gpu)  # the fake's handles are objects, not the driver's pointers
        return event

    def nvmlEventSetFree(self, eventSet):
        self._enter("nvmlEventSetFree")
        self._event_set(eventSet)
        del self._event_sets[ctypes.addressof(eventSet.contents)]

    def nvmlDeviceGetMigMode(self, device):
        gpu = self._enter("nvmlDeviceGetMigMode", device).gpu
        if gpu.mig is None:
            raise error(real.NVML_ERROR_NOT_SUPPORTED)
        mode = real.NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device):
        gpu = self._enter("nvmlDeviceGetMaxMigDeviceCount", device).gpu
        return gpu.max_mig_devices if gpu.mig is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index):
        gpu = self._enter("nvmlDeviceGetMigDeviceHandleByIndex", device).gpu
        if not gpu.mig_enabled or index >= len(gpu.mig or []):
            raise error(real.NVML_ERROR_NOT_FOUND)
        return FakeHandle(gpu, gpu.mig[index])

    def nvmlDeviceGetGpuInstanceId(self, device):
        h = self._enter("nvmlDeviceGetGpuInstanceId", device)
        if h.mig is None:
            raise error(real.NVML_ERROR_INVALID_ARGUMENT)
        return h.mig.gpu_instance

    def _processes(self, symbol: str, handle: FakeHandle):
        gpu = self._enter(symbol, handle).gpu
        found = []
        for p in gpu.processes:
            used = real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if p.used_bytes is None else p.used_bytes
            struct = real.c_nvmlProcessInfo_v2_t(
                pid=p.pid, usedGpuMemory=used, gpuInstanceId=p.gpu_instance, computeInstanceId=p.gpu_instance
            )
            obj = real.nvmlStructToFriendlyObject(struct)
            if obj.usedGpuMemory == real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None  # as pynvml does
            found.append(obj)
        return found

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle):
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v3", handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle):
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", handle)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        try:
            return self.nvmlDeviceGetComputeRunningProcesses_v3(handle)
        except real.NVMLError_FunctionNotFound:  # pynvml's throwOnVersionMismatch
            raise real.NVMLLibraryMismatchError("Unversioned function called ...") from None

    def nvmlGpmQueryDeviceSupport(self, device):
        gpu = self._enter("nvmlGpmQueryDeviceSupport", device).gpu
        return real.c_nvmlGpmSupport_t(version=real.NVML_GPM_SUPPORT_VERSION, isSupportedDevice=gpu.gpm is not None)

    def nvmlGpmSampleAlloc(self):
        self._enter("nvmlGpmSampleAlloc")
        storage = real.struct_c_nvmlGpmSample_t()
        sample = real.c_nvmlGpmSample_t(storage)
        self._gpm_keep[ctypes.addressof(storage)] = storage
        self._gpm[ctypes.addressof(storage)] = None
        return sample

    def nvmlGpmSampleFree(self, gpmSample):
        self._enter("nvmlGpmSampleFree")
        address = ctypes.addressof(gpmSample.contents)
        self._gpm.pop(address)
        self._gpm_keep.pop(address)

    def nvmlGpmSampleGet(self, device, gpmSample):
        gpu = self._enter("nvmlGpmSampleGet", device).gpu
        if gpu.gpm is None:
            raise error(real.NVML_ERROR_NOT_SUPPORTED)
        self._record(gpmSample, GpmData(gpu.uuid, self.clock, dict(gpu.gpm_counters)))
        return gpmSample

    def nvmlGpmMigSampleGet(self, device, gpuInstanceId, gpmSample):
        gpu = self._enter("nvmlGpmMigSampleGet", device).gpu
        mig = next((m for m in gpu.mig or [] if m.gpu_instance == gpuInstanceId), None)
        if mig is None:
            raise error(real.NVML_ERROR_NOT_FOUND)
        self._record(gpmSample, GpmData(mig.uuid, self.clock, dict(mig.gpm_counters)))
        return gpmSample

    def _record(self, sample, data: GpmData) -> None:
        address = ctypes.addressof(sample.contents)
        if address not in self._gpm:
            raise error(real.NVML_ERROR_INVALID_ARGUMENT)  # not allocated, or freed
        self._gpm[address] = data

    def nvmlGpmMetricsGet(self, metricsGet):
        self._enter("nvmlGpmMetricsGet")
        if metricsGet.version != real.NVML_GPM_METRICS_GET_VERSION:
            raise error(real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self._gpm.get(ctypes.addressof(metricsGet.sample1.contents))
        second = self._gpm.get(ctypes.addressof(metricsGet.sample2.contents))
        if first is None or second is None or first.device != second.device or second.time <= first.time:
            raise error(real.NVML_ERROR_INVALID_ARGUMENT)
        elapsed = second.time - first.time
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            if metric.metricId in second.counters:
                delta = second.counters[metric.metricId] - first.counters.get(metric.metricId, 0.0)
                metric.value, metric.nvmlReturn = delta / elapsed, real.NVML_SUCCESS
            else:
                metric.nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
        return metricsGet


FAKED = tuple(name for name in vars(FakeNvml) if name.startswith("nvml"))
UNTIMED = ("nvmlEventSetWait",)  # the Xid waiter's idle, not time a tick spends in the driver


# -- GPUs as the driver describes them (names, bus widths and clocks of real boards) --


# NVLink, ECC on, MIG-capable (disabled): what A100s and H100s share.
DATACENTER = dict(nvlink_tx_kib=0, nvlink_rx_kib=0, nvlinks=[True] * 12, ecc_enabled=True, mig=[],
                  remapped_rows=(0, 0, 0, 0))  # fmt: skip


def _board(short: str, index: int, overrides: dict, **spec) -> FakeGpu:
    return FakeGpu(**{"uuid": f"GPU-{short}-0000-{index}", **spec, **overrides})


def a100_80gb(index: int = 0, **overrides) -> FakeGpu:
    return _board(
        "a100", index, overrides, name="NVIDIA A100-SXM4-80GB", architecture=real.NVML_DEVICE_ARCH_AMPERE,
        bus_width=5120, max_sm_mhz=1410, max_mem_mhz=1593, **DATACENTER,
    )  # fmt: skip


def h100_sxm(index: int = 0, **overrides) -> FakeGpu:
    return _board(
        "h100", index, overrides, name="NVIDIA H100 80GB HBM3", architecture=real.NVML_DEVICE_ARCH_HOPPER,
        bus_width=5120, max_sm_mhz=1980, max_mem_mhz=2619,
        gpm={GPM_DRAM: 0.0, GPM_SM: 0.0, GPM_OCCUPANCY: 0.0, GPM_TENSOR: 0.0}, **DATACENTER,
    )  # fmt: skip


def h100_mig(index: int = 0, **overrides) -> FakeGpu:
    """An H100 in MIG mode with two instances (GPU instance ids 1 and 2)."""
    migs = [
        FakeMig(1, f"MIG-h100-{index}-1", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40 * GIB, 10 * GIB),
        FakeMig(2, f"MIG-h100-{index}-2", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40 * GIB, 30 * GIB),
    ]
    # In MIG mode the whole GPU reports no utilization; its instances report memory and GPM.
    return h100_sxm(index, mig=migs, mig_enabled=True, unsupported={"nvmlDeviceGetUtilizationRates"}, **overrides)


def t4(index: int = 0, **overrides) -> FakeGpu:
    return _board(
        "t4", index, overrides, name="Tesla T4", architecture=real.NVML_DEVICE_ARCH_TURING,
        bus_width=256, max_sm_mhz=1590, max_mem_mhz=5001, memory_total=16 * GIB,
    )  # fmt: skip


#: The C symbols a driver from before GPM, memory info v2, process info v3,
#: TemperatureV and the "clock events" rename lacks.
OLD_DRIVER_MISSING = frozenset(
    {
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlGpmQueryDeviceSupport",
    }
)
