"""HTTP upstreams that stand in for vLLM servers, healthy or broken.

This is the one fake boundary of the exporter's fault tests: a real HTTP server
(aiohttp, in a background thread of the test process) that serves a real vLLM
0.32 exposition, or misbehaves on purpose. Each upstream lives under its own
path prefix, so its engine URL is ``http://127.0.0.1:PORT/<name>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

from batchlens.admin_api import CACHE_RESET_PATH
from harness.admin import accepted
from harness.procs import free_port


@dataclass
class Upstream:
    """How one fake engine answers. Mutable: tests change it while the exporter runs."""

    behavior: str = "ok"  # ok | status | hang | garbage | huge | slow
    text: str = ""
    status: int = 200
    huge_bytes: int = 50 * 1024 * 1024
    slow_seconds: float = 30.0
    admin: dict | None = None  # the /batchlens/v1/batch reply; None: 404 like a plain vLLM
    admin_token: str | None = None
    hits: int = 0
    admin_auth_seen: list[str] = field(default_factory=list)
    admin_calls_at: list[float] = field(default_factory=list)  # time.monotonic() of each admin API call
    prefix_cache_resets: int = 0


class Upstreams:
    def __init__(self) -> None:
        self.port = free_port()
        self.engines: dict[str, Upstream] = {}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="upstreams", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("upstream server did not start")

    def add(self, name: str, **kwargs) -> str:
        self.engines[name] = Upstream(**kwargs)
        return self.url(name)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/{name}/metrics", self._metrics)
        app.router.add_get("/{name}/batchlens/v1/batch", self._admin)
        app.router.add_put("/{name}/batchlens/v1/batch", self._admin)
        app.router.add_post("/{name}" + CACHE_RESET_PATH, self._reset_prefix_cache)
        # Handlers that hang on purpose must not hold up the teardown.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def _stop() -> None:
            await self._runner.cleanup()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:  # handlers that hang on purpose
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        up = self.engines[request.match_info["name"]]
        up.hits += 1
        if up.behavior == "ok":
            return web.Response(text=up.text, content_type="text/plain")
        if up.behavior == "status":
            return web.Response(status=up.status, text="upstream error\n")
        if up.behavior == "hang":  # headers never come
            await asyncio.sleep(3600)
        if up.behavior == "garbage":
            return web.Response(body=b"<html>\x00\xff not metrics {{{\n" + os.urandom(4096), content_type="text/plain")
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):  # the exporter gave up on us, as it should
            await self._stream(up, resp)
        return resp

    async def _stream(self, up: Upstream, resp: web.StreamResponse) -> None:
        if up.behavior == "huge":  # valid lines, 50 MB of them, streamed without a length
            line = b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
            chunk = line * (1024 * 1024 // len(line))
            for _ in range(up.huge_bytes // len(chunk) + 1):
                await resp.write(chunk)
        elif up.behavior == "slow":  # a trickle: one line at a time, over slow_seconds
            lines = up.text.splitlines(keepends=True)
            for ln in lines:
                await resp.write(ln.encode())
                await asyncio.sleep(up.slow_seconds / max(1, len(lines)))
        await resp.write_eof()

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """The plugin's route: counted only with the engine's admin token, as the plugin answers."""
        up = self.engines[request.match_info["name"]]
        if not accepted(up.admin_token, request.headers.get("Authorization", ""), request.method, request.path):
            return web.json_response({"error": "unauthorized"}, status=401)
        up.prefix_cache_resets += 1
        return web.json_response({"reset": True})

    async def _admin(self, request: web.Request) -> web.Response:
        up = self.engines[request.match_info["name"]]
        if up.admin is None:
            raise web.HTTPNotFound()
        auth = request.headers.get("Authorization", "")
        up.admin_auth_seen.append(auth)
        up.admin_calls_at.append(time.monotonic())
        if up.behavior == "hang":
            await asyncio.sleep(3600)
        body = await request.read()
        if not accepted(up.admin_token, auth, request.method, request.path, body):
            return web.json_response({"error": "unauthorized"}, status=401)
        if request.method == "PUT":
            up.admin = {**up.admin, "max_num_active_seqs": json.loads(body)["max_num_active_seqs"]}
        return web.json_response(up.admin)
