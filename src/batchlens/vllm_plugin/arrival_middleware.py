"""An ASGI middleware in vLLM's API server: it observes request arrivals (batchlens.arrivals) and keeps the door.

It sees a generation request when it arrives and its answer when the headers
go out (``text/event-stream`` is a stream), and never changes a body. It
reads the request's door priority from its ``x-batchlens-priority`` header
(the lowest copy, where there are several), counts it by class, and counts by
class each queued cap's 503: a 503's headers wait for its body, whose message
says whether a queued cap refused it (docs/admission.md) or something else
did (the server shutting down). To a cap's 503 it adds the ``Retry-After``
the door gives: when the backlog should have drained. On a
release without vLLM's own queued caps, the plugin's door (door.py) refuses
here, before vLLM sees the request, with vLLM's 503 and its error body.
The series go to prometheus_client's default registry, which vLLM's /metrics
serves. With several API server processes (``--api-server-count``) each counts
the requests it takes, in vLLM's multiprocess metrics directory, so /metrics
gives the server's totals whichever process answers; each measures its gaps from
the last arrival at any of them (siblings.py), so the gaps are the server's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Protocol

from batchlens.arrivals import GENERATION_PATHS, ArrivalMetrics
from batchlens.queued_caps import PRIORITY_HEADER, cap_refusal, door_priority, priority_class, refusal_body

_metrics: ArrivalMetrics | None = None
_PRIORITY_KEY = PRIORITY_HEADER.encode()  # as ASGI gives header names: bytes, once, not on every request


def metrics() -> ArrivalMetrics:
    """One set of series per process, however often vLLM builds its app."""
    global _metrics
    if _metrics is None:
        _metrics = ArrivalMetrics()
    return _metrics


class Door(Protocol):
    def refusal(self, priority: int) -> str | None: ...  # a reason of queued_caps.MESSAGES to refuse one now
    def retry_after(self) -> int: ...


class ArrivalMiddleware:
    def __init__(self, app: Any, arrivals: ArrivalMetrics, door: Callable[[], Door]):
        self.app = app
        self.arrivals = arrivals
        self.door = door

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        priority = door_priority(value for key, value in scope.get("headers") or () if key.lower() == _PRIORITY_KEY)
        door_class = priority_class(priority)
        self.arrivals.arrived(time.monotonic(), door_class)
        door = self.door()
        if (reason := door.refusal(priority)) is not None:
            self.arrivals.refused(door_class)
            await refuse(send, reason, door.retry_after())
            return

        held: list[dict] = []  # a 503's start, until its body says whether a queued cap refused

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start" and message.get("status") == 200:
                content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
                self.arrivals.answered(content_type.startswith(b"text/event-stream"))
            elif message["type"] == "http.response.start" and message.get("status") == 503:
                held.append(message)
                return
            elif held and message["type"] == "http.response.body":
                start = held.pop()
                if cap_refusal(message.get("body", b"")):  # vLLM's own caps; not a 503 of another cause
                    self.arrivals.refused(door_class)
                    headers = [h for h in start.get("headers") or () if h[0].lower() != b"retry-after"]
                    start = {**start, "headers": [*headers, (b"retry-after", str(door.retry_after()).encode())]}
                await send(start)
            await send(message)

        await self.app(scope, receive, watch)


async def refuse(send: Any, reason: str, retry_after: int) -> None:
    """vLLM's 503 for a queued cap, as its serving code answers it, with the door's Retry-After."""
    body = json.dumps(refusal_body(reason)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(retry_after).encode()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
