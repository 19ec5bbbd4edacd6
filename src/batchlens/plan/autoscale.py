"""What the scaling signal would have done: a fleet whose replica count follows ``batchlens:desired_replicas``.
Pure and deterministic, in simulated time.

:class:`Signal` computes the signal as the recording rules do (rules/recording.py, ``scaling_rules``;
docs/scaling.md), from what the fleet shows at each rule evaluation: the arrivals of the last minute (by
conservation, what the balancer sent: what finished, what the door shed and what the engines hold more of),
what a replica served in the minutes the fleet was saturated (its queue held a request on average, or its
door shed; the best of the last hour is its capacity), the headroom, the up window (every evaluation of it
wants more, and it is full) and the down window (the most any evaluation of it wanted).

:func:`replay_autoscaled` runs a fleet on it. A replica the signal adds serves after ``startup_seconds`` (a vLLM
pod's scheduling, image pull, weight load and warm-up) and costs its GPUs from the moment it is asked for; one it
removes takes no new arrival and costs its GPUs until it has drained. The balancer is the fleet's
(plan/fleet.py): it sees the serving replicas only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from batchlens.config import duration_seconds
from batchlens.goodput import Judgement, Slo, judge
from batchlens.plan.fleet import balancer
from batchlens.replay.policies import Policy
from batchlens.replay.simulated import Replica, outcome
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine, SimRequest

MINUTE = 60.0
HOUR = 3600.0


@dataclass(frozen=True)
class ScalingSettings:
    headroom: float = 0.2  # thresholds.scale_headroom
    up_seconds: float = 180.0  # thresholds.scale_up_window
    down_seconds: float = 900.0  # thresholds.scale_down_window
    evaluation_seconds: float = 15.0  # Prometheus' rule evaluation interval
    startup_seconds: float = 120.0  # from asked for to serving
    min_replicas: int = 1
    max_replicas: int = 64


@dataclass(frozen=True)
class Sample:
    """What the fleet shows at an evaluation: its counters (since the start) and gauges."""

    t: float
    arrived: int  # requests the balancer sent
    shed: int  # requests the doors refused (and those too long for the engine)
    unfinished: int  # requests queued and running
    waiting: int  # requests queued
    replicas: int  # serving


class Signal:
    """``batchlens:desired_replicas`` of one deployment, one evaluation per :meth:`evaluate`."""

    def __init__(self, settings: ScalingSettings):
        self.settings = settings
        self._samples: deque[Sample] = deque()
        self._capacities: deque[tuple[float, float]] = deque()  # (t, served per replica at saturation)
        self._capacity: float | None = None  # the last measured, kept when the hour holds none
        self._raw: deque[tuple[float, int]] = deque()
        self.arrivals = math.nan  # requests per second over the last minute, as the last evaluation read them

    def evaluate(self, now: Sample) -> int:
        """The replicas wanted after ``now``; the replicas serving where nothing says otherwise."""
        s = self.settings
        self._samples.append(now)
        while len(self._samples) > 2 and self._samples[1].t <= now.t - MINUTE:
            self._samples.popleft()
        before = self._samples[0]
        if now.t - before.t < MINUTE - 1e-9:  # rate() needs a minute of samples
            return now.replicas
        minute = [x for x in self._samples if x.t > now.t - MINUTE]
        self.arrivals = (now.arrived - before.arrived) / (now.t - before.t)
        shed = now.shed - before.shed
        served = (now.arrived - before.arrived) - shed - (now.unfinished - before.unfinished)
        saturated = sum(x.waiting for x in minute) / len(minute) >= 1 or shed > 0
        if saturated and now.replicas == before.replicas and now.replicas > 0:
            self._capacities.append((now.t, served / (now.t - before.t) / now.replicas))
        while self._capacities and self._capacities[0][0] <= now.t - HOUR:
            self._capacities.popleft()
        if self._capacities:
            self._capacity = max(c for _, c in self._capacities)
        if not self._capacity or self._capacity <= 0:
            return now.replicas  # no capacity measured yet: where it is
        raw = max(1, math.ceil(self.arrivals * (1 + s.headroom) / self._capacity))
        self._raw.append((now.t, raw))
        while self._raw and self._raw[0][0] < now.t - s.down_seconds - 1e-9:
            self._raw.popleft()
        up = [r for t, r in self._raw if t >= now.t - s.up_seconds - 1e-9]
        full = self._raw[0][0] <= now.t - s.up_seconds + 1e-9  # a raw value as old as the window: it is full
        if full and min(up) > now.replicas:
            return min(up)
        if (most := max(r for _, r in self._raw)) < now.replicas:
            return most
        return now.replicas


@dataclass
class ScalingRun:
    judgement: Judgement
    shed: int
    gpu_hours: float
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (t, serving, desired) at each change
    most: int = 0  # the most replicas serving at once

    @property
    def shed_share(self) -> float:
        return self.shed / self.judgement.requests if self.judgement.requests else 0.0


def replay_autoscaled(
    trace: Sequence[TraceRequest],
    make_engine: Callable[[], Engine],
    make_policy: Callable[[], Policy],
    slo: Slo,
    settings: ScalingSettings,
    *,
    start_replicas: int = 1,
    gpus_per_replica: int = 1,
    balancer_name: str = "least-loaded",
    max_model_len: int = 8192,
) -> ScalingRun:
    """Replay ``trace`` on a fleet that starts with ``start_replicas`` serving and follows the signal."""
    if not trace:
        raise ValueError("an empty trace: nothing to replay")
    spread = balancer(balancer_name)

    def replica() -> Replica:
        return Replica(make_engine(), make_policy(), slo, max_model_len=max_model_len, false_sheds=False)

    serving = [replica() for _ in range(max(1, start_replicas))]
    starting: list[tuple[float, Replica]] = []  # (serving from, replica)
    draining: list[Replica] = []
    signal = Signal(settings)
    requests = [SimRequest(str(i), r.prompt_tokens, r.output_tokens, r.t) for i, r in enumerate(trace)]
    arrived = shed = 0
    gpu_seconds, last = 0.0, 0.0
    timeline = [(0.0, len(serving), len(serving))]
    most = len(serving)
    evaluation = settings.evaluation_seconds

    def until(t: float) -> None:
        """Every replica to ``t``; the GPU-seconds of every replica that holds GPUs in between."""
        nonlocal gpu_seconds, last
        for r in (*serving, *draining):  # one starting has nothing to do: its clock is set as it starts serving
            r.advance(t)
        gpu_seconds += (len(serving) + len(starting) + len(draining)) * (t - last) * gpus_per_replica
        last = t
        draining[:] = [r for r in draining if r.busy]  # drained: given back

    def evaluate(t: float) -> None:
        nonlocal most
        until(t)
        for ready, r in list(starting):
            if ready <= t:
                starting.remove((ready, r))
                r.now = max(r.now, t)
                serving.append(r)
        every = [*serving, *draining]
        sample = Sample(t, arrived, shed, sum(r.engine.unfinished for r in every),
                        sum(len(r.engine.waiting) for r in every), len(serving))  # fmt: skip
        desired = min(settings.max_replicas, max(settings.min_replicas, signal.evaluate(sample)))
        planned = len(serving) + len(starting)
        if desired > planned:
            starting.extend((t + settings.startup_seconds, replica()) for _ in range(desired - planned))
        elif desired < len(serving):  # the emptiest go first; those starting are not cancelled
            serving.sort(key=lambda r: r.engine.unfinished)
            draining.extend(serving[: len(serving) - desired])
            del serving[: len(serving) - desired]
        if (len(serving), desired) != timeline[-1][1:]:
            timeline.append((t, len(serving), desired))
        most = max(most, len(serving))

    next_evaluation = evaluation
    for request in requests:
        while next_evaluation <= request.arrival:
            evaluate(next_evaluation)
            next_evaluation += evaluation
        until(request.arrival)
        chosen = serving[spread.pick([r.engine.unfinished for r in serving])]
        chosen.arrive(request)
        arrived += 1
        shed += request.finish_reason in ("shed", "refused")
    while any(r.busy for r in (*serving, *draining)):  # the drain, the signal still evaluated
        evaluate(next_evaluation)
        next_evaluation += evaluation
    seconds = max([r.now for r in serving] + [last])
    judgement = judge([outcome(r) for r in requests], seconds, slo)
    return ScalingRun(judgement, shed, gpu_seconds / HOUR, timeline, most)


@dataclass(frozen=True)
class Compared:
    """A profile's fleet on the signal against the fewest fixed replicas that met the SLO."""

    profile: str
    fixed_replicas: int
    fixed_attainment: float
    fixed_gpu_hours: float
    scaled: ScalingRun
    startup_seconds: float

    def row(self) -> dict:
        s = self.scaled
        return {"profile": self.profile, "fixed_replicas": self.fixed_replicas,
                "fixed_slo_attainment": self.fixed_attainment, "fixed_gpu_hours": self.fixed_gpu_hours,
                "autoscaled_slo_attainment": s.judgement.slo_attainment, "autoscaled_shed_share": s.shed_share,
                "autoscaled_gpu_hours": s.gpu_hours, "autoscaled_most_replicas": s.most,
                "startup_seconds": self.startup_seconds}  # fmt: skip

    def said(self) -> str:
        s = self.scaled
        return (
            f"autoscaled {self.profile} (from 1 replica, {self.startup_seconds:g} s to start, at most {s.most}): "
            f"attained {s.judgement.slo_attainment:.2%}, shed {s.shed_share:.2%}, {s.gpu_hours:.2f} GPU-h; fixed "
            f"{self.fixed_replicas}: attained {self.fixed_attainment:.2%}, {self.fixed_gpu_hours:.2f} GPU-h "
            f"(ratio {s.gpu_hours / self.fixed_gpu_hours:.2f})"
        )


def compare_autoscaled(trace: Sequence[TraceRequest], profile, fixed, make_policy: Callable[[], Policy], slo: Slo,
                       thresholds, *, startup_seconds: float, balancer_name: str, max_replicas: int,
                       max_num_seqs: int, max_model_len: int) -> Compared:  # fmt: skip
    """``profile`` (plan.search.Profile) on the signal, against ``fixed`` (its fewest replicas meeting the SLO)."""
    settings = ScalingSettings(
        thresholds.scale_headroom, duration_seconds(thresholds.scale_up_window),
        duration_seconds(thresholds.scale_down_window), startup_seconds=startup_seconds, max_replicas=max_replicas,
    )  # fmt: skip
    scaled = replay_autoscaled(trace, lambda: profile.engine(max_num_seqs), make_policy, slo, settings,
                               gpus_per_replica=profile.gpus_per_replica, balancer_name=balancer_name,
                               max_model_len=max_model_len)  # fmt: skip
    return Compared(profile.name, fixed.replicas, fixed.slo_attainment, fixed.gpu_hours, scaled, startup_seconds)
