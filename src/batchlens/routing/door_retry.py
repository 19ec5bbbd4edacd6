"""A refusal that finds another engine: where an engine door's 503 is retried, once, within the TTFT budget. Pure.

An engine's admission door (vLLM's queued caps, the plugin's door) refuses a request with a 503 whose body is
one of ``batchlens.queued_caps.MESSAGES``. That engine is full; another engine of the same role may not be. So
the request is sent once more, to the engines of the role the router chose that have room by the signals
(neither down nor saturated) and that have not failed it already, while its TTFT budget (``slo.ttft_seconds``,
counted from the routing plugin's pre-call hook, as the proxy takes the request in) is not spent. Never to an
engine of another role, never to an engine that refused it, never twice: after that door refusal nothing more is
sent, by LiteLLM's generic retry or by its fallback group either, and the client gets the 503 with its
``Retry-After``.

:class:`DoorRetry` is one request's record, kept in the request's LiteLLM metadata by the plugin
(``routing/litellm_proxy.py``), which feeds it each failed and answered attempt and asks it, on each routing
pass, where the request may go.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from batchlens.queued_caps import cap_refusal
from batchlens.routing.signals import DOWN, SATURATED

#: The outcomes of a door refusal, as ``batchlens_routing_door_retries_total`` labels them.
SERVED = "served"  # retried on another engine of the role, which answered
REFUSED_AGAIN = "refused_again"  # retried, and that engine's door refused too: the client gets its 503
FAILED = "failed"  # retried, and that engine failed otherwise (down, timed out): the client gets the first 503
NO_ENGINE = "no_engine_with_room"  # not retried: no other engine of the role has room
PAST_BUDGET = "past_budget"  # not retried: the request's TTFT budget was spent
OUTCOMES = (SERVED, REFUSED_AGAIN, FAILED, NO_ENGINE, PAST_BUDGET)
#: The request metadata key the plugin keeps the record under.
METADATA_KEY = "batchlens_door_retry"


@dataclass(eq=False)
class DoorRetry:
    """One request's door retry: what failed it, where its one retry went, and how that ended.

    Kept by reference in the request's metadata, which LiteLLM shares across a request's attempts and copies
    (shallowly) into each fallback hop; a deep copy keeps the same record too, so every attempt sees one. LiteLLM's
    logging payloads take only the metadata keys they know: the record is never logged nor serialized."""

    role: str  # the role the router chose; a retry stays within it
    since: float  # when the proxy took the request in (the clock the plugin reads, seconds)
    failed_on: list[str] = field(default_factory=list)  # engines that failed this request, in order
    answer: object = None  # once a door refused: the 503 the client gets, raised wherever nothing is sent
    refused_by: str | None = None  # the engine whose door refused first
    retry: tuple[str, ...] | None = None  # the engines the one retry was offered to
    outcome: str = ""  # one of OUTCOMES once settled

    def __copy__(self) -> DoorRetry:
        return self

    def __deepcopy__(self, memo: dict) -> DoorRetry:
        return self

    def failed(self, engine: str | None, refusal: object = None) -> str:
        """An attempt failed on ``engine``: a door's refusal (``refusal``: the 503 to answer with, kept from the
        first) or anything else (None). The outcome this settles (refused_again or failed), else ""."""
        if engine and engine not in self.failed_on:
            self.failed_on.append(engine)
        if self.answer is None and refusal is not None:
            self.answer, self.refused_by = refusal, engine
        if self.retry is None or self.outcome:
            return ""
        self.outcome = REFUSED_AGAIN if refusal is not None else FAILED
        return self.outcome

    def answered(self) -> str:
        """An attempt answered: SERVED when it was the retry, else ""."""
        if self.retry is None or self.outcome:
            return ""
        self.outcome = SERVED
        return SERVED

    def said(self) -> str:
        """What became of it, for the log (engine names only)."""
        refused = f"the door of {self.role} engine {self.refused_by or '?'} refused a request"
        retry = ", ".join(self.retry or ())
        return refused + {
            SERVED: f"; retried on {retry}, which served it",
            REFUSED_AGAIN: f"; retried on {retry}, whose door refused it too: the client got the 503 with Retry-After",
            FAILED: f"; retried on {retry}, which failed otherwise: the client got the first 503 with Retry-After",
            NO_ENGINE: f"; not retried: no other {self.role} engine had room: the client got the 503 with Retry-After",
            PAST_BUDGET: "; not retried: its TTFT budget (slo.ttft_seconds) was spent: the client got the 503 with "
            "Retry-After",
        }.get(self.outcome, "")

    def route(self, now: float, budget: float, roles: Mapping[str, Sequence[str]], states: Mapping[str, str],
              available: Collection[str], hop: bool) -> tuple[str, ...] | None:  # fmt: skip
        """Where a routing pass may send the request: None, as LiteLLM would (no door has refused it); the
        engines of its one retry; or () for nothing: raise ``answer``. The retry is LiteLLM's fallback hop
        (``hop``), the first pass in the fallback group after the refusal: a pass in the request's own group (its
        generic retry) sends nothing. ``available``: the engines LiteLLM offers in this pass (not in its
        cooldown); ``states``: each engine's signal state."""
        if self.answer is None:
            return None
        if self.retry is not None or self.outcome or not hop:
            return ()
        if now - self.since >= budget:
            self.outcome = PAST_BUDGET
            return ()
        room = tuple(e for e in roles.get(self.role, ()) if e not in self.failed_on and e in available
                     and states.get(e) not in (DOWN, SATURATED))  # fmt: skip
        if not room:
            self.outcome = NO_ENGINE
            return ()
        self.retry = room
        return room


def door_refusal(error: BaseException) -> bool:
    """Whether an attempt's error (LiteLLM's) is an engine door's 503, for any reason of queued_caps.MESSAGES, and
    not another 503 (an engine shutting down) nor a failure to connect. LiteLLM's error text carries the body."""
    text = str(getattr(error, "message", None) or error)
    return getattr(error, "status_code", None) == 503 and cap_refusal(text.encode())


def retry_after(error: BaseException) -> str | None:
    """The engine's Retry-After, from LiteLLM's error (which keeps the engine's response headers)."""
    for headers in (getattr(error, "litellm_response_headers", None),
                    getattr(getattr(error, "response", None), "headers", None)):  # fmt: skip
        for name, value in (headers or {}).items():
            if str(name).lower() == "retry-after":
                return str(value)
    return None


def door_of(kwargs: Mapping | None) -> DoorRetry | None:
    """A request's record, from LiteLLM's request kwargs; only the plugin puts one there (a client's JSON never is)."""
    metadata = (kwargs or {}).get("metadata")
    door = metadata.get(METADATA_KEY) if isinstance(metadata, Mapping) else None
    return door if isinstance(door, DoorRetry) else None
