"""The simulated GPU: what NVML would report, derived from the bytes and time of the engine's steps. Pure.

Over a sliding window of simulated time:
- SM busy ratio: the share of the window in which a step ran (NVML utilization.gpu: any kernel running);
- memory busy ratio: the share in which a step was bound by memory traffic (utilization.memory);
- DRAM bandwidth ratio: bytes read / (peak bandwidth x window) (GPM DRAM_BW_UTIL);
- memory used: the weights plus the whole KV cache, which vLLM allocates up front;
- power: idle plus the busy share of the board's range; temperature follows power.
"""

from __future__ import annotations

from collections import deque

from batchlens.simulator.engine import Engine, StepResult


class SimulatedGpu:
    def __init__(self, engine: Engine, window_seconds: float = 1.0):
        self._engine = engine
        self._window = window_seconds
        self._steps: deque[tuple[float, float, float, float]] = deque()  # start, end, bytes, memory-bound seconds

    def record(self, step: StepResult) -> None:
        if step.duration <= 0:
            return
        memory_seconds = min(step.duration, step.bytes_read / self._achievable_bandwidth())
        self._steps.append((step.started, step.started + step.duration, step.bytes_read, memory_seconds))

    def _achievable_bandwidth(self) -> float:
        gpu = self._engine.gpu
        return gpu.bandwidth_bytes_per_second * gpu.bandwidth_efficiency

    def report(self, now: float) -> dict[str, float | str | int]:
        since = now - self._window
        while self._steps and self._steps[0][1] <= since:
            self._steps.popleft()
        busy = memory = moved = 0.0
        for start, end, bytes_read, memory_seconds in self._steps:
            overlap = max(0.0, min(end, now) - max(start, since))
            share = overlap / (end - start)
            busy += overlap
            memory += memory_seconds * share
            moved += bytes_read * share
        gpu, engine = self._engine.gpu, self._engine
        sm_busy = min(1.0, busy / self._window)
        power = gpu.idle_watts + (gpu.max_watts - gpu.idle_watts) * sm_busy
        kv_bytes = engine.num_gpu_blocks * engine.block_size * engine.model.kv_bytes_per_token
        return {
            "index": 0,
            "uuid": "GPU-00000000-sim0-0000-0000-000000000000",
            "name": gpu.name,
            "sm_busy_ratio": sm_busy,
            "memory_busy_ratio": min(1.0, memory / self._window),
            "dram_bandwidth_ratio": min(1.0, moved / (gpu.bandwidth_bytes_per_second * self._window)),
            "memory_used_bytes": engine.model.resident_bytes + kv_bytes,
            "memory_total_bytes": gpu.memory_bytes,
            "memory_bandwidth_peak_bytes_per_second": gpu.bandwidth_bytes_per_second,
            "power_watts": power,
            "temperature_celsius": 35 + 45 * (power - gpu.idle_watts) / (gpu.max_watts - gpu.idle_watts),
        }
