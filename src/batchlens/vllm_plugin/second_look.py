"""The per-request door's second look, in vLLM's API server: the requests it admitted, judged again while queued.

At arrival the door sees the prompts ahead of a request, never those behind it; but a burst that arrives during
one long step all goes into the next, and the prompts behind a request lengthen the step that gives it its first
token (docs/admission.md, "re-judging the queue"). So on every tick of the plugin's sampler each request still in
prefill is judged again, with the queue as it then stands (predicted_ttft.late_in_queue), and one that would now
miss its TTFT is refused as at the door: vLLM aborts it (the abort a client's disconnect makes), and its client
gets the door's 503 with its Retry-After.

Only a request whose answer has not begun can be refused so. The arrival middleware holds each admitted
request's response start until its first body message (vLLM sends it with the first token, streamed or not) and
gives a :class:`Ticket` to this registry; it names the request to vLLM by an ``X-Request-Id`` of its own
(``batchlens-<hex>``), which vLLM puts in its request ids. A request that came with an ``X-Request-Id`` keeps it
and is not judged again: two clients may send the same one, and the wrong request would be aborted.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from batchlens.predicted_ttft import Rates, late_in_queue

log = logging.getLogger("vllm.batchlens")

TOKEN_PREFIX = "batchlens-"
_TOKEN = re.compile(TOKEN_PREFIX + "[0-9a-f]{32}")


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
        states = list(engine_client.output_processor.request_states.items())
        queued = [(rid, s) for rid, s in states if s.is_prefilling]
        tickets = [self._ticket_of(getattr(s, "external_req_id", None) or rid) for rid, s in queued]
        late = late_in_queue([s.prompt_len or 0 for _, s in queued],
                             [None if t is None else now - t.arrived for t in tickets],
                             len(states) - len(queued), slots, step_tokens, rates, budget_seconds)  # fmt: skip
        for i in late:
            ticket, (rid, state) = tickets[i], queued[i]
            ticket.refused = True
            self.untrack(ticket)
            self._abort(engine_client, getattr(state, "external_req_id", None) or rid)
            log.debug("batchlens: the door refused request %s while queued (waited %.3fs; bound %.3fs)", rid,
                      now - ticket.arrived, budget_seconds)  # fmt: skip
        return len(late)

    def _ticket_of(self, request_id: str) -> Ticket | None:
        match = _TOKEN.search(request_id)
        ticket = None if match is None else self._tickets.get(match.group())
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
