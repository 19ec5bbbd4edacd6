"""vLLM's queued caps, as its API server applies them before any work for a request (0.32). Pure.

``max_num_queued_reqs`` bounds the unfinished requests (waiting and running); ``max_num_queued_tokens``
the prompt tokens of the requests still in prefill, counted whole until their prefill ends, as vLLM does
(``AsyncLLM.check_admission``). The simulator refuses with these rules, so that the demo, replay and the
tests see what a vLLM with the caps set would do.
"""

from __future__ import annotations

from batchlens.admin_api import AdmissionState

#: vLLM's reasons, as its ``vllm:admission_rejections_total`` labels them, and the message its 503 carries.
MESSAGES = {
    "max_num_queued_reqs": "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance.",
    "max_num_queued_tokens": "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance.",
}


def refusal(caps: AdmissionState, n: int = 1) -> str | None:
    """The cap a request of ``n`` sequences would pass (a reason of MESSAGES), or None: admitted."""
    if caps.max_num_queued_reqs is not None and caps.num_unfinished_reqs + n > caps.max_num_queued_reqs:
        return "max_num_queued_reqs"
    if caps.max_num_queued_tokens is not None and caps.num_queued_tokens >= caps.max_num_queued_tokens:
        return "max_num_queued_tokens"
    return None


def refusal_body(reason: str) -> dict[str, object]:
    """The OpenAI-style error body of vLLM's 503 for a queued cap (0.32 types it by the status's phrase)."""
    return {"error": {"message": MESSAGES[reason], "type": "Service Unavailable", "param": None, "code": 503}}
