"""Which role a request wants, and why. Pure.

In order, the first that holds decides:

1. the prompt is over ``long_prompt_tokens``: ``long`` (long prompts hold KV
   blocks and stall every batch they join);
2. the latency header is present: ``interactive`` when its value is one of the
   latency classes, else the request has said it is not latency-sensitive and
   no tag overrides that (a client's header is more specific than a key's tags);
3. the latency tag is among the request's tags: ``interactive``;
4. the gap since the previous arrival is over the cold-path threshold: ``cold``
   (a quiet spell, where a small batch costs nothing);
5. otherwise ``main``.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchlens.config import Routing


@dataclass(frozen=True)
class Request:
    prompt_tokens: int | None  # None: could not be counted
    latency_class: str | None = None  # the latency header's value; None: no header
    tags: tuple[str, ...] = ()
    gap: float | None = None  # seconds since the previous arrival; None: the first one


@dataclass(frozen=True)
class Choice:
    role: str
    reason: str  # long_prompt, latency_header, latency_tag, cold_gap or default


def classify(request: Request, rules: Routing, cold_gap: float | None) -> Choice:
    """The role ``request`` wants. ``cold_gap`` is the threshold in force (None: not known yet, nothing is cold)."""
    if request.prompt_tokens is not None and request.prompt_tokens > rules.long_prompt_tokens:
        return Choice("long", "long_prompt")
    if request.latency_class is not None:
        if request.latency_class.strip().lower() in {c.lower() for c in rules.latency_classes}:
            return Choice("interactive", "latency_header")
    elif rules.latency_tag in request.tags:
        return Choice("interactive", "latency_tag")
    if cold_gap is not None and request.gap is not None and request.gap > cold_gap:
        return Choice("cold", "cold_gap")
    return Choice("main", "default")
