"""vLLM's queued caps, as its API server applies them before any work for a request (0.32). Pure.

``max_num_queued_reqs`` bounds the unfinished requests (waiting and running); ``max_num_queued_tokens``
the prompt tokens of the requests still in prefill, counted whole until their prefill ends, as vLLM does
(``AsyncLLM.check_admission``). The simulator refuses with these rules, so that the demo, replay and the
tests see what a vLLM with the caps set would do.

A request's door priority (``x-batchlens-priority``, after the Gateway API Inference Extension: higher is more
important) sorts it into a class. ``critical`` (above 0) is never refused at the door; ``standard`` (0, the
default) meets the caps; ``sheddable`` (below 0) is refused first, once the backlog reaches SHEDDABLE_SHARE of a
cap, so that under a rising overload it goes before any standard request does. vLLM's own caps (0.29 and later)
cannot tell requests apart: there a critical request is refused at the caps like a standard one
(docs/admission.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from batchlens.admin_api import AdmissionState

#: vLLM's reasons, as its ``vllm:admission_rejections_total`` labels them, and the message its 503 carries.
MESSAGES = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.",
}
#: The plugin's per-request door (batchlens.predicted_ttft): its reason, in the same counter, and its 503's
#: message, in the same words, so that a client or a router that retries vLLM's refusals retries this one too.
PREDICTED_TTFT = "predicted_ttft"
MESSAGES[PREDICTED_TTFT] = (
    "The engine predicts this request would miss its time to first token. "
    "Please try again later or on a different instance."
)


#: The header an admitted request's answer carries its predicted TTFT in (seconds), where the per-request door
#: predicted one: a client or a benchmark compares it with the TTFT it got (docs/admission.md).
PREDICTED_TTFT_HEADER = "x-batchlens-predicted-ttft"
#: The request header that carries a request's door priority: an integer, higher is more important.
PRIORITY_HEADER = "x-batchlens-priority"
#: The share of a cap at which the door starts refusing sheddable requests.
SHEDDABLE_SHARE = 0.5
#: The door's classes, as ``priority_class`` labels them.
CLASSES = ("critical", "standard", "sheddable")


_PRIORITY = re.compile(r"[+-]?[0-9]{1,9}")  # ASCII digits only: int() also reads "١" or "1_0", and 5000 digits


def priority_of(header: str | bytes | None) -> int:
    """A request's door priority from its header; absent or not an integer of at most 9 ASCII digits: 0,
    standard (never an error: a client's typo must not turn into a refusal, nor into a claim to be critical)."""
    text = (header.decode("latin-1") if isinstance(header, bytes) else header or "").strip()
    return int(text) if _PRIORITY.fullmatch(text) else 0


def door_priority(copies: Iterable[str | bytes]) -> int:
    """The priority of a request that may carry the header more than once (a gateway that appends its own copy
    to the client's): the lowest, so that no copy can raise a request past what another copy says; none: 0."""
    return min((priority_of(copy) for copy in copies), default=0)


def priority_class(priority: int) -> str:
    return "critical" if priority > 0 else "sheddable" if priority < 0 else "standard"


def refusal(caps: AdmissionState, n: int = 1, priority: int = 0) -> str | None:
    """The cap a request of ``n`` sequences and door ``priority`` would pass (a reason of MESSAGES), or None:
    admitted. Critical requests always pass; sheddable ones meet SHEDDABLE_SHARE of each cap."""
    if priority > 0:
        return None

    def bound(cap: int) -> float:  # a sheddable share of a cap of 1 would refuse on an idle engine; never past it
        return cap if priority == 0 else min(cap, max(1.0, cap * SHEDDABLE_SHARE))

    if caps.max_num_queued_reqs is not None and caps.num_unfinished_reqs + n > bound(caps.max_num_queued_reqs):
        return "max_num_queued_reqs"
    if caps.max_num_queued_tokens is not None and caps.num_queued_tokens >= bound(caps.max_num_queued_tokens):
        return "max_num_queued_tokens"
    return None


def cap_refusal(body: bytes) -> bool:
    """Whether a 503's body is vLLM refusing at a queued cap (its messages), not another 503 (shutting down)."""
    return any(message.encode() in body for message in MESSAGES.values())


def plugin_refusal(caps: Callable[[], AdmissionState], priority: int, vllm_caps: bool) -> str | None:
    """What the plugin's middleware refuses before vLLM reads the request. Where it keeps the door itself (no
    ``vllm_caps``, before 0.29) every class's rule; where vLLM's own caps do, only the sheddable class's early
    refusal: vLLM then refuses standard and critical requests alike at the caps. ``caps`` is read only where
    the plugin judges: on every request, that is work on vLLM's serving path."""
    if vllm_caps and priority >= 0:
        return None
    return refusal(caps(), priority=priority)


def refusal_body(reason: str) -> dict[str, object]:
    """The OpenAI-style error body of vLLM's 503 for a queued cap (0.32 types it by the status's phrase)."""
    return {"error": {"message": MESSAGES[reason], "type": "Service Unavailable", "param": None, "code": 503}}
