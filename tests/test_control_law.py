"""The controller's signals and law, pure: table-driven cases with time travel, properties, and convergence.

No server and no fake: signals are read from a real vLLM 0.32 exposition (tests/data) and from texts
rendered by prometheus_client; the law is a pure function. Its plant in the convergence test is a
small model of decode (pace rising with the running batch), stated below.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import statistics
from dataclasses import replace
from random import Random

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from batchlens.config import Control
from batchlens.control.capacity import Capacity, Demand, PaceSlope
from batchlens.control.law import (
    KEEP_UP_CUT,
    REASONS,
    Peak,
    State,
    Tuning,
    decide,
    decode_pace,
    one_slot,
    prefill_bound,
)
from batchlens.control.pid import Gains, PidState, decide_pid
from batchlens.control.signals import Histogram, NotFinite, Window, read_sample, window
from batchlens.control.steering import Steering, bounds_said, steer, tuning
from batchlens.goodput import Slo

SLO = Slo(0.5, 0.1)
ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, math.inf)


def itl(gaps: dict[float, float]) -> Histogram:
    """A cumulative ITL histogram with ``gaps`` observations per bucket bound."""
    total, out = 0.0, []
    for bound in ITL_BOUNDS:
        total += gaps.get(bound, 0.0)
        out.append((bound, total))
    return Histogram(tuple(out))


def w(*, running: float, waiting: float = 0, kv: float = 0.3, pace: float | None = None, n: int = 100,
      tps: float | None = None, late: int = 0) -> Window:  # fmt: skip
    """A window in which every gap between tokens was ``pace`` (in that bucket, and summing to n x pace).

    Its tokens/s is ``tps``, by default what ``running`` requests give at that pace: the batch the law
    infers from a window is tokens/s x the mean gap. ``late``: of its 100 first tokens, how many came past the
    SLO's TTFT (none: no first token came)."""
    tps = tps if tps is not None else running / pace if pace else 1000.0
    bound = next((b for b in ITL_BOUNDS if pace is not None and pace <= b), None)
    gaps = itl({bound: n} if bound else {})
    ttft = itl({SLO.ttft_seconds: 100 - late, math.inf: late}) if late else Histogram()
    return Window(2.0, running, waiting, kv, tps, 0.0, ttft, Histogram(gaps.buckets, n * (pace or 0.0)))


def test_histograms_give_prometheus_quantiles_and_survive_a_restart() -> None:
    h = itl({0.05: 50, 0.1: 50})
    assert h.count == 100 and h.quantile(0.5) == 0.05 and h.quantile(0.9) == pytest.approx(0.095)
    assert math.isnan(Histogram().quantile(0.9)) and itl({math.inf: 5}).quantile(0.5) == 1.0
    restarted = itl({0.05: 3})
    assert restarted.minus(h) == restarted, "counters that went down: the engine restarted, take them as they are"


def test_a_real_vllm_exposition_reads_into_a_sample(vllm_exposition: str) -> None:
    sample = read_sample(vllm_exposition, time=10.0)
    assert sample.ttft.count > 0 and sample.itl.count > 0 and sample.generated_tokens > 0
    assert sample.itl.buckets[-1][0] == math.inf and 0 <= sample.kv_usage <= 1
    assert 0 < sample.itl.mean < sample.itl.buckets[-2][0], "the exact mean gap, from _sum over _count"
    later = read_sample(vllm_exposition, time=12.0)
    assert window(sample, later).itl.count == 0 and window(sample, later).tokens_per_second == 0


@pytest.mark.parametrize("value", ["NaN", "+Inf"])
@pytest.mark.parametrize("series", ["vllm:num_requests_waiting{", "vllm:prompt_tokens_total{", "vllm:time_to_first"])
def test_a_nan_or_infinite_figure_is_no_sample(vllm_exposition: str, series: str, value: str) -> None:
    """The text format allows NaN and +Inf in any sample; a rate or a cap computed from one raises (int(nan)) or
    overflows (ceil(inf)) deep in the law or the door, so the reading fails instead, as one that does not parse."""
    lines = vllm_exposition.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(series))
    lines[at] = lines[at].rsplit(" ", 1)[0] + " " + value
    with pytest.raises(NotFinite, match=f"is {value.lstrip('+').lower()}"):
        read_sample("\n".join(lines) + "\n", time=10.0)


@pytest.mark.parametrize("le", ["abc", "NaN"])
def test_a_bucket_with_no_bound_is_no_sample(vllm_exposition: str, le: str) -> None:
    """A ValueError of float() would escape the tick (and leave the door's cap in force); a NaN bound would make
    every percentile NaN. Either is a reading that fails, counted as one that does not parse."""
    lines = vllm_exposition.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("vllm:time_to_first_token_seconds_bucket{"))
    lines[at] = re.sub(r'le="[^"]*"', f'le="{le}"', lines[at])
    with pytest.raises(NotFinite, match=f"le='{le}'"):
        read_sample("\n".join(lines) + "\n", time=10.0)


@pytest.mark.parametrize("cores", [("NaN",), ("NaN", "0.9"), ("0.9", "NaN")])
def test_vllms_nan_kv_usage_before_it_has_blocks_is_no_usage(vllm_exposition: str, cores: tuple[str, ...]) -> None:
    """A core at NaN is a core with no blocks yet: it neither hides another core's usage nor reads as any."""
    lines = vllm_exposition.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("vllm:kv_cache_usage_perc{"))
    series = lines[at].rsplit(" ", 1)[0]
    lines[at : at + 1] = [series.replace('engine="0"', f'engine="{n}"') + " " + usage for n, usage in enumerate(cores)]
    want = 0.0 if len(cores) == 1 else 0.9
    assert read_sample("\n".join(lines) + "\n", time=10.0).kv_usage == want, "a starting engine is steered"


