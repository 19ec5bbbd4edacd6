"""The controller's second knob: vLLM's queued-token cap, set from the prefill throughput the engine shows. Pure.

A request refused at the door in a millisecond is better than one admitted to wait out its TTFT behind a
backlog that cannot drain in time. vLLM refuses a request once the prompts still in prefill add up to its
``max_num_queued_tokens``; set to ``slo.ttft × prefill tokens/s``, a request it admits can be prefilled
within its TTFT (vLLM's own advice for that flag). This module computes that cap, tick by tick:

- Prefill throughput is read only from windows where requests were waiting. Then the engine prefills as
  fast as it admits, and the prompt tokens per second are the rate at which the queue drains. In a window
  with nothing waiting they are only the arrival rate, which says nothing of capacity.
- The estimate is the median of the recent saturated windows, so one noisy window moves nothing.
- ``margin`` (below 1) leaves room for the decode steps that share the engine with prefill.
- A cap within ``tolerance`` of the one in force is not set again: the estimate moves a little every tick.
- The door fails open, never shut. With too few saturated windows, with data older than ``stale_seconds``,
  or when the engine does not answer, the cap is None (no cap), and the reason says why.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from batchlens.control.signals import Window


@dataclass(frozen=True)
class AdmissionSettings:
    ttft_seconds: float  # the SLO's TTFT
    margin: float = 0.8
    min_windows: int = 3  # saturated windows before the cap is set at all
    stale_seconds: float = 60.0  # a saturated window older than this no longer counts
    tolerance: float = 0.1  # a new cap within this share of the one in force is not worth a change


@dataclass(frozen=True)
class Saturated:
    """One window in which requests waited: when it ended, and the prompt tokens per second it prefilled."""

    at: float
    prefill_tokens_per_second: float


def saturated(window: Window, at: float) -> Saturated | None:
    """The window's prefill rate, where it measures the engine (requests waiting, and some prefill done)."""
    if window.waiting <= 0 or window.prompt_tokens_per_second <= 0:
        return None
    return Saturated(at, window.prompt_tokens_per_second)


@dataclass(frozen=True)
class CapDecision:
    cap: int | None  # the queued-token cap to have in force; None: no cap (the door open)
    reason: str  # estimated, too_few_windows, stale or no_signal
    prefill_tokens_per_second: float | None  # the estimate the cap rests on


def queued_token_cap(history: Sequence[Saturated], now: float, settings: AdmissionSettings) -> CapDecision:
    """The cap from the saturated windows seen so far (oldest first)."""
    if not history:
        return CapDecision(None, "no_signal", None)
    recent = [s.prefill_tokens_per_second for s in history if now - s.at <= settings.stale_seconds]
    if not recent:
        return CapDecision(None, "stale", None)
    if len(recent) < settings.min_windows:
        return CapDecision(None, "too_few_windows", None)
    rate = statistics.median(recent)
    return CapDecision(max(1, int(settings.ttft_seconds * rate * settings.margin)), "estimated", rate)


def worth_setting(in_force: int | None, wanted: int | None, settings: AdmissionSettings) -> bool:
    """Whether to set ``wanted`` over ``in_force``: opening or closing the door always, a move only past tolerance."""
    if in_force is None or wanted is None:
        return in_force != wanted
    return abs(wanted - in_force) > settings.tolerance * in_force
