"""Local processes: which one serves an engine, its process tree, its ancestors.

An engine's server process is the one listening on its URL's port. vLLM does
the work in children of that process (EngineCore, workers), so both the host
source (CPU, memory) and the NVML source (GPU processes) find an engine by
walking from the listener down, or from a worker up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
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


def lineage(pid: int) -> tuple[int, ...]:
    """``pid`` and its ancestors, nearest first; empty if the process is gone or not visible here."""
    try:
        return (pid, *(p.pid for p in psutil.Process(pid).parents()))
    except psutil.Error:
        return ()


def titles(pids: tuple[int, ...]) -> tuple[str, ...]:
    """Each process's command line as it shows itself (vLLM retitles its processes: ``VLLM::EngineCore_DP3``);
    "" for one that is gone or not visible."""
    found = []
    for pid in pids:
        try:
            found.append(" ".join(psutil.Process(pid).cmdline()).strip())
        except psutil.Error:
            found.append("")
    return tuple(found)


def _alive(process: psutil.Process) -> bool:
    """Still the same process (pid and start time), and not a zombie awaiting its parent."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ServerPids:
    """Which local process serves each engine, remembered while that process lives.

    Finding a listener means reading every socket of the host, which costs
    milliseconds on a busy one. So a found server is only checked to be the
    same running process (pid and start time) on later ticks, and a missing
    one is looked for again at most every ``rescan_seconds``.
    """

    def __init__(
        self,
        engines: Sequence[Engine],
        source: str,
        rescan_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._engines = [e for e in engines if e.is_local]
        self._clock = clock
        self._source = source
        self._rescan = rescan_seconds
        self._servers: dict[str, psutil.Process] = {}
        self._scanned: dict[str, float] = {}  # engine -> when it was last looked for, while missing

    def resolve(self) -> dict[str, int]:
        """engine name -> pid, for the local engines that are up."""
        return {e.name: pid for e in self._engines if (pid := self._pid(e)) is not None}

    def _pid(self, engine: Engine) -> int | None:
        server = self._servers.get(engine.name)
        if server is not None and _alive(server):
            return server.pid
        if server is None and self._clock() - self._scanned.get(engine.name, -math.inf) < self._rescan:
            return None
        pid = listening_pid(engine.port)
        try:
            found = psutil.Process(pid) if pid is not None else None
        except psutil.Error:
            found = None
        if found is None:
            if server is not None:
                log.info("%s: engine %s: server pid %d has exited", self._source, engine.name, server.pid)
            self._servers.pop(engine.name, None)
            self._scanned[engine.name] = self._clock()
            return None
        log.info(
            "%s: engine %s is served by pid %d (listening on port %d)", self._source, engine.name, pid, engine.port
        )
        self._servers[engine.name] = found
        return found.pid


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