TUNING = Tuning(min_limit=2, max_limit=64, drain_seconds=5.0)
PEAK = Peak(32, 1000.0)  # 1000 tokens/s from a batch of 32: a peak carries no time, so age never forgets it
# A minute of demand under what is served (so keep_up stays out), with 40 prompt tokens to a generated one (the
# Azure code trace's mix) and with 4 (chat).
PREFILL_MIX = Capacity(demand=Demand().observe(60, arrived=300, finished=600, tokens=60_000, prompted=2_400_000))
CHAT_MIX = Capacity(demand=Demand().observe(60, arrived=300, finished=600, tokens=60_000, prompted=240_000))
# The same mix asked of the engine at twice what it serves: keep_up's "short"
SHORT_CHAT = Capacity(demand=Demand().observe(60, arrived=1200, finished=600, tokens=60_000, prompted=240_000))

# The pace over the SLO in a window whose requests arrived at 12/s, against CHAT_MIX's 5/s.
OVER_IN_A_BURST = replace(w(running=32, pace=0.15), arrived_per_second=12)


@pytest.mark.parametrize(
    ("state", "win", "now", "limit", "reason"),
    [
        # the pace over the SLO: cut by the ratio, at least x0.5, and drain
        (State(32), w(running=32, pace=0.15), 100, 21, "pace_over"),  # the mean gap 0.15: x 0.1 / 0.15
        (State(32), w(running=32, pace=0.5), 100, 16, "pace_over"),
        # ... but not on the first window after growth (the limit grew at 99): its newcomers' prefills stall
        # the steps, a passing cost; the window after is judged
        (State(32, since=99), w(running=32, waiting=9, pace=0.4), 100, 32, "steady"),
        (State(32, since=99), w(running=32, waiting=9, pace=0.4), 104, 16, "pace_over"),
        (State(32, since=99, hold_until=129), w(running=32, pace=0.4), 100, 16, "pace_over"),  # after a cut: no
        # ... nor on a window whose arrivals came at over BURST x their average rate (5/s here): the burst's
        # prefills stall the steps for a moment (the published profile's bursty load: 144 -> 77 on one such
        # window at 187 ms, whose next ran at 25 ms); the next window over is cut, as is one of usual arrivals
        (State(32, capacity=CHAT_MIX), OVER_IN_A_BURST, 100, 32, "steady"),
        (State(32, capacity=CHAT_MIX, over=1), OVER_IN_A_BURST, 100, 21, "pace_over"),
        (State(32, capacity=CHAT_MIX), replace(OVER_IN_A_BURST, arrived_per_second=6), 100, 21, "pace_over"),
        # draining: judge nothing until hold_until
        (State(16, hold_until=105), w(running=30, pace=0.5), 103, 16, "drain"),
        (State(16, hold_until=105), w(running=16, waiting=9, pace=0.05), 106, 20, "headroom"),
        # the drain ends once the batch is down to the limit, and at the latest at hold_until
        (State(16, hold_until=105), w(running=16, waiting=9, pace=0.05), 103, 20, "headroom"),
        (State(29, hold_until=130), w(running=57, pace=0.17), 104, 29, "drain"),  # the 57 -> 29 -> 15
        (State(16, hold_until=105), w(running=30, pace=0.5), 106, 8, "pace_over"),  # still over, but the bound
        # KV nearly full: down to running x 0.95 / usage; at 0.93, under kv_target, the queue may grow it
        (State(40), w(running=40, kv=0.98, pace=0.05), 100, 38, "kv_ceiling"),
        (State(40), w(running=40, waiting=5, kv=0.93, pace=0.05), 100, 47, "headroom"),
        # nothing waits and the batch is half empty: the limit is not what binds
        (State(32), w(running=10, pace=0.05), 100, 32, "app_limited"),
        (State(32), w(running=0), 100, 32, "idle"),
        # a queue behind a full batch with room in the pace: + sqrt(limit)
        (State(16), w(running=16, waiting=5, pace=0.05), 100, 20, "headroom"),
        # a queue behind a batch under 90% of the limit: the limit is not what binds; at 90% it is
        (State(32), w(running=20, waiting=5, pace=0.05), 100, 32, "steady"),
        (State(20), w(running=18, waiting=5, pace=0.05), 100, 25, "headroom"),
        # a queue, but the pace is near the SLO: stay
        (State(16), w(running=16, waiting=5, pace=0.095), 100, 16, "steady"),
        # ... on a prefill-bound mix, one slot at a time: the step's prompts would stall every decode at once
        (State(32, capacity=PREFILL_MIX), w(running=32, waiting=12, pace=0.02), 100, 33, "headroom"),
        (State(32, capacity=CHAT_MIX), w(running=32, waiting=12, pace=0.02), 100, 48, "slow_start"),
        # bounds: never above max_limit, never below min_limit
        (State(64), w(running=64, waiting=50, pace=0.02), 100, 64, "slow_start"),
        (State(8), w(running=8, waiting=50, pace=0.02), 100, 12, "slow_start"),  # doubling, within max_step
        (State(2), w(running=2, pace=0.9), 100, 2, "pace_over"),
        # saturated, and a bigger batch served fewer tokens/s than the peak's limit did, twice: back to it
        (State(48, peak=PEAK, below=1), w(running=48, waiting=9, pace=0.06, tps=800), 100, 32, "past_peak"),
        (State(48, peak=PEAK), w(running=48, waiting=9, pace=0.06, tps=800), 100, 48, "steady"),  # once: wait
        (State(48, peak=PEAK, below=1), w(running=48, waiting=9, pace=0.05, tps=900), 100, 55, "headroom"),  # <15%
        # a peak seen while this very limit bound (a queue behind a full batch) is the limit's, less the turnover:
        # windows at the same limit serving less are noise, not a fall (a real vLLM's cold start: 12 -> 11, held)
        (
            State(12, peak=Peak(10.2, 1000, limit=12), below=1),
            w(running=12, waiting=30, pace=0.015, tps=760),
            100,
            18,
            "slow_start",
        ),
        # slow start past the peak's batch doubles only while tokens/s keep up with the peak's, within the noise
        # of a window (CLIMB_SHARE): the Azure conversation trace's engine peaked near a batch of 23 (1,036
        # tokens/s) and 32 served 922
        (State(32, peak=Peak(23.2, 1036)), w(running=32, waiting=2, pace=0.03, tps=922), 100, 32, "steady"),
        (State(32, peak=Peak(23.2, 1036)), w(running=32, waiting=2, pace=0.03, tps=1000), 100, 48, "slow_start"),
        (
            State(32, peak=Peak(23.2, 1036), since=99),
            w(running=32, waiting=2, pace=0.03, tps=922),
            100,
            48,
            "slow_start",
        ),  # a window the growth's prefills still weigh on says nothing of tokens/s
        # a peak whose batch is over this limit: back to it would be growth, not a cut (the simulator's e2e
        # once went 36 -> 54 on a window whose inferred batch, 60, overlapped the drain from a larger limit)
        (State(36, peak=Peak(50, 3000), below=1), w(running=36, waiting=10, pace=0.05, tps=1200), 100, 42, "headroom"),
        # a burst of arrivals under the limit (nothing waits) lowers tokens/s with its prefills: not a fall
        (State(135, peak=Peak(79, 2881), below=1), w(running=126, pace=0.062, tps=2067), 100, 135, "steady"),
        # a window that began before the batch settled (the limit moved at 99) says nothing of tokens/s
        (State(48, peak=PEAK, below=1, since=99), w(running=48, waiting=9, pace=0.06, tps=800), 100, 55, "headroom"),
        # ... and, on an engine that has shown a fall, growth one slot at a time: with no door beside the limit,
        # a step back past the peak builds a backlog that an engine this near its capacity never drains
        (State(36, ceiling=40, ceiling_until=155), w(running=36, waiting=9, pace=0.05), 100, 37, "headroom"),
        (State(36, ceiling=40, ceiling_until=99), w(running=36, waiting=9, pace=0.05), 100, 37, "headroom"),
        # ... and none while the fall is remembered and the engine serves short of what is asked: its backlog
        # drains only at the peak (the Azure conversation trace from 600 s at x0.75 regrew 24 -> 31 one slot at
        # a time on flat tokens/s, and the queue of the fall never drained: 0.86 of the best static limit)
        (
            State(36, ceiling=40, ceiling_until=155, capacity=SHORT_CHAT),
            w(running=36, waiting=9, pace=0.05),
            100,
            36,
            "steady",
        ),
        (
            State(36, ceiling=40, ceiling_until=99, capacity=SHORT_CHAT),
            w(running=36, waiting=9, pace=0.05),
            100,
            37,
            "headroom",
        ),
    ],
)
def test_the_law_case_by_case(state: State, win: Window, now: float, limit: int, reason: str) -> None:
    decision = decide(state, win, now, SLO, TUNING)
    assert (decision.limit, decision.reason) == (limit, reason)
    if reason in ("pace_over", "past_peak") and limit < state.limit:
        assert decision.state.hold_until == now + TUNING.drain_seconds
    if reason == "past_peak":
        assert decision.state.ceiling == state.limit and decision.state.ceiling_until == now + TUNING.peak_seconds


