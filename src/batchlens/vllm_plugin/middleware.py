"""The admin API on vLLM releases without endpoint plugins (before 0.32), through vLLM's ``--middleware``.

    vllm serve MODEL --middleware batchlens.vllm_plugin.middleware.AdminMiddleware

vLLM wraps its app in this class (``app.add_middleware``). It serves
``/batchlens/v1/*`` itself, with the same routes, token and answers as the
endpoint plugin, and hands every other request to vLLM, observing arrivals on
the way as the endpoint plugin does. The engine client is the one vLLM keeps on
its app's state; it exists once the server has started, which is when the
first request can come.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from typing import Any

from batchlens.admin_api import API_PREFIX
from batchlens.vllm_plugin.admin_port import admin_listen, start_admin_server
from batchlens.vllm_plugin.arrival_middleware import ArrivalMiddleware
from batchlens.vllm_plugin.arrival_middleware import metrics as arrival_metrics
from batchlens.vllm_plugin.compat import MIDDLEWARE, check_installed_vllm
from batchlens.vllm_plugin.endpoint import (
    STATE_KEY,
    AdminService,
    admin_app,
    admin_state,
    door_of,
    log_refusal,
    serves_own_port,
)


class AdminMiddleware:
    def __init__(self, app: Any):
        self.support = replace(check_installed_vllm(), api_route=MIDDLEWARE)  # whatever else this vLLM offers
        log_refusal(self.support)
        self.listen = admin_listen(os.environ)
        self.admin = admin_app()
        self.app = ArrivalMiddleware(app, arrivals=arrival_metrics(), door=lambda: door_of(self.admin.state))
        self._server: asyncio.Task | None = None  # the admin API's own port, where it has one
        self._tick: asyncio.Task | None = None  # the siblings' tick (AdminService.start)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self._bind(scope)  # the door applies from vLLM's first request on, admin call or not
        if scope["type"] == "lifespan" and self.listen.separate:
            await self.app(scope, receive, self._start_own_port(scope, send))
            return
        if scope["type"] != "http" or not scope.get("path", "").startswith(API_PREFIX) or self.listen.separate:
            await self.app(scope, receive, send)
            return
        await self.admin(scope, receive, send)

    def _bind(self, scope: dict) -> None:
        """The engine client, once vLLM has one: its Starlette app puts itself in the scope, the client on its state."""
        if getattr(self.admin.state, STATE_KEY, None) is None:
            engine_client = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
            if engine_client is not None:
                service = admin_state(engine_client, self.support)
                setattr(self.admin.state, STATE_KEY, service)
                self._tick = service.start() if isinstance(service, AdminService) else None

    def _start_own_port(self, scope: dict, send: Any) -> Any:
        """vLLM's lifespan, watched: once its startup is complete the engine client exists, and the port opens."""

        async def watch(message: dict) -> None:
            await send(message)
            if message["type"] == "lifespan.startup.complete" and self._server is None:
                self._bind(scope)
                if serves_own_port(getattr(self.admin.state, STATE_KEY, None)):
                    self._server = start_admin_server(self.admin, self.listen)

        return watch
