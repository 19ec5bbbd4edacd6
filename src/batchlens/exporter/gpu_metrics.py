"""What the NVML source read, and the metric families it becomes. Pure: no NVML, no I/O.

Every GPU series carries one label set, ``{gpu, uuid, gpu_name, mig_instance,
vllm_instance, model_name}``, so a GPU joins with the engine that drives it.
``mig_instance`` is the GPU instance id of a MIG device and empty for a whole
GPU; ``vllm_instance`` and ``model_name`` are empty for a GPU no engine uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client.metrics_core import Metric

from batchlens.exporter import families as fam
from batchlens.exporter.render import source_up


class GpuDevice(NamedTuple):
    """A whole GPU, or one MIG instance of it."""

    index: int  # NVML index of the physical GPU
    uuid: str  # "GPU-..." for a whole GPU, "MIG-..." for a MIG instance
    name: str
    mig_instance: str = ""  # GPU instance id of a MIG device
    parent_uuid: str = ""  # the physical GPU's uuid, for a MIG device

    @property
    def is_mig(self) -> bool:
        return bool(self.mig_instance)


class GpuProcess(NamedTuple):
    """A compute process on a GPU, as NVML lists it."""

    gpu: int
    gpu_instance: str  # the MIG GPU instance id it runs in, "" outside MIG mode
    pid: int
    used_bytes: float | None  # None where NVML cannot tell (NVML_VALUE_NOT_AVAILABLE)


@dataclass(frozen=True, slots=True)
class GpuReading:
    device: GpuDevice
    #: metric name (from GPU_METRICS) -> value; a metric the device does not support is absent.
    values: Mapping[str, float]
    #: extra labels of batchlens_gpu_info
    info: Mapping[str, str] = field(default_factory=dict)
    #: bitmask of NVML's nvmlClocksEventReason* flags, None where unsupported
    clock_events: int | None = None
    #: "corrected" / "uncorrected" -> volatile ECC error count; empty where ECC is off
    ecc_errors: Mapping[str, float] = field(default_factory=dict)


class MetricSpec(NamedTuple):
    name: str
    type: str  # "gauge" or "counter"
    help: str


def _gauge(name: str, help: str) -> MetricSpec:
    return MetricSpec(name, "gauge", help)


def _counter(name: str, help: str) -> MetricSpec:
    return MetricSpec(name, "counter", help)


SM_BUSY = "batchlens_gpu_sm_busy_ratio"
MEMORY_BUSY = "batchlens_gpu_memory_busy_ratio"
DRAM_BANDWIDTH = "batchlens_gpu_dram_bandwidth_ratio"
PEAK_BANDWIDTH = "batchlens_gpu_memory_bandwidth_peak_bytes_per_second"
BANDWIDTH = "batchlens_gpu_memory_bandwidth_bytes_per_second"

#: The per-device metrics, in the order they are exposed. docs/gpu-metrics.md names the NVML call behind each.
GPU_METRICS: tuple[MetricSpec, ...] = (
    _gauge(SM_BUSY, "Share of time one or more kernels ran on the GPU (NVML utilization.gpu). Time, not SMs."),
    _gauge(
        MEMORY_BUSY,
        "Share of time device memory was being read or written (NVML utilization.memory, nvidia-smi dmon 'mem'). "
        "Busy time, not a share of bandwidth: see batchlens_gpu_dram_bandwidth_ratio.",
    ),
    _gauge(
        DRAM_BANDWIDTH,
        "DRAM bandwidth used over the last interval as a share of the peak (GPM DRAM_BW_UTIL, Hopper and newer).",
    ),
    _gauge("batchlens_gpu_sm_active_ratio", "Share of SMs that were busy over the last interval (GPM SM_UTIL)."),
    _gauge(
        "batchlens_gpu_sm_occupancy_ratio",
        "Active warps as a share of the theoretical maximum over the last interval (GPM SM_OCCUPANCY).",
    ),
    _gauge(
        "batchlens_gpu_tensor_active_ratio",
        "Share of time the SMs ran any tensor-core work over the last interval (GPM ANY_TENSOR_UTIL).",
    ),
    _gauge(PEAK_BANDWIDTH, "Peak memory bandwidth: bus width x max memory clock x 2 / 8, or the data sheet's."),
    _gauge(BANDWIDTH, "Estimated memory bandwidth in use: the GPM DRAM bandwidth ratio x the peak."),
    _gauge("batchlens_gpu_memory_total_bytes", "Device memory in total (NVML memory info)."),
    _gauge("batchlens_gpu_memory_used_bytes", "Device memory allocated (NVML memory info)."),
    _gauge("batchlens_gpu_memory_free_bytes", "Device memory free (NVML memory info)."),
    _gauge("batchlens_gpu_memory_reserved_bytes", "Device memory the driver reserves (NVML memory info v2)."),
    _gauge("batchlens_gpu_sm_clock_hertz", "Current SM clock."),
    _gauge("batchlens_gpu_sm_clock_max_hertz", "Maximum SM clock."),
    _gauge("batchlens_gpu_memory_clock_hertz", "Current memory clock."),
    _gauge("batchlens_gpu_memory_clock_max_hertz", "Maximum memory clock."),
    _gauge("batchlens_gpu_power_watts", "Power draw of the board."),
    _counter("batchlens_gpu_energy_joules_total", "Energy used since the driver loaded."),
    _gauge("batchlens_gpu_temperature_celsius", "GPU core temperature."),
    _counter("batchlens_gpu_pcie_transmit_bytes_total", "Bytes sent over PCIe (NVML field PCIE_COUNT_TX_BYTES)."),
    _counter("batchlens_gpu_pcie_receive_bytes_total", "Bytes received over PCIe (NVML field PCIE_COUNT_RX_BYTES)."),
    _counter(
        "batchlens_gpu_nvlink_transmit_bytes_total", "Data bytes sent over all NVLinks (NVML field NVLINK_THROUGHPUT)."
    ),
    _counter(
        "batchlens_gpu_nvlink_receive_bytes_total",
        "Data bytes received over all NVLinks (NVML field NVLINK_THROUGHPUT).",
    ),
    _gauge(
        "batchlens_gpu_remapped_rows_correctable",
        "Memory rows remapped for correctable errors since the GPU was made (NVML remapped rows, Ampere+).",
    ),
    _gauge(
        "batchlens_gpu_remapped_rows_uncorrectable",
        "Memory rows remapped for uncorrectable errors since the GPU was made (NVML remapped rows, Ampere+).",
    ),
    _gauge(
        "batchlens_gpu_row_remapping_pending",
        "1 while a row remapping waits for the GPU's next reset to take effect (NVML remapped rows).",
    ),
    _gauge(
        "batchlens_gpu_row_remapping_failed",
        "1 once a row could not be remapped: the GPU is out of spare rows (NVML remapped rows).",
    ),
)


def remapped_rows(correctable: int, uncorrectable: int, pending: int, failed: int) -> dict[str, float]:
    """nvmlDeviceGetRemappedRows's answer as the four gauges (pending and failed as 0 or 1)."""
    return {
        "batchlens_gpu_remapped_rows_correctable": correctable,
        "batchlens_gpu_remapped_rows_uncorrectable": uncorrectable,
        "batchlens_gpu_row_remapping_pending": 1.0 if pending else 0.0,
        "batchlens_gpu_row_remapping_failed": 1.0 if failed else 0.0,
    }