@pytest.mark.parametrize(
    ("state", "limit"),
    [
        # no growth to the limit that lowered throughput while the fall is remembered, after it + sqrt(limit)
        (State(36, ceiling=40, ceiling_until=155), 39),
        (State(36, ceiling=40, ceiling_until=99), 42),
        (State(36, ceiling=40, ceiling_until=155, capacity=SHORT_CHAT), 39),  # short: the door sheds the backlog
        (State(32, capacity=PREFILL_MIX), 33),  # a prefill-bound mix: one slot, door or not
    ],
)
def test_with_a_door_beside_it_the_law_regrows_past_a_fall_in_headroom_steps(state: State, limit: int) -> None:
    decision = decide(state, w(running=state.limit, waiting=9, pace=0.05), 100, SLO, replace(TUNING, door=True))
    assert (decision.limit, decision.reason) == (limit, "headroom")


def test_the_hook_is_told_why_growth_is_one_slot() -> None:
    assert one_slot(State(32, capacity=PREFILL_MIX), door=True).startswith("a prefill-bound mix (98% prompt")
    assert one_slot(State(36, ceiling=40), door=False).startswith("tokens/s fell at a limit of 40")
    assert one_slot(State(36, ceiling=40), door=True) is None and one_slot(State(36), door=False) is None


def test_a_mix_is_prefill_bound_only_once_the_model_has_seen_one() -> None:
    assert prefill_bound(PREFILL_MIX) and not prefill_bound(CHAT_MIX)
    assert not prefill_bound(None) and not prefill_bound(Capacity()), "no window yet: unknown is not bound"


