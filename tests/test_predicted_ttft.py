"""The per-request door's prediction, pure (batchlens.predicted_ttft), and the prompt read from a body
(batchlens.prompt_size). How close it predicts on a real vLLM and on the simulator is benchmarks/predicted_ttft.py."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from batchlens.predicted_ttft import (
    LOOK_MOST,
    MIN_PREFILLS,
    SLOT_MARGIN,
    Backlog,
    Prediction,
    Rates,
    Seen,
    Watch,
    first_token_seconds,
    late_in_queue,
    predict,
    refuses,
)
from batchlens.prompt_size import prompt_tokens
from batchlens.quantiles import poisson_quantile


def learned(rate: float = 1000.0, step: float = 0.0, prompts=(100, 300, 500, 700, 900, 200, 400, 600, 800, 1000)):
    """Rates that saw each prompt prefilled alone, in ``step + tokens / rate`` seconds."""
    rates, now = Rates(), 0.0
    for prompt in prompts:
        seconds = step + prompt / rate
        now += seconds
        rates.observe(now, seconds, busy=True, full=False, prefilled_tokens=prompt, prefills=1, in_prefill=(0, 0))
        now += 1.0
        rates.observe(now, 1.0, busy=False, full=False)
    return rates, now


def test_the_door_knows_nothing_until_enough_first_tokens_came_and_then_admits() -> None:
    rates, _ = learned(prompts=(500,) * (MIN_PREFILLS - 1))
    assert rates.prefill_tokens_per_second is None
    assert predict(Backlog(10_000, 10, 0), 500, rates, limit=4) is None
    assert not refuses(None, 0.001)  # it fails open
    rates, _ = learned(prompts=(500,) * MIN_PREFILLS)
    assert rates.prefill_tokens_per_second == pytest.approx(1000)


def test_a_lone_prompt_is_a_step_and_its_tokens_and_the_backlog_ahead_drains_at_the_rate() -> None:
    """Prompts alone measure the step (a first token comes at a step's end) apart from the rate: proportional
    alone, a rate learned on short prompts would take a long one for longer than it takes."""
    rates, _ = learned(rate=2000.0, step=0.05)
    step, per_token = rates.lone
    assert step == pytest.approx(0.05) and per_token == pytest.approx(1 / 2000)
    alone = predict(Backlog(0, 0, 3), 4000, rates, limit=None)
    assert alone.prefill_seconds == pytest.approx(0.05 + 2.0)
    rate = rates.prefill_tokens_per_second  # over all busy time, steps included: what a backlog drains at
    behind = predict(Backlog(3000, 2, 3), 4000, rates, limit=None)
    assert behind.prefill_seconds == pytest.approx(3000 / rate + 0.05 + 2.0)
    assert behind.slots_needed == 0 and behind.ttft_seconds == behind.prefill_seconds


def test_what_the_rate_says_is_done_of_the_prompts_in_prefill_is_not_waited_for_twice() -> None:
    rates, now = learned()
    rates.observe(now + 0.5, 0.5, busy=True, full=False, in_prefill=(2000, 2))  # half a second on two prompts
    assert rates.partial_tokens == pytest.approx(0.5 * rates.prefill_tokens_per_second)
    rates.observe(now + 5.0, 4.5, busy=True, full=False, in_prefill=(2000, 2))
    assert rates.partial_tokens == 2000 - 2  # never a whole prompt: no first token came
    rates.observe(now + 5.1, 0.1, busy=True, full=False, prefilled_tokens=2000, prefills=2, in_prefill=(0, 0))
    assert rates.partial_tokens == 0


def test_a_request_past_the_batch_limit_waits_for_finishes_which_count_only_while_the_batch_is_full() -> None:
    rates, now = learned()
    rates.observe(now + 1, 1.0, busy=False, full=False, finishes=50)  # finishes with room to spare say nothing
    assert rates.finishes_per_second is None
    rates.observe(now + 3, 2.0, busy=False, full=True, finishes=4)
    assert rates.finishes_per_second == pytest.approx(2.0)
    prediction = predict(Backlog(0, 3, 8), 100, rates, limit=8)  # 11 unfinished on 8 slots: 4 finishes to wait
    assert prediction.slots_needed == 4
    assert prediction.ttft_seconds == pytest.approx(4 / 2.0 + prediction.own_seconds)


def test_the_door_refuses_only_past_the_budget_and_a_slot_only_past_the_quantile_of_the_finishes() -> None:
    prefill = Prediction(1.0, 1.0, 0.2, 0, None)
    assert refuses(prefill, 0.99) and not refuses(prefill, 1.0)  # a prefill's own bound: no margin over it
    # A slot wait is judged against the budget and SLOT_MARGIN of it more: 1.6 s -> 2 s. 5 finishes needed, 2 a
    # second, 2 s less 0.2 s of its own prefill: Poisson(3.6)'s 0.9 quantile is 6.
    assert SLOT_MARGIN == 0.25 and poisson_quantile(3.6, 0.9) == 6
    assert not refuses(Prediction(2.7, 0.2, 0.2, 6, 2.0), 1.6, confidence=0.9)  # expected 3.2 s, yet it may make it
    assert refuses(Prediction(3.7, 0.2, 0.2, 7, 2.0), 1.6, confidence=0.9)
    assert refuses(Prediction(0.3, 0.3, 0.3, 1, 2.0), 0.2)  # its own prefill alone is past the budget and margin
    assert not refuses(Prediction(0.3, 0.3, 0.3, 0, None), 0.3)


def test_a_request_the_slot_test_refuses_would_have_missed_nine_times_in_ten_or_more() -> None:
    """The slot test against random finishes: of the requests it refuses, at most 1 - confidence would have
    had their slot in time (Poisson finishes at the rate measured)."""
    rng, confidence, rate, budget = random.Random(3), 0.9, 4.0, 1.5
    made = refused = 0
    for needed in range(1, 15):
        prediction = Prediction(needed / rate, 0.0, 0.0, needed, rate)
        if not refuses(prediction, budget / (1 + SLOT_MARGIN), confidence):  # judged at the budget, margin and all
            continue
        for _ in range(400):
            refused += 1
            t, got = 0.0, 0
            while (t := t + rng.expovariate(rate)) <= budget:
                got += 1
            made += got >= needed
    assert refused and made / refused <= 1 - confidence


def test_the_watch_sees_first_tokens_and_finishes_in_the_request_states_it_samples() -> None:
    watch = Watch()
    watch.sample(0.0, {"a": (100, True), "b": (200, True), "c": (50, False)}, limit=3)
    backlog = watch.sample(0.5, {"b": (200, True), "a": (100, False), "d": (400, True)}, limit=3)  # a: first token
    assert backlog == Backlog(600, 2, 1)
    assert watch.rates._sums[2:4] == [100, 1]  # 100 prompt tokens in half a second of prefill
    assert watch.rates._sums[0] == pytest.approx(0.5)
    watch.sample(1.0, {"b": (200, True), "a": (100, False), "d": (400, True)}, limit=3)  # full: 3 on 3 slots...
    watch.sample(2.0, {"b": (200, True), "d": (400, True)}, limit=3)  # ...and a finished
    assert watch.rates.finishes_per_second == pytest.approx(1.0)
    # Every slot held by a request past its first token: the ones in prefill wait for a slot, not for prefill.
    before = watch.rates._sums[0]
    watch.sample(3.0, {"x": (10, False), "y": (10, False), "z": (10, False), "b": (200, True)}, limit=3)
    watch.sample(4.0, {"x": (10, False), "y": (10, False), "z": (10, False), "b": (200, True)}, limit=3)
    assert watch.rates._sums[0] == pytest.approx(before + 1.0)  # the second: 3 decoding on 3 slots, not busy


def test_a_slot_frees_at_the_latest_when_the_requests_ahead_reach_their_max_tokens() -> None:
    """Where the output processor knows each request's max_tokens and its output so far, the slots are held by the
    decoding requests and the oldest prefilling ones, each to its max_tokens at the latest, and a request waiting
    takes the first slot that frees, oldest first: a new one has its slot when every one ahead has had theirs."""
    states = [Seen(10, False, 90, 100), Seen(10, False, 0, 300), Seen(10, False, 50, 70), Seen(20, True, 0, 40),
              Seen(30, True, 0, 5)]  # fmt: skip
    backlog = Backlog.of(states)
    assert backlog.decoding_left == (10, 20, 300) and backlog.prefilling_left == (40, 5)
    assert backlog.slot_tokens(limit=6) == 0  # room now
    assert backlog.slot_tokens(limit=5) == 5  # the 5-token one holds the fifth slot
    assert backlog.slot_tokens(limit=4) == 15  # it waits for the 10-token one, then holds its slot for 5
    # The controller cut the limit below the decoding ones: two must end before the 40-token one has a slot.
    assert backlog.slot_tokens(limit=2) == 20 + 40 + 5
    assert Backlog.of([*states, Seen(5, True)]).slot_tokens(limit=4) is None  # one max_tokens unknown
    assert Backlog.of([(10, False), (20, True)]).decoding_left is None


def test_the_decode_step_is_learned_from_steps_with_no_prompt_in_them() -> None:
    rates, now = learned()
    assert rates.decode_seconds_per_token is None
    rates.observe(now + 1, 1.0, busy=False, full=True, decoded=(200, 10.0))  # 10 requests, 20 tokens in a second
    assert rates.decode_seconds_per_token == pytest.approx(0.05)
    rates.observe(now + 2, 1.0, busy=True, full=True, decoded=(20, 10.0))  # a prompt's chunks in the steps: not
    assert rates.decode_seconds_per_token == pytest.approx(0.05)  # what a request waiting for a slot waits through
    rates.observe(now + 12, 10.0, busy=False, full=True, decoded=(1000, 100.0))  # ten seconds on: the new step rules
    assert rates.decode_seconds_per_token == pytest.approx(0.1, rel=0.01)


def test_a_request_whose_slot_frees_in_time_at_the_latest_is_admitted_whatever_the_finishes_say() -> None:
    rates, now = learned()  # 1000 prompt tokens a second, no step
    rates.observe(now + 2, 2.0, busy=False, full=True, finishes=1, decoded=(400, 20.0))  # 0.05 s a token
    # 4 decoding on 4 slots with 10, 20, 30 and 300 tokens left, 2 prompts of 100 waiting for 9 tokens each: its
    # slot frees at the latest in 20 x 0.05 = 1 s (the 10-token one's slot twice, then the 20-token one's), where
    # one finish in 2 s says 3 finishes come in 6 s.
    backlog = Backlog.of([*(Seen(10, False, 0, n) for n in (10, 20, 30, 300)), Seen(100, True, 0, 9),
                          Seen(100, True, 0, 9)])  # fmt: skip
    prediction = predict(backlog, 100, rates, limit=4)
    assert prediction.slots_needed == 3 and prediction.slot_seconds == pytest.approx(1.0)
    assert prediction.ttft_seconds == pytest.approx(3 / 0.5 + 0.1)  # expected: the finishes' (the latest is a bound)
    assert prediction.prefill_seconds == pytest.approx(0.3)
    at = 1.3 / (1 + SLOT_MARGIN)  # the budget that, with the slot wait's margin, is 1.3 s
    assert not refuses(prediction, at)  # 1 s, and the prompts ahead and its own: 1.3 s
    assert refuses(prediction, at - 0.01)  # past it, only the finishes judge, and they say 6 s
    assert refuses(replace(prediction, slot_seconds=None), at)


def test_the_watch_learns_the_decode_step_from_the_output_of_requests_decoding_at_both_looks() -> None:
    watch = Watch()
    watch.sample(0.0, {"a": Seen(10, False, 5, 100), "b": Seen(10, False, 0, 100)})
    watch.sample(1.0, {"a": Seen(10, False, 25, 100), "b": Seen(10, False, 20, 100), "c": Seen(10, False, 9, 100)})
    assert watch.rates.decode_seconds_per_token == pytest.approx(2 / 40)  # c, not seen before, is not counted
    # A prompt in prefill (with room for it): its chunks are in the steps, which are not a decode step's.
    watch.sample(2.0, {"a": Seen(10, False, 45, 100), "b": Seen(10, False, 40, 100), "d": Seen(10, True)})
    watch.sample(3.0, {"a": Seen(10, False, 46, 100), "b": Seen(10, False, 41, 100), "d": Seen(10, True)})
    assert watch.rates.decode_seconds_per_token == pytest.approx(2 / 40)


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"prompt": "x" * 400}, 100),
        ({"prompt": "abc"}, 1),
        ({"prompt": "批处理大小"}, 5),  # a token a Chinese character, not 4 characters a token
        ({"prompt": "batch 批处理"}, 2 + 3),
        ({"prompt": [1, 2, 3]}, 3),
        ({"prompt": ["x" * 40, [1, 2]]}, 12),
        ({"messages": [{"role": "user", "content": "x" * 80}, {"role": "system", "content": None}]}, 20 + 8),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 8}, {"type": "image_url"}]}]},
         2 + 4),
        ({"prompt": [True, 2]}, None),  # not token ids
        ({"prompt": []}, None),
        ({"prompt": [[], [1]]}, None),
        ({"messages": "hi"}, None),
        ({"messages": [{"content": 5}]}, None),
        ({"model": "m"}, None),
        ([1, 2], None),
    ],
)  # fmt: skip
def test_a_prompt_is_read_from_its_body_token_ids_exactly_text_at_four_characters(body, tokens) -> None:
    assert prompt_tokens(json.dumps(body).encode()) == tokens


def test_a_body_that_is_not_json_is_not_judged() -> None:
    assert prompt_tokens(b"{not json") is None
    assert prompt_tokens(b"\xff\xfe") is None
    assert prompt_tokens(b"[" * 100_000) is None  # too deep to read: no crash


def test_what_the_rates_saw_is_forgotten_past_the_horizon() -> None:
    rates = Rates(min_prefills=1)
    rates.observe(2.0, 1.0, busy=True, full=False, prefilled_tokens=100, prefills=1, in_prefill=(0, 0))
    rates.observe(32.0, 0.0, busy=False, full=False)  # 30 s on: kept
    assert rates.prefill_tokens_per_second == 100 and len(rates._lone) == 1
    rates.observe(32.5, 0.5, busy=False, full=True)  # and a full batch with no finish tells of none
    assert rates.prefill_tokens_per_second is None and not rates._lone and rates.finishes_per_second is None
    assert rates._sums == [0, 0.5, 0, 0, 0]  # what was forgotten is taken off once; the full half second stays


def test_the_prediction_takes_what_is_done_off_the_backlog_and_counts_a_batch_just_full() -> None:
    rates, now = learned()
    rates.observe(now + 0.5, 0.5, busy=True, full=False, in_prefill=(2000, 2))
    rate, done = rates.prefill_tokens_per_second, rates.partial_tokens
    assert done > 0
    prediction = predict(Backlog(2000, 2, 2), 100, rates, limit=5)
    assert prediction.prefill_seconds == pytest.approx((2000 - done) / rate + prediction.own_seconds)
    assert prediction.slots_needed == 0
    assert predict(Backlog(2000, 2, 2), 100, rates, limit=4).slots_needed == 1  # 4 unfinished on 4 slots
    assert prediction.slot_seconds is None  # no decode step learned: no latest either
    assert refuses(Prediction(1.0, 1.0, 0.2, 0, 2.0), 0.99)  # room in the batch: the prefill judges


def test_the_decode_step_follows_the_batch_within_its_time_constant() -> None:
    rates = Rates()
    rates.observe(1.0, 1.0, busy=False, full=True, decoded=(200, 10.0))
    rates.observe(3.0, 2.0, busy=False, full=True, decoded=(100, 20.0))  # 2 s later: the first weighs e^-1
    decay = math.exp(-2.0 / 2.0)
    assert rates.decode_seconds_per_token == pytest.approx((10 * decay + 20) / (200 * decay + 100))


def test_the_latest_needs_every_request_known_and_a_limit() -> None:
    assert Backlog(0, 0, 1, (5,), None).slot_tokens(limit=2) is None
    assert Backlog(0, 1, 1, (5,), (7,)).slot_tokens(limit=1) == 5 + 7
    assert Backlog(0, 1, 1, (5,), (7,)).slot_tokens(limit=0) is None
    assert Backlog.of([Seen(10, False), Seen(20, True, 0, 5)]).slot_tokens(limit=1) is None  # a decoding one unknown


def test_the_watch_counts_a_limit_raised_as_slots_freed_and_what_is_done_of_the_prompts_in_prefill() -> None:
    watch = Watch()
    decoding = {f"d{i}": Seen(10, False, 1, 100) for i in range(6)}
    watch.sample(0.0, decoding, limit=3)
    watch.sample(1.0, decoding, limit=5)  # still full, no finish: the two slots the controller added free as two
    assert watch.rates.finishes_per_second == pytest.approx(2.0)
    watch = Watch(learned()[0])
    watch.sample(0.0, {"a": Seen(1000, True)})
    watch.sample(0.5, {"a": Seen(1000, True)})
    assert watch.rates.partial_tokens == pytest.approx(0.5 * watch.rates.prefill_tokens_per_second)


def test_a_slot_test_with_less_than_a_second_left_still_counts_the_finishes() -> None:
    assert not refuses(Prediction(0.2, 0.2, 0.1, 1, 10.0), 0.7)  # 0.5 s left, 5 finishes expected in it


def test_a_lone_prompt_is_measured_over_its_whole_busy_period_and_two_prompts_are_not_alone() -> None:
    rates = Rates(min_prefills=1)
    rates.observe(0.2, 0.2, busy=True, full=False, in_prefill=(300, 1))  # one prompt, over two looks
    rates.observe(0.5, 0.3, busy=True, full=False, prefilled_tokens=300, prefills=1, in_prefill=(0, 0))
    assert list(rates._lone) == [(0.5, 300, pytest.approx(0.5))]
    rates.observe(1.0, 0.5, busy=True, full=False, prefilled_tokens=600, prefills=2, in_prefill=(0, 0))
    rates.observe(1.5, 0.0, busy=False, full=False, prefilled_tokens=100, prefills=1, in_prefill=(0, 0))
    assert len(rates._lone) == 1  # two prompts in one period, and a first token with no time in prefill seen


def test_the_watch_counts_the_tokens_of_each_look_over_its_time_and_a_stalled_request_gets_none() -> None:
    watch = Watch()
    watch.sample(0.0, {"a": Seen(10, False, 0, 100), "b": Seen(10, False, 7, 100)})
    watch.sample(0.5, {"a": Seen(10, False, 10, 100), "b": Seen(10, False, 7, 100)})  # b got nothing
    assert watch.rates.decode_seconds_per_token == pytest.approx(2 * 0.5 / 10)


def test_the_latest_is_only_said_where_a_slot_is_waited_for_and_the_decode_step_is_known() -> None:
    rates, now = learned()  # no decode step seen
    full = Backlog.of([Seen(10, False, 0, 5), Seen(10, False, 0, 6), Seen(20, True, 0, 9)])
    assert predict(full, 100, rates, limit=2).slot_seconds is None
    rates.observe(now + 1, 1.0, busy=False, full=False, decoded=(10, 1.0))
    assert predict(full, 100, rates, limit=2).slot_seconds == pytest.approx(0.1 * 6)  # the 9-token one took the first
    waiting = predict(full, 100, rates, limit=2)  # no finish seen yet: the latest is all it has to expect by
    assert waiting.ttft_seconds == pytest.approx(0.6 + waiting.prefill_seconds)
    assert predict(full, 100, rates, limit=4).slot_seconds is None  # room: no slot to wait for
    assert not refuses(Prediction(1.0, 1.0, 0.2, 0, 2.0), 1.0)  # room, the finishes known: the prefill judges


def test_the_requests_holding_a_slot_share_their_steps_and_one_waiting_for_a_slot_is_bounded_below() -> None:
    """Prompts of 1,000, 600 and 600, 400 tokens of the oldest done, and steps of 1,000 tokens taking 0.1 s + 1 ms a
    token. The two holding slots share their steps: the first's first token ends the first (full) step, at 1.1 s,
    and the second's the next (200 tokens), at 0.2 + 1.2 s. The third, waiting for a slot, gets its first token no
    sooner than if it had one and nobody behind it: at the end of a second step of 800 tokens, 0.2 + 1.8 s."""
    times = list(first_token_seconds([1000, 600, 600], slotted=2, done_tokens=400, step_tokens=1000, lone=(0.1, 0.001)))
    assert times == pytest.approx([1.1, 1.4, 2.0])
    # Every one with a slot: the third's prompt fills the second step, and the second's first token comes with it.
    assert list(first_token_seconds([1000, 600, 600], 3, 400, 1000, (0.1, 0.001))) == pytest.approx([1.1, 2.0, 2.0])


def test_the_second_look_refuses_the_earliest_that_would_miss_and_looks_again() -> None:
    """Four prompts of 1,000 in 1,000-token steps of 1 ms a token (no step time): first tokens at 1, 2, 3 and 4 s.
    With a 3 s bound and the first two having waited 2.5 s, the first misses (3.5 s): refused, the second's then
    comes at 1 s (3.5 s waited: refused too), and the third and fourth, which have waited nothing, make it."""
    rates, _ = learned(rate=1000.0)  # no step time: the fit may say nothing, and the rate is the time a token
    prompts, waited = [1000] * 4, [2.5, 2.5, 0.0, 0.0]
    assert late_in_queue(prompts, waited, decoding=0, limit=None, step_tokens=1000, rates=rates,
                         budget_seconds=3.0) == [0, 1]  # fmt: skip
    # One that is not the door's (its answer begun, or a request id of the client's) counts, but is never refused.
    assert late_in_queue(prompts, [None, 2.5, 0.0, 0.0], 0, None, 1000, rates, 3.0) == [1]
    # The decoding requests take a token of each step and hold the slots: with one slot left, the fourth waits.
    assert late_in_queue(prompts, [0.0, 0.0, 0.0, 1.0], 10, 11, 1010, rates, 3.0) == [3]
    assert late_in_queue(prompts, waited, 0, None, 1000, learned(prompts=(500,))[0], 3.0) == []  # no rate: open
    # The slots known, a short prompt shares its step with the long one behind it (1 s) and misses; not known, the
    # door judges it by its lower bound (alone: 0.2 s) and refuses nothing that could make it.
    assert late_in_queue([200, 800], [0.5, 0.0], 0, 2, 1000, rates, 1.0) == [0]
    assert late_in_queue([200, 800], [0.5, 0.0], 0, None, 1000, rates, 1.0) == []
    # A look refuses LOOK_MOST at most: the rest wait for the next (each refusal means judging the queue again).
    assert late_in_queue([1000] * 40, [9.0] * 40, 0, None, 1000, rates, 3.0) == list(range(LOOK_MOST))
