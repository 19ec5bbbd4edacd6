"""The capacity model (control/capacity.py) and the law's keep_up step, pure: known curves, time travel.

No server and no fake: the pace is drawn from stated curves (a fixed part plus a part that grows with the
square of the batch, whose tokens/s peaks where their slope in log-log passes 1), with the KV usage in
proportion to the batch and noise from a seeded Random.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import replace
from random import Random

import pytest

from batchlens.control.capacity import Capacity, Demand, PaceSlope, _inverse
from batchlens.control.law import KEEP_UP_CUT, State, Tuning, decide
from batchlens.control.signals import EngineSample, Histogram, window
from test_control_law import SLO, capacity_of, w

TUNING = Tuning(min_limit=2, max_limit=128, drain_seconds=5.0, past_peak=None)  # keep_up alone


def pace_of(batch: float, fixed: float = 0.01, square: float = 2e-5) -> float:
    """A decode step of ``fixed`` seconds plus ``square`` x batch²: tokens/s peaks at sqrt(fixed / square)."""
    return fixed + square * batch**2


def elasticity_of(batch: float, fixed: float = 0.01, square: float = 2e-5) -> float:
    return 2 * square * batch**2 / pace_of(batch, fixed, square)


def fitted(limits, noise: float = 0.0, seed: int = 1, kv_per_request: float = 0.005) -> PaceSlope:
    rng, slope = Random(seed), PaceSlope()
    for limit in limits:
        context = 1 + rng.uniform(-noise, noise)  # longer or shorter contexts than usual in this window
        pace = pace_of(limit) * (1 + 0.5 * (context - 1)) * (1 + rng.gauss(0, noise / 2))
        slope = slope.observe(limit, pace, kv_per_request * limit * context)
    return slope


@pytest.mark.parametrize("at", [10, 22.4, 30, 40])
def test_the_slope_is_the_curves_own_where_the_law_has_been(at: float) -> None:
    around = [at * f for f in (0.8, 0.9, 1.0, 1.1, 1.2)] * 6
    found = fitted(around).elasticity(at)
    assert found is not None and found[0] == pytest.approx(elasticity_of(at), abs=0.05), found
    noisy = fitted(around * 4, noise=0.2).elasticity(at)
    assert noisy[0] == pytest.approx(elasticity_of(at), abs=0.25) and noisy[1] > 0, "noise: wider, not biased"


def test_the_slopes_standard_error_shrinks_as_one_over_the_root_of_the_windows() -> None:
    around = [40 * f for f in (0.8, 0.9, 1.0, 1.1, 1.2)]
    _, fewer = fitted(around * 16, noise=0.2).elasticity(40)
    _, more = fitted(around * 64, noise=0.2).elasticity(40)
    assert more == pytest.approx(fewer / 2, rel=0.2)


def test_the_context_length_is_told_apart_from_the_batch() -> None:
    """Longer contexts slow a step at the same batch: the KV term takes that, not the batch's slope."""
    rng, slope = Random(3), PaceSlope()
    for _ in range(60):
        limit, context = rng.choice((20, 25, 30)), rng.uniform(0.5, 1.5)
        slope = slope.observe(limit, pace_of(limit) * context**0.5, 0.005 * limit * context)
    assert slope.elasticity(25)[0] == pytest.approx(elasticity_of(25), abs=0.1)


@pytest.mark.parametrize(("running", "learned"), [(36, True), (40, True), (35, False), (41, False), (60, False)])
def test_the_slope_learns_a_full_batch_at_the_limit_not_one_still_draining_from_a_higher_limit(
    running, learned
) -> None:
    """After a cut the old, larger batch drains for a while: its pace belongs to the limit before, not to this one.
    Nor is a batch under 90% of the limit full: its pace is a smaller batch's."""
    state = State(40, capacity=capacity_of(True))
    win = replace(w(running=running, waiting=30, pace=0.042), kv_usage=0.005 * running)
    before = state.capacity.aged(win.seconds, TUNING.slope_seconds, TUNING.demand_seconds).slope.n
    after = decide(state, win, 100, SLO, TUNING).state.capacity.slope.n
    assert after == pytest.approx(before + 1 if learned else before)


@pytest.mark.parametrize(
    ("change", "learned"),
    [
        ({"waiting": 1}, True),
        ({"waiting": 0}, False),  # no queue: the batch is what arrived, not what the limit holds
        ({"itl": Histogram(((math.inf, 1.0),), 0.042)}, True),  # one gap is a pace
        ({"itl": Histogram()}, False),  # no gap seen in the window
        ({"itl": Histogram(((math.inf, 3.0),), 0.0)}, False),  # gaps that sum to nothing: no pace (no log of 0)
    ],
)
def test_the_slope_learns_only_behind_a_queue_from_gaps_that_were_seen(change, learned) -> None:
    state = State(40, capacity=capacity_of(True))
    win = replace(w(running=40, waiting=30, pace=0.042), kv_usage=0.2, **change)
    before = state.capacity.aged(win.seconds, TUNING.slope_seconds, TUNING.demand_seconds)
    after = decide(state, win, 100, SLO, TUNING).state.capacity
    assert after.slope.n == pytest.approx(before.slope.n + 1 if learned else before.slope.n)


