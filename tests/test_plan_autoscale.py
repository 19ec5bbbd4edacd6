"""The scaling signal replayed (plan/autoscale.py): the rules' arithmetic on a fleet's samples, pure, and a fleet
that follows it in simulated time. The rules themselves are checked by promtool (alerts/tests/scaling.test.yml)."""

from __future__ import annotations

import random

from batchlens.goodput import Slo
from batchlens.plan.autoscale import Sample, ScalingSettings, Signal, replay_autoscaled
from batchlens.plan.search import Profile
from batchlens.replay.policies import Static
from batchlens.replay.traces import TraceRequest

SETTINGS = ScalingSettings(headroom=0.2, up_seconds=180, down_seconds=900, evaluation_seconds=15)


def run_signal(rates: list[tuple[float, float, bool]], replicas: int = 2) -> list[tuple[float, int]]:
    """Feed a deployment whose arrivals per second are ``rate`` until ``end``, each replica serving 5/s at most
    (``saturated``: a queue held all the while), its replicas what the signal wants at once; the desired replicas
    at each evaluation, as (t, desired)."""
    signal, t, arrived, served, out = Signal(SETTINGS), 0.0, 0.0, 0.0, []
    for end, rate, saturated in rates:
        while t < end:
            t += 15
            arrived += rate * 15
            served += min(rate, 5 * replicas) * 15
            sample = Sample(t, round(arrived), 0, round(arrived - served), 3 if saturated else 0, replicas)
            replicas = signal.evaluate(sample)
            out.append((t, replicas))
    return out


def desired_at(timeline: list[tuple[float, int]], t: float) -> int:
    return next(d for when, d in timeline if when >= t)


def test_the_signal_rises_within_the_up_window_ignores_a_burst_and_falls_after_the_down_window() -> None:
    timeline = run_signal([(300, 10, True), (360, 30, True), (1200, 10, True), (1500, 25, True),
                           (2700, 5, False)])  # fmt: skip
    assert desired_at(timeline, 290) == 3, "10/s x 1.2 over 5 per replica: 3 (from the 2 serving)"
    assert max(d for t, d in timeline if 300 <= t <= 1200) == 3, "a one-minute burst moves nothing"
    assert desired_at(timeline, 1200 + 60 + 180) == 6, "25/s: 6, within the up window of the step"
    assert desired_at(timeline, 1500 + 900 - 30) == 6, "after the fall, the most of the down window holds"
    assert desired_at(timeline, 1500 + 900 + 90) == 2, "then 5/s x 1.2 / 5: 2"


def test_no_capacity_measured_no_move() -> None:
    timeline = run_signal([(900, 30, False)])
    assert {d for _, d in timeline} == {2}, "an unsaturated deployment's capacity is unknown: it stays"


def test_a_fleet_on_the_signal_grows_after_a_step_and_gives_the_replicas_back_after_it() -> None:
    rng, trace, t = random.Random(3), [], 0.0
    while t < 1500:
        t += rng.expovariate(1.0 if t < 300 or t > 700 else 9.0)
        trace.append(TraceRequest(t, rng.randint(1500, 3000), rng.randint(20, 60)))
    settings = ScalingSettings(up_seconds=60, down_seconds=300, startup_seconds=60)
    profile = Profile("h100", "dense-7b")
    run = replay_autoscaled(trace, lambda: profile.engine(64), Static, Slo(2.0, 0.1), settings)
    asked = next(t for t, _, desired in run.timeline if desired > 1)
    served = next(t for t, serving, _ in run.timeline if serving > 1)
    assert 300 < asked < 700 and served == asked + settings.startup_seconds, run.timeline
    assert run.timeline[-1][1] == 1 and run.timeline[-1][0] > 700 + settings.down_seconds - 60, run.timeline
    assert run.gpu_hours < run.most * run.judgement.seconds / 3600, "not the most replicas all the while"
