"""The exporter's HTTP server: /metrics, /healthz, and the samplers' lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batchlens import __version__
from batchlens.config import Config, Engine, parse_listen
from batchlens.discovery.kubernetes import PodLister, node_name
from batchlens.exporter.discovery_source import DiscoverySource
from batchlens.exporter.host_source import HostSource
from batchlens.exporter.http_get import HttpGetter
from batchlens.exporter.http_serve import Answer, HttpServer, Route
from batchlens.exporter.kubelet.client import PodResourcesClient
from batchlens.exporter.nvml_source import NvmlSource
from batchlens.exporter.render import engine_roles, render
from batchlens.exporter.router_source import RouterSource
from batchlens.exporter.sampler import Sampler, Source, describe
from batchlens.exporter.sim_gpu_source import SimulatedGpuSource
from batchlens.exporter.snapshot import SnapshotStore
from batchlens.exporter.vllm_source import VllmSource
from batchlens.exporter.worker_thread import DaemonWorker
from batchlens.masking import mask_url

log = logging.getLogger("batchlens.exporter")

_TRIM_SECONDS = 10.0

_INDEX = """<html><head><title>batchlens exporter</title></head><body>
<h1>batchlens exporter {version}</h1>
<p><a href="/metrics">/metrics</a> (Prometheus text format) &middot; <a href="/healthz">/healthz</a> (JSON)</p>
</body></html>
"""


class Exporter:
    """Owns the sources, their samplers and the snapshot they publish to."""

    def __init__(self, config: Config, environ: Mapping[str, str] | None = None, *, nvml: ModuleType | None = None):
        """``nvml`` replaces ``pynvml`` (tests pass a fake; see tests/harness/fake_pynvml.py)."""
        self.config = config
        self._nvml_module = nvml
        self.store = SnapshotStore()
        self._environ = os.environ if environ is None else environ
        self._http = HttpGetter()
        self._executors: list[DaemonWorker] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._body_version = -1
        self._body_lock = threading.Lock()  # scrapes come in on the HTTP server's threads
        self._static = engine_roles(config.engines)
        self._body = b""
        self._nvml: NvmlSource | None = None
        self._engines: dict[str, VllmSource] = {}  # every engine, configured or discovered, by name
        self._discovered: dict[str, asyncio.Task[None]] = {}  # a discovered engine's sampler
        self._parser: DaemonWorker | None = None
        # Built here, not at start: a missing extra or API config stops the command with its reason.
        k8s, socket = config.kubernetes, config.exporter.pod_resources_socket
        self._node = node_name(k8s, self._environ) if k8s.discover else ""
        self._lister = PodLister(k8s, self._node, tokens=False) if k8s.discover else None
        # Asked once per NVML tick, in the NVML thread; a hanging kubelet costs at most this deadline.
        timeout = min(1.0, config.exporter.timeout_seconds)
        self._kubelet = PodResourcesClient(socket, timeout) if socket and config.exporter.nvml else None

    def _worker(self, name: str) -> DaemonWorker:
        # One thread per kind of blocking work, no more: every thread gets its own
        # malloc arena and holds on to its memory.
        executor = DaemonWorker(f"batchlens-{name}")
        self._executors.append(executor)
        return executor

    def _vllm_source(self, engine: Engine) -> VllmSource:
        cfg = self.config.exporter
        source = VllmSource(
            engine,
            self._http,
            self._parser,
            timeout=cfg.timeout_seconds,
            max_response_bytes=cfg.max_response_bytes,
            environ=self._environ,
        )
        self._engines[engine.name] = source
        return source

    def _sources(self) -> list[Source]:
        self._parser = self._worker("parse")
        sources: list[Source] = [self._vllm_source(engine) for engine in self.config.engines]

        def models() -> dict[str, str]:
            return {e.engine.instance: e.model_name for e in self._engines.values() if e.model_name}

        sources += [
            SimulatedGpuSource(engine, self._http, timeout=self.config.exporter.timeout_seconds, models=models)
            for engine in self.config.engines
            if engine.simulated_gpu
        ]
        # psutil reads other processes' /proc files, which can block for seconds while
        # such a process maps memory (vLLM allocating its KV cache): its own thread, so
        # that parsing never queues behind it.
        sources.append(HostSource(self.config.engines, self._worker("host")))
        if self.config.routing.proxy_url:
            sources.append(
                RouterSource(self.config.routing.proxy_url, self._http, timeout=self.config.exporter.timeout_seconds)
            )
        if not self.config.exporter.nvml:
            return sources  # no NVML source, so no batchlens_source_up{source="nvml"} 0 to alert on
        # NVML calls go to the driver, which can take its time with a busy or failing GPU.
        self._nvml = NvmlSource(
            self.config.engines,
            self._worker("nvml"),
            nvml=self._nvml_module,
            models=models,
            pod_resources=self._kubelet,
            names=self._engines.keys,
            headless_engine=self.config.exporter.headless_engine,
            sysfs=Path(self.config.exporter.sysfs_path),
        )
        sources.append(self._nvml)
        return sources

    async def start(self) -> None:
        cfg = self.config.exporter
        # No cap on connections: each source has at most one request of each kind (metrics, admin) at a time.
        for source in self._sources():
            self._tasks.append(self._sample(source, cfg.interval_seconds))
        if (trim := _malloc_trim()) is not None:
            self._tasks.append(asyncio.create_task(_trim_every(trim, _TRIM_SECONDS), name="malloc_trim"))
        names = ", ".join(f"{e.name}={mask_url(e.url)}" for e in self.config.engines) or "none"
        log.info("sampling every %gs; engines: %s", cfg.interval_seconds, names)
        k8s = self.config.kubernetes
        if self._lister is not None:
            self._tasks.append(self._sample(DiscoverySource(self._lister, self._discover), k8s.interval_seconds))
            where = f"on node {self._node}" if self._node else "on every node"
            log.info("discovering vLLM pods %s with %s every %gs", where, k8s.selector, k8s.interval_seconds)

    def _sample(self, source: Source, interval: float) -> asyncio.Task[None]:
        cfg = self.config.exporter
        # A safety net for a stuck sample, not a second timeout: generous enough that a
        # busy host does not trip it while the sample's own requests still finish.
        deadline = 2 * cfg.timeout_seconds + max(5.0, interval)
        sampler = Sampler(source, self.store, interval, deadline)
        return asyncio.create_task(sampler.run(), name=f"sampler {describe(source)}")

    def _discover(self, engines: Sequence[Engine]) -> None:
        """Start sampling the engines that appeared, stop and forget those that went."""
        wanted = {e.name: e for e in engines if e.name not in {c.name for c in self.config.engines}}
        # A pod recreated under its name has a new IP (and its old one may be another pod's by now), and a
        # rotated Secret a new token: such an engine's sampler starts again with what discovery now says.
        changed = {name for name in self._discovered if name in wanted and self._engines[name].engine != wanted[name]}
        for name in (self._discovered.keys() - wanted.keys()) | changed:
            self._discovered.pop(name).cancel()
            source = self._engines.pop(name)
            self.store.forget((source.kind, source.labels))  # its series go with it, not frozen
            if name not in changed:
                log.info("engine %s is gone: no longer sampled", name)
        for name in wanted.keys() - self._discovered.keys():
            source = self._vllm_source(wanted[name])
            self._discovered[name] = self._sample(source, self.config.exporter.interval_seconds)
            log.info("engine %s found at %s: sampling it", name, wanted[name].url)

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._discovered.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self._discovered.clear()
        if self._lister is not None:
            await self._lister.aclose()
        if self._nvml is not None:
            await self._nvml.aclose()
        await self._http.aclose()
        for executor in self._executors:
            executor.shutdown(wait=False, cancel_futures=True)
        self._executors.clear()
        log.info("stopped")

    def body(self) -> bytes:
        """The rendered snapshot, rendered again only when a source published."""
        with self._body_lock:
            snapshot = self.store.snapshot()
            if snapshot.version != self._body_version:
                self._body, self._body_version = render(snapshot, self._static), snapshot.version
            return self._body

    def metrics(self) -> Answer:
        return Answer(200, CONTENT_TYPE_LATEST, self.body())

    def healthz(self) -> Answer:
        sources = [
            {"source": s.source, **dict(s.labels), "up": s.up, "last_success": s.last_success}
            for s in self.store.snapshot().states
        ]
        body = json.dumps({"status": "ok", "version": __version__, "sources": sources})
        return Answer(200, "application/json; charset=utf-8", body.encode())

    def routes(self) -> dict[str, Route]:
        index = Answer(200, "text/html; charset=utf-8", _INDEX.format(version=__version__).encode())
        return {"/metrics": self.metrics, "/healthz": self.healthz, "/": lambda: index}


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


async def _trim_every(trim: Callable[[int], int], seconds: float) -> None:
    # Every engine's exposition is parsed each tick in the parse thread, and glibc keeps the pages
    # that thread's arena freed: a few MiB of resident memory per node, returned here.
    while True:
        await asyncio.sleep(seconds)
        trim(0)


def serve(config: Config, *, access_log: bool = False) -> None:
    """Run the exporter until SIGINT or SIGTERM, then shut down cleanly; OSError when it cannot listen."""
    asyncio.run(_run(Exporter(config), config.exporter.listen, access_log=access_log))


async def _run(exporter: Exporter, listen: str, *, access_log: bool) -> None:
    host, port = parse_listen(listen)
    server = HttpServer(exporter.routes(), access_log=log if access_log else None)
    await server.start(host, port)  # before the samplers start: a taken port must never read as a start
    log.info("batchlens exporter %s listening on http://%s/metrics", __version__, listen)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await exporter.start()
    try:
        await stopping.wait()
    finally:
        await server.close()
        await exporter.stop()
