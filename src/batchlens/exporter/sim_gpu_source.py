"""The simulated GPU source: a ``batchlens simulate`` server's GPU, exported like a real one.

For engines with ``simulated_gpu: true``. It reads ``/batchlens/v1/sim/gpu``
and renders the same ``batchlens_gpu_*`` families as the NVML source
(gpu_metrics.py), so dashboards and alerts work unchanged in a demo. Its
``batchlens_source_up`` says ``source="simulated_gpu"``, so a simulated GPU is
never mistaken for a real one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError

from batchlens.config import Engine
from batchlens.exporter.gpu_metrics import (
    DRAM_BANDWIDTH,
    MEMORY_BUSY,
    PEAK_BANDWIDTH,
    SM_BUSY,
    GpuDevice,
    GpuReading,
    gpu_families,
)
from batchlens.exporter.http_get import HttpGetter
from batchlens.exporter.sampler import SourceError
from batchlens.exporter.snapshot import Reading

GPU_PATH = "/batchlens/v1/sim/gpu"
KIND = "simulated_gpu"


class SimGpu(BaseModel):
    model_config = ConfigDict(extra="ignore")

    index: int
    uuid: str
    name: str
    sm_busy_ratio: float
    memory_busy_ratio: float
    dram_bandwidth_ratio: float
    memory_used_bytes: float
    memory_total_bytes: float
    memory_bandwidth_peak_bytes_per_second: float
    power_watts: float
    temperature_celsius: float


class SimGpus(BaseModel):
    gpus: list[SimGpu]


def readings(report: SimGpus) -> list[GpuReading]:
    return [
        GpuReading(
            GpuDevice(g.index, g.uuid, g.name),
            {
                SM_BUSY: g.sm_busy_ratio,
                MEMORY_BUSY: g.memory_busy_ratio,
                DRAM_BANDWIDTH: g.dram_bandwidth_ratio,
                PEAK_BANDWIDTH: g.memory_bandwidth_peak_bytes_per_second,
                "batchlens_gpu_memory_used_bytes": g.memory_used_bytes,
                "batchlens_gpu_memory_total_bytes": g.memory_total_bytes,
                "batchlens_gpu_memory_free_bytes": g.memory_total_bytes - g.memory_used_bytes,
                "batchlens_gpu_power_watts": g.power_watts,
                "batchlens_gpu_temperature_celsius": g.temperature_celsius,
            },
            {"architecture": "simulated", "bandwidth_basis": "datasheet", "mig_mode": "disabled"},
        )
        for g in report.gpus
    ]


class SimulatedGpuSource:
    kind = KIND

    def __init__(
        self,
        engine: Engine,
        http: HttpGetter,
        *,
        timeout: float,
        models: Callable[[], Mapping[str, str]],
    ):
        self.engine = engine
        self.labels = (("vllm_instance", engine.name),)
        self._http = http
        self._timeout = timeout
        self._models = models

    async def sample(self) -> Reading:
        url = self.engine.url + GPU_PATH
        body = await self._http.text(url, timeout=self._timeout, limit=256 * 1024)
        try:
            report = SimGpus.model_validate_json(body)
        except ValidationError as exc:
            raise SourceError("parse", f"{url} is not a simulated GPU report: {exc.errors()[0]['msg']}") from None
        found = readings(report)
        name = self.engine.name
        engines = {r.device: name for r in found}
        metrics = gpu_families(found, [], engines, self._models(), [], {}, source=KIND)
        return Reading(metrics=tuple(metrics))
