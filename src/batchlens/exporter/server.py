"""The exporter's HTTP server: /metrics, /healthz, and the samplers' lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import aiohttp
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batchlens import __version__
from batchlens.config import Config, parse_listen
from batchlens.exporter.host_source import HostSource
from batchlens.exporter.kubelet.client import PodResourcesClient
from batchlens.exporter.nvml_source import NvmlSource
from batchlens.exporter.render import render
from batchlens.exporter.sampler import Sampler, Source, describe
from batchlens.exporter.sim_gpu_source import SimulatedGpuSource
from batchlens.exporter.snapshot import SnapshotStore
from batchlens.exporter.vllm_source import VllmSource
from batchlens.http_server import run_app

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
        self._body = b""
        self._nvml: NvmlSource | None = None

    def _worker(self, name: str) -> ThreadPoolExecutor:
        # One thread per kind of blocking work, no more: every thread gets its own
        # malloc arena and holds on to its memory.
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"batchlens-{name}")
        self._executors.append(executor)
        return executor

    def _sources(self, session: aiohttp.ClientSession) -> list[Source]:
        cfg = self.config.exporter
        parser = self._worker("parse")
        engines = [
            VllmSource(
                engine,
                session,
                parser,
                timeout=cfg.timeout_seconds,
                max_response_bytes=cfg.max_response_bytes,
                environ=self._environ,
            )
            for engine in self.config.engines
        ]
        sources: list[Source] = list(engines)

        def models() -> dict[str, str]:
            return {e.engine.name: e.model_name for e in engines}

        sources += [
            SimulatedGpuSource(engine, session, timeout=cfg.timeout_seconds, models=models)
            for engine in self.config.engines
            if engine.simulated_gpu
        ]
        # psutil reads other processes' /proc files, which can block for seconds while
        # such a process maps memory (vLLM allocating its KV cache): its own thread, so
        # that parsing never queues behind it.
        sources.append(HostSource(self.config.engines, self._worker("host")))
        if not self.config.exporter.nvml:
            return sources  # no NVML source, so no batchlens_source_up{source="nvml"} 0 to alert on
        # NVML calls go to the driver, which can take its time with a busy or failing GPU.
        socket = self.config.exporter.pod_resources_socket
        # Asked once per NVML tick, in the NVML thread; a hanging kubelet costs at most this deadline.
        kubelet = PodResourcesClient(socket, timeout=min(1.0, self.config.exporter.timeout_seconds)) if socket else None
        self._nvml = NvmlSource(
            self.config.engines,
            self._worker("nvml"),
            nvml=self._nvml_module,
            models=models,
            pod_resources=kubelet,
        )
        sources.append(self._nvml)
        return sources

    async def start(self, _app: web.Application | None = None) -> None:
        cfg = self.config.exporter
        # Enough connections for two requests (metrics + admin) to every engine at once.
        connector = aiohttp.TCPConnector(limit=max(16, 4 * len(self.config.engines)))
        self._session = aiohttp.ClientSession(connector=connector, headers={"User-Agent": f"batchlens/{__version__}"})
        # A safety net for a stuck sample, not a second timeout: generous enough that a
        # busy host does not trip it while the sample's own requests still finish.
        deadline = 2 * cfg.timeout_seconds + max(5.0, cfg.interval_seconds)
        for source in self._sources(self._session):
            sampler = Sampler(source, self.store, cfg.interval_seconds, deadline)
            self._tasks.append(asyncio.create_task(sampler.run(), name=f"sampler {describe(source)}"))
        names = ", ".join(f"{e.name}={e.url}" for e in self.config.engines) or "none"
        log.info("sampling every %gs; engines: %s", cfg.interval_seconds, names)

    async def stop(self, _app: web.Application | None = None) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
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
            self._body, self._body_version = render(snapshot), snapshot.version
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
        app = web.Application()
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/healthz", self.handle_healthz)
        app.router.add_get("/", self.handle_index)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


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
