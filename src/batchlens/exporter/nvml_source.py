"""The NVML source: every GPU's utilization, memory, clocks, power, interconnect
counters and, on Hopper and newer, GPM bandwidth, read once per tick through
nvidia-ml-py (``import pynvml``) and mapped to the engine that uses the GPU.

NVML's errors follow one policy, in :class:`NvmlCalls`:

- ``NotSupported``: this device cannot do it. Remembered per (device, call) and
  never asked again.
- ``FunctionNotFound``: the driver is older than the call. Logged once, never
  asked again; where an older call does the same job, that one is used.
- ``NotFound``: nothing there (an empty MIG slot). Not an error.
- ``GpuIsLost`` and ``Unknown``: the GPU is gone. Its series drop and its
  ``batchlens_source_up{gpu=...}`` turns 0, still labelled with the engine it
  served (the alert BatchlensGpuLost); the other GPUs carry on. It is tried
  again every tick.
- ``DriverNotLoaded`` on a running source: the driver went away (unloaded, or
  its container restarted). NVML is let go, and the source reports no driver
  (``batchlens_nvml_driver_present 0``) until one answers again. Whether this
  host has GPUs at all is the PCI bus's answer, read from sysfs
  (``batchlens_pci_nvidia_gpus``): a host with GPUs and no driver is a page
  (BatchlensGpuDriverGone), a CPU host is not.
- an exception that is no NVMLError at all (a binding's ctypes or decode
  error) on one GPU: that GPU is down for the tick, as if lost, with the
  traceback logged once (``gpu_error``); the other GPUs carry on.
- anything else (``NoPermission``, ``Timeout``...): counted as a soft error,
  and the value is skipped this tick.

Xid errors come from NVML's event API, through a thread of their own
(xid_events.py). Nothing else here waits. GPM metrics compare this tick's sample with the previous
tick's, so a scrape never sleeps, and the blocking PCIe throughput call
(which sleeps 20 ms) is never used: PCIe and NVLink bytes are counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client.metrics_core import Metric

from batchlens.config import Engine
from batchlens.exporter import families as fam
from batchlens.exporter.gpu_bandwidth import peak_bandwidth
from batchlens.exporter.gpu_mapping import (
    assign_engines,
    device_ranks,
    dp_rank_of,
    engine_of,
    is_vllm_title,
    process_owners,
    static_mapping,
)
from batchlens.exporter.gpu_metrics import (
    DRAM_BANDWIDTH,
    MEMORY_BUSY,
    PEAK_BANDWIDTH,
    SM_BUSY,
    GpuDevice,
    GpuProcess,
    GpuReading,
    gpu_families,
    remapped_rows,
)
from batchlens.exporter.kubelet.client import PodResourcesClient, PodResourcesError
from batchlens.exporter.kubelet.holders import PodRef, device_holders, holders
from batchlens.exporter.pci_bus import nvidia_gpus
from batchlens.exporter.processes import ServerPids, lineage, titles
from batchlens.exporter.sampler import SourceError
from batchlens.exporter.snapshot import Reading
from batchlens.exporter.xid_events import XidWaiter

log = logging.getLogger("batchlens.exporter")

ALL_LINKS = 0xFFFFFFFF  # a field value's scopeId that sums over every NVLink
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId of a process outside MIG mode
MHZ = 1e6

ARCHITECTURES = {5: "volta", 6: "turing", 7: "ampere", 8: "ada", 9: "hopper", 10: "blackwell"}

# (GPM metric id attribute, metric name); GPM reports percentages.
GPM_METRICS = (
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", DRAM_BANDWIDTH),
    ("NVML_GPM_METRIC_SM_UTIL", "batchlens_gpu_sm_active_ratio"),
    ("NVML_GPM_METRIC_SM_OCCUPANCY", "batchlens_gpu_sm_occupancy_ratio"),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "batchlens_gpu_tensor_active_ratio"),
)

# (field id attribute, scopeId, metric name, multiplier to bytes)
FIELDS = (
    ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 0, "batchlens_gpu_pcie_transmit_bytes_total", 1),
    ("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 0, "batchlens_gpu_pcie_receive_bytes_total", 1),
    ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", ALL_LINKS, "batchlens_gpu_nvlink_transmit_bytes_total", 1024),  # KiB
    ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", ALL_LINKS, "batchlens_gpu_nvlink_receive_bytes_total", 1024),
)

# valueType of a field value -> the member of its value union that holds it
VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def error_reason(exc: BaseException) -> str:
    """``NVMLError_GpuIsLost`` -> ``gpu_is_lost``: a short, bounded label value."""
    name = type(exc).__name__
    if not name.startswith("NVMLError_"):
        return "nvml_error"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name.removeprefix("NVMLError_")).lower()


class GpuLost(Exception):
    """NVML says the GPU is gone (GpuIsLost) or failed without a reason (Unknown)."""


class DriverGone(Exception):
    """NVML, initialised, now says no driver is loaded: the driver went away under a running source."""


class NvmlCalls:
    """Every NVML call goes through here, so that its errors follow one policy (see the module doc)."""

    def __init__(self, nvml: ModuleType):
        self.nvml = nvml
        self._unsupported: set[tuple[str, str]] = set()
        self._missing: set[str] = set()
        self._lost = (nvml.NVMLError_GpuIsLost, nvml.NVMLError_Unknown)
        #: Soft errors of the current tick: reason -> message.
        self.soft: dict[str, str] = {}

    def get(self, scope: str, fn: Callable[..., Any], *args: Any, call: str | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, or None where the device or driver cannot answer.

        ``scope`` names the device (its UUID); ``call`` names the call where one
        function serves several (a versioned struct, a clock domain).
        """
        name = call or fn.__name__
        if name in self._missing or (scope, name) in self._unsupported:
            return None
        n = self.nvml
        try:
            return fn(*args, **kwargs)
        except n.NVMLError_NotSupported:
            log.debug("nvml: %s does not support %s", scope, name)
            self._unsupported.add((scope, name))
        except n.NVMLError_FunctionNotFound:
            log.info("nvml: the driver has no %s (it is older than nvidia-ml-py); not asked again", name)
            self._missing.add(name)
        except n.NVMLError_NotFound:
            pass
        except self._lost as exc:
            raise GpuLost(f"{name}: {exc}") from None
        except n.NVMLError_DriverNotLoaded as exc:
            raise DriverGone(f"{name}: {exc}") from None
        except n.NVMLError as exc:
            self.soft[error_reason(exc)] = f"{scope}: {name} failed: {exc}"
        return None

    def first(self, scope: str, *attempts: tuple[Callable[..., Any], tuple[Any, ...], str | None]) -> Any:
        """The first answer among equivalent calls, newest first: (fn, args, call name)."""
        for fn, args, call in attempts:
            value = self.get(scope, fn, *args, call=call)
            if value is not None:
                return value
        return None

    def unsupported(self, scope: str, call: str) -> None:
        self._unsupported.add((scope, call))

    def is_unsupported(self, scope: str, call: str) -> bool:
        return (scope, call) in self._unsupported


