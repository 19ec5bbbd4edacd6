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

from dataclasses import replace
from typing import Any

from fastapi import FastAPI

from batchlens.admin_api import API_PREFIX
from batchlens.vllm_plugin.arrival_middleware import ArrivalMiddleware
from batchlens.vllm_plugin.arrival_middleware import metrics as arrival_metrics
from batchlens.vllm_plugin.compat import MIDDLEWARE, check_installed_vllm
from batchlens.vllm_plugin.endpoint import STATE_KEY, admin_state, attach_routes, log_refusal, retry_after_of


class AdminMiddleware:
    def __init__(self, app: Any):
        self.support = replace(check_installed_vllm(), api_route=MIDDLEWARE)  # whatever else this vLLM offers
        log_refusal(self.support)
        self.admin = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        self.app = ArrivalMiddleware(
            app, arrivals=arrival_metrics(), retry_after=lambda: retry_after_of(self.admin.state)
        )
        attach_routes(self.admin)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        if getattr(self.admin.state, STATE_KEY, None) is None:
            # vLLM's Starlette app puts itself in the scope; its state holds the engine client after startup.
            engine_client = getattr(scope["app"].state, "engine_client", None)
            if engine_client is not None:
                setattr(self.admin.state, STATE_KEY, admin_state(engine_client, self.support))
        await self.admin(scope, receive, send)
