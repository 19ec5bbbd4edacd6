"""An ASGI middleware in vLLM's API server that observes request arrivals (batchlens.arrivals).

It sees a generation request when it arrives and its answer when the headers
go out (``text/event-stream`` is a stream), and never touches the bodies. To
a 503 (vLLM's queued caps refusing it, docs/admission.md) it adds the
``Retry-After`` that ``retry_after`` gives: when the backlog should have drained.
The series go to prometheus_client's default registry, which vLLM's /metrics
serves. With several API server processes (``--api-server-count``) each sees
only its own share of the arrivals, so the gaps are per process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batchlens.arrivals import GENERATION_PATHS, ArrivalMetrics

_metrics: ArrivalMetrics | None = None


def metrics() -> ArrivalMetrics:
    """One set of series per process, however often vLLM builds its app."""
    global _metrics
    if _metrics is None:
        _metrics = ArrivalMetrics()
    return _metrics


class ArrivalMiddleware:
    def __init__(self, app: Any, arrivals: ArrivalMetrics, retry_after: Callable[[], int] = lambda: 1):
        self.app = app
        self.arrivals = arrivals
        self.retry_after = retry_after

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.arrivals.arrived(time.monotonic())

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start" and message.get("status") == 200:
                content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
                self.arrivals.answered(content_type.startswith(b"text/event-stream"))
            elif message["type"] == "http.response.start" and message.get("status") == 503:
                headers = [h for h in message.get("headers") or () if h[0].lower() != b"retry-after"]
                message = {**message, "headers": [*headers, (b"retry-after", str(self.retry_after()).encode())]}
            await send(message)

        await self.app(scope, receive, watch)