class GpmPair:
    """Two GPM samples that take turns, so each tick compares itself with the last one.

    GPM metrics are rates over the time between two samples; taking both in one
    tick would mean sleeping. The first tick after start (or after the GPU came
    back) therefore has no GPM values.
    """

    def __init__(self, calls: NvmlCalls, scope: str, take: Callable[[Any], Any]):
        self._calls, self._scope, self._take = calls, scope, take
        n = calls.nvml
        self._samples = [calls.get("gpm", n.nvmlGpmSampleAlloc), calls.get("gpm", n.nvmlGpmSampleAlloc)]
        self._current = 0
        self._primed = False
        self._request = n.c_nvmlGpmMetricsGet_t()
        self._ids = [(getattr(n, attr), name) for attr, name in GPM_METRICS]

    @property
    def usable(self) -> bool:
        return all(s is not None for s in self._samples)

    def reset(self) -> None:
        self._primed = False

    def tick(self) -> dict[str, float]:
        current, previous = self._samples[self._current], self._samples[1 - self._current]
        if self._take(current) is None:
            self._primed = False
            return {}
        self._current = 1 - self._current
        if not self._primed:
            self._primed = True
            return {}
        n, req = self._calls.nvml, self._request
        req.version = n.NVML_GPM_METRICS_GET_VERSION
        req.numMetrics = len(self._ids)
        req.sample1, req.sample2 = previous, current
        for i, (metric_id, _) in enumerate(self._ids):
            req.metrics[i].metricId = metric_id
        if self._calls.get(self._scope, n.nvmlGpmMetricsGet, req) is None:
            return {}
        return {
            name: req.metrics[i].value / 100
            for i, (_, name) in enumerate(self._ids)
            if req.metrics[i].nvmlReturn == n.NVML_SUCCESS
        }

    def free(self) -> None:
        for sample in self._samples:
            if sample is not None:
                self._calls.get("gpm", self._calls.nvml.nvmlGpmSampleFree, sample)