def test_a_higher_throughput_replaces_the_peak_and_its_batch_seen_again_averages_it() -> None:
    at32 = w(running=32, waiting=5, pace=0.025, tps=1280)  # 1280 tokens/s x 25 ms: a batch of 32
    higher = decide(State(32, peak=Peak(16, 800)), at32, 100, SLO, TUNING)
    assert higher.state.peak == Peak(32, 1280, limit=32), "seen with requests waiting behind a full batch of 32"
    again = decide(State(32, peak=Peak(32, 1480)), at32, 100, SLO, TUNING)
    assert again.state.peak == Peak(32, 1380), "seen again at about its batch, the peak's rate is averaged"
    near = decide(State(32, peak=Peak(32, 1480)), w(running=30, waiting=5, pace=0.025, tps=1200), 100, SLO,
                  TUNING)  # fmt: skip
    assert near.state.peak == Peak(32, 1340), "a batch of 30 is within 10% of the peak's 32: averaged"
    level = decide(State(32, peak=Peak(16, 1280)), at32, 100, SLO, TUNING)
    assert level.state.peak == Peak(16, 1280), "the same rate from a larger batch is no new peak"
    old = decide(State(32, peak=Peak(16, 2000)), at32, 100, SLO, TUNING)
    assert old.state.peak == Peak(16, 2000), "not forgotten by age: only a higher rate or its batch again"
    quiet = decide(State(32, peak=PEAK), w(running=3, tps=100), 100, SLO, TUNING)
    assert quiet.state.peak == PEAK, "a lower rate at a smaller batch leaves the peak as it is"
    # The peak is learned from any window, by the batch that ran: under a burst that never filled the limit,
    # 20 running served more than 48 now do, so 48 is past the peak.
    light = decide(State(48), w(running=20, pace=0.02), 100, SLO, TUNING)
    assert light.reason == "app_limited" and light.state.peak == Peak(20, 1000)
    busy = replace(light.state, below=1)
    back = decide(busy, w(running=48, waiting=9, pace=0.06, tps=700), 110, SLO, TUNING)
    assert (back.limit, back.reason) == (24, "past_peak"), "down to the peak's batch, one max_step at a time"


def test_a_fall_whose_way_back_is_no_cut_leaves_no_ceiling() -> None:
    # A real vLLM on the CPU, steered from 4: a peak's batch of 3.6 (read from tokens/s) and then 4 serving less
    # made a "fall" whose way back, to ceil(3.6), was 4 itself; its ceiling held the limit at 4 for a minute
    # under a queue 28 s long. A batch of 4 against 3.6 is no fall to act on: the queue grows the limit.
    state = State(4, peak=Peak(3.6, 600.0), below=1)
    decision = decide(state, w(running=4, waiting=20, pace=0.01, tps=400), 100, SLO, TUNING)
    assert (decision.reason, decision.limit, decision.state.ceiling) == ("slow_start", 6, None)


def test_no_peak_of_under_four_requests_makes_a_fall_or_holds_slow_start() -> None:
    # A real vLLM on the CPU, steered from 4 under a queue: its first window made a peak of 2.98 requests at
    # 1,915 tokens/s, 4 served less twice, and the law cut to 3 with a ceiling of 4 that held it there.
    state = State(4, peak=Peak(2.98, 1915.0), below=1)
    decision = decide(state, w(running=4, waiting=5, pace=0.006, tps=1500), 100, SLO, TUNING)
    assert (decision.reason, decision.limit, decision.state.ceiling) == ("slow_start", 6, None)
    # From a peak of four requests on, the same fall counts (the way back, to 4, is a cut from 6).
    fallen = decide(replace(state, limit=6, peak=Peak(4.0, 1915.0)), w(running=6, waiting=5, pace=0.006, tps=1500),
                    100, SLO, TUNING)  # fmt: skip
    assert (fallen.reason, fallen.limit) == ("past_peak", 4)


def test_on_a_prefill_bound_mix_only_a_window_with_a_queue_shows_a_peak() -> None:
    # On the Azure code trace at x2.5 (from 600 s), a quiet window of 10 running and no prompt to prefill served
    # 650 tokens/s; 27 running under a queue, their prompts prefilling, served 390, and the law cut 27 -> 14 -> 10
    # where the best static limit is 32 (0.84 of it; with the peak kept to windows with a queue, 0.99).
    quiet = w(running=10, pace=0.015, tps=650)
    for capacity, peak in ((PREFILL_MIX, None), (CHAT_MIX, Peak(9.75, 650))):
        decision = decide(State(32, capacity=capacity), quiet, 100, SLO, TUNING)
        assert decision.state.peak == peak, "a chat mix prefills as it decodes: its quiet windows count"
    queued = w(running=30, waiting=4, pace=0.075, tps=400)
    assert decide(State(32, capacity=PREFILL_MIX), queued, 100, SLO, TUNING).state.peak == Peak(30, 400, limit=32)
    # At a cold start the mix is unknown for a while: a quiet window's peak learned then goes once it is known.
    early = State(32, peak=Peak(9.75, 650), capacity=PREFILL_MIX)
    assert decide(early, queued, 100, SLO, TUNING).state.peak == Peak(30, 400, limit=32)
    loose = w(running=20, waiting=4, pace=0.05, tps=400)  # requests wait, but the limit does not bind
    assert decide(early, loose, 100, SLO, TUNING).state.peak is None


def test_with_keep_up_off_the_law_still_learns_the_mix() -> None:
    prefill = replace(w(running=32, waiting=9, pace=0.05), prompt_tokens_per_second=50_000.0)
    state = State(32)
    for now in range(100, 200, 2):
        state = decide(state, prefill, now, SLO, replace(TUNING, keep_up=None)).state
    assert prefill_bound(state.capacity), "keep_up: null turns off its steps, not the one-slot growth of this mix"


