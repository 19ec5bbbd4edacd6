"""The per-request door's second look, in vLLM's API server: the requests it admitted, judged again while queued.

At arrival the door sees the prompts ahead of a request, never those behind it; but a burst that arrives during
one long step all goes into the next, and the prompts behind a request lengthen the step that gives it its first
token (docs/admission.md, "re-judging the queue"). So on every tick of the plugin's sampler each request still in
prefill is judged again, with the queue as it then stands (predicted_ttft.late_in_queue), and one that would now
miss its TTFT is refused as at the door: vLLM aborts it (the abort a client's disconnect makes), and its client
gets the door's 503 with its Retry-After.

Only a request whose answer has not begun can be refused so. The arrival middleware holds each admitted
request's response start until its first body message (vLLM sends it with the first token when it streams, with
the whole answer when it does not) and gives a :class:`Ticket` to this registry; it names the request to vLLM by
an ``X-Request-Id`` that ends in a token of its own (``batchlens-<hex>``, after the client's id where it sent one),
which vLLM puts in its request ids. One HTTP request may be several requests in vLLM (a list of prompts, ``n``):
the door refuses it whole, and its answer has begun once any of them is past its first token. Requests judged at
arrival alone: ``/v1/responses`` (vLLM names it by its body, not the header), beam search (a new request in vLLM for
each output token) and a body that sets its own ``request_id`` (the header would override it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from batchlens.predicted_ttft import Rates, late_in_queue

log = logging.getLogger("vllm.batchlens")

TOKEN_PREFIX = "batchlens-"
#: The token as vLLM's ids carry it: the end of the id the header gave (``chatcmpl-<id>``), or before the index
#: of one of its prompts (``cmpl-<id>-<i>``); never a token somewhere inside an id a client chose.
_TOKEN = re.compile(f"(?:^|-)({TOKEN_PREFIX}[0-9a-f]{{32}})(?:-[0-9]+)?$")
#: Where vLLM names a request by the ``X-Request-Id`` header (its ``/v1/responses`` names it by the body).
JUDGED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


@dataclass
class Ticket:
    """An admitted request the door may still refuse: until its answer begins."""

    token: str = field(default_factory=lambda: TOKEN_PREFIX + uuid.uuid4().hex)
    arrived: float = field(default_factory=time.monotonic)
    refused: bool = False


class SecondLook:
    """The tickets of this API server's admitted requests, and their judgement on each tick."""

    def __init__(self) -> None:
        self._tickets: dict[str, Ticket] = {}
        self._aborts: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references

    def track(self) -> Ticket:
        ticket = Ticket()
        self._tickets[ticket.token] = ticket
        return ticket

    def untrack(self, ticket: Ticket) -> None:
        """Its answer began (or ended): no longer the door's to refuse."""
        self._tickets.pop(ticket.token, None)

    def judge(self, engine_client: Any, rates: Rates, slots: int | None, step_tokens: int | None,
              budget_seconds: float) -> int:  # fmt: skip
        """Refuse the tracked requests in prefill that would now miss ``budget_seconds``: each is marked refused
        (its middleware answers the 503) and aborted in vLLM. ``slots``, ``step_tokens``: this API server's share
        of the batch's slots and of a step's token budget (``max_num_batched_tokens``). How many it refused."""
        if not self._tickets or step_tokens is None:
            return 0
        now = time.monotonic()
        # Read between two awaits: the output processor's writer is on this loop. Insertion order is arrival order.
        states = [(_external_id(rid, s), s) for rid, s in list(engine_client.output_processor.request_states.items())]
        for request_id, state in states:
            if not state.is_prefilling and (ticket := self._ticket_of(request_id)) is not None:
                self.untrack(ticket)  # one of its requests has its first token: its answer has begun
        queued = [(request_id, s) for request_id, s in states if s.is_prefilling]
        tickets = [self._ticket_of(request_id) for request_id, _ in queued]
        late = late_in_queue([s.prompt_len or 0 for _, s in queued],
                             [None if t is None else now - t.arrived for t in tickets],
                             len(states) - len(queued), slots, step_tokens, rates, budget_seconds)  # fmt: skip
        refused = {tickets[i].token: tickets[i] for i in late}
        for ticket in refused.values():
            ticket.refused = True
            self.untrack(ticket)
            log.debug("batchlens: the door refused request %s while queued (waited %.3fs; bound %.3fs)",
                      ticket.token, now - ticket.arrived, budget_seconds)  # fmt: skip
        # Every request in vLLM that the HTTP request made (its prompts, its n), each once.
        for request_id in dict.fromkeys(r for r, _ in states if (m := _TOKEN.search(r)) and m.group(1) in refused):
            self._abort(engine_client, request_id)
        return len(refused)

    def _ticket_of(self, request_id: str) -> Ticket | None:
        match = _TOKEN.search(request_id)
        ticket = None if match is None else self._tickets.get(match.group(1))
        return None if ticket is None or ticket.refused else ticket

    def _abort(self, engine_client: Any, request_id: str) -> None:
        async def abort() -> None:
            try:
                await engine_client.abort(request_id)
            except Exception:  # the client has its 503 either way; the engine finishes the request unheard
                log.exception("batchlens: vLLM could not abort request %s, refused by the door while queued",
                              request_id)  # fmt: skip

        task = asyncio.get_running_loop().create_task(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)


def _external_id(request_id: str, state: Any) -> str:
    """The id vLLM was given for a request (its request states are keyed by an id of its own since 0.12)."""
    return getattr(state, "external_req_id", None) or request_id


def judged_again(path: str, body: bytes | None) -> bool:
    """Whether a request on ``path`` with ``body`` can be judged again while queued (see above)."""
    if path not in JUDGED_PATHS or body is None:
        return False
    if b"use_beam_search" not in body and b'"request_id"' not in body:
        return True  # most bodies: no second parse
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(request, dict) and not request.get("use_beam_search") and request.get("request_id") is None


def request_id_header(headers: list, token: str) -> list:
    """The request's headers with the ``X-Request-Id`` that names it to vLLM: the client's, if it sent one, and the
    token after it."""
    given = [value for key, value in headers if key.lower() == b"x-request-id"]
    others = [(key, value) for key, value in headers if key.lower() != b"x-request-id"]
    return [*others, (b"x-request-id", (given[0] + b"-" if given else b"") + token.encode())]