class Gpu:
    """One physical GPU: its handle, what never changes, and its GPM state."""

    def __init__(self, index: int):
        self.index = index
        self.handle: Any = None
        self.device = GpuDevice(index, "", "")
        self.fixed: dict[str, float] = {}  # peak bandwidth, max clocks
        self.info: dict[str, str] = {}
        self.gpm: GpmPair | None = None
        self.mig_gpm: dict[str, GpmPair] = {}

    def reset_gpm(self) -> None:
        for pair in (self.gpm, *self.mig_gpm.values()):
            if pair is not None:
                pair.reset()

    def free(self) -> None:
        for pair in (self.gpm, *self.mig_gpm.values()):
            if pair is not None:
                pair.free()


NO_DRIVER: list[Gpu] = []  # _open's answer on a host without an NVIDIA driver (compared by identity)


def _driver_present(present: bool) -> Metric:
    doc = "1 when an NVIDIA driver answers NVML here; 0 on a host without one (the nvml source is then up, no GPUs)."
    return fam.gauge("batchlens_nvml_driver_present", doc, [({}, 1.0 if present else 0.0)])


def _bus(sysfs: Path) -> list[Metric]:
    """The PCI bus's count of NVIDIA GPUs; nothing where sysfs cannot be read (the alert then cannot tell)."""
    count = nvidia_gpus(sysfs)
    if count is None:
        return []
    doc = "NVIDIA GPUs on this host's PCI bus (sysfs), whether or not a driver answers for them."
    return [fam.gauge("batchlens_pci_nvidia_gpus", doc, [({}, count)])]