def capacity_of(short: bool, limits=(30, 35, 40, 45, 50) * 4) -> Capacity:
    """A capacity model learned on a pace of 10 ms + 20 us x batch² (slope 1.5 at 40, 0.26 at 10), KV usage in
    proportion to the batch, and a demand twice what is served (``short``) or half of it."""
    slope = PaceSlope()
    for limit in limits:
        slope = slope.observe(limit, 0.01 + 2e-5 * limit**2, 0.005 * limit)
    asked = 2000 if short else 500
    return Capacity(slope, Demand().observe(60, arrived=asked * 60 / 100, finished=10 * 60, tokens=1000 * 60))


CAPACITIES = (None, capacity_of(True), capacity_of(True, (8, 10, 12, 14) * 5), capacity_of(False), PREFILL_MIX)


@st.composite
def situations(draw) -> tuple[State, Window, float]:
    """A state and a window the law can meet, drawn so that every branch is reached (test_every_branch...): the
    hold, the last move, the peak and the ceiling are drawn around ``now``, not anywhere in a million seconds."""
    limit, now = draw(st.integers(2, 64)), draw(st.floats(100, 1e6))
    hold = draw(st.one_of(st.just(0.0), st.floats(now - 10, now + 10)))
    since = now - draw(st.floats(0, 30))
    bound = st.one_of(st.just(0), st.integers(0, 64))  # 0: a peak seen where no limit bound, as most are
    peak = draw(st.one_of(st.none(), st.builds(Peak, st.floats(1, 64), st.floats(1, 1e4), bound)))
    ceiling = draw(st.one_of(st.none(), st.integers(2, 64)))
    state = State(limit, hold, peak, ceiling, now + draw(st.floats(-60, 60)), since, draw(st.integers(0, 1)),
                  draw(st.sampled_from(CAPACITIES)), now - draw(st.floats(0, 60)))  # fmt: skip
    pace = draw(st.one_of(st.none(), st.floats(0.001, 0.3)))
    # Tokens/s anywhere, or near the peak's (flat past it, ttft_flat's ground, is a narrow band of the first).
    tps = draw(st.one_of(st.floats(0, 1e4), st.floats(0.8, 1.1).map(lambda f: f * (peak.tokens_per_second if peak
                                                                                     else 1000))))  # fmt: skip
    win = w(running=draw(st.integers(0, 100)), waiting=draw(st.integers(0, 100)), kv=draw(st.floats(0, 1)),
            pace=pace, tps=tps, late=draw(st.sampled_from((0, 50))))  # fmt: skip
    return state, win, now


def test_every_branch_of_the_law_is_within_the_property_tests_reach() -> None:
    """One search over the property tests' own draws until each of the law's reasons has come up (past_peak, the
    rarest, within about 1,300 draws). A fixed seed, and yet the search differed with what else pytest collected
    (test_replay.py beside it: past_peak missed in 5000 draws), so up to 20,000. Only the search: shrinking what
    it found would take most of a minute and prove nothing more. The property tests below still draw at random."""
    seen: set[str] = set()

    def every_reason_seen(situation) -> bool:
        seen.add(decide(*situation[:2], situation[2], SLO, TUNING).reason)
        return seen >= set(REASONS)

    with contextlib.suppress(NoSuchExample):
        find(situations(), every_reason_seen, random=Random(0),
             settings=settings(max_examples=20_000, deadline=None, database=None, phases=[Phase.generate]))  # fmt: skip
    assert sorted(set(REASONS) - seen) == []


@settings(max_examples=400, deadline=None)
@given(situations())
def test_each_branch_moves_the_limit_only_its_own_way(situation) -> None:
    state, win, now = situation
    decision = decide(state, win, now, SLO, TUNING)
    limit, new, step = state.limit, decision.limit, max(1, math.floor(state.limit * TUNING.max_step))
    assert TUNING.min_limit <= new <= TUNING.max_limit and abs(new - limit) <= step
    pace = decode_pace(win, TUNING)
    if not math.isnan(pace) and pace > SLO.tpot_seconds:
        assert new <= limit, "never up while the pace breaks the SLO"
    match decision.reason:
        case "drain":  # the capacity model learns from every window; the rest stands
            assert replace(decision.state, capacity=state.capacity) == state and now < state.hold_until
        case "pace_over":
            cut = min(max(SLO.tpot_seconds / pace, 0.5), 0.9)
            assert pace > SLO.tpot_seconds and new == max(math.floor(limit * cut), limit - step, TUNING.min_limit)
            assert new == limit or decision.state.hold_until == now + TUNING.drain_seconds
        case "kv_ceiling":
            assert win.kv_usage > TUNING.kv_target and (new < limit or limit == TUNING.min_limit)
            assert new == max(math.floor(win.running * TUNING.kv_target / win.kv_usage), limit - step, TUNING.min_limit)
        case "keep_up":
            assert win.waiting > 0 and state.capacity is not None and state.capacity.short(TUNING.keep_up)
            assert new == max(math.floor(limit * KEEP_UP_CUT), limit - step, TUNING.min_limit) and new <= limit
            assert decision.state.stepped == now and (new == limit or decision.state.hold_until > now)
        case "past_peak":
            peak = decision.state.peak
            assert new == max(math.ceil(peak.batch), limit - step, TUNING.min_limit) and new <= limit
            assert decision.state.ceiling is not None and decision.state.ceiling_until == now + TUNING.peak_seconds
        case "idle" | "app_limited":
            assert new == limit and win.waiting == 0 and win.running < limit / 2
        case "slow_start":
            assert limit < new <= min(2 * limit, limit + step) or new == limit == TUNING.max_limit
        case "headroom":
            capped = decision.state.ceiling is not None and now < decision.state.ceiling_until
            assert (
                limit < new <= limit + math.ceil(math.sqrt(limit))
                or new == limit == TUNING.max_limit
                or (capped and new == limit >= decision.state.ceiling - 1)
            )
            if capped and new > limit:
                assert new < decision.state.ceiling, "never back up to the limit that fell"
            if one_slot(decision.state, TUNING.door) is not None:
                assert new <= limit + 1, "a prefill-bound mix, or a fall with no door: one slot a tick"
        case "ttft_flat":
            assert new == limit and not TUNING.door and win.ttft.share_at_most(SLO.ttft_seconds) < 0.9
        case "steady":
            assert new == limit
        case other:
            pytest.fail(f"a reason the law does not document: {other}")