def test_a_window_adds_its_rates_times_its_seconds_to_the_demand() -> None:
    state = State(40, capacity=capacity_of(True))
    win = replace(w(running=40, waiting=30, pace=0.042), arrived_per_second=3, finished_per_second=2,
                  prompt_tokens_per_second=500)  # fmt: skip
    before = state.capacity.aged(win.seconds, TUNING.slope_seconds, TUNING.demand_seconds).demand
    after = decide(state, win, 100, SLO, TUNING).state.capacity.demand
    added = (after.arrived - before.arrived, after.finished - before.finished, after.tokens - before.tokens,
             after.prompted - before.prompted)  # fmt: skip
    assert added == pytest.approx((3 * 2.0, 2 * 2.0, win.tokens_per_second * 2.0, 500 * 2.0))


def test_no_slope_before_enough_windows_at_spread_limits_and_it_fades_with_age() -> None:
    assert PaceSlope().elasticity(10) is None
    assert fitted([20, 22] * 4).elasticity(21) is None, "8 windows: too few"
    assert fitted([20, 22] * 5, noise=0.1).elasticity(21) is not None, "10: enough"
    assert fitted([20, 22] * 5).elasticity(21) is None, "KV usage moving with the batch alone: no telling them apart"
    assert fitted([40, 40.2, 40.4] * 10, noise=0.1).elasticity(40) is None, "limits within 2% of each other"
    assert fitted([20] * 30).elasticity(20) is None, "one limit says nothing of the slope"
    faded = fitted([16, 20, 24] * 10).decayed(math.exp(-3))
    assert faded.elasticity(20) is None, "old windows weigh less, and then not enough"


def test_ageing_weighs_every_sum_down_by_its_own_time_constant() -> None:
    capacity = capacity_of(True)
    aged = capacity.aged(60, slope_seconds=60, demand_seconds=120)
    assert aged.slope == capacity.slope.decayed(math.exp(-1)) and aged.demand == capacity.demand.decayed(math.exp(-0.5))
    assert aged.slope.vv == pytest.approx(capacity.slope.vv * math.exp(-1)) and aged.slope.n < capacity.slope.n


def test_the_inverse_pivots_and_judges_singularity_against_the_matrixs_own_scale() -> None:
    assert _inverse([[2.0, 0.0], [0.0, 4.0]]) == [[0.5, 0.0], [0.0, 0.25]]  # a zero under the diagonal is no pivot
    [a, b], [c, d] = _inverse([[2.0, 1.0], [1.0, 2.0]])
    assert [a, b, c, d] == pytest.approx([2 / 3, -1 / 3, -1 / 3, 2 / 3])
    [a, b], [c, d] = _inverse([[2e-13, 0.0], [0.0, 4e-13]])  # small sums (old windows, decayed) are still a fit
    assert [a, b, c, d] == pytest.approx([5e12, 0.0, 0.0, 2.5e12])
    assert _inverse([[1.0, 2.0], [2.0, 4.0]]) is None


def test_a_slope_bending_the_wrong_way_is_noise_and_is_taken_straight() -> None:
    """Pace concave in log-log (the slope falling with the batch) is no engine's: fit without the bend."""
    slope = PaceSlope()
    for limit in (10, 20, 40, 80) * 5:
        slope = slope.observe(limit, 0.02 * math.log(limit) ** 0.5, 0.001 * limit)  # grows ever slower
    straight = slope.elasticity(10)[0]
    assert straight == pytest.approx(slope.elasticity(80)[0]), "one slope everywhere"


def test_demand_is_nan_before_any_window_and_exact_after_a_short_one() -> None:
    empty = Demand()
    assert all(
        math.isnan(x) for x in (empty.arrived_per_second(), empty.asked(), empty.served(), empty.prefill_share())
    )
    assert Capacity().said(40) == "serving nan of nan tokens/s asked, pace slope unknown at 40"
    young = Demand().observe(0.5, arrived=2, finished=1, tokens=50)  # no prompt tokens told: none counted
    assert (young.arrived_per_second(), young.asked(), young.served(), young.prefill_share()) == (4, 200, 100, 0)
    assert Demand(tokens=0.5, prompted=0.25).prefill_share() == pytest.approx(1 / 3)  # decayed sums under one


def test_demand_is_arrivals_times_the_tokens_a_request_takes() -> None:
    demand = Demand().observe(10, arrived=50, finished=40, tokens=4000)
    assert demand.asked() == pytest.approx(5 * 100) and demand.served() == pytest.approx(400)
    assert math.isnan(Demand().observe(10, 5, 0, 0).asked()), "no finished request yet: no tokens per request"
    assert Capacity(demand=demand).short(1.15) and not Capacity(demand=demand).short(0.8)
    later = window(
        EngineSample(0, 10, 5, 0.3, 0, 0, Histogram(), Histogram(), finished=100, rejected=3),
        EngineSample(2, 12, 9, 0.3, 500, 0, Histogram(), Histogram(), finished=104, rejected=5),
    )
    assert later.arrived_per_second == pytest.approx((4 + 2 + 2 + 4) / 2), "finished + refused + grown"


