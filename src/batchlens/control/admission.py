"""The controller's second knob: vLLM's queued-token cap, set from the prefill throughput the engine shows. Pure.

A request refused at the door in a millisecond is better than one admitted to wait out its TTFT behind a
backlog that cannot drain in time. vLLM refuses a request once the prompts still in prefill add up to its
``max_num_queued_tokens``; set to ``slo.ttft × prefill tokens/s``, a request it admits can be prefilled
within its TTFT on average (vLLM's own advice for that flag). This module computes that cap, tick by tick,
wide enough that what the door refuses would have missed its TTFT (:func:`spread`):

- Prefill throughput is read only from windows where requests were waiting at both ends, or refused at the
  door. Then the engine prefills as fast as it admits, and the prompt tokens per second are the rate at which
  the queue drains. In a window with nothing waiting and nothing refused they are only the arrival rate, which
  says nothing of capacity; nor in one whose queue was a burst's prompts waiting a step for the token budget
  as the sample was taken (vLLM keeps those in its waiting queue too).
- The estimate is the median of the recent saturated windows, so one noisy window moves nothing. Recent as of
  the newest of them: with no new window the estimate stands, and time alone only opens the door, once too few
  are left (else the cap would move a few times after a load ends, as old windows left the median).
- The drain is not steady. A batch at its limit takes a waiting request in only as a running one finishes,
  and finishes come at random: the cap is the ``confidence`` quantile of what drains within a TTFT, not its
  mean, so that a request refused at the cap would have missed with that confidence (a false shed is one
  that would have made it). ``margin`` scales it: under 1 refuses sooner, trading false sheds for goodput.
- A cap within ``tolerance`` of the one in force is not set again: the estimate moves a little every tick.
- The door fails open, never shut. With too few saturated windows, with data older than ``stale_seconds``,
  or when the engine does not answer, the cap is None (no cap), and the reason says why.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from batchlens.admin_api import MAX_QUEUED_CAP
from batchlens.control.signals import Window
from batchlens.quantiles import poisson_quantile


@dataclass(frozen=True)
class AdmissionSettings:
    ttft_seconds: float  # the SLO's TTFT
    margin: float = 1.0  # a multiple of the cap the confidence gives: under 1 sheds sooner, for more goodput
    confidence: float = 0.95  # how sure the door is that a request it refuses would have missed its TTFT
    min_windows: int = 3  # saturated windows before the cap is set at all
    stale_seconds: float = 60.0  # a saturated window older than this no longer counts
    tolerance: float = 0.1  # a new cap within this share of the one in force is not worth a change


@dataclass(frozen=True)
class Saturated:
    """One window in which requests waited: when it ended, and the prompt tokens per second it prefilled."""

    at: float
    prefill_tokens_per_second: float
    finished_per_second: float = 0.0  # requests completed: each frees a slot for one that waits


def saturated(window: Window, at: float) -> Saturated | None:
    """The window's prefill rate, where it measures the engine: some prefill done, with requests waiting at
    its start and at its end, or refused at the door. A queue seen at one end only is a moment's: on the Azure
    code trace a burst's prompts, seen waiting for the next step's token budget, made a door whose cap rested
    on the arrival rate, and 82% of what it shed would have made its TTFT.

    Refusals count as much as a queue: with the door in force it keeps the queue short, and a window whose
    sample found nobody waiting would otherwise not count, the estimate would run out of windows, and the door
    would open on an engine still overloaded (seen: the breaker then halved to a cold start)."""
    queued = window.waiting > 0 and window.waiting_before > 0
    if (not queued and window.rejected_per_second <= 0) or not 0 < window.prompt_tokens_per_second < math.inf:
        return None
    if not math.isfinite(window.finished_per_second):  # a broken reading (read_sample refuses one live)
        return None
    return Saturated(at, window.prompt_tokens_per_second, window.finished_per_second)


#: Why the door's cap is what it is: no_signal is no saturated window yet (an engine idle since the hook started,
#: or one it cannot read). remediation/controller.py adds manual_hold and resumed, and counts error where a set fails.
CAP_REASONS = ("estimated", "too_few_windows", "stale", "no_signal")


@dataclass(frozen=True)
class CapDecision:
    cap: int | None  # the queued-token cap to have in force; None: no cap (the door open)
    reason: str  # one of CAP_REASONS; live, also manual_hold or resumed
    prefill_tokens_per_second: float | None  # the estimate the cap rests on


def queued_token_cap(history: Sequence[Saturated], now: float, settings: AdmissionSettings) -> CapDecision:
    """The cap from the saturated windows seen so far (oldest first)."""
    if not history:
        return CapDecision(None, "no_signal", None)
    # A window from the future is one from before the wall clock stepped back: as old as it is, unknown.
    recent = [s for s in history if 0 <= now - s.at <= settings.stale_seconds]
    if not recent:
        return CapDecision(None, "stale", None)
    if len(recent) < settings.min_windows:
        return CapDecision(None, "too_few_windows", None)
    newest = max(s.at for s in recent)
    basis = [s for s in history if 0 <= newest - s.at <= settings.stale_seconds]  # what was recent when it came
    rate = statistics.median(s.prefill_tokens_per_second for s in basis)
    cap = min(settings.ttft_seconds * rate * spread(basis, settings), MAX_QUEUED_CAP)  # int(inf) raises
    return CapDecision(max(1, int(cap)), "estimated", rate)


def spread(recent: Sequence[Saturated], settings: AdmissionSettings) -> float:
    """How many TTFTs of the mean drain rate the cap allows, so that a request refused at the cap would have
    missed its TTFT with ``settings.confidence`` (times ``settings.margin``).

    A batch at its limit takes a waiting request in only as a running one finishes. Finishes come about at
    random, so within a TTFT they number Poisson(finished/s x TTFT), and the prompt tokens drained are that many
    requests' worth: a request behind the confidence quantile of them would have waited too long, where one
    behind the mean of them would have made it about half the time. The fewer finish within a TTFT, the wider
    that quantile is than the mean. An engine that finished nothing while requests waited is held to the mean.
    """
    finishes = statistics.median(s.finished_per_second for s in recent) * settings.ttft_seconds
    wider = poisson_quantile(finishes, settings.confidence) / finishes if finishes > 0 else 1.0
    return max(wider, 1.0) * settings.margin


def worth_setting(in_force: int | None, wanted: int | None, settings: AdmissionSettings) -> bool:
    """Whether to set ``wanted`` over ``in_force``: opening or closing the door always, a move only past tolerance."""
    if in_force is None or wanted is None:
        return in_force != wanted
    return abs(wanted - in_force) > settings.tolerance * in_force
