"""Which vLLM engine uses which GPU. Pure: the process facts come in as arguments.

Three ways, in this order:

- **Static**: ``gpus:`` in an engine's config names GPU indexes or UUIDs (a
  ``MIG-...`` UUID names one MIG instance). For containers that cannot see the
  host's PIDs, which are the PIDs NVML reports.
- **Kubernetes**: the kubelet says which pod holds the GPU (kubelet/holders.py);
  the engine named ``<namespace>/<pod>`` gets it.
- **Automatic**: NVML lists each GPU's compute processes. A vLLM worker is a
  descendant of the API server, which listens on the engine URL's port, so
  walking a process's ancestors up to a listener finds its engine.

Where several engines share a GPU, the GPU goes to the one using the most of
its memory (then the first by name): a series has one ``vllm_instance``, and
``batchlens_gpu_process_memory_bytes`` still shows every process.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from batchlens.config import Engine
from batchlens.exporter.gpu_metrics import GpuDevice, GpuProcess

log = logging.getLogger("batchlens.exporter")


def static_mapping(engines: Iterable[Engine]) -> dict[str, str]:
    """GPU index or UUID, as a string -> engine name, from the engines' ``gpus:``."""
    mapping: dict[str, str] = {}
    for engine in engines:
        for gpu in engine.gpus:
            key = str(gpu)
            if key in mapping and mapping[key] != engine.name:
                log.warning(
                    "nvml: GPU %s is listed under engines %s and %s; using %s",
                    key,
                    mapping[key],
                    engine.name,
                    mapping[key],
                )
                continue
            mapping[key] = engine.name
    return mapping


def engine_of(lineage: Sequence[int], servers: Mapping[int, str]) -> str | None:
    """The engine whose server process is ``lineage[0]`` or its nearest ancestor among ``servers`` (pid -> engine)."""
    for pid in lineage:
        engine = servers.get(pid)
        if engine is not None:
            return engine
    return None


#: vLLM's titles for the processes of a data-parallel rank: ``VLLM::EngineCore_DP<rank>`` for its engine core,
#: ``VLLM::Worker_DP<rank>_TP<t>...`` for the workers under it (the global rank, on a --headless node too).
_DP_TITLE = re.compile(r"^VLLM::[A-Za-z]+_DP([0-9]{1,5})(?![0-9])")


def is_vllm_title(title: str) -> bool:
    return title.startswith("VLLM::")


def dp_rank_of(titles: Iterable[str]) -> str:
    """The data-parallel rank of a process, from its own title or its nearest ancestor's (nearest first); ""
    where none names one (no data parallelism)."""
    for title in titles:
        if found := _DP_TITLE.match(title):
            return str(int(found.group(1)))
    return ""


def device_ranks(
    devices: Iterable[GpuDevice], processes: Sequence[GpuProcess], ranks: Mapping[int, str]
) -> dict[GpuDevice, str]:
    """device -> the DP rank of the process using the most of its memory, for the devices a ranked process uses."""
    found: dict[GpuDevice, str] = {}
    for device in devices:
        on_it = [(p.used_bytes or 0.0, ranks[p.pid]) for p in processes if _runs_on(p, device) and ranks.get(p.pid)]
        if on_it:
            found[device] = max(on_it, key=lambda used_rank: (used_rank[0], -int(used_rank[1])))[1]
    return found


def _static_engine(device: GpuDevice, static: Mapping[str, str]) -> str | None:
    # A MIG instance belongs to its GPU: naming the GPU maps every instance of it.
    keys = (device.uuid, str(device.index), device.parent_uuid) if device.is_mig else (device.uuid, str(device.index))
    return next((static[k] for k in keys if k and k in static), None)


def _runs_on(process: GpuProcess, device: GpuDevice) -> bool:
    return process.gpu == device.index and (not device.is_mig or process.gpu_instance == device.mig_instance)


def assign_engines(
    devices: Iterable[GpuDevice],
    processes: Sequence[GpuProcess],
    process_engines: Mapping[int, str],
    static: Mapping[str, str],
    pod_engines: Mapping[GpuDevice, str] | None = None,
) -> dict[GpuDevice, str]:
    """device -> engine name, for the devices an engine uses."""
    assigned: dict[GpuDevice, str] = {}
    for device in devices:
        engine = _static_engine(device, static) or (pod_engines or {}).get(device)
        if engine is None:
            memory: dict[str, float] = defaultdict(float)
            for p in processes:
                if _runs_on(p, device) and p.pid in process_engines:
                    memory[process_engines[p.pid]] += p.used_bytes or 0.0
            if memory:
                engine = min(memory, key=lambda name: (-memory[name], name))
        if engine is not None:
            assigned[device] = engine
    return assigned


def process_owners(
    processes: Iterable[GpuProcess],
    process_engines: Mapping[int, str],
    devices: Iterable[GpuDevice],
    static: Mapping[str, str],
) -> dict[int, str]:
    """pid -> engine: by the process's own ancestry, else by its GPU's static mapping."""
    by_slot = {(d.index, d.mig_instance): e for d in devices if (e := _static_engine(d, static)) is not None}
    owners = {}
    for p in processes:
        engine = process_engines.get(p.pid) or by_slot.get((p.gpu, p.gpu_instance)) or by_slot.get((p.gpu, ""))
        if engine:
            owners[p.pid] = engine
    return owners
