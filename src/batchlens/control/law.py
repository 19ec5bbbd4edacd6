"""The control law: (state, what the engine did since the last tick) -> the batch limit from now on. Pure.

An SLO-targeted gradient law, after Netflix's Gradient2 and Envoy's adaptive
concurrency, with one change LLM decode forces: inter-token latency rises with
the batch even when nothing queues, so "latency above the no-load latency" is
not congestion here. The law aims at the SLO itself instead of a minimum-RTT
baseline. Each tick, in this order:

1. **Draining.** After a decrease the running batch needs time to come down to
   the new limit: running requests are never preempted, they finish. The law
   judges nothing while more requests run than the limit, for at most
   ``drain_seconds``: a window of the old batch would only cut again (the hook
   once cut 57 -> 29 -> 15 with 57, then 56, still running after a fixed 5 s).
2. **Too slow per token.** The decode pace (ITL, the TPOT of the requests in
   flight) is over the SLO: cut the limit by the ratio of the SLO to the pace,
   between x0.5 and x0.9 (fast decrease), and drain. Not on the first window
   after growth: the requests it let in are prefilling, their prompts stall
   every step for a moment, and a cut then undoes the growth for a transient
   (on the published profile's ramp the law swung 96 <-> 192 on it, 0.91 of
   the best static limit; judged a window later, 0.95). Nor on the first
   window over in a burst, whose arrivals came at over ``BURST`` times their
   average rate: its prompts stall the steps the same way, and a cut keeps
   the burst waiting (the published profile's bursty load cut 144 -> 77 on
   one window at 187 ms, whose next ran at 25 ms: 0.966 of the best static
   limit, 0.975 judged a window later; with the door 0.972 -> 0.982). A
   second window over in a row is cut. A steady excess of long prompts
   arrives at the usual rate, and is cut at once (the article's phase load:
   0.98 of the best static limit with every first window judged a window
   later, 0.99 this way).
3. **KV ceiling.** KV usage above ``kv_target`` means preemptions are near:
   the limit comes down to running x kv_target / KV usage.
4. **App-limited.** Fewer than half the limit run and nothing waits: the limit
   is not what binds, so it does not move (it would otherwise creep upward
   with nobody to test it).
5. **Keep up.** The law learns, as it runs, the slope of the decode pace in
   the batch (control/capacity.py) and what is asked of the engine against
   what it serves. While it serves under ``keep_up`` x what is asked, and
   the pace grows faster than the batch (a slope over KEEP_UP_SLOPE: past the
   throughput peak, and far enough that the burst room a bigger batch gives
   is not worth it), the limit steps down x0.85 and does not grow. This finds
   the peak where tokens/s alone cannot: near capacity it falls too slowly
   past the peak for 2 s windows to show through their noise. Not while the
   law holds after a fall (7).
6. **Past the throughput peak.** The law remembers the most tokens/s any
   window showed and the batch that made them (tokens/s x the mean gap),
   averaged when that batch is seen again (so a change of mix corrects it).
   When, twice in a row and after the batch settled, a batch over 10% larger
   serves under ``past_peak`` of that, the limit comes down to the peak's
   batch, and growth stops short of the limit that hurt for
   ``peak_seconds``. On an engine whose throughput falls past a batch size
   (KV re-reads thrashing L2, prefill stalls) the pace can stay within the
   SLO while each step of growth lengthens the queue: only tokens/s shows it.
   A flat throughput is not a fall: under overload a bigger batch still
   admits more requests within their TTFT. Nor is a noisy window at the same
   binding limit: a peak seen while the limit bound shows that limit (its
   batch is the limit less the turnover), and only growth past it can have
   gone past the peak. At a cold start on a real vLLM one window at a
   binding 12 made a peak at a batch of 10, the next ones fell below it, and
   the law cut to 11 and held there under a queue. Nor is a peak of under
   ``MIN_PEAK_BATCH`` requests, where one request is a quarter of the batch
   or more. A peak seen while the
   limit did not bind is a smaller batch's own, except on a prefill-bound
   mix: there a quiet window, no prompt to prefill, serves far more tokens/s
   than any batch under a queue does (10 running gave 650 tokens/s, 27 under
   a queue 390, on the Azure code trace), so only a window under a binding
   limit shows a peak, and one learned before the mix was known is dropped.
7. **Headroom.** Requests wait behind a full batch and the pace has room under
   the SLO: far below it, double (slow start, bounded by ``max_step``); nearer,
   add sqrt(limit) (slow increase, Envoy's headroom). On an engine that has
   shown a fall, growth is always the slow kind, and waits for a settled
   window before each step: probe, then measure. With no door beside the
   limit (``door``: control/admission.py's cap) it is one slot: near
   capacity a sqrt step back past the peak built a backlog that the engine
   never drained (Azure conversation trace, from 600 s at x0.75: 24 -> 29 ->
   35 -> 41 after a fall at 48, 0.57 of the best static limit; one slot a
   step, 0.73). While the fall is remembered and the engine serves short of
   what is asked, it does not move at all, nor does ``keep_up`` step it
   down (``holding``): that backlog drains only at the peak, and near it
   tokens/s are too flat for a window to tell one slot from the next (the
   same trace regrew 24 -> 31 after a fall at 32, then keep_up walked it
   down to 15, on 900-1,100 tokens/s throughout: 0.86; held, 0.94). A door
   sheds such a backlog, and there the sqrt step served more (article ramp
   1.36 against 1.31 of the best static), and keep_up steps as ever. On a
   prefill-bound mix (``PREFILL_BOUND``: long prompts, short answers) growth
   is one slot a tick: there a bigger batch buys next to no tokens/s, and a
   step lets a burst's prompts in together, whose prefills stall every
   running decode past the SLO before the next window can show it (a pace of
   33 ms at 31 running became 105 ms at 48 on the Azure code trace). One at a
   time, each step's cost shows before the next. Slow start doubles only
   while the throughput still rises: a settled window whose batch is over
   10% past the peak's and served under ``CLIMB_SHARE`` of the peak's
   tokens/s holds the limit. Doubling from there overshoots the peak before
   any fall can show, and near capacity the backlog of those seconds is
   never drained (the Azure conversation trace from 600 s at x0.75: 32 ->
   48 on an engine that peaks near 24, 0.69 of the best static limit; held
   at 32 until ``past_peak`` took it to 24, 0.86).

A replayed run starts at ``start_limit``, an eighth of the capacity unless
set: a burst into an engine whose gate is wide open ruins every request in
flight before the first tick can react (benchmarks/controller.py measured
0.75 of the best static limit from the capacity on bursty load), and a start
far below it queues the first seconds of a heavy load for longer than they
last (0.83 from 16 on the published profile's steady load, 0.97 from 32).
Live, control starts from the limit in force (control/steering.py).

Every answer is clamped to [min_limit, max_limit] and to a step of at most
``max_step`` times the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from batchlens.control.capacity import Capacity
from batchlens.control.signals import Window
from batchlens.goodput import Slo


@dataclass(frozen=True)
class Tuning:
    min_limit: int = 1
    max_limit: int = 256
    start_limit: int | None = None  # where a replayed run starts; None: an eighth of max_limit
    pace_quantile: float | None = None  # None: the mean gap (exact, and what TPOT averages); else this quantile
    headroom: float = 0.8  # grow only while the pace is under this share of the SLO
    kv_target: float = 0.95
    drain_seconds: float = 30.0  # the longest hold after a cut while the running batch drains to the limit
    max_step: float = 0.5  # a move is at most this share of the limit (and at least 1)
    past_peak: float | None = 0.85  # saturated tokens/s under this share of the peak's, above it: back to it
    peak_seconds: float = 60.0  # after a fall, no growth back to the limit that fell for this long
    settle_seconds: float = 2.0  # tokens/s is judged on windows that start this long after the limit moved
    keep_up: float | None = 1.15  # serving under this x the tokens/s asked is falling short; None: not judged
    slope_seconds: float = 120.0  # the pace's slope forgets a window this old by a factor e
    demand_seconds: float = 60.0  # likewise the demand's average
    door: bool = False  # a queued-token cap (control/admission.py) is kept beside the limit: a backlog is shed

    def clamp(self, limit: int) -> int:
        """``limit`` within min_limit..max_limit."""
        return min(max(limit, self.min_limit), self.max_limit)

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError(f"need 1 <= min_limit <= max_limit, got {self.min_limit} and {self.max_limit}")


# Past the peak by this much (tokens/s ~ batch^(1 - slope): 10% more batch, 1% fewer tokens/s): a batch a little
# past the peak costs little throughput and takes in more of a burst.
KEEP_UP_SLOPE = 1.1
KEEP_UP_CUT = 0.85  # a keep_up step: small, since the slope is learned where the law has been
KEEP_UP_DWELL = 10.0  # seconds at a limit before the next keep_up step
KEEP_UP_PROBE = 30.0  # ... where the slope is over KEEP_UP_SLOPE but not surely, or unknown: since the last step
# A mix whose prompt tokens are this share of all it processes (19 or more prompt tokens to a generated one; the
# Azure code trace has about 70: prompts of 2,000 tokens, answers of 28) is prefill-bound: growth there is one slot
# a tick.
PREFILL_BOUND = 0.95
PEAK_BATCH_SPAN = 1.1  # batches within 10% of the peak's are the peak's; a fall needs a batch 10% larger
# No peak under this batch says that a bigger batch serves less: there one request is a quarter or more of the
# batch, and a window's tokens/s moves by as much on its own. A real vLLM on the CPU, started at 4 under a
# queue, saw a peak of 2.98 requests at 1,915 tokens/s in its first window; 4 served under 85% of that twice, and
# the law cut to 3 and held there under the queue, by the ceiling, to the end of the test.
MIN_PEAK_BATCH = 4.0
# Slow start holds where a settled batch past the peak's served under this share of the peak's tokens/s: on an
# engine whose throughput still rises, a window in a burst can come a few percent under a peak a lucky window set
# (the published profile's bursty load: 2% under at a batch 35% larger); past the peak, the conversation trace's
# engine served 6-11% under.
CLIMB_SHARE = 0.95
#: Growth stops where fewer first tokens than this share come within the SLO's TTFT ...
TTFT_ON_TIME = 0.9
#: ... while the batch, past the peak's, serves under this multiple of the peak's tokens/s: it buys nothing.
FLAT_SHARE = 1.05
BURST = 1.5  # a window whose arrivals came at over this x their average rate (control/capacity.py's demand)


@dataclass(frozen=True)
class Peak:
    """The most tokens/s a window showed, with how many requests ran (the batch).

    Seen again at about the same batch, its rate is averaged: a peak that is the luckiest of many noisy
    windows would make every later window look like a fall."""

    batch: float
    tokens_per_second: float
    # The smallest limit it was seen binding under (requests waiting behind a full batch), 0 where none bound:
    # a batch under a binding limit is the limit's, less the turnover, so a fall from it needs growth past it.
    limit: int = 0


@dataclass(frozen=True)
class State:
    limit: int
    hold_until: float = 0.0
    peak: Peak | None = None
    ceiling: int | None = None  # growth to this limit lowered throughput: do not grow to it again before ...
    ceiling_until: float = 0.0
    since: float = 0.0  # when the limit last moved
    below: int = 0  # settled saturated windows in a row under past_peak x the peak's rate
    capacity: Capacity | None = None  # the pace's slope and the demand (control/capacity.py); None until a window
    stepped: float = 0.0  # when keep_up last stepped down
    over: int = 0  # windows in a row whose pace was over the SLO


#: Every reason the law gives (docs/control.md's table), in the order it tries them.
REASONS = ("drain", "pace_over", "kv_ceiling", "idle", "app_limited", "keep_up", "past_peak", "ttft_flat",
           "slow_start", "headroom", "steady")  # fmt: skip


@dataclass(frozen=True)
class Decision:
    state: State
    reason: str  # one of REASONS

    @property
    def limit(self) -> int:
        return self.state.limit


def decide(state: State, w: Window, now: float, slo: Slo, tuning: Tuning) -> Decision:
    limit = state.limit
    batch = batch_served(w)
    # Only a window that starts after the batch settled shows what a limit serves: requests just let in are
    # still in prefill and give no tokens yet.
    settled = now - w.seconds >= state.since + tuning.settle_seconds
    state = _learn(state, w, settled, tuning)
    if now < state.hold_until and w.running > limit:
        return Decision(state, "drain")
    pace = decode_pace(w, tuning)
    over = not math.isnan(pace) and pace > slo.tpot_seconds
    state = replace(state, over=state.over + 1 if over else 0)
    if over:
        if not settled and state.hold_until < state.since:
            # The first window after growth: the requests it let in are prefilling, and their prompts stall
            # every decode step. That is the growth's passing cost, not this limit's pace: judge the next one.
            return Decision(state, "steady")
        if state.over < 2 and burst(state.capacity, w):
            # So do a burst's prompts, for a moment, and a cut would only keep the burst waiting.
            return Decision(state, "steady")
        cut = min(max(slo.tpot_seconds / pace, 0.5), 0.9)
        return _move(state, math.floor(limit * cut), now + tuning.drain_seconds, "pace_over", tuning, now)
    if w.kv_usage > tuning.kv_target and w.running > 0:
        ceiling = math.floor(w.running * tuning.kv_target / w.kv_usage)
        if ceiling < limit:
            return _move(state, ceiling, now + tuning.drain_seconds, "kv_ceiling", tuning, now)
    saturated = w.waiting > 0 and w.running >= 0.9 * limit
    held = holding(state, now, tuning)
    step, past = _keep_up(state, pace, settled, now - w.seconds - state.since, now, slo, tuning)
    if saturated and step and not held:
        state = replace(state, stepped=now)
        return _move(state, math.floor(limit * KEEP_UP_CUT), now + tuning.drain_seconds, "keep_up", tuning, now)
    if tuning.past_peak is not None and batch >= 1:
        quiet_misleads = prefill_bound(state.capacity)  # only a batch under a queue shows a peak then
        if quiet_misleads and state.peak is not None and state.peak.limit == 0:
            state = replace(state, peak=None)  # one kept from before the mix was known
        if saturated or not quiet_misleads:
            state = _remember_peak(state, batch, w.tokens_per_second, state.limit if saturated else 0)
        peak = state.peak
        # A fall counts only where the limit binds (requests wait behind a full batch): a burst of arrivals
        # under the limit lowers tokens/s too, with its prefills, and the limit has no part in that.
        # Back to the peak's batch, rounded up as the move rounds it, must be a cut, and past a limit that bound
        # the peak: at 4 a peak's batch of 3.6 went "back" to 4, and the ceiling it left held the limit there for
        # peak_seconds (a real vLLM on the CPU, under a queue 28 s long).
        fell = settled and saturated and past_the_peak(peak, limit, w, tuning.past_peak)
        state = replace(state, below=state.below + 1 if fell else 0)
        if state.below >= 2:
            # Twice in a row, a bigger batch served fewer tokens/s than a smaller one did: it only lengthens
            # the queue (L2 thrashing, prefill stalls). Down to the peak's batch, and no growth back to this
            # limit for a while.
            ceiling = min(limit, state.ceiling) if remembered(state, now) else limit
            state = replace(state, ceiling=ceiling, ceiling_until=now + tuning.peak_seconds, below=0)
            return _move(state, math.ceil(peak.batch), now + tuning.drain_seconds, "past_peak", tuning, now)
        if fell:
            return Decision(state, "steady")  # once may be noise: no growth until the next window says
    if w.waiting == 0 and w.running < limit / 2:
        return Decision(state, "idle" if w.running == 0 else "app_limited")
    if saturated and past:
        return Decision(state, "steady")  # growth would serve fewer tokens/s, and they fall short already
    if saturated and not tuning.door and late_for_nothing(state, w, settled, slo):
        return Decision(state, "ttft_flat")
    if saturated and (math.isnan(pace) or pace < tuning.headroom * slo.tpot_seconds):
        # Far below the SLO (slow start): double; near it, or on an engine that has shown a throughput
        # peak: + sqrt(limit), Envoy's headroom, and never up to the ceiling while it holds; + 1 on a
        # prefill-bound mix, and after a fall with no door (one_slot).
        if state.ceiling is not None and not settled:
            return Decision(state, "steady")  # probe, then measure: growth past a peak must show its tokens/s
        if held:
            return Decision(state, "steady")
        capped = remembered(state, now)
        single = one_slot(state, tuning.door) is not None
        far = (not single and state.ceiling is None
               and (math.isnan(pace) or pace < tuning.headroom * slo.tpot_seconds / 2))  # fmt: skip
        if far and settled and past_the_peak(state.peak, limit, w, CLIMB_SHARE):
            # The throughput has stopped rising: doubling would overshoot the peak before a fall can show.
            return Decision(state, "steady")
        target = limit + 1 if single else 2 * limit if far else limit + math.ceil(math.sqrt(limit))
        if capped:  # up to just under the ceiling, and never down: headroom is no reason to cut
            target = max(limit, min(target, state.ceiling - 1))
        return _move(state, target, state.hold_until, "slow_start" if far else "headroom", tuning, now)
    return Decision(state, "steady")


def late_for_nothing(state: State, w: Window, settled: bool, slo: Slo) -> bool:
    """Whether growth would buy nothing and cost first tokens: over a tenth of them late (TTFT_ON_TIME) while the
    batch, past the throughput peak's, serves no more than the peak did (FLAT_SHARE). Past the conversation
    trace's cliff a limit of 20 to 29 served the same tokens/s as 16, at a pace far inside the SLO, and every
    step's token budget then carried more decodes beside the long prompts' chunks: P50 TTFT 3.25 s against
    1.21 s, 0.84 of the best static limit's goodput, which neither the pace nor the tokens/s could show
    (docs/control.md). Only without a door: with one, the door refuses what would be late, and the queue it
    leaves says nothing of the batch."""
    late = w.ttft.count > 0 and w.ttft.share_at_most(slo.ttft_seconds) < TTFT_ON_TIME
    return late and settled and past_the_peak(state.peak, state.limit, w, FLAT_SHARE)


def one_slot(state: State, door: bool) -> str | None:
    """Why growth is one slot a tick here, or None where it is not: on a prefill-bound mix, or on an engine that
    has shown a fall where no ``door`` (the queued-token cap) stands beside the limit."""
    if prefill_bound(state.capacity):
        return f"a prefill-bound mix ({state.capacity.demand.prefill_share():.0%} prompt tokens)"
    if state.ceiling is not None and not door:
        return f"tokens/s fell at a limit of {state.ceiling} before (no door to shed a backlog)"
    return None


def batch_served(w: Window) -> float:
    """The batch that made the window's tokens: tokens/s x the mean gap between them (each request in decode gives
    one token a step); NaN with no gap. The running gauge is the batch at the window's end, not during it."""
    return w.tokens_per_second * w.itl.mean if w.itl.count > 0 else math.nan


