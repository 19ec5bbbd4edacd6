"""The host source: CPU, memory and load, the kernel settings that the article's
checklist names, and the server process of every engine that runs on this host.

An engine's metrics cover its server process and that process's descendants,
because vLLM does the work in an EngineCore child process (see processes.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path

import psutil
from prometheus_client.metrics_core import Metric

from batchlens.config import Engine
from batchlens.exporter import families as fam
from batchlens.exporter.processes import ProcessTree, ServerPids, process_tree
from batchlens.exporter.snapshot import Reading

THP_ENABLED = "sys/kernel/mm/transparent_hugepage/enabled"
NUMA_BALANCING = "proc/sys/kernel/numa_balancing"
ZONE_RECLAIM = "proc/sys/vm/zone_reclaim_mode"
UNAVAILABLE = "unavailable"


def selected_mode(text: str) -> str:
    """The bracketed choice of a sysfs selector such as ``always [madvise] never``."""
    start, end = text.find("["), text.find("]")
    if 0 <= start < end:
        return text[start + 1 : end]
    return text.strip() or UNAVAILABLE


def read_setting(path: Path) -> str:
    try:
        return path.read_text().strip() or UNAVAILABLE
    except OSError:
        return UNAVAILABLE


def kernel_settings(root: Path = Path("/")) -> dict[str, str]:
    """The host settings the article's checklist asks about (docs/article.md, "Where it is wrong"), under ``root``."""
    thp = read_setting(root / THP_ENABLED)
    return {
        "transparent_hugepage": selected_mode(thp) if thp != UNAVAILABLE else UNAVAILABLE,
        "numa_balancing": read_setting(root / NUMA_BALANCING),
        "zone_reclaim_mode": read_setting(root / ZONE_RECLAIM),
    }


class HostSource:
    kind = "host"
    labels: tuple[tuple[str, str], ...] = ()

    def __init__(self, engines: Sequence[Engine], executor: Executor | None = None):
        self._executor = executor
        self._servers = ServerPids(engines, "host")
        self._labels = {e.name: e.series_labels for e in engines}
        psutil.cpu_percent(interval=None)  # primes the counter: the next call covers one interval

    async def sample(self) -> Reading:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._sample)

    def _sample(self) -> Reading:
        mem = psutil.virtual_memory()
        load1, load5, load15 = os.getloadavg()
        metrics: list[Metric] = [
            fam.gauge(
                "batchlens_host_cpu_utilization_ratio",
                "Share of CPU time busy since the last sample, all CPUs.",
                [({}, psutil.cpu_percent(interval=None) / 100)],
            ),
            fam.gauge("batchlens_host_cpus", "Logical CPUs of the host.", [({}, psutil.cpu_count() or 0)]),
            fam.gauge("batchlens_host_memory_total_bytes", "Physical memory.", [({}, mem.total)]),
            fam.gauge(
                "batchlens_host_memory_available_bytes", "Memory available without swapping.", [({}, mem.available)]
            ),
            fam.gauge("batchlens_host_load1", "1-minute load average.", [({}, load1)]),
            fam.gauge("batchlens_host_load5", "5-minute load average.", [({}, load5)]),
            fam.gauge("batchlens_host_load15", "15-minute load average.", [({}, load15)]),
            fam.info(
                "batchlens_host_kernel_info",
                "Kernel settings from the tuning checklist: THP mode, kernel.numa_balancing, vm.zone_reclaim_mode.",
                kernel_settings(),
            ),
        ]
        trees = {name: tree for name, pid in self._servers.resolve().items() if (tree := process_tree(pid))}
        metrics += _engine_process_metrics({name: (self._labels[name], tree) for name, tree in trees.items()})
        return Reading(metrics=tuple(metrics))


def _engine_process_metrics(trees: dict[str, tuple[dict[str, str], ProcessTree]]) -> list[Metric]:
    """Each local server's process tree, labelled as its engine's series are (Engine.series_labels)."""
    if not trees:
        return []

    def per_engine(attr: str) -> list[tuple[dict[str, str], float]]:
        return [(labels, getattr(t, attr)) for labels, t in trees.values() if getattr(t, attr) is not None]

    return [
        fam.gauge(
            "batchlens_engine_process_info",
            "The engine's server process on this host (pid label), always 1.",
            [({**labels, "pid": str(t.pid)}, 1) for labels, t in trees.values()],
        ),
        fam.gauge(
            "batchlens_engine_processes", "Processes in the engine's server process tree.", per_engine("processes")
        ),
        fam.gauge(
            "batchlens_engine_process_resident_memory_bytes",
            "Resident memory of the engine's process tree.",
            per_engine("resident_bytes"),
        ),
        fam.counter(
            "batchlens_engine_process_cpu_seconds_total",
            "CPU time (user + system) of the engine's process tree.",
            per_engine("cpu_seconds"),
        ),
        fam.gauge("batchlens_engine_process_threads", "Threads in the engine's process tree.", per_engine("threads")),
        fam.gauge(
            "batchlens_engine_process_cpu_affinity_cpus",
            "CPUs the engine's server process may run on.",
            per_engine("affinity_cpus"),
        ),
    ]
