"""Local processes: which one serves an engine, its process tree, its ancestors.

An engine's server process is the one listening on its URL's port. vLLM does
the work in children of that process (EngineCore, workers), so both the host
source (CPU, memory) and the NVML source (GPU processes) find an engine by
walking from the listener down, or from a worker up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from batchlens.config import Engine

log = logging.getLogger("batchlens.exporter")


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


def lineage(pid: int) -> tuple[int, ...]:
    """``pid`` and its ancestors, nearest first; empty if the process is gone or not visible here."""
    try:
        return (pid, *(p.pid for p in psutil.Process(pid).parents()))
    except psutil.Error:
        return ()


class ServerPids:
    """Which local process serves each engine, remembered while it keeps listening.

    Scanning every socket of the host is the costly part, so it happens only
    when an engine is new, restarted or gone.
    """

    def __init__(self, engines: Sequence[Engine], source: str):
        self._engines = [e for e in engines if e.is_local]
        self._source = source
        self._pids: dict[str, int] = {}

    def resolve(self) -> dict[str, int]:
        """engine name -> pid, for the local engines that are up."""
        return {e.name: pid for e in self._engines if (pid := self._pid(e)) is not None}

    def _pid(self, engine: Engine) -> int | None:
        pid = self._pids.get(engine.name)
        if pid is not None and still_listening(pid, engine.port):
            return pid
        pid = listening_pid(engine.port)
        if pid is None:
            self._pids.pop(engine.name, None)
        elif self._pids.get(engine.name) != pid:
            log.info(
                "%s: engine %s is served by pid %d (listening on port %d)", self._source, engine.name, pid, engine.port
            )
            self._pids[engine.name] = pid
        return pid


@dataclass(frozen=True, slots=True)
class ProcessTree:
    pid: int
    processes: int
    resident_bytes: int
    cpu_seconds: float
    threads: int
    affinity_cpus: int | None


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
