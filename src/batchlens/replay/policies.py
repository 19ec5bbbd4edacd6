"""Batch-limit policies a replay can run: how the engine's admission limit is chosen, tick by tick. Pure.

``default`` is vLLM as shipped: the limit is the capacity (max_num_seqs) and
never moves. ``static:N`` holds N. ``adaptive`` is the controller's law
(control/law.py) fed from the engine's /metrics text, exactly what it reads
live: a policy sees only what it could see live (:class:`Signals`), never the
simulator's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from batchlens.config import Thresholds
from batchlens.control.law import State, Tuning, decide
from batchlens.control.pid import Gains, PidState, decide_pid
from batchlens.control.signals import EngineSample, read_sample, window
from batchlens.goodput import Slo


@dataclass(frozen=True)
class Signals:
    """What a policy sees at a tick: the engine's gauges, as its /metrics would show them."""

    now: float
    limit: int
    capacity: int
    running: int
    waiting: int
    kv_usage: float
    exposition: str = ""  # the engine's /metrics text, for the policies that read it (wants_metrics)


class Policy(Protocol):
    name: str
    tick_seconds: float  # how often it decides
    wants_metrics: bool  # whether it reads Signals.exposition (rendering it costs the replay time)

    def initial(self, capacity: int) -> int:
        """The limit the run starts with."""

    def decide(self, signals: Signals) -> int:
        """The limit from this tick on."""


@dataclass(frozen=True)
class Static:
    """A fixed limit; ``None`` is the capacity, which is vLLM's default."""

    limit: int | None = None
    tick_seconds: float = 1.0
    wants_metrics: bool = False

    @property
    def name(self) -> str:
        return "default" if self.limit is None else f"static:{self.limit}"

    def initial(self, capacity: int) -> int:
        if self.limit is not None and self.limit > capacity:
            raise ValueError(f"{self.name} is above the engine's capacity (max_num_seqs {capacity})")
        return capacity if self.limit is None else self.limit

    def decide(self, signals: Signals) -> int:
        return signals.limit


class Adaptive:
    """A control law on the engine's own metrics, every ``tick_seconds``: ``adaptive`` is the gradient law
    the controller ships (control/law.py); ``pid`` is the article's PID (control/pid.py), every 30 s."""

    wants_metrics = True

    def __init__(self, slo: Slo, tuning: Tuning | None = None, tick_seconds: float = 2.0, *, pid: Gains | None = None):
        self.slo, self.tuning, self.pid = slo, tuning, pid
        self.name = "adaptive" if pid is None else "pid"
        self.tick_seconds = tick_seconds if pid is None else pid.period_seconds
        self._state: State | PidState | None = None
        self._previous: EngineSample | None = None
        self.decisions: dict[str, int] = {}

    def initial(self, capacity: int) -> int:
        self.tuning = self.tuning or Tuning(max_limit=capacity)
        self.tuning = replace(self.tuning, max_limit=min(self.tuning.max_limit, capacity))
        wanted = self.tuning.start_limit or max(1, self.tuning.max_limit // 8)
        start = min(max(wanted, self.tuning.min_limit), self.tuning.max_limit)
        self._state, self._previous = (State(start) if self.pid is None else PidState(start)), None
        return self._state.limit

    def decide(self, signals: Signals) -> int:
        sample = read_sample(signals.exposition, signals.now)
        if self._previous is not None:
            seen = window(self._previous, sample)
            if self.pid is None:
                decision = decide(self._state, seen, signals.now, self.slo, self.tuning)
                self._state, reason = decision.state, decision.reason
            else:
                self._state, reason = decide_pid(self._state, seen, self.slo, self.tuning, self.pid)
            self.decisions[reason] = self.decisions.get(reason, 0) + 1
        self._previous = sample
        return self._state.limit


POLICIES = ("default", "static:N", "breaker", "adaptive", "pid")


def parse_policy(text: str, slo: Slo, thresholds: Thresholds | None = None) -> Policy:
    """``default``, ``static:N``, ``breaker``, ``adaptive`` or ``pid``; ValueError naming what exists otherwise."""
    name, _, arg = text.strip().partition(":")
    if name == "adaptive" and not arg:
        return Adaptive(slo)
    if name == "pid" and not arg:
        return Adaptive(slo, pid=Gains())
    if name == "breaker" and not arg:
        from batchlens.replay.breaker_policy import BreakerPolicy  # it builds on this module's Signals

        return BreakerPolicy(thresholds)
    if name == "default" and not arg:
        return Static()
    if name == "static":
        try:
            limit = int(arg)
        except ValueError:
            limit = 0
        if limit < 1:
            raise ValueError(f"static:N takes a batch limit N of 1 or more, got {text!r}")
        return Static(limit)
    raise ValueError(f"unknown policy {text!r}: one of {', '.join(POLICIES)}")


def oracle_limits(capacity: int) -> list[int]:
    """The static limits an oracle sweep tries first: powers of two up to the capacity, and the capacity."""
    limits, limit = [], 1
    while limit < capacity:
        limits.append(limit)
        limit *= 2
    return [*limits, capacity]
