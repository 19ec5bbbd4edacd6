"""`batchlens report --watch`: the report's view on a local page, redrawn from Prometheus every few seconds.

One loop draws (the queries, then matplotlib in a worker thread); a request only serves the last drawing, as a
scrape of the exporter only renders its last snapshot. So a slow or dead Prometheus never slows the page: the
page says what went wrong above the last good picture, and reloads itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import aiohttp
from aiohttp import web

from batchlens import __version__
from batchlens.config import Thresholds
from batchlens.http_server import get_app
from batchlens.masking import mask_url
from batchlens.prometheus_api import Prometheus, PrometheusError, step_for
from batchlens.report.data import available, fetch
from batchlens.report.render import page, png_bytes

log = logging.getLogger("batchlens.report")
POINTS = 600  # as the written report: about this many points over the range


@dataclass(frozen=True)
class Drawing:
    """The last good picture and its page, and what went wrong since, if anything."""

    png: bytes = b""
    html: str = ""
    version: int = 0
    drawn_at: float = 0.0
    error: str = ""


class LiveReport:
    def __init__(self, prometheus_url: str, thresholds: Thresholds, *, seconds: float, timeout: float, every: float):
        self.url, self.thresholds = prometheus_url, thresholds
        self.seconds, self.timeout, self.every = seconds, timeout, every
        self.drawing = Drawing()
        self.draws = self.failures = 0
        # matplotlib is not thread-safe and takes a second: one thread, off the event loop.
        self._painter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchlens-report")
        self._task: asyncio.Task | None = None

    async def draw(self, session: aiohttp.ClientSession) -> None:
        """One drawing; a failure is kept beside the last good picture, logged once per new reason."""
        prometheus = Prometheus(session, self.url, self.timeout)
        try:
            start, end = await available(prometheus, self.thresholds, self.seconds, time.time())
            report = await fetch(prometheus, self.thresholds, start, end, step_for(end - start, POINTS))
        except PrometheusError as exc:
            self.failures += 1
            if str(exc) != self.drawing.error:
                log.warning("cannot draw the report: %s", exc)
            self.drawing = replace(self.drawing, error=str(exc))
            return
        png = await asyncio.get_running_loop().run_in_executor(self._painter, png_bytes, report)
        version = self.drawing.version + 1
        if self.drawing.error:
            log.info("drawing again: Prometheus answers")
        self.draws += 1
        self.drawing = Drawing(png, page(report, f"report.png?v={version}", refresh=self.every), version, time.time())

    async def _every(self) -> None:
        async with aiohttp.ClientSession(headers={"User-Agent": f"batchlens/{__version__}"}) as session:
            while True:
                await self.draw(session)
                await asyncio.sleep(self.every)

    async def start(self, _app: web.Application) -> None:
        self._task = asyncio.create_task(self._every(), name="report")

    async def stop(self, _app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._painter.shutdown(wait=True)

    async def handle_index(self, _request: web.Request) -> web.Response:
        drawing = self.drawing
        if not drawing.html:
            return web.Response(text=_waiting(drawing.error, self.every), content_type="text/html")
        text = drawing.html
        if drawing.error:  # the last good picture, under what went wrong since
            stale = f"not redrawn since {time.strftime('%H:%M:%S', time.localtime(drawing.drawn_at))}"
            text = text.replace("<body>", f'<body><p class="banner">{html.escape(drawing.error)} ({stale})</p>', 1)
        return web.Response(text=text, content_type="text/html")

    async def handle_png(self, _request: web.Request) -> web.Response:
        if not self.drawing.png:
            return web.Response(status=404, text="nothing drawn yet: Prometheus has no batchlens data yet\n")
        return web.Response(body=self.drawing.png, content_type="image/png", headers={"Cache-Control": "no-store"})

    async def handle_healthz(self, _request: web.Request) -> web.Response:
        d = self.drawing
        return web.json_response({"status": "ok", "prometheus": mask_url(self.url), "draws": self.draws,
                                  "failures": self.failures, "drawn_at": d.drawn_at or None,
                                  "error": d.error or None})  # fmt: skip

    def app(self) -> web.Application:
        routes = {"/": self.handle_index, "/report.png": self.handle_png, "/healthz": self.handle_healthz}
        return get_app(routes, start=self.start, stop=self.stop)


def _waiting(error: str, every: float) -> str:
    why = html.escape(error or "the first drawing is under way")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" '
            f'content="{every:g}"><link rel="icon" href="data:,">'
            "<title>batchlens: batch efficiency trend report</title></head><body>"
            f"<h1>Batch efficiency trend report</h1><p>Waiting for data: {why}. This page reloads every "
            f"{every:g} s.</p></body></html>")  # fmt: skip
