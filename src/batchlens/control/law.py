"""The control law: (state, what the engine did since the last tick) -> the batch limit from now on. Pure.

An SLO-targeted gradient law, after Netflix's Gradient2 and Envoy's adaptive
concurrency, with one change LLM decode forces: inter-token latency rises with
the batch even when nothing queues, so "latency above the no-load latency" is
not congestion here. The law aims at the SLO itself instead of a minimum-RTT
baseline. Each tick, in this order:

1. **Draining.** After a decrease the running batch needs time to come down to
   the new limit; the law holds for ``drain_seconds`` and judges nothing.
2. **Too slow per token.** The decode pace (ITL, the TPOT of the requests in
   flight) is over the SLO: cut the limit by the ratio of the SLO to the pace,
   between x0.5 and x0.9 (fast decrease), and drain.
3. **KV ceiling.** KV usage above ``kv_target`` means preemptions are near:
   the limit comes down to running x kv_target / KV usage.
4. **App-limited.** Fewer than half the limit run and nothing waits: the limit
   is not what binds, so it does not move (it would otherwise creep upward
   with nobody to test it).
5. **Past the throughput peak.** While the batch is full and requests wait,
   the law remembers the limit that served the most tokens/s (for
   ``peak_seconds``: the mix changes). A larger limit serving under
   ``past_peak`` of that goes back to it, and growth stops short of the limit
   that hurt until the peak is forgotten. On an engine whose throughput falls
   past a batch size (KV re-reads thrashing L2, prefill stalls) the pace can
   stay well within the SLO while each step of growth lengthens the queue:
   only tokens/s shows it. A flat throughput is not a fall: under overload a
   bigger batch still admits more requests within their TTFT.
6. **Headroom.** Requests wait behind a full batch and the pace has room under
   the SLO: far below it, double (slow start, bounded by ``max_step``); nearer,
   add sqrt(limit) (slow increase, Envoy's headroom).

A run starts at ``start_limit``, not at the capacity: a burst into an engine
whose gate is wide open ruins every request in flight before the first tick
can react (benchmarks/controller.py measured it: 0.69 of the best static limit
from the capacity, 0.94 to 1.01 from 16).

Every answer is clamped to [min_limit, max_limit] and to a step of at most
``max_step`` times the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from batchlens.control.signals import Window
from batchlens.goodput import Slo


@dataclass(frozen=True)
class Tuning:
    min_limit: int = 1
    max_limit: int = 256
    start_limit: int = 16  # slow start: grow from here with headroom, never open the gate wide on a burst
    pace_quantile: float | None = None  # None: the mean gap (exact, and what TPOT averages); else this quantile
    headroom: float = 0.8  # grow only while the pace is under this share of the SLO
    kv_target: float = 0.9
    drain_seconds: float = 5.0
    max_step: float = 0.5  # a move is at most this share of the limit (and at least 1)
    past_peak: float | None = 0.85  # saturated tokens/s under this share of the peak's, above it: back to it
    peak_seconds: float = 60.0  # a peak (and the ceiling it sets) is forgotten after this: the mix changes

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.max_limit:
            raise ValueError(f"need 1 <= min_limit <= max_limit, got {self.min_limit} and {self.max_limit}")


@dataclass(frozen=True)
class Peak:
    """The most tokens/s seen while the batch was full and requests waited, at which limit, and when."""

    limit: int
    tokens_per_second: float
    at: float


@dataclass(frozen=True)
class State:
    limit: int
    hold_until: float = 0.0
    peak: Peak | None = None
    ceiling: int | None = None  # growth to this limit lowered throughput: do not grow to it again before ...
    ceiling_until: float = 0.0


@dataclass(frozen=True)
class Decision:
    state: State
    reason: str  # drain, pace_over, kv_ceiling, idle, app_limited, past_peak, slow_start, headroom or steady

    @property
    def limit(self) -> int:
        return self.state.limit


def decide(state: State, w: Window, now: float, slo: Slo, tuning: Tuning) -> Decision:
    limit = state.limit
    if now < state.hold_until:
        return Decision(state, "drain")
    pace = decode_pace(w, tuning)
    if not math.isnan(pace) and pace > slo.tpot_seconds:
        cut = min(max(slo.tpot_seconds / pace, 0.5), 0.9)
        return _move(state, math.floor(limit * cut), now + tuning.drain_seconds, "pace_over", tuning)
    if w.kv_usage > tuning.kv_target and w.running > 0:
        ceiling = math.floor(w.running * tuning.kv_target / w.kv_usage)
        if ceiling < limit:
            return _move(state, ceiling, now + tuning.drain_seconds, "kv_ceiling", tuning)
    if w.waiting == 0 and w.running < limit / 2:
        return Decision(state, "idle" if w.running == 0 else "app_limited")
    saturated = w.waiting > 0 and w.running >= 0.9 * limit
    if saturated and tuning.past_peak is not None:
        state = _remember_peak(state, w.tokens_per_second, now, tuning)
        peak = state.peak
        if limit > peak.limit and w.tokens_per_second < tuning.past_peak * peak.tokens_per_second:
            # A bigger batch that serves fewer tokens/s only lengthens the queue (L2 thrashing, prefill
            # stalls): back to the peak's limit, and no growth past it while the peak is remembered.
            state = replace(state, ceiling=limit, ceiling_until=peak.at + tuning.peak_seconds)
            return _move(state, peak.limit, now + tuning.drain_seconds, "past_peak", tuning)
    if saturated and (math.isnan(pace) or pace < tuning.headroom * slo.tpot_seconds):
        # Far below the SLO (slow start): double; near it: + sqrt(limit), Envoy's headroom.
        far = math.isnan(pace) or pace < tuning.headroom * slo.tpot_seconds / 2
        target = 2 * limit if far else limit + math.ceil(math.sqrt(limit))
        if state.ceiling is not None and now < state.ceiling_until:
            target = min(target, state.ceiling - 1)
        return _move(state, target, state.hold_until, "slow_start" if far else "headroom", tuning)
    return Decision(state, "steady")


def _remember_peak(state: State, tokens_per_second: float, now: float, tuning: Tuning) -> State:
    """The saturated throughput peak: a higher rate replaces it, and it is forgotten after peak_seconds."""
    peak = state.peak
    if peak is None or now - peak.at > tuning.peak_seconds or tokens_per_second >= peak.tokens_per_second:
        return replace(state, peak=Peak(state.limit, tokens_per_second, now))
    return state


def decode_pace(w: Window, tuning: Tuning) -> float:
    """The decode pace the window shows: the mean gap between tokens, or a quantile of the gaps."""
    return w.itl.mean if tuning.pace_quantile is None else w.itl.quantile(tuning.pace_quantile)


def _move(state: State, target: int, hold_until: float, reason: str, tuning: Tuning) -> Decision:
    step = max(1, math.floor(state.limit * tuning.max_step))
    bounded = min(max(target, state.limit - step), state.limit + step)
    limit = min(max(bounded, tuning.min_limit), tuning.max_limit)
    if limit == state.limit:
        return Decision(state, reason)
    return Decision(replace(state, limit=limit, hold_until=hold_until if limit < state.limit else 0.0), reason)
