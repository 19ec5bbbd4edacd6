"""The admission law, pure: the queued-token cap from the prefill rate of saturated windows, with time travel.

No server: windows are built by hand, and the time is given. The live part (the cap reaching an engine) is
in tests/test_control_live.py.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from statistics import NormalDist

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchlens.admin_api import MAX_QUEUED_CAP
from batchlens.control.admission import (
    AdmissionSettings,
    CapDecision,
    Saturated,
    poisson_quantile,
    queued_token_cap,
    saturated,
    spread,
    worth_setting,
)
from batchlens.control.signals import EngineSample, Histogram, Window, read_sample, window

SETTINGS = AdmissionSettings(ttft_seconds=2.0, margin=0.8, min_windows=3, stale_seconds=60.0)


def sample(t: float, prompt_tokens: float, waiting: float, finished: float = 0, rejected: float = 0) -> EngineSample:
    return EngineSample(t, running=8, waiting=waiting, kv_usage=0.5, generated_tokens=0, preemptions=0,
                        ttft=Histogram(), itl=Histogram(), prompt_tokens=prompt_tokens, finished=finished,
                        rejected=rejected)  # fmt: skip


def test_a_window_measures_prefill_only_while_requests_wait(vllm_exposition: str) -> None:
    busy = window(sample(0, 1000, waiting=3), sample(2, 5000, waiting=3, finished=10))
    assert busy.prompt_tokens_per_second == 2000
    assert saturated(busy, 2.0) == Saturated(2.0, 2000, finished_per_second=5.0)
    assert saturated(window(sample(0, 1000, 0), sample(2, 5000, 0)), 2.0) is None  # the arrivals, not capacity
    assert saturated(window(sample(0, 1000, 3), sample(2, 1000, 3)), 2.0) is None  # waiting, nothing prefilled
    # A queue at one end only: a burst's prompts waiting a step for the token budget as the sample was taken
    # (vLLM keeps them in its waiting queue), after a window that prefilled only what arrived.
    assert saturated(window(sample(0, 1000, 0), sample(2, 5000, 3)), 2.0) is None
    assert saturated(window(sample(0, 1000, 3), sample(2, 5000, 0)), 2.0) is None
    # Nobody waiting at the sample, but the door refused some in the window: it is holding the queue down, and
    # the window measures the engine as much as one with a queue (else the door opens on an overloaded engine).
    refusing = window(sample(0, 1000, 0), sample(2, 5000, 0, finished=10, rejected=4))
    assert refusing.rejected_per_second == 2 and saturated(refusing, 2.0) == Saturated(2.0, 2000, 5.0)
    # At the smallest of each: one request waiting at both ends, one refusal in the window, one prompt token
    one_each = window(sample(0, 1000, waiting=1), sample(2, 1001, waiting=1, finished=10))
    assert saturated(one_each, 2.0) == Saturated(2.0, 0.5, 5.0)
    one_refused = window(sample(0, 1000, 0), sample(2, 5000, 0, finished=10, rejected=1))
    assert one_refused.rejected_per_second == 0.5 and saturated(one_refused, 2.0) == Saturated(2.0, 2000, 5.0)
    assert read_sample(vllm_exposition, 0).prompt_tokens > 0  # vLLM's own counter, vllm:prompt_tokens_total
    for broken in ({"prompt_tokens_per_second": math.nan}, {"prompt_tokens_per_second": math.inf},
                   {"finished_per_second": math.nan}):  # fmt: skip
        assert saturated(replace(busy, **broken), 2.0) is None, f"{broken}: int(nan) would raise in the cap"


def test_the_shed_share_is_the_doors_refusals_over_what_was_settled_and_reads_vllms_counter_every_reason() -> None:
    text = (
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"} 30\n'
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"} 10\n'
        'vllm:request_success_total{model_name="m",finished_reason="stop"} 100\n'
    )
    before, after = read_sample("", 0.0), read_sample(text, 10.0)
    assert after.rejected == 40
    assert window(before, after).shed_share == 40 / 140
    assert window(after, after).shed_share == 0.0  # idle: nothing settled, nothing shed


@pytest.mark.parametrize(
    ("history", "now", "cap", "reason"),
    [
        ([], 100, None, "no_signal"),
        ([Saturated(90, 2000), Saturated(95, 2000)], 100, None, "too_few_windows"),
        ([Saturated(10, 2000)] * 5, 100, None, "stale"),  # 90 s old: the engine may have changed since
        ([Saturated(40, 2000)] * 3, 100, 3200, "estimated"),  # just stale_seconds old: still recent
        ([Saturated(90, 2000), Saturated(92, 2000), Saturated(94, 2000)], 100, 3200, "estimated"),  # 2 s x 2000 x 0.8
        ([Saturated(30, 9000), Saturated(90, 1000), Saturated(92, 1000), Saturated(94, 1000)], 100, 1600, "estimated"),
        ([Saturated(90, 1000), Saturated(92, 50_000), Saturated(94, 1200)], 100, 1920, "estimated"),  # the median
        ([Saturated(90, 0.1)] * 3, 100, 1, "estimated"),  # never a cap of 0, which would refuse everything
        ([Saturated(190, 2000)] * 3, 100, None, "stale"),  # from before the wall clock stepped back 100 s
        ([Saturated(90, 1e308)] * 3, 100, MAX_QUEUED_CAP, "estimated"),  # x TTFT x spread: inf, and int(inf) raises
    ],
    ids=[
        "nothing",
        "two windows",
        "stale",
        "just recent",
        "steady",
        "an old window left",
        "one outlier",
        "tiny rate",
        "from the future",
        "absurd rate",
    ],
)
def test_the_cap_is_ttft_times_the_median_prefill_rate_or_open(history, now, cap, reason) -> None:
    decision = queued_token_cap(history, now, SETTINGS)
    assert (decision.cap, decision.reason) == (cap, reason)
    assert (decision.prefill_tokens_per_second is None) == (cap is None)


def test_with_no_new_window_the_cap_stands_until_too_few_are_left_then_opens() -> None:
    """Time alone does not move the cap: after a load ends, old windows leaving the median would move it a few
    times before it opened (seen live), each a PUT and a log line about an engine nobody loads."""
    history = [Saturated(0, 9000), Saturated(2, 1000), Saturated(4, 1000), Saturated(6, 1200), Saturated(8, 1200)]
    when_the_last_came = queued_token_cap(history, 8, SETTINGS)
    assert when_the_last_came.prefill_tokens_per_second == 1200  # the median of the five
    for now in (61, 63):  # the 9000 at 0 s, then the 1000 at 2 s, older than stale_seconds
        assert queued_token_cap(history, now, SETTINGS) == when_the_last_came
    assert queued_token_cap(history, 65, SETTINGS) == CapDecision(None, "too_few_windows", None)
    moved = queued_token_cap([*history, Saturated(62, 1000)], 62, SETTINGS)  # a new window: recent as of it
    assert moved.prefill_tokens_per_second == 1000  # 1000, 1000, 1200, 1200 and the new 1000


@pytest.mark.parametrize(
    ("finished_per_second", "wider"),
    [(0.0, 1.0), (2.0, 8 / 4), (0.05, 1 / 0.1), (100.0, poisson_quantile(200, 0.95) / 200)],
    ids=["none finished: the mean", "4 per TTFT", "one in ten TTFTs: one request's worth", "200 per TTFT"],
)
def test_the_cap_is_the_confidence_quantile_of_what_drains_within_a_ttft(finished_per_second, wider) -> None:
    recent = [Saturated(90 + i, 2000, finished_per_second) for i in range(3)]
    assert spread(recent, SETTINGS) == pytest.approx(wider * SETTINGS.margin)
    assert queued_token_cap(recent, 100, SETTINGS).cap == int(2.0 * 2000 * wider * SETTINGS.margin)
    assert 1.0 <= wider < 1.15 or finished_per_second < 100, "many finishes per TTFT: about the mean"


@pytest.mark.parametrize("finishes", [0.5, 1.75, 4.0, 9.0, 40.0])
def test_a_request_refused_at_the_cap_would_have_missed_its_ttft_with_the_doors_confidence(finishes) -> None:
    """Random finishes, drawn: a request behind the quantile's worth of waiting requests needs one more finish
    than that to start, and at most 5% of the draws give it within the TTFT (the door's own claim)."""
    ahead, rng, draws = poisson_quantile(finishes, 0.95), random.Random(7), 20_000
    in_time = 0
    for _ in range(draws):
        t, done = rng.expovariate(finishes), 0  # finishes per TTFT: time in TTFTs
        while t <= 1.0:
            done, t = done + 1, t + rng.expovariate(finishes)
        in_time += done >= ahead + 1
    assert in_time / draws <= 0.05 + 0.005
    one_fewer = poisson_quantile(finishes, 0.95) - 1
    assert one_fewer < 0 or 1 - sum(_poisson(finishes, n) for n in range(one_fewer + 1)) > 0.05, "the smallest such"


@pytest.mark.parametrize("finishes", [746.0, 2_000.0, 20_000.0, 1e10])  # 1e10: one term a step would hang the hook
def test_a_busy_engines_quantile_is_just_past_the_mean(finishes) -> None:
    """Past about 745 finishes per TTFT e^-mean underflows: the quantile must still be the mean plus about 1.645
    standard deviations (the normal limit), not the loop's guard at 10x the mean (a door that never sheds)."""
    normal = finishes + NormalDist().inv_cdf(0.95) * math.sqrt(finishes)
    assert abs(poisson_quantile(finishes, 0.95) - normal) <= 2


def _poisson(mean: float, n: int) -> float:
    return math.exp(-mean) * mean**n / math.factorial(n)


@given(
    st.lists(st.tuples(st.floats(0, 200), st.floats(0.001, 1e6), st.floats(0, 1e3)), max_size=30),
    st.floats(0, 300),
)
def test_the_door_is_never_shut_and_never_narrower_than_the_mean_drain(windows, now) -> None:
    history = [Saturated(at, rate, finished) for at, rate, finished in sorted(windows)]
    decision = queued_token_cap(history, now, SETTINGS)
    if decision.cap is not None:
        recent = [s for s in history if now - s.at <= SETTINGS.stale_seconds]
        mean_cap = SETTINGS.ttft_seconds * decision.prefill_tokens_per_second * SETTINGS.margin
        assert decision.cap >= 1 and decision.cap >= int(mean_cap)
        assert len(recent) >= SETTINGS.min_windows
    else:
        assert decision.reason in ("no_signal", "stale", "too_few_windows")


def test_a_window_from_a_restarted_engine_measures_nothing() -> None:
    restarted = window(sample(0, 90_000, waiting=4), sample(2, 100, waiting=4))  # counters back near zero
    assert restarted.prompt_tokens_per_second == 0 and saturated(restarted, 2.0) is None
    assert isinstance(restarted, Window)


@pytest.mark.parametrize(
    ("in_force", "wanted", "worth"),
    [
        (None, None, False),
        (None, 3200, True),
        (3200, None, True),
        (3200, 3400, False),
        (3200, 2880, False),
        (3200, 3600, True),
        (3200, 2800, True),
    ],
)
def test_the_cap_moves_only_past_its_tolerance_but_the_door_always_opens_and_closes(in_force, wanted, worth) -> None:
    assert worth_setting(in_force, wanted, SETTINGS) is worth