def past_the_peak(peak: Peak | None, limit: int, w: Window, share: float = 1.0) -> bool:
    """Whether a window at ``limit`` is past the throughput peak: its batch over PEAK_BATCH_SPAN times the peak's,
    serving under ``share`` of the peak's tokens/s, at a limit above the peak's batch (rounded up, as a move
    rounds it) and above a limit that bound the peak (a batch under it is that limit's, less the turnover: at
    a binding 12 a real vLLM's peak was a batch of 10.2, and windows at 12 serving less are noise), from a peak
    of MIN_PEAK_BATCH or more."""
    if peak is None or peak.batch < MIN_PEAK_BATCH or max(math.ceil(peak.batch), peak.limit) >= limit:
        return False
    return batch_served(w) > PEAK_BATCH_SPAN * peak.batch and w.tokens_per_second < share * peak.tokens_per_second


def burst(capacity: Capacity | None, w: Window) -> bool:
    """Whether requests arrived in the window at over BURST times their average rate over the last
    ``demand_seconds`` (the window's own included); not before the capacity model has a window."""
    average = math.nan if capacity is None else capacity.demand.arrived_per_second()
    return not math.isnan(average) and w.arrived_per_second > BURST * average


def prefill_bound(capacity: Capacity | None) -> bool:
    """Whether the engine's mix is prefill-bound: prompt tokens PREFILL_BOUND or more of what it processed over
    the last ``demand_seconds`` (unknown before the capacity model has a window: not bound)."""
    share = math.nan if capacity is None else capacity.demand.prefill_share()
    return not math.isnan(share) and share >= PREFILL_BOUND


