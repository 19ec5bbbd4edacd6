"""The exporter's HTTP server: /metrics, /healthz, and the samplers' lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import aiohttp
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batchlens import __version__
from batchlens.config import Config, Engine, parse_listen
from batchlens.discovery.kubernetes import DiscoverySource, PodLister, node_name
from batchlens.exporter.host_source import HostSource
from batchlens.exporter.kubelet.client import PodResourcesClient
from batchlens.exporter.nvml_source import NvmlSource
from batchlens.exporter.render import engine_roles, render
from batchlens.exporter.router_source import RouterSource
from batchlens.exporter.sampler import Sampler, Source, describe
from batchlens.exporter.sim_gpu_source import SimulatedGpuSource
from batchlens.exporter.snapshot import SnapshotStore
from batchlens.exporter.vllm_source import VllmSource
from batchlens.http_server import get_app, run_app

log = logging.getLogger("batchlens.exporter")

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
        self._session: aiohttp.ClientSession | None = None
        self._executors: list[ThreadPoolExecutor] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._body_version = -1
        self._static = engine_roles(config.engines)
        self._body = b""
        self._nvml: NvmlSource | None = None
        self._engines: dict[str, VllmSource] = {}  # every engine, configured or discovered, by name
        self._discovered: dict[str, asyncio.Task[None]] = {}  # a discovered engine's sampler
        self._parser: ThreadPoolExecutor | None = None
        # Built here, not at start: a missing extra or API config stops the command with its reason.
        k8s, socket = config.kubernetes, config.exporter.pod_resources_socket
        self._node = node_name(k8s, self._environ) if k8s.discover else ""
        self._lister = PodLister(k8s, self._node) if k8s.discover else None
        # Asked once per NVML tick, in the NVML thread; a hanging kubelet costs at most this deadline.
        timeout = min(1.0, config.exporter.timeout_seconds)
        self._kubelet = PodResourcesClient(socket, timeout) if socket and config.exporter.nvml else None

    def _worker(self, name: str) -> ThreadPoolExecutor:
        # One thread per kind of blocking work, no more: every thread gets its own
        # malloc arena and holds on to its memory.
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"batchlens-{name}")
        self._executors.append(executor)
        return executor

    def _vllm_source(self, engine: Engine, session: aiohttp.ClientSession) -> VllmSource:
        cfg = self.config.exporter
        source = VllmSource(
            engine,
            session,
            self._parser,
            timeout=cfg.timeout_seconds,
            max_response_bytes=cfg.max_response_bytes,
            environ=self._environ,
        )
        self._engines[engine.name] = source
        return source

    def _sources(self, session: aiohttp.ClientSession) -> list[Source]:
        self._parser = self._worker("parse")
        sources: list[Source] = [self._vllm_source(engine, session) for engine in self.config.engines]

        def models() -> dict[str, str]:
            return {name: e.model_name for name, e in self._engines.items()}

        sources += [
            SimulatedGpuSource(engine, session, timeout=self.config.exporter.timeout_seconds, models=models)
            for engine in self.config.engines
            if engine.simulated_gpu
        ]
        # psutil reads other processes' /proc files, which can block for seconds while
        # such a process maps memory (vLLM allocating its KV cache): its own thread, so
        # that parsing never queues behind it.
        sources.append(HostSource(self.config.engines, self._worker("host")))
        if self.config.routing.proxy_url:
            sources.append(
                RouterSource(self.config.routing.proxy_url, session, timeout=self.config.exporter.timeout_seconds)
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
        )
        sources.append(self._nvml)
        return sources

    async def start(self, _app: web.Application | None = None) -> None:
        cfg = self.config.exporter
        # Enough connections for two requests (metrics + admin) to every engine at once; with discovery the
        # engines are not known yet, so no cap (each engine still has one request of each kind at a time).
        limit = 0 if self._lister is not None else max(16, 4 * len(self.config.engines))
        connector = aiohttp.TCPConnector(limit=limit)
        self._session = aiohttp.ClientSession(connector=connector, headers={"User-Agent": f"batchlens/{__version__}"})
        for source in self._sources(self._session):
            self._tasks.append(self._sample(source, cfg.interval_seconds))
        names = ", ".join(f"{e.name}={e.url}" for e in self.config.engines) or "none"
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
            assert self._session is not None
            source = self._vllm_source(wanted[name], self._session)
            self._discovered[name] = self._sample(source, self.config.exporter.interval_seconds)
            log.info("engine %s found at %s: sampling it", name, wanted[name].url)

    async def stop(self, _app: web.Application | None = None) -> None:
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
        if self._session is not None:
            await self._session.close()
        for executor in self._executors:
            executor.shutdown(wait=False, cancel_futures=True)
        self._executors.clear()
        log.info("stopped")

    def body(self) -> bytes:
        """The rendered snapshot, rendered again only when a source published."""
        snapshot = self.store.snapshot()
        if snapshot.version != self._body_version:
            self._body, self._body_version = render(snapshot, self._static), snapshot.version
        return self._body

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.body(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_healthz(self, _request: web.Request) -> web.Response:
        sources = [
            {"source": s.source, **dict(s.labels), "up": s.up, "last_success": s.last_success}
            for s in self.store.snapshot().states
        ]
        return web.json_response({"status": "ok", "version": __version__, "sources": sources})

    async def handle_index(self, _request: web.Request) -> web.Response:
        return web.Response(text=_INDEX.format(version=__version__), content_type="text/html")

    def app(self) -> web.Application:
        routes = {"/metrics": self.handle_metrics, "/healthz": self.handle_healthz, "/": self.handle_index}
        return get_app(routes, start=self.start, stop=self.stop)


def serve(config: Config, *, access_log: bool = False) -> None:
    """Run the exporter until SIGINT or SIGTERM, then shut down cleanly."""
    host, port = parse_listen(config.exporter.listen)
    exporter = Exporter(config)
    run_app(
        exporter.app(),
        host,
        port,
        logger=log,
        ready=f"batchlens exporter {__version__} listening on http://{config.exporter.listen}/metrics",
        access_log=log if access_log else None,
        shutdown_timeout=5,
    )