def plant(limit: int, demand: float) -> Window:
    """Decode on a stationary load: ``demand`` requests want to run; the pace grows with the running batch
    (8 ms + 2 ms per request: the SLO's 0.1 s is reached at 46 running)."""
    running = min(limit, demand)
    pace = 0.008 + 0.002 * running
    return w(running=running, waiting=max(demand - limit, 0), pace=pace)


@pytest.mark.parametrize("start", [2, 16, 64])
def test_on_a_stationary_load_it_converges_below_the_pace_bound(start: int) -> None:
    state, now, seen = State(start), 0.0, []
    for _ in range(200):
        now += 2.0
        state = decide(state, plant(state.limit, demand=80), now, SLO, TUNING).state
        seen.append(state.limit)
    tail = seen[-50:]
    assert max(tail) - min(tail) <= 8, tail  # settled, not oscillating across the range
    # Pace 0.008 + 0.002 x limit must stay within the SLO's bucket, and the law grows while there is headroom.
    assert 0.008 + 0.002 * max(tail) <= 0.15 and min(tail) >= 20, tail


def thrashing_plant(limit: int, demand: float = 80) -> Window:
    """An engine whose throughput peaks at 24 running and falls past it (the article's L2 thrashing), with
    the pace within the SLO's headroom all along (10 ms at 24, 53 ms at 64): only tokens/s says that growing
    further hurts."""
    running = min(limit, demand)
    tps = 100 * running if running <= 24 else 2400 * (1 - (running - 24) / 80)
    return w(running=running, waiting=max(demand - limit, 0), pace=running / tps)


def test_on_a_load_past_the_throughput_peak_it_settles_near_the_peak_not_at_the_top() -> None:
    state, now, seen = State(8), 0.0, []
    for _ in range(300):
        now += 2.0
        state = decide(state, thrashing_plant(state.limit), now, SLO, TUNING).state
        seen.append(state.limit)
    tail = seen[-100:]
    # It probes past the peak now and then (a peak is forgotten after peak_seconds), and comes back.
    assert 18 <= statistics.median(tail) <= 40 and sum(limit > 44 for limit in tail) <= 10, tail
    unguarded = State(8)
    for _ in range(300):
        unguarded = decide(unguarded, thrashing_plant(unguarded.limit), now, SLO, replace(TUNING, past_peak=None)).state
    assert unguarded.limit == TUNING.max_limit, "the plant is one where the pace alone never stops the growth"


# --- live steering (control/steering.py): who owns the limit, tick by tick ---------------------------------------

CONTROL = Control(enabled=True, manual_hold_seconds=60, drain_seconds=5)


def tick(state: Steering, *, now: float = 100.0, in_force: int = 32, ours=(32,), breaker_open: bool = False,
         signals: Window | None = None, capacity: int = 64, control: Control = CONTROL,
         door: bool = False, gpu_fault: bool = False):  # fmt: skip
    return steer(state, now=now, in_force=in_force, set_by_batchlens=set(ours), breaker_open=breaker_open,
                 signals=signals, slo=SLO, control=control, capacity=capacity, door=door,
                 gpu_fault=gpu_fault)  # fmt: skip


def test_after_a_fall_live_growth_takes_the_doors_step_only_where_a_door_is_kept() -> None:
    fallen = Steering(State(36, ceiling=40, ceiling_until=99), seen_limit=36)
    busy = w(running=36, waiting=9, pace=0.05)
    admitting = Control(enabled=True, admission=True)
    assert tick(fallen, in_force=36, ours=(36,), signals=busy, control=admitting).state.limit == 37, "no door kept"
    assert tick(fallen, in_force=36, ours=(36,), signals=busy, control=admitting, door=True).state.limit == 42


def test_while_a_gpu_of_the_engine_fails_the_limit_holds_and_the_law_learns_nothing() -> None:
    """A window that would cut (the pace far over the SLO) and teach a peak: with a failing GPU, neither."""
    steady = Steering(State(36), seen_limit=36)
    slow = w(running=36, waiting=9, pace=0.5, tps=100)
    assert tick(steady, in_force=36, ours=(36,), signals=slow).state.limit < 36, "the window alone cuts"
    held = tick(steady, in_force=36, ours=(36,), signals=slow, gpu_fault=True)
    assert (held.reason, held.state) == ("gpu_fault", steady)


def test_control_starts_where_the_engine_is_or_at_its_start_limit_and_decides_nothing_without_a_window() -> None:
    first = tick(Steering())
    assert (first.state.limit, first.state.seen_limit, first.reason) == (32, 32, "warming_up"), "not cut to a guess"
    low = tick(Steering(), control=Control(enabled=True, start_limit=16))
    assert low.state.limit == 16
    small = tick(Steering(), capacity=8, in_force=8, control=Control(enabled=True, start_limit=16))
    assert small.state.limit == 8, "never above the engine's capacity"
    bounded = tick(Steering(), control=Control(enabled=True, min_limit=40, max_limit=200), capacity=100)
    assert bounded.state.limit == 40
    assert tuning(Control(max_limit=500), 64).max_limit == 64
    assert tuning(Control(admission=True), 64, door=True).door, "the law knows the door"
    assert not tuning(Control(admission=True), 64).door, "configured is not kept: a dry run, a route that errs"