def test_the_prefill_share_is_the_prompt_tokens_of_all_processed_and_ages_with_the_demand() -> None:
    assert math.isnan(Demand().prefill_share()), "nothing processed yet: unknown, not 0"
    code = Demand().observe(10, arrived=5, finished=5, tokens=140, prompted=10_000)  # prompts of 2000, answers of 28
    assert code.prefill_share() == pytest.approx(10_000 / 10_140)
    aged = code.decayed(0.5).observe(10, arrived=5, finished=5, tokens=800, prompted=3000)  # a chat minute
    assert aged.prefill_share() == pytest.approx(8000 / (8000 + 870)), "old windows count for less"


@pytest.mark.parametrize(
    ("state", "win", "limit", "reason"),
    [
        # short of demand, and surely past the peak (slope 1.5 at 40): down a step, then drain
        (State(40, capacity=capacity_of(True)), w(running=40, waiting=30, pace=0.042), 34, "keep_up"),
        # ... not before the last step's limit has run KEEP_UP_DWELL
        (State(40, since=95, capacity=capacity_of(True)), w(running=40, waiting=30, pace=0.042), 40, "steady"),
        # ... nor while a fall is remembered (past_peak cut from 48) with no door beside the limit: the law holds
        # the batch the fall showed, as growth is held there (control/law.py's holding)
        (
            State(40, ceiling=48, ceiling_until=150, capacity=capacity_of(True)),
            w(running=40, waiting=30, pace=0.042),
            40,
            "steady",
        ),
        # serving what is asked with the margin: a bigger batch takes in bursts, so headroom may grow it
        (State(40, capacity=capacity_of(False)), w(running=40, waiting=30, pace=0.042), 47, "headroom"),
        # short, but before the peak (slope under 1 at the small limits it has run): growth serves more
        (
            State(12, capacity=capacity_of(True, (8, 10, 12, 14) * 5)),
            w(running=12, waiting=30, pace=0.013),
            18,
            "slow_start",
        ),
    ],
)
def test_keep_up_case_by_case(state: State, win, limit: int, reason: str) -> None:
    decision = decide(state, replace(win, kv_usage=0.005 * state.limit), 100, SLO, TUNING)
    assert (decision.limit, decision.reason) == (limit, reason)
    if state.ceiling is not None:  # with a door beside the limit, which sheds the backlog, keep_up steps as ever
        door = decide(state, replace(win, kv_usage=0.005 * state.limit), 100, SLO, replace(TUNING, door=True))
        assert (door.limit, door.reason) == (34, "keep_up")
    if reason == "keep_up":
        assert limit == math.floor(state.limit * KEEP_UP_CUT) and decision.state.hold_until == 100 + 5.0
        said = decision.state.capacity.said(state.limit)  # the log line's facts
        assert re.fullmatch(r"serving 99\d of 19\d\d tokens/s asked, pace slope 1\.\d\d ± 0\.\d\d at 40", said), said


def cliff(limit: int, rng: Random, asked: float = 1500.0):
    """An engine past its capacity whose tokens/s peaks at 22 running (1100/s) and falls slowly past it
    (903/s at 44, 730/s at 60), the pace within the SLO up to 67: only throughput says where to stop. A
    request takes 100 tokens; 15 arrive each second, more than any batch serves."""
    running = limit
    context = rng.uniform(0.8, 1.2)
    pace = pace_of(running) * (1 + 0.5 * (context - 1)) * (1 + rng.gauss(0, 0.03))
    tps = running / pace
    return replace(w(running=running, waiting=200, pace=pace, tps=tps), kv_usage=0.005 * running * context,
                   finished_per_second=tps / 100, arrived_per_second=asked / 100)  # fmt: skip


def test_past_capacity_it_settles_near_the_throughput_peak_not_at_the_pace_bound() -> None:
    rng, state, now, seen = Random(7), State(8), 0.0, []
    for _ in range(400):
        now += 2.0
        state = decide(state, cliff(state.limit, rng), now, SLO, TUNING).state
        seen.append(state.limit)
    tail = seen[-200:]
    # The peak is 22, and the slope passes KEEP_UP_SLOPE (1.1) at 25; tokens/s within 5% of the peak's
    # from 15 to 33.
    assert 15 <= statistics.median(tail) <= 33, tail
    served = statistics.mean(t / pace_of(t) for t in tail)
    assert served >= 0.93 * (22.4 / pace_of(22.4)), served
    blind = State(8)
    for _ in range(400):
        blind = decide(blind, cliff(blind.limit, rng), now, SLO, replace(TUNING, keep_up=None)).state
    assert blind.limit > 50, "the plant is one where the pace alone grows past the peak"
