"""The host source: CPU, memory and load, the kernel settings that the article's
checklist names, and the server process of every engine that runs on this host.

An engine's server process is the one listening on its URL's port. Its
metrics cover that process and its descendants, because vLLM does the work in
an EngineCore child process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import psutil
from prometheus_client.metrics_core import Metric

from batchlens.config import Engine
from batchlens.exporter import families as fam
from batchlens.exporter.snapshot import Reading

log = logging.getLogger("batchlens.exporter")

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
NUMA_BALANCING = Path("/proc/sys/kernel/numa_balancing")
ZONE_RECLAIM = Path("/proc/sys/vm/zone_reclaim_mode")
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


def kernel_settings() -> dict[str, str]:
    """The host settings the article's checklist asks about (see DESIGN.md, Corrections)."""
    thp = read_setting(THP_ENABLED)
    return {
        "transparent_hugepage": selected_mode(thp) if thp != UNAVAILABLE else UNAVAILABLE,
        "numa_balancing": read_setting(NUMA_BALANCING),
        "zone_reclaim_mode": read_setting(ZONE_RECLAIM),
    }


@dataclass(frozen=True, slots=True)
class ProcessTree:
    pid: int
    processes: int
    resident_bytes: int
    cpu_seconds: float
    threads: int
    affinity_cpus: int | None


def listening_pid(port: int) -> int | None:
    """The process listening on a TCP port here; the parent where several share it."""
    pids = {
        c.pid
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
    }
    for pid in sorted(pids):
        try:
            if psutil.Process(pid).ppid() not in pids:
                return pid
        except psutil.Error:
            continue
    return None


def still_listening(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def process_tree(pid: int) -> ProcessTree | None:
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
        affinity = len(root.cpu_affinity()) if hasattr(root, "cpu_affinity") else None
    except psutil.Error:
        return None
    rss = threads = 0
    cpu = 0.0
    alive = 0
    for proc in members:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                times = proc.cpu_times()
                cpu += times.user + times.system
                threads += proc.num_threads()
            alive += 1
        except psutil.Error:
            continue  # a child that just exited
    return ProcessTree(pid, alive, rss, cpu, threads, affinity)


class HostSource:
    kind = "host"
    labels: tuple[tuple[str, str], ...] = ()

    def __init__(self, engines: Sequence[Engine], executor: Executor | None = None):
        self._engines = [e for e in engines if e.is_local]
        self._executor = executor
        self._pids: dict[str, int] = {}
        psutil.cpu_percent(interval=None)  # primes the counter: the next call covers one interval

    async def sample(self) -> Reading:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._sample)

    def _engine_pid(self, engine: Engine) -> int | None:
        pid = self._pids.get(engine.name)
        if pid is not None and still_listening(pid, engine.port):
            return pid
        pid = listening_pid(engine.port)
        if pid is None:
            self._pids.pop(engine.name, None)
        elif self._pids.get(engine.name) != pid:
            log.info("host: engine %s is served by pid %d (listening on port %d)", engine.name, pid, engine.port)
            self._pids[engine.name] = pid
        return pid

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
        trees = {}
        for engine in self._engines:
            pid = self._engine_pid(engine)
            tree = process_tree(pid) if pid is not None else None
            if tree is not None:
                trees[engine.name] = tree
        metrics += _engine_process_metrics(trees)
        return Reading(metrics=tuple(metrics))


def _engine_process_metrics(trees: dict[str, ProcessTree]) -> list[Metric]:
    if not trees:
        return []

    def per_engine(attr: str) -> list[tuple[dict[str, str], float]]:
        return [
            ({"vllm_instance": name}, getattr(t, attr)) for name, t in trees.items() if getattr(t, attr) is not None
        ]

    return [
        fam.gauge(
            "batchlens_engine_process_info",
            "The engine's server process on this host (pid label), always 1.",
            [({"vllm_instance": name, "pid": str(t.pid)}, 1) for name, t in trees.items()],
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
