"""Batch-limit policies a replay can run: how the engine's admission limit is chosen, tick by tick. Pure.

``default`` is vLLM as shipped: the limit is the capacity (max_num_seqs) and
never moves. ``static:N`` holds N. ``adaptive`` is the controller's law
(control/law.py) fed from the engine's /metrics text, exactly what it reads
live: a policy sees only what it could see live (:class:`Signals`), never the
simulator's internals. ``admit`` is vLLM's default limit with the controller's
second knob, the queued-token cap (control/admission.py), and
``adaptive+admit`` both knobs; vLLM's own door applies the cap (queued_caps.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Protocol

from batchlens.config import Control
from batchlens.control.admission import AdmissionSettings, Saturated, saturated
from batchlens.control.door import DoorState, admit
from batchlens.control.law import State, Tuning, decide
from batchlens.control.pid import Gains, PidState, decide_pid
from batchlens.control.signals import EngineSample, read_sample, window
from batchlens.control.steering import tuning as tuning_of
from batchlens.exporter.parser import ExpositionReader
from batchlens.goodput import Slo
from batchlens.predicted_ttft import Backlog, Rates, late_in_queue, predict, refuses


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

    def __init__(self, slo: Slo, tuning: Tuning | None = None, tick_seconds: float = 2.0, *, pid: Gains | None = None,
                 control: Control | None = None):  # fmt: skip
        self.slo, self.tuning, self.pid, self.control = slo, tuning, pid, control
        self.name = "adaptive" if pid is None else "pid"
        self.tick_seconds = tick_seconds if pid is None else pid.period_seconds
        self._state: State | PidState | None = None
        self._previous: EngineSample | None = None
        self._readers = [ExpositionReader()]  # the engine's series parsed once, as live (read_sample)
        self.decisions: dict[str, int] = {}

    def initial(self, capacity: int) -> int:
        if self.control is not None:  # the config's bounds, as live; the start too, where live takes the engine's
            self.tuning = replace(tuning_of(self.control, capacity), start_limit=self.control.start_limit)
        self.tuning = self.tuning or Tuning(max_limit=capacity)
        self.tuning = replace(self.tuning, max_limit=min(self.tuning.max_limit, capacity))
        wanted = self.tuning.start_limit or max(1, self.tuning.max_limit // 8)
        start = min(max(wanted, self.tuning.min_limit), self.tuning.max_limit)
        self._state, self._previous = (State(start) if self.pid is None else PidState(start)), None
        return self._state.limit

    def decide(self, signals: Signals) -> int:
        sample = read_sample(signals.exposition, signals.now, self._readers)
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


class Admitting:
    """A limit policy with the controller's queued-token cap beside it, fed the same /metrics windows.

    ``queued_token_cap`` is the cap in force, which the replay's door applies to each arrival as vLLM does. It moves
    by the hook's own rules (control/door.py), where no hand moves it and nothing restarts.
    """

    wants_metrics = True

    def __init__(self, slo: Slo, limits: Policy, settings: AdmissionSettings | None = None, tick_seconds: float = 2.0):
        self.limits = limits
        self.name = "admit" if limits == Static() else f"{limits.name}+admit"
        self.tick_seconds = limits.tick_seconds if limits.wants_metrics else tick_seconds  # the controller's tick
        self.settings = settings or AdmissionSettings(slo.ttft_seconds)
        self.queued_token_cap: int | None = None  # the door open until the estimate is sure
        self._door = DoorState()
        self._saturated: deque[Saturated] = deque(maxlen=64)
        self._previous: EngineSample | None = None
        self._readers = [ExpositionReader()]  # the engine's series parsed once, as live (read_sample)
        self.decisions: dict[str, int] = {}

    def initial(self, capacity: int) -> int:
        self.queued_token_cap, self._previous, self._door = None, None, DoorState()
        self._saturated.clear()
        start = self.limits.initial(capacity)
        if isinstance(self.limits, Adaptive) and self.limits.pid is None:  # the law grows knowing the door sheds
            self.limits.tuning = replace(self.limits.tuning, door=True)
        return start

    def decide(self, signals: Signals) -> int:
        sample = read_sample(signals.exposition, signals.now, self._readers)
        if self._previous is not None and (seen := saturated(window(self._previous, sample), signals.now)):
            self._saturated.append(seen)
        self._previous = sample
        tick = admit(self._door, now=signals.now, in_force=self.queued_token_cap, history=self._saturated,
                     settings=self.settings, manual_hold_seconds=0.0)  # fmt: skip
        self._door = tick.state.landed(tick.decision.cap) if tick.change else tick.state
        self.queued_token_cap = self._door.cap
        key = f"admission_{tick.decision.reason}"
        self.decisions[key] = self.decisions.get(key, 0) + 1
        limit = self.limits.decide(signals)
        for reason, count in getattr(self.limits, "decisions", {}).items():
            self.decisions[reason] = count
        return limit


class Predicting:
    """An admitting policy with the plugin's per-request door in front of its cap (predicted_ttft.py):
    a request predicted to miss its TTFT by more than ``margin`` of it is shed; the cap stays the backstop (its
    settings say how wide: control/steering.door_settings).

    The replay feeds :attr:`rates` what the API server would see of each step (first tokens, finishes) and asks
    :meth:`refuses` at each arrival that the cap let in."""

    wants_metrics = True

    def __init__(self, slo: Slo, admitting: Admitting, margin: float, second_look: bool = True):
        self.slo, self.admitting, self.margin = slo, admitting, margin
        self.second_look = second_look  # the requests in prefill judged again before each step (Replica.rejudge)
        self.name = admitting.name.replace("admit", "predict")
        self.tick_seconds = admitting.tick_seconds
        self.rates = Rates()

    @property
    def queued_token_cap(self) -> int | None:
        return self.admitting.queued_token_cap

    @property
    def decisions(self) -> dict[str, int]:
        return self.admitting.decisions

    def initial(self, capacity: int) -> int:
        self.rates = Rates()
        return self.admitting.initial(capacity)

    def decide(self, signals: Signals) -> int:
        return self.admitting.decide(signals)

    def refuses(self, prompt_tokens: int, backlog: Backlog, limit: int, waited: float = 0.0) -> bool:
        """``waited``: how long the request has waited already (the replay takes arrivals in at step ends)."""
        prediction = predict(backlog, prompt_tokens, self.rates, limit)
        return refuses(prediction, self.bound - waited)

    def refuses_queued(self, prompts: list[int], waited: list[float], decoding: int, limit: int,
                       step_tokens: int) -> list[int]:  # fmt: skip
        """The door's second look at the requests in prefill (predicted_ttft.late_in_queue): which to refuse."""
        return late_in_queue(prompts, waited, decoding, limit, step_tokens, self.rates, self.bound)

    @property
    def bound(self) -> float:
        """The TTFT past which the door refuses: the SLO's and the margin over it."""
        return self.slo.ttft_seconds * (1 + self.margin)


def oracle_limits(capacity: int) -> list[int]:
    """The static limits an oracle sweep tries first: powers of two up to the capacity, and the capacity."""
    limits, limit = [], 1
    while limit < capacity:
        limits.append(limit)
        limit *= 2
    return [*limits, capacity]