def holding(state: State, now: float, tuning: Tuning) -> bool:
    """Whether the law holds the limit where ``past_peak`` brought it, neither growing nor stepping down
    (``keep_up``): while the fall is remembered, with no ``door`` beside the limit, and the engine serving short
    of what is asked. Its backlog drains only at the peak, and near it tokens/s are too flat for a window to
    tell one slot from the next: steps either way only walk in the noise, away from the batch the fall showed."""
    return remembered(state, now) and not tuning.door and short(state, tuning)


def remembered(state: State, now: float) -> bool:
    """Whether a fall's ceiling still holds: ``past_peak`` cut less than ``peak_seconds`` ago."""
    return state.ceiling is not None and now < state.ceiling_until


def short(state: State, tuning: Tuning) -> bool:
    """Whether the engine serves under ``keep_up`` x what is asked of it (control/capacity.py): the queue grows,
    or would at the next burst. Not judged with ``keep_up`` None, or before the capacity model has a window."""
    return tuning.keep_up is not None and state.capacity is not None and state.capacity.short(tuning.keep_up)


def _keep_up(state: State, pace: float, settled: bool, dwelt: float, now: float, slo: Slo,
             tuning: Tuning) -> tuple[bool, bool]:  # fmt: skip
    """(step down now, no growth): falling short of what is asked (control/capacity.py), is a smaller batch
    faster? Sure that the pace's slope is over KEEP_UP_SLOPE here, a step once the last step's limit has run
    KEEP_UP_DWELL; over it but unsure, or with no slope at all while the pace stops growth, a step every
    KEEP_UP_PROBE all the same: holding still on one limit, the slope learns nothing, and the queue grows.
    ``dwelt``: how long the window ran at this limit."""
    if not short(state, tuning):
        return False, False
    capacity = state.capacity
    slope = capacity.slope.elasticity(state.limit)
    past = slope is not None and slope[0] > KEEP_UP_SLOPE
    if slope is not None and slope[0] - slope[1] > KEEP_UP_SLOPE:
        return dwelt >= KEEP_UP_DWELL, True
    bound = not math.isnan(pace) and pace >= tuning.headroom * slo.tpot_seconds
    return (past or (slope is None and bound)) and settled and now - state.stepped >= KEEP_UP_PROBE, past


