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
from batchlens.prompt_size import prompt_tokens
from batchlens.queued_caps import (
    PREDICTED_TTFT,
    PREDICTED_TTFT_HEADER,
    PRIORITY_HEADER,
    cap_refusal,
    door_priority,
    priority_class,
    refusal_body,
)
from batchlens.vllm_plugin.second_look import Ticket, judged_again, request_id_header

_metrics: ArrivalMetrics | None = None
_PRIORITY_KEY = PRIORITY_HEADER.encode()  # as ASGI gives header names: bytes, once, not on every request
_PREDICTED_KEY = PREDICTED_TTFT_HEADER.encode()
#: A body past this size is not read for the per-request door: it goes on unjudged (vLLM answers what it says).
MAX_JUDGED_BODY_BYTES = 4 * 1024 * 1024


def metrics() -> ArrivalMetrics:
    """One set of series per process, however often vLLM builds its app."""
    global _metrics
    if _metrics is None:
        _metrics = ArrivalMetrics()
    return _metrics


class Door(Protocol):
    def refusal(self, priority: int) -> str | None: ...  # a reason of queued_caps.MESSAGES to refuse one now
    def retry_after(self) -> int: ...
    def predicts(self) -> bool: ...  # whether the per-request door wants each request's prompt
    def predicted(self, prompt_tokens: int | None) -> tuple[str | None, float | None]: ...  # (reason, TTFT)
    def track(self) -> Ticket | None: ...  # an admitted request's ticket for the door's second look
    def untrack(self, ticket: Ticket) -> None: ...


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
        predicted, body = None, None
        if (reason := door.refusal(priority)) is None and door.predicts():
            held, body = await read_body(receive)
            receive = replay(held, receive)
            reason, predicted = door.predicted(None if body is None else prompt_tokens(body))
        if reason is not None:
            self.arrivals.refused(door_class)
            await refuse(send, reason, door.retry_after())
            return

        ticket = door.track() if predicted is not None and judged_again(scope["path"], body) else None
        if ticket is not None:  # vLLM names the request by it, and the door's second look finds it so
            scope = {**scope, "headers": request_id_header(list(scope.get("headers") or ()), ticket.token)}
        held: list[dict] = []  # a 503's start, until its body says whether a queued cap refused; an admitted
        # request's start, until its first body (its first token), while the door's second look may refuse it
        refused = False  # by the second look, and the client has the door's 503: vLLM's answer to the abort is dropped

        async def watch(message: dict) -> None:
            nonlocal refused
            if refused:
                return
            if message["type"] == "http.response.start" and (ticket is not None or message.get("status") == 503):
                held.append(message)
                return
            if held and message["type"] == "http.response.body":
                start = held.pop()
                if ticket is not None:
                    door.untrack(ticket)
                    if ticket.refused:  # refused while queued: vLLM answers its abort, the client the 503
                        refused = True
                        self.arrivals.refused(door_class)
                        await refuse(send, PREDICTED_TTFT, door.retry_after())
                        return
                if start.get("status") == 503 and cap_refusal(message.get("body", b"")):  # vLLM's own caps
                    self.arrivals.refused(door_class)
                    headers = [h for h in start.get("headers") or () if h[0].lower() != b"retry-after"]
                    start = {**start, "headers": [*headers, (b"retry-after", str(door.retry_after()).encode())]}
                await send(answered(start))
            elif message["type"] == "http.response.start":
                message = answered(message)
            await send(message)

        def answered(start: dict) -> dict:
            """A start as it goes out: an answer counted, stream or not, and told its prediction."""
            if start.get("status") != 200:
                return start
            content_type = dict(start.get("headers") or ()).get(b"content-type", b"")
            self.arrivals.answered(content_type.startswith(b"text/event-stream"))
            if predicted is None:
                return start
            return {**start, "headers": [*(start.get("headers") or ()), (_PREDICTED_KEY, f"{predicted:.3f}".encode())]}

        try:
            await self.app(scope, receive, watch)
        finally:
            if ticket is not None:
                door.untrack(ticket)


async def read_body(receive: Any) -> tuple[list[dict], bytes | None]:
    """The request's messages as read, and its body; None past MAX_JUDGED_BODY_BYTES or a client gone (the rest is
    then not read here: vLLM reads it, after the messages held)."""
    held, chunks, size = [], [], 0
    while True:
        message = await receive()
        held.append(message)
        if message["type"] != "http.request":
            return held, None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_JUDGED_BODY_BYTES:
            return held, None
        if not message.get("more_body"):
            return held, b"".join(chunks)


def replay(held: list[dict], receive: Any) -> Any:
    """A receive that gives vLLM the messages read for the door first, then the rest as they come."""

    async def again() -> dict:
        return held.pop(0) if held else await receive()

    return again


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