#: NVML's clock event (throttle) reason flags, a stable part of its ABI.
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)


#: The labels of the pod that holds a GPU, on Kubernetes (exporter.pod_resources_socket).
POD_LABELS = ("namespace", "pod", "container")


def device_labels(device: GpuDevice, engine: str, model_name: str, pod: Sequence[str] | None = None) -> dict[str, str]:
    """A device's labels; ``pod`` (namespace, pod, container) where the kubelet is asked, empty if none holds it."""
    labels = {
        "gpu": str(device.index),
        "uuid": device.uuid,
        "gpu_name": device.name,
        "mig_instance": device.mig_instance,
        "vllm_instance": engine,
        "model_name": model_name,
    }
    if pod is not None:
        labels.update(zip(POD_LABELS, pod or ("", "", ""), strict=True))
    return labels


def with_estimates(values: Mapping[str, float]) -> dict[str, float]:
    """``values`` plus the bandwidth in use, where GPM gives a true bandwidth ratio and the peak is known."""
    out = dict(values)
    if DRAM_BANDWIDTH in values and PEAK_BANDWIDTH in values:
        out[BANDWIDTH] = values[DRAM_BANDWIDTH] * values[PEAK_BANDWIDTH]
    return out


def gpu_families(
    readings: Sequence[GpuReading],
    down: Sequence[GpuDevice],
    engines: Mapping[GpuDevice, str],
    models: Mapping[str, str],
    processes: Iterable[GpuProcess],
    process_engines: Mapping[int, str],
    source: str = "nvml",
    pods: Mapping[GpuDevice, Sequence[tuple[str, str, str]]] | None = None,
    ranks: Mapping[GpuDevice, str] | None = None,
    xids: Sequence[tuple[Mapping[str, str], float]] = (),
) -> list[Metric]:
    """The NVML source's families.

    ``readings`` hold a whole GPU, and in MIG mode each of its instances too.
    ``down`` are the physical GPUs that failed this tick (lost, unknown error);
    ``engines`` maps a device to the engine that uses it and ``models`` an engine
    to its model; ``process_engines`` maps a compute process to its engine.
    ``pods`` (on Kubernetes) maps a device to the (namespace, pod, container) holding it, first first.
    ``ranks`` maps a device to the data-parallel rank of the engine core on it: its series carry ``dp_rank``.
    ``engines`` names a ``down`` GPU's engine too (the one it last served), on its up series.
    ``xids``: each (GPU, Xid label)'s labels and count (xid_events.py).
    """
    labelled = []
    for r in readings:
        engine = engines.get(r.device, "")
        held = None if pods is None else next(iter(pods.get(r.device, ())), ())
        labels = device_labels(r.device, engine, models.get(engine, ""), held)
        if rank := (ranks or {}).get(r.device):
            labels["dp_rank"] = rank
        labelled.append((labels, r))
    metrics = [
        # Up per physical GPU, beside the source's own series: a lost GPU leaves the others alone, and names the
        # engine it served (the page says whose P99 it is about to hurt).
        source_up(
            [
                ({"source": source, "gpu": str(d.index), "uuid": d.uuid, "vllm_instance": engines.get(d, "")}, up)
                for d, up in [(r.device, 1) for r in readings if not r.device.is_mig] + [(d, 0) for d in down]
            ]
        ),
        fam.gauge(
            "batchlens_gpu_info",
            "The GPU and what batchlens knows of it, always 1: architecture, MIG mode, peak bandwidth basis.",
            [({**labels, **r.info}, 1.0) for labels, r in labelled],
        ),
    ]
    values = [(labels, with_estimates(r.values)) for labels, r in labelled]
    for spec in GPU_METRICS:
        samples = [(labels, v[spec.name]) for labels, v in values if spec.name in v]
        if samples:
            build = fam.counter if spec.type == "counter" else fam.gauge
            metrics.append(build(spec.name, spec.help, samples))
    events = [
        ({**labels, "reason": reason}, 1.0 if r.clock_events & bit else 0.0)
        for labels, r in labelled
        if r.clock_events is not None
        for bit, reason in CLOCK_EVENT_REASONS
    ]
    if events:
        metrics.append(
            fam.gauge(
                "batchlens_gpu_clock_event_active",
                "1 while NVML reports this reason for holding the clocks down (throttling), else 0.",
                events,
            )
        )
    ecc = [({**labels, "type": kind}, n) for labels, r in labelled for kind, n in sorted(r.ecc_errors.items())]
    if ecc:
        metrics.append(
            fam.counter("batchlens_gpu_ecc_errors_total", "ECC errors since the driver loaded (volatile).", ecc)
        )
    if xids:
        metrics.append(
            fam.counter(
                "batchlens_gpu_xid_errors_total",
                "Xid errors NVML reported for this GPU since the exporter started, by code (the known codes by "
                "number, the rest as 'other').",
                xids,
            )
        )
    if pods is not None:
        holders = [
            ({"gpu": str(device.index), "uuid": device.uuid, **dict(zip(POD_LABELS, ref, strict=True))}, 1.0)
            for device, refs in pods.items()
            for ref in refs
        ]
        metrics.append(
            fam.gauge(
                "batchlens_gpu_pod_info",
                "Each container the kubelet gave this GPU (several where it is time-sliced), always 1.",
                holders,
            )
        )
    memory = [
        ({"gpu": str(p.gpu), "pid": str(p.pid), "vllm_instance": process_engines.get(p.pid, "")}, p.used_bytes)
        for p in processes
        if p.used_bytes is not None
    ]
    if memory:
        metrics.append(fam.gauge("batchlens_gpu_process_memory_bytes", "Device memory a compute process uses.", memory))
    return metrics