def _learn(state: State, w: Window, settled: bool, tuning: Tuning) -> State:
    """The capacity model, aged by the window and fed it: demand always; the pace at the limit when a queue
    stood behind a full batch (prefill then runs at its steady share of each step) that had settled.

    The limit, not the batch inferred from tokens/s: that estimate is noisy, and least squares on a noisy
    regressor flattens the slope (regression dilution), which puts the fitted peak too far out.

    Learned with ``keep_up`` off too: the mix it knows decides whether growth is one slot a tick."""
    capacity = (state.capacity or Capacity()).aged(w.seconds, tuning.slope_seconds, tuning.demand_seconds)
    demand = capacity.demand.observe(w.seconds, w.arrived_per_second * w.seconds,
                                     w.finished_per_second * w.seconds, w.tokens_per_second * w.seconds,
                                     w.prompt_tokens_per_second * w.seconds)  # fmt: skip
    slope = capacity.slope
    full = 0.9 * state.limit <= w.running <= state.limit  # over it, the old batch still drains: not this limit's
    if settled and full and w.waiting > 0 and w.itl.mean > 0:  # no gap seen: a NaN mean
        slope = slope.observe(state.limit, w.itl.mean, w.kv_usage)
    return replace(state, capacity=Capacity(slope, demand))