def test_a_hand_on_the_knob_pauses_control_and_it_resumes_from_the_hand_after_the_hold() -> None:
    steady = Steering(State(32), seen_limit=32)
    found = tick(steady, in_force=50, ours=(32,), signals=w(running=32, waiting=9, pace=0.02))
    assert (found.state.limit, found.reason, found.event) == (50, "manual_hold", "manual")
    assert found.state.manual_until == 100 + CONTROL.manual_hold_seconds
    held = tick(found.state, now=150, in_force=50, signals=w(running=50, waiting=9, pace=0.02))
    assert (held.state.limit, held.reason) == (50, "manual_hold")
    back = tick(held.state, now=161, in_force=50, signals=w(running=50, waiting=9, pace=0.02))
    assert back.event == "resumed" and back.state.manual_until == 0 and back.state.limit > 50


def test_a_limit_outside_the_bounds_comes_within_them_before_the_law_decides() -> None:
    bounded = Control(enabled=True, min_limit=4, max_limit=32)
    restarted = tick(Steering(State(64), seen_limit=64), in_force=64, ours=(64,), signals=w(running=5),
                     control=bounded, capacity=128)  # a store from before max_limit came down  # fmt: skip
    assert (restarted.state.limit, restarted.reason) == (32, "out_of_bounds")
    held = tick(Steering(State(2), seen_limit=2, manual_until=90), in_force=2, ours=(2,), signals=w(running=1),
                control=bounded)  # a hand's 2, its hold over  # fmt: skip
    assert (held.state.limit, held.reason, held.event) == (4, "out_of_bounds", "resumed")
    cold = tick(Steering(State(2), seen_limit=2), in_force=2, ours=(2,), breaker_open=True, signals=w(running=1),
                control=bounded)  # fmt: skip
    assert cold.state.limit == 2, "the breaker's cold start is the breaker's to lift"


def test_a_limit_batchlens_set_is_not_mistaken_for_a_hand() -> None:
    moved = tick(Steering(State(40), seen_limit=32), in_force=40, ours=(32, 40), signals=w(running=5))
    assert moved.event == "" and moved.reason == "app_limited" and moved.state.manual_until == 0


def test_while_the_breaker_is_open_control_may_cut_but_never_raise() -> None:
    open_ = Steering(State(32), seen_limit=16)
    growth = tick(open_, in_force=16, ours=(16,), breaker_open=True, signals=w(running=16, waiting=50, pace=0.02))
    assert (growth.state.limit, growth.reason) == (16, "breaker_open"), "follows the breaker's limit, no raise"
    cut = tick(open_, in_force=16, ours=(16,), breaker_open=True, signals=w(running=16, pace=0.5))
    assert (cut.state.limit, cut.reason) == (8, "pace_over")


def test_live_steering_keeps_the_laws_peak_across_ticks_and_through_the_store() -> None:
    first = tick(Steering(State(32), seen_limit=32), signals=w(running=32, waiting=9, pace=0.05, tps=640))
    assert first.state.law.peak == Peak(32, 640, limit=32) and first.reason == "headroom"
    grown, state = first.state.limit, first.state
    for now, reason in ((102, "headroom"), (104.5, "steady"), (106.5, "past_peak")):  # 102: not settled yet
        ticked = tick(state, now=now, in_force=state.limit, ours=(state.limit,),
                      signals=w(running=state.limit, waiting=9, pace=0.075, tps=500))  # fmt: skip
        assert ticked.reason == reason, (now, ticked)
        held = replace(ticked.state.law, limit=grown, since=first.state.law.since)  # headroom's growth undone
        state = ticked.state if reason != "headroom" else replace(ticked.state, law=held)
    assert (state.limit, state.law.ceiling) == (32, grown)
    assert Steering.from_dict(json.loads(json.dumps(state.to_dict()))) == state, "kill -9 keeps it"
    assert Steering.from_dict({"limit": 8}) == Steering(State(8)), "a state stored before the peak still loads"
    short_sums = {"slope": {"gram": [1.0], "xv": [0.0] * 4, "vv": 0.0}, "demand": {}}
    for broken in (None, {"slope": {"gram": [1.0]}}, {"demand": {}}, "junk", short_sums):
        assert Steering.from_dict({"limit": 8, "capacity": broken}) == Steering(State(8)), broken
    stored = {"limit": 8, "peak": {"batch": 16, "tokens_per_second": 500.0, "at": 3.0}}  # with the peak's old clock
    assert Steering.from_dict(stored).law.peak == Peak(16, 500.0)
    unguarded = replace(state, law=replace(state.law, limit=grown, below=1, hold_until=0, ceiling=None))
    off = tick(unguarded, now=110, in_force=grown, ours=(grown,), control=Control(enabled=True, past_peak=None),
               signals=w(running=grown, waiting=9, pace=0.075, tps=500))  # fmt: skip
    assert off.reason == "headroom", "control.past_peak: null turns the guard off"


def test_attainment_and_goodput_estimates_read_the_buckets_as_a_cdf() -> None:
    h = itl({0.05: 50, 0.1: 30, 0.2: 20})
    assert h.share_at_most(0.1) == pytest.approx(0.8) and h.share_at_most(0.09) == pytest.approx(0.68)
    assert h.share_at_most(5.0) == 1.0 and math.isnan(Histogram().share_at_most(1.0))
    ttft = Histogram(((0.25, 90.0), (0.5, 100.0), (math.inf, 100.0)))
    win = Window(2.0, 10, 0, 0.3, 100.0, 0.0, ttft, h, finished_per_second=4.0)
    assert win.attainment(SLO) == pytest.approx(1.0 * 0.8) and win.goodput(SLO) == pytest.approx(3.2)
    assert Window(2.0, 0, 0, 0, 0, 0, Histogram(), Histogram()).goodput(SLO) == 0.0