class NvmlSource:
    kind = "nvml"
    labels: tuple[tuple[str, str], ...] = ()

    def __init__(
        self,
        engines: Sequence[Engine],
        executor: Executor | None = None,
        *,
        nvml: ModuleType | None = None,
        models: Callable[[], Mapping[str, str]] = dict,
        pod_resources: PodResourcesClient | None = None,
        names: Callable[[], Collection[str]] | None = None,
        headless_engine: str = "",
        sysfs: Path = Path("/sys"),
    ):
        """``names`` gives the engine names in force (discovery changes them); default: ``engines``'.
        ``headless_engine``: on a ``--headless`` node, the engine its vLLM processes serve (no server here).
        ``sysfs``: where the host's PCI bus is read (pci_bus.py)."""
        if nvml is None:
            import pynvml as nvml
        self._nvml = nvml
        self._calls = NvmlCalls(nvml)
        self._executor = executor
        self._models = models
        self._static = static_mapping(engines)
        # The servers of a deployment are its instance on the GPU series, as on their own (Engine.instance).
        self._instances = {e.name: e.instance for e in engines}
        configured = frozenset(e.name for e in engines)
        self._names = names or (lambda: configured)
        self._pod_resources = pod_resources
        self._servers = ServerPids(engines, "nvml")
        self._lineages: dict[int, tuple[int, ...]] = {}
        self._titles: dict[int, tuple[str, ...]] = {}  # pid -> the titles of its lineage, nearest first
        self._headless = headless_engine
        self._sysfs = sysfs
        self._gpus: list[Gpu] | None = None
        self._xids: XidWaiter | None = None
        # The engine each GPU last served: a lost GPU and its Xids still name it (whole GPUs, by index).
        self._served: dict[int, str] = {}
        self._driver: dict[str, str] = {}
        self._static_checked = False
        self._said_no_driver = False
        self._said_broken: set[int] = set()  # GPUs whose exception outside NVML was logged, until they read again

    async def sample(self) -> Reading:
        models = dict(self._models())  # read on the event loop, where the vLLM sources write it
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.sample_now, models)

    def sample_now(self, models: Mapping[str, str]) -> Reading:
        """One tick, blocking: NVML calls go to the driver."""
        try:
            gpus = self._open()
            if gpus is not NO_DRIVER:
                return self._sample(gpus, models)
        except DriverGone as exc:
            self._let_go(exc)
        return Reading(metrics=(_driver_present(False), *_bus(self._sysfs)))

    def _let_go(self, exc: DriverGone) -> None:
        """The driver went away under us: NVML's state is let go (its calls would only fail), to start afresh."""
        log.error("nvml: the NVIDIA driver went away (%s): no GPU metrics until it answers again; "
                  "batchlens_nvml_driver_present is 0", exc)  # fmt: skip
        if self._xids is not None:
            self._xids.close()
            self._xids = None
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()
        self._gpus = None
        self._said_no_driver = True  # not "a host without a driver": this one had one, and the log said so

    def _sample(self, gpus: list[Gpu], models: Mapping[str, str]) -> Reading:
        self._calls.soft.clear()
        readings: list[GpuReading] = []
        processes: list[GpuProcess] = []
        down: list[GpuDevice] = []
        lost: list[str] = []
        broken: list[str] = []
        for gpu in gpus:
            try:  # both or neither: a GPU that is down must have no series
                read, running = self._read(gpu), self._processes(gpu)
            except DriverGone:
                raise  # not this GPU's: the whole driver's
            except GpuLost as exc:
                gpu.reset_gpm()
                down.append(gpu.device)
                lost.append(f"GPU {gpu.index} {gpu.device.uuid} ({exc})")
            except Exception as exc:  # not NVML's: a bug in the binding on one GPU must not take the others
                if gpu.index not in self._said_broken:
                    log.exception("nvml: GPU %d: reading it raised %s; it is down until it reads again",
                                  gpu.index, type(exc).__name__)  # fmt: skip
                    self._said_broken.add(gpu.index)
                gpu.reset_gpm()
                down.append(gpu.device)
                broken.append(f"GPU {gpu.index} {gpu.device.uuid} ({type(exc).__name__}: {exc})")
            else:
                readings += read
                processes += running
                self._said_broken.discard(gpu.index)
        if lost:
            self._calls.soft["gpu_lost"] = "GPU lost, its series dropped: " + "; ".join(lost)
        if broken:
            self._calls.soft["gpu_error"] = "GPU read failed outside NVML, its series dropped: " + "; ".join(broken)
        devices = [r.device for r in readings]
        if not self._static_checked and not down:
            self._check_static(devices)
        own, ranks = self._process_engines(processes)
        pods = self._holders(devices)
        pod_engines = {d: engine for d, refs in (pods or {}).items() if (engine := next(self._engines_of(refs), None))}
        instance = self._instances.get
        engines = {device: instance(name, name) for device, name in
                   assign_engines(devices, processes, own, self._static, pod_engines).items()}  # fmt: skip
        self._served.update({d.index: engines.get(d, "") for d in devices if not d.is_mig})
        engines.update({d: self._served.get(d.index, "") for d in down})
        owners = process_owners(processes, own, devices, self._static)
        metrics = gpu_families(
            readings,
            down,
            engines,
            models,
            processes,
            {pid: instance(name, name) for pid, name in owners.items()},
            pods=pods,
            ranks=device_ranks(devices, processes, ranks),
            xids=self._xid_counts(gpus),
        )
        metrics.append(fam.info("batchlens_nvml_info", "The NVIDIA driver and NVML library versions.", self._driver))
        metrics.append(_driver_present(True))
        metrics += _bus(self._sysfs)
        return Reading(metrics=tuple(metrics), soft_errors=tuple(self._calls.soft.items()))

    def _xid_counts(self, gpus: Sequence[Gpu]) -> list[tuple[dict[str, str], int]]:
        """The Xid counts, labelled with their GPU and the engine it serves or last served."""
        if self._xids is None:
            return []
        device = {gpu.index: gpu.device for gpu in gpus}
        rows = []
        for (index, xid), count in sorted(self._xids.counts().items()):
            uuid = device[index].uuid if index in device else ""
            gpu = str(index) if index >= 0 else ""
            rows.append(({"gpu": gpu, "uuid": uuid, "vllm_instance": self._served.get(index, ""), "xid": xid}, count))
        return rows

    def _holders(self, devices: Sequence[GpuDevice]) -> dict[GpuDevice, list[PodRef]] | None:
        """device -> the pods holding it, from the kubelet; None when not asked, {} when it failed (counted)."""
        if self._pod_resources is None:
            return None
        try:
            return device_holders(devices, holders(self._pod_resources.list()))
        except PodResourcesError as exc:
            # The process-tree mapping still applies; the series lose their pod labels until the kubelet answers.
            self._calls.soft[f"pod_resources_{exc.reason}"] = str(exc)
            return {}

    def _engines_of(self, refs: Sequence[PodRef]):
        names = self._names()
        return (ref.instance for ref in refs if ref.instance in names)

    async def aclose(self, timeout: float = 2.0) -> None:
        """:meth:`close` in the NVML thread, after any sample still running there; bounded by ``timeout``."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                await loop.run_in_executor(self._executor, self.close)
        except TimeoutError:
            log.warning("nvml: a call is stuck in the driver (%.0f s after stopping); exiting without it", timeout)

    def _check_static(self, devices: Sequence[GpuDevice]) -> None:
        """Warn, once, about a ``gpus:`` entry that names no GPU here: most likely a typo."""
        known = {key for d in devices for key in (str(d.index), d.uuid, d.parent_uuid) if key}
        for key in sorted(self._static.keys() - known):
            log.warning(
                "nvml: engine %s lists GPU %r under gpus:, but this host has no such GPU (it has %s)",
                self._static[key], key, ", ".join(sorted(known)) or "none",
            )  # fmt: skip
        self._static_checked = True

    def close(self) -> None:
        if self._pod_resources is not None:
            self._pod_resources.close()
        if self._xids is not None:
            self._xids.close()
            self._xids = None
        if self._gpus is None:
            return
        for gpu in self._gpus:
            gpu.free()
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.debug("nvml: shutdown: %s", exc)
        self._gpus = None

    # -- discovery -------------------------------------------------------

    def _open(self) -> list[Gpu]:
        """Initialise NVML once; until it works, every tick fails with the reason.

        A host with no NVIDIA driver at all is a state, not an outage: the source is up
        with no GPUs (``batchlens_nvml_driver_present 0``), said once in the log, and
        NVML is tried again each tick in case a driver is loaded later.
        """
        if self._gpus is not None:
            return self._gpus
        n = self._nvml
        try:
            n.nvmlInit()
        except (n.NVMLError_LibraryNotFound, n.NVMLError_DriverNotLoaded) as exc:
            if not self._said_no_driver:
                if gpus := nvidia_gpus(self._sysfs):  # a GPU node whose driver is not loaded: a fault, not a state
                    log.error("nvml: no NVIDIA driver answers (%s), yet the PCI bus holds %d NVIDIA GPUs: the driver "
                              "is not loaded (BatchlensGpuDriverGone pages)", exc, gpus)  # fmt: skip
                else:
                    log.warning("nvml: no NVIDIA driver on this host (%s): no GPU metrics; set exporter.nvml: false "
                                "to skip NVML on hosts without GPUs", exc)  # fmt: skip
                self._said_no_driver = True
            return NO_DRIVER
        except n.NVMLError as exc:
            raise SourceError(
                error_reason(exc),
                f"NVML is not available ({exc}): no NVIDIA GPU or driver on this host? "
                "GPU metrics are off; trying again every tick",
            ) from None
        try:
            count = n.nvmlDeviceGetCount()
        except n.NVMLError as exc:
            with contextlib.suppress(n.NVMLError):
                n.nvmlShutdown()
            raise SourceError(
                error_reason(exc), f"NVML cannot count the GPUs ({exc}); trying again every tick"
            ) from None
        c = self._calls
        self._driver = {
            "driver_version": c.get("system", n.nvmlSystemGetDriverVersion) or "",
            "nvml_version": c.get("system", n.nvmlSystemGetNVMLVersion) or "",
        }
        self._gpus = [Gpu(i) for i in range(count)]
        log.info("nvml: driver %s, %d GPUs", self._driver["driver_version"] or "unknown", count)
        self._xids = self._watch_xids(count)
        return self._gpus

    def _watch_xids(self, count: int) -> XidWaiter | None:
        """The Xid waiter over every GPU that gives a handle now (a GPU lost at the start is not watched)."""
        n, handles = self._nvml, []
        for index in range(count):
            try:
                handles.append((index, n.nvmlDeviceGetHandleByIndex(index)))
            except n.NVMLError as exc:
                log.warning("nvml: GPU %d gives no handle (%s): its Xids are not watched", index, exc)
        waiter = XidWaiter(n, handles)
        return waiter if waiter.start() else None

    def _discover(self, gpu: Gpu) -> None:
        """The facts of a GPU that never change, read on its first good tick."""
        c, n, scope = self._calls, self._nvml, f"gpu{gpu.index}"
        handle = c.get(scope, n.nvmlDeviceGetHandleByIndex, gpu.index)
        if handle is None:
            raise GpuLost("no handle")
        uuid = c.get(scope, n.nvmlDeviceGetUUID, handle) or ""
        name = c.get(scope, n.nvmlDeviceGetName, handle) or "unknown"
        scope = uuid or scope
        arch = c.get(scope, n.nvmlDeviceGetArchitecture, handle)
        bus = c.get(scope, n.nvmlDeviceGetMemoryBusWidth, handle)
        max_sm = c.get(scope, n.nvmlDeviceGetMaxClockInfo, handle, n.NVML_CLOCK_SM, call="max_sm_clock")
        max_mem = c.get(scope, n.nvmlDeviceGetMaxClockInfo, handle, n.NVML_CLOCK_MEM, call="max_memory_clock")
        peak = peak_bandwidth(name, bus, max_mem)
        if peak.basis == "datasheet":
            log.info(
                "nvml: GPU %d (%s): bus width %s bits x max memory clock %s MHz does not match the data sheet; "
                "using the data sheet's %.0f GB/s as peak bandwidth",
                gpu.index, name, bus, max_mem, peak.bytes_per_second / 1e9,
            )  # fmt: skip
        fixed = {"batchlens_gpu_sm_clock_max_hertz": max_sm, "batchlens_gpu_memory_clock_max_hertz": max_mem}
        gpu.fixed = {k: v * MHZ for k, v in fixed.items() if v is not None}
        if peak.bytes_per_second is not None:
            gpu.fixed[PEAK_BANDWIDTH] = peak.bytes_per_second
        gpu.info = {"architecture": ARCHITECTURES.get(arch, "unknown"), "bandwidth_basis": peak.basis}
        support = c.get(scope, n.nvmlGpmQueryDeviceSupport, handle)
        if support is not None and support.isSupportedDevice:
            pair = GpmPair(c, scope, lambda sample: c.get(scope, n.nvmlGpmSampleGet, handle, sample))
            gpu.gpm = pair if pair.usable else None
        gpu.handle, gpu.device = handle, GpuDevice(gpu.index, uuid, name)

    # -- one tick --------------------------------------------------------

    def _read(self, gpu: Gpu) -> list[GpuReading]:
        if gpu.handle is None:
            self._discover(gpu)
        c, n, h, scope = self._calls, self._nvml, gpu.handle, gpu.device.uuid
        values = dict(gpu.fixed)
        values.update(self._shared_values(scope, h))
        for name, clock in (
            ("batchlens_gpu_sm_clock_hertz", n.NVML_CLOCK_SM),
            ("batchlens_gpu_memory_clock_hertz", n.NVML_CLOCK_MEM),
        ):
            mhz = c.get(scope, n.nvmlDeviceGetClockInfo, h, clock, call=name)
            if mhz is not None:
                values[name] = mhz * MHZ
        power = c.get(scope, n.nvmlDeviceGetPowerUsage, h)
        if power is not None:
            values["batchlens_gpu_power_watts"] = power / 1000  # milliwatts
        energy = c.get(scope, n.nvmlDeviceGetTotalEnergyConsumption, h)
        if energy is not None:
            values["batchlens_gpu_energy_joules_total"] = energy / 1000  # millijoules
        temperature = c.first(
            scope,
            (n.nvmlDeviceGetTemperatureV, (h, n.NVML_TEMPERATURE_GPU), None),
            (n.nvmlDeviceGetTemperature, (h, n.NVML_TEMPERATURE_GPU), None),
        )
        if temperature is not None:
            values["batchlens_gpu_temperature_celsius"] = temperature
        values.update(self._fields(scope, h))
        if gpu.gpm is not None:
            values.update(gpu.gpm.tick())
        events = c.first(
            scope,
            (n.nvmlDeviceGetCurrentClocksEventReasons, (h,), None),
            (n.nvmlDeviceGetCurrentClocksThrottleReasons, (h,), None),
        )
        rows = c.get(scope, n.nvmlDeviceGetRemappedRows, h)  # Ampere and newer: how memory faults show first
        if rows is not None:
            values.update(remapped_rows(*rows))
        mig = c.get(scope, n.nvmlDeviceGetMigMode, h)
        mig_enabled = mig is not None and mig[0] == n.NVML_DEVICE_MIG_ENABLE
        info = {**gpu.info, "mig_mode": "unsupported" if mig is None else ("enabled" if mig_enabled else "disabled")}
        whole = GpuReading(gpu.device, values, info, events, self._ecc(scope, h))
        return [whole, *self._mig_readings(gpu)] if mig_enabled else [whole]

    def _shared_values(self, scope: str, handle: Any) -> dict[str, float]:
        """What a whole GPU and a MIG instance both report: utilization and memory."""
        c, n = self._calls, self._nvml
        values: dict[str, float] = {}
        util = c.get(scope, n.nvmlDeviceGetUtilizationRates, handle)
        if util is not None:
            for name, percent in ((SM_BUSY, util.gpu), (MEMORY_BUSY, util.memory)):
                if 0 <= percent <= 100:  # a driver's 0xFFFFFFFF is no reading, not 43 million percent
                    values[name] = percent / 100
        memory = c.first(
            scope,
            (partial(n.nvmlDeviceGetMemoryInfo, version=n.nvmlMemory_v2), (handle,), "nvmlDeviceGetMemoryInfo_v2"),
            (n.nvmlDeviceGetMemoryInfo, (handle,), None),
        )
        if memory is not None:
            values["batchlens_gpu_memory_total_bytes"] = memory.total
            values["batchlens_gpu_memory_used_bytes"] = memory.used
            values["batchlens_gpu_memory_free_bytes"] = memory.free
            if hasattr(memory, "reserved"):
                values["batchlens_gpu_memory_reserved_bytes"] = memory.reserved
        return values

    def _fields(self, scope: str, handle: Any) -> dict[str, float]:
        """PCIe and NVLink byte counters, in one field-value call. Each field can fail on its own."""
        c, n = self._calls, self._nvml
        wanted = [(getattr(n, attr), scope_id, name, unit) for attr, scope_id, name, unit in FIELDS]
        wanted = [w for w in wanted if not c.is_unsupported(scope, f"field_{w[0]}")]
        if not wanted:
            return {}
        results = c.get(scope, n.nvmlDeviceGetFieldValues, handle, [(fid, sid) for fid, sid, _, _ in wanted])
        if results is None:
            return {}
        values = {}
        for (field_id, _, name, unit), result in zip(wanted, results, strict=True):
            if result.nvmlReturn == n.NVML_SUCCESS:
                values[name] = getattr(result.value, VALUE_MEMBERS.get(result.valueType, "ullVal")) * unit
            elif result.nvmlReturn == n.NVML_ERROR_NOT_SUPPORTED:
                c.unsupported(scope, f"field_{field_id}")
            elif result.nvmlReturn in (n.NVML_ERROR_GPU_IS_LOST, n.NVML_ERROR_UNKNOWN):
                raise GpuLost(f"field {field_id}: {n.NVMLError(result.nvmlReturn)}")
            else:
                error = n.NVMLError(result.nvmlReturn)
                c.soft[error_reason(error)] = f"{scope}: field {field_id}: {error}"
        return values

    def _ecc(self, scope: str, handle: Any) -> dict[str, float]:
        c, n = self._calls, self._nvml
        mode = c.get(scope, n.nvmlDeviceGetEccMode, handle)
        if mode is None or mode[0] != n.NVML_FEATURE_ENABLED:
            return {}
        counts = {}
        for kind, error_type in (
            ("corrected", n.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("uncorrected", n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            count = c.get(scope, n.nvmlDeviceGetTotalEccErrors, handle, error_type, n.NVML_VOLATILE_ECC, call=kind)
            if count is not None:
                counts[kind] = count
        return counts

    def _mig_readings(self, gpu: Gpu) -> list[GpuReading]:
        c, n, parent, scope = self._calls, self._nvml, gpu.handle, gpu.device.uuid
        readings = []
        slots = c.get(scope, n.nvmlDeviceGetMaxMigDeviceCount, parent) or 0
        for slot in range(slots):
            handle = c.get(scope, n.nvmlDeviceGetMigDeviceHandleByIndex, parent, slot)
            if handle is None:
                continue  # an empty slot
            uuid = c.get(scope, n.nvmlDeviceGetUUID, handle) or ""
            instance = c.get(uuid, n.nvmlDeviceGetGpuInstanceId, handle)
            if instance is None:
                continue
            device = GpuDevice(gpu.index, uuid, c.get(uuid, n.nvmlDeviceGetName, handle) or "", str(instance), scope)
            values = self._shared_values(uuid, handle)
            if gpu.gpm is not None:
                pair = gpu.mig_gpm.get(device.mig_instance)
                if pair is None:
                    take = self._mig_sampler(uuid, parent, instance)
                    pair = gpu.mig_gpm[device.mig_instance] = GpmPair(c, uuid, take)
                values.update(pair.tick())
            info = {
                "architecture": gpu.info.get("architecture", "unknown"),
                "bandwidth_basis": "",
                "mig_mode": "instance",
            }
            readings.append(GpuReading(device, values, info))
        return readings

    def _mig_sampler(self, scope: str, parent: Any, instance: int) -> Callable[[Any], Any]:
        c, n = self._calls, self._nvml
        return lambda sample: c.get(scope, n.nvmlGpmMigSampleGet, parent, instance, sample)

    def _processes(self, gpu: Gpu) -> list[GpuProcess]:
        c, n, h = self._calls, self._nvml, gpu.handle
        found = c.first(
            gpu.device.uuid,
            (n.nvmlDeviceGetComputeRunningProcesses_v3, (h,), None),
            (n.nvmlDeviceGetComputeRunningProcesses_v2, (h,), None),
        )
        return [
            GpuProcess(
                gpu.index,
                "" if p.gpuInstanceId in (None, NO_INSTANCE) else str(p.gpuInstanceId),
                p.pid,
                p.usedGpuMemory,
            )
            for p in found or ()
        ]

    def _process_engines(self, processes: Sequence[GpuProcess]) -> tuple[dict[int, str], dict[int, str]]:
        """pid -> engine, by walking each GPU process's ancestors up to an engine's server (on a --headless node,
        where none is, any vLLM process is the headless engine's); and pid -> its DP rank, from its line's titles.
        """
        servers = {pid: name for name, pid in self._servers.resolve().items()} if processes else {}
        live = {p.pid for p in processes}
        # A process's ancestry and title do not change once it holds a GPU (vLLM retitles it before CUDA starts):
        # remember them while the process lives.
        self._lineages = {pid: self._lineages[pid] if pid in self._lineages else lineage(pid) for pid in live}
        self._titles = {pid: self._titles[pid] if pid in self._titles else titles(self._lineages[pid]) for pid in live}
        ranks = {pid: rank for pid in live if (rank := dp_rank_of(self._titles[pid]))}
        engines = {}
        for pid in live:
            engine = engine_of(self._lineages[pid], servers) if servers else None
            if engine is None and self._headless and any(is_vllm_title(t) for t in self._titles[pid]):
                engine = self._headless
            if engine:
                engines[pid] = engine
        return engines, ranks