def _remember_peak(state: State, batch: float, tokens_per_second: float, bound: int) -> State:
    """The throughput peak: a higher rate anywhere replaces it; seen again at its batch, it is averaged.

    It is never forgotten by age alone: a peak learned again at a batch past the real one would let the
    law grow on and never come back. When the mix changes, re-measuring at the peak's batch corrects it.
    ``bound``: the limit that bound the window's batch, 0 where none did.
    """
    peak = state.peak
    if peak is not None and abs(batch - peak.batch) <= (PEAK_BATCH_SPAN - 1) * peak.batch:
        rate = (peak.tokens_per_second + tokens_per_second) / 2
        return replace(state, peak=Peak(peak.batch, rate, min(peak.limit, bound)))
    if peak is None or tokens_per_second > peak.tokens_per_second:
        return replace(state, peak=Peak(batch, tokens_per_second, bound))
    return state


def decode_pace(w: Window, tuning: Tuning) -> float:
    """The decode pace the window shows: the mean gap between tokens, or a quantile of the gaps."""
    return w.itl.mean if tuning.pace_quantile is None else w.itl.quantile(tuning.pace_quantile)


def _move(state: State, target: int, hold_until: float, reason: str, tuning: Tuning, now: float) -> Decision:
    step = max(1, math.floor(state.limit * tuning.max_step))
    bounded = min(max(target, state.limit - step), state.limit + step)
    limit = tuning.clamp(bounded)
    if limit == state.limit:
        return Decision(state, reason)
    moved = replace(state, limit=limit, hold_until=hold_until if limit < state.limit else 0.0, since=now, below=0)
    return Decision(moved, reason)
