"""`--policy breaker`: today's remediation hook, replayed. Pure.

The same pure state machine `batchlens remediate` runs (remediation/breaker.py),
driven as the deployed stack drives it, from the engine's own /metrics:

- **the alert**: ``VllmP99LatencyBreaker`` fires while more than 1% of the TTFTs
  of the last ``thresholds.p99_window`` were slower than ``thresholds.p99_seconds``
  (the generated rule), evaluated every 15 s (Prometheus' evaluation interval);
- **Alertmanager**: the first firing evaluation notifies at once (group_wait 0s),
  a still-firing alert notifies again every 2 minutes (repeat_interval), and
  the evaluation that finds it gone notifies the resolution;
- **the hook**: every notification and every tick go through the breaker's
  ``on_firing``, ``on_resolved`` and ``on_tick``, with the engine's gauges as the
  admin API would report them.
"""

from __future__ import annotations

from collections import deque

from batchlens.config import Breaker, Thresholds, duration_seconds
from batchlens.control.signals import EngineSample, read_sample
from batchlens.exporter.parser import ExpositionReader
from batchlens.remediation.breaker import EngineState, Observation, on_firing, on_resolved, on_tick
from batchlens.replay.policies import Signals

EVALUATION_SECONDS = 15.0  # Prometheus' evaluation_interval in the provisioned stack
REPEAT_SECONDS = 120.0  # the breaker route's repeat_interval (provisioning/alertmanager)


class BreakerPolicy:
    name = "breaker"
    wants_metrics = True
    tick_seconds = EVALUATION_SECONDS

    def __init__(self, thresholds: Thresholds | None = None, settings: Breaker | None = None):
        self.thresholds, self.settings = thresholds or Thresholds(), settings or Breaker()
        self.window = duration_seconds(self.thresholds.p99_window)
        self.decisions: dict[str, int] = {}

    def initial(self, capacity: int) -> int:
        self._state, self._limit = EngineState(), capacity
        self._samples: deque[EngineSample] = deque()
        self._readers = [ExpositionReader()]  # the engine's series parsed once, as live (read_sample)
        self._firing_since: float | None = None
        self._notified_at = 0.0
        return capacity

    def _slow_ratio(self, now: float) -> float:
        """The share of the window's TTFTs over the threshold, from the bucket at the threshold (an exact bound)."""
        while len(self._samples) > 1 and self._samples[1].time <= now - self.window:
            self._samples.popleft()
        delta = self._samples[-1].ttft.minus(self._samples[0].ttft)
        within = dict(delta.buckets).get(self.thresholds.p99_seconds, 0.0)
        return 1 - within / delta.count if delta.count else 0.0

    def decide(self, signals: Signals) -> int:
        now = signals.now
        self._samples.append(read_sample(signals.exposition, now, self._readers))
        firing = self._slow_ratio(now) > 0.01
        obs = Observation(self._limit, signals.capacity, signals.running, signals.waiting)
        decision = None
        if firing and (self._firing_since is None or now - self._notified_at >= REPEAT_SECONDS):
            self._firing_since = self._firing_since if self._firing_since is not None else now
            self._notified_at = now
            decision = on_firing(self._state, starts_at=self._firing_since, now=now, obs=obs, settings=self.settings)
        elif not firing and self._firing_since is not None:
            decision = on_resolved(self._state, starts_at=self._firing_since, now=now)
            self._firing_since = None
        if decision is not None:
            self._apply(decision)
        self._apply(on_tick(self._state, now=now, settings=self.settings))
        return self._limit

    def _apply(self, decision) -> None:
        self._state = decision.state
        if decision.action != "none":
            self.decisions[decision.action] = self.decisions.get(decision.action, 0) + 1
        if decision.set_limit is not None:
            self._limit = decision.set_limit
