"""GPU: each GPU with the engine that uses it (the exporter's mapping), from NVML and GPM."""

from __future__ import annotations

from batchlens.config import Thresholds
from batchlens.dashboards.kit import GPU_SEL, dashboard, place, state_timeline, target, timeseries

GPU = "GPU {{gpu}} {{vllm_instance}}"
CLOCK_EVENT = "batchlens_gpu_clock_event_active"


def q(metric: str) -> str:
    return f"max by (cluster, gpu, vllm_instance) ({metric}{{{GPU_SEL}}})"


def counter(metric: str) -> str:
    return f"max by (cluster, gpu, vllm_instance) (rate({metric}{{{GPU_SEL}}}[$__rate_interval]))"


def gpu(thresholds: Thresholds) -> dict:
    throttle = state_timeline(
        "Clock events (throttle reasons)",
        target(f"max by (gpu, reason) (batchlens_gpu_clock_event_active{{{GPU_SEL}}}) > 0", "GPU {{gpu}} {{reason}}"),
        "Why NVML holds the clocks down: power cap, thermal, sync boost, ... An idle GPU shows gpu_idle.",
    )
    panels = place(
        [
            (
                8,
                [
                    (timeseries("Memory busy and DRAM bandwidth", (q("batchlens_gpu_memory_busy_ratio"), f"{GPU} busy"),
                                (q("batchlens_gpu_dram_bandwidth_ratio"), f"{GPU} DRAM bandwidth"),
                                unit="percentunit", threshold=thresholds.bandwidth_ratio,
                                description="Memory busy is NVML's share of time memory was read or written; the "
                                "DRAM bandwidth ratio (GPM, Hopper and newer) is the true share of peak bandwidth."),
                     12),
                    (timeseries("Memory bandwidth against peak",
                                (q("batchlens_gpu_memory_bandwidth_bytes_per_second"), f"{GPU} used"),
                                (q("batchlens_gpu_memory_bandwidth_peak_bytes_per_second"), "GPU {{gpu}} peak"),
                                unit="Bps"), 12),
                ],
            ),
            (
                8,
                [
                    (timeseries("SM busy, occupancy, tensor activity",
                                (q("batchlens_gpu_sm_busy_ratio"), f"{GPU} busy"),
                                (q("batchlens_gpu_sm_occupancy_ratio"), f"{GPU} occupancy"),
                                (q("batchlens_gpu_tensor_active_ratio"), f"{GPU} tensor"),
                                unit="percentunit"), 12),
                    (timeseries("Memory used", (q("batchlens_gpu_memory_used_bytes"), f"{GPU} used"),
                                (q("batchlens_gpu_memory_total_bytes"), "GPU {{gpu}} total"), unit="bytes",
                                description="vLLM takes its KV cache up front: used memory is flat by design."), 12),
                ],
            ),
            (
                8,
                [
                    (timeseries("Power", (q("batchlens_gpu_power_watts"), GPU), unit="watt"), 8),
                    (timeseries("Temperature", (q("batchlens_gpu_temperature_celsius"), GPU), unit="celsius"), 8),
                    (timeseries("Clocks", (q("batchlens_gpu_sm_clock_hertz"), f"{GPU} SM"),
                                (q("batchlens_gpu_memory_clock_hertz"), f"{GPU} memory"), unit="hertz"), 8),
                ],
            ),
            (
                8,
                [
                    (throttle, 8),
                    (timeseries("PCIe", (counter("batchlens_gpu_pcie_transmit_bytes_total"), f"{GPU} tx"),
                                (counter("batchlens_gpu_pcie_receive_bytes_total"), f"{GPU} rx"), unit="Bps"), 8),
                    (timeseries("NVLink", (counter("batchlens_gpu_nvlink_transmit_bytes_total"), f"{GPU} tx"),
                                (counter("batchlens_gpu_nvlink_receive_bytes_total"), f"{GPU} rx"), unit="Bps"), 8),
                ],
            ),
        ]
    )  # fmt: skip
    return dashboard(
        "gpu",
        "GPU",
        "Each GPU beside the vLLM engine that uses it: memory bandwidth first, the article's first bottleneck.",
        panels,
    )