# --- the article's PID (control/pid.py), kept to compare with the gradient law ------------------------------------


def test_the_pid_grows_on_margin_with_a_queue_cuts_on_a_broken_pace_and_stays_in_bounds() -> None:
    gains = Gains()
    grown, reason = decide_pid(PidState(16), w(running=16, waiting=20, pace=0.025), SLO, TUNING, gains)
    assert reason == "pid_up" and grown.limit > 16 and grown.integral > 0
    held, reason = decide_pid(PidState(16), w(running=10, pace=0.025), SLO, TUNING, gains)
    assert (held.limit, reason) == (16, "pid_hold"), "margin without a queue is no reason to grow"
    cut, reason = decide_pid(PidState(32), w(running=32, waiting=20, pace=0.3), SLO, TUNING, gains)
    assert reason == "pid_down" and 16 <= cut.limit < 32, "a broken pace cuts, at most max_step at once"
    top, _ = decide_pid(PidState(64), w(running=64, waiting=99, pace=0.01), SLO, TUNING, gains)
    assert top.limit == TUNING.max_limit
    idle, reason = decide_pid(PidState(8), w(running=0), SLO, TUNING, gains)
    assert (idle, reason) == (PidState(8), "idle")


def test_the_bounds_may_pin_the_limit_and_a_crossed_pair_is_named() -> None:
    pinned = Tuning(min_limit=8, max_limit=8)
    assert decide(State(8), w(running=8, waiting=50, pace=0.02), 100, SLO, pinned).limit == 8
    with pytest.raises(ValueError, match="need 1 <= min_limit <= max_limit, got 9 and 8"):
        Tuning(min_limit=9, max_limit=8)


def test_what_each_move_leaves_in_the_state_stated_by_hand() -> None:
    """The state a decision leaves for the next window: the drain after a KV cut, the ceiling a fall keeps,
    the fall count reset by a window that is not one, and slow start's doubling where max_step allows it."""
    kv = decide(State(40), w(running=40, kv=0.98, pace=0.05), 100, SLO, TUNING)
    assert (kv.reason, kv.limit, kv.state.hold_until) == ("kv_ceiling", 38, 105.0)
    # a second fall while an earlier ceiling (40) still holds: the ceiling stays the lower of the two
    again = decide(State(48, peak=PEAK, below=1, ceiling=40, ceiling_until=150),
                   w(running=48, waiting=9, pace=0.06, tps=800), 100, SLO, TUNING)  # fmt: skip
    assert (again.reason, again.limit, again.state.ceiling, again.state.below) == ("past_peak", 32, 40, 0)
    assert again.state.peak == PEAK  # the peak stands
    calm = decide(State(48, peak=PEAK, below=1), w(running=48, waiting=9, pace=0.095, tps=900), 100, SLO, TUNING)
    assert (calm.reason, calm.state.below) == ("steady", 0), "a window that is not a fall resets the count"
    wide = Tuning(min_limit=2, max_limit=64, max_step=2.0, drain_seconds=5.0)
    assert decide(State(8), w(running=8, waiting=50, pace=0.02), 100, SLO, wide).limit == 16  # doubling, no more


@pytest.mark.parametrize(
    ("control", "said", "clamped"),
    [
        (Control(), "limits 1..64", False),
        (Control(start_limit=16, max_limit=32), "limits 1..32, starting at 16", False),
        (
            Control(start_limit=500, min_limit=100),
            "limits 64..64, starting at 64: control.min_limit 100, control.start_limit 500 above the engine's "
            "capacity 64 (max_num_seqs)",
            True,
        ),
    ],
)
def test_the_controller_says_what_it_will_use_and_which_settings_the_capacity_cut(control, said, clamped) -> None:
    assert bounds_said(control, 64) == (said, clamped)


def test_live_and_replay_steer_with_the_same_defaults() -> None:
    # Live, the law's settings come from the config (Control, through steering.tuning); replay and the benches
    # use Tuning's own: the figures in docs/ hold for a live controller only while the two agree.
    assert tuning(Control(), 256) == Tuning(max_limit=256)


def test_no_growth_that_buys_no_tokens_and_makes_first_tokens_late_unless_a_door_sheds() -> None:
    """Past the conversation trace's cliff a limit of 20 to 29 served what 16 did, the pace far inside its SLO,
    and its long prompts' first tokens came later (docs/control.md): a batch past the peak's that serves no more
    than the peak did, with a tenth of its first tokens late, does not grow. It does where they come on time, or
    where it serves more, and with a door beside it (the door refuses what would be late)."""
    flat = dict(running=48, waiting=9, pace=0.05, tps=1000)  # a batch of 50 serving the peak's 1000 tokens/s
    assert decide(State(48, peak=PEAK), w(**flat, late=50), 100, SLO, TUNING).reason == "ttft_flat"
    assert decide(State(48, peak=PEAK), w(**flat, late=50), 100, SLO, TUNING).limit == 48
    assert decide(State(48, peak=PEAK), w(**flat, late=5), 100, SLO, TUNING).reason == "headroom"
    assert decide(State(48, peak=PEAK), w(**{**flat, "tps": 1100}, late=50), 100, SLO, TUNING).reason == "headroom"
    door = replace(TUNING, door=True)
    assert decide(State(48, peak=PEAK), w(**flat, late=50), 100, SLO, door).reason == "headroom"
