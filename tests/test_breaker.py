"""The breaker state machine, table-driven with time travel, and under hostile alert times. Pure: no clock, no servers.

Each table is one engine's story: a list of steps (time, event, expected action, expected state),
run in order, each step's state feeding the next. ``says`` is a phrase the decision's reason must hold: the
reason is what the hook logs and what the page to on-call reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchlens.config import Breaker
from batchlens.remediation.breaker import (
    Door,
    EngineState,
    Observation,
    on_firing,
    on_resolved,
    on_tick,
    without_future_times,
)
from batchlens.remediation.webhook import BREAKER_ALERT, MAX_FUTURE_SECONDS, WebhookPayload, deliveries
from harness.remediate import alert, notification

SETTINGS = Breaker(strikes=3, cooldown_seconds=60, cold_start_limit=1, recovery_interval_seconds=300)
EPISODE = 1000.0  # startsAt of the alert in the stories below
SKIPPED = ("cooldown", "stale", "cold_start_hold", "recorded")  # the labels of batchlens_remediation_actions_total


def fire(limit: int, *, starts_at: float = EPISODE, capacity: int = 64, running: int | None = None, waiting: int = 0,
         door: Door | None = None):  # fmt: skip
    obs = Observation(limit, capacity, limit if running is None else running, waiting, door)
    return lambda s, now: on_firing(s, starts_at=starts_at, now=now, obs=obs, settings=SETTINGS)


def resolve(starts_at: float = EPISODE):
    return lambda s, now: on_resolved(s, starts_at=starts_at, now=now)


def tick(s, now):
    return on_tick(s, now=now, settings=SETTINGS)


def run(story, state: EngineState | None = None):
    state = state or EngineState()
    for i, (now, event, action, expect) in enumerate(story):
        decision = event(state, now)
        assert decision.action == action, f"step {i} at t={now}: {decision.action} ({decision.reason})"
        assert isinstance(decision.reason, str), f"step {i}: no reason"
        # a decision that does not act says why, as the metric label the hook counts it under
        assert (decision.skipped in SKIPPED) == (action == "none"), f"step {i}: skipped={decision.skipped!r}"
        expect = dict(expect)
        says = expect.pop("says", "")
        assert says in decision.reason, f"step {i} at t={now}: {decision.reason!r} does not say {says!r}"
        for field, value in expect.items():
            got = getattr(decision, field) if hasattr(decision, field) and field != "state" else None
            got = getattr(decision.state, field) if got is None and hasattr(decision.state, field) else got
            assert got == value, f"step {i} at t={now}: {field} is {got!r}, expected {value!r} ({decision.reason})"
        state = decision.state
    return state


def test_three_strikes_then_cold_start_then_additive_recovery_to_the_original_limit() -> None:
    final = run([
        (1100, fire(32), "halve", {"set_limit": 16, "strikes": 1, "mode": "tripped", "original_limit": 32,
                                   "says": "strike 1 of 3: 32 -> 16"}),
        (1130, fire(16), "none", {"strikes": 1, "skipped": "cooldown",  # a repeat inside the cooldown: recorded
                                  "says": "inside the cooldown (30 s left)"}),
        (1159, fire(16), "none", {"strikes": 1, "says": "(1 s left)"}),  # still inside (59 s after the action)
        (1160, fire(16), "halve", {"set_limit": 8, "strikes": 2}),    # outside: another strike
        (1220, fire(8), "cold_start", {"set_limit": 1, "strikes": 3, "mode": "cold_start", "page": "cold_start",
                                       "says": "strike 3 of 3: cold start at 1"}),
        (1400, fire(1), "none", {"mode": "cold_start", "page": None,  # cold start holds; no second page
                                 "skipped": "cold_start_hold", "says": "already in cold-start mode"}),
        (1500, resolve(), "resolved", {"mode": "recovering", "target_limit": 1, "recovering_since": 1500,
                                       "says": "recovery begins"}),
        (1799, tick, "none", {"target_limit": 1, "reason": ""}),      # not yet stable for 300 s: nothing to log
        (1800, tick, "raise", {"set_limit": 4, "recovering_since": 1800, "says": "recovery: -> 4"}),  # + 3
        (2100, tick, "raise", {"set_limit": 7}),
        *[(2100 + 300 * k, tick, "raise", {"set_limit": 7 + 3 * k}) for k in range(1, 9)],  # 10, 13, ..., 31
        (4800, tick, "recovered", {"set_limit": 32, "mode": "closed", "strikes": 0, "resolved_pages": ("cold_start",),
                                   "says": "back to 32: breaker closed"}),
        (5100, tick, "none", {"mode": "closed", "reason": ""}),
    ])  # fmt: skip
    # closing forgets the episode, and keeps what the engine is and what it was last told
    assert final == EngineState(capacity=64, resolved_through=EPISODE, target_limit=32)


def test_closing_after_recovery_keeps_the_limit_the_engine_last_confirmed() -> None:
    """The hook PUTs a target only while it differs from the applied limit (remediation/service.py): a closed
    breaker that forgot the applied one would have it tell the engine again what it already has."""
    recovering = EngineState(mode="recovering", strikes=3, original_limit=32, target_limit=31, applied_limit=31,
                             capacity=64, recovering_since=0.0)  # fmt: skip
    decision = on_tick(recovering, now=300, settings=SETTINGS)
    assert decision.action == "recovered" and decision.state == EngineState(capacity=64, target_limit=32,
                                                                             applied_limit=31)  # fmt: skip


def test_a_trigger_during_recovery_halves_again_and_keeps_counting_strikes() -> None:
    run([
        (10, fire(40, starts_at=0), "halve", {"set_limit": 20, "strikes": 1}),
        (20, resolve(starts_at=0), "resolved", {"mode": "recovering"}),
        (320, tick, "raise", {"set_limit": 24}),                      # + 10% of 40
        (400, fire(24, starts_at=350), "halve", {"set_limit": 12, "strikes": 2, "original_limit": 40,
                                                 "recovering_since": None}),
        (500, fire(12, starts_at=350), "cold_start", {"strikes": 3, "set_limit": 1, "page": "cold_start"}),
        (600, resolve(starts_at=350), "resolved", {"mode": "recovering"}),
        (700, fire(1, starts_at=650), "cold_start", {"strikes": 4, "page": None, "paged": ("cold_start",)}),  # once
    ])  # fmt: skip


def test_recovery_steps_by_one_below_ten_and_never_passes_the_capacity_the_engine_has_now() -> None:
    run([
        (10, fire(8), "halve", {"set_limit": 4}),
        (20, resolve(), "resolved", {}),
        (320, tick, "raise", {"set_limit": 5}),                       # 10% of 8 rounds down to 0: the step is 1
    ])  # fmt: skip
    # the engine restarted with a smaller max_num_seqs during the episode: recovery stops there, not at 32
    run([
        (10, fire(32), "halve", {"set_limit": 16}),
        (80, fire(16, capacity=16), "halve", {"set_limit": 8, "capacity": 16}),
        (90, resolve(), "resolved", {}),
        (390, tick, "raise", {"set_limit": 11}),
        (690, tick, "raise", {"set_limit": 14}),
        (990, tick, "recovered", {"set_limit": 16, "capacity": 16}),
    ])  # fmt: skip


def test_a_tick_outside_recovery_never_acts_whatever_else_the_state_holds() -> None:
    for state in (EngineState(mode="tripped", recovering_since=0.0, target_limit=4, original_limit=8),
                  EngineState(mode="closed", recovering_since=0.0, target_limit=4, original_limit=8)):  # fmt: skip
        # within the silence (the hook has listened for a minute): only silence itself ends an episode unheard
        decision = on_tick(state, now=10_000, settings=SETTINGS, listening_since=10_000 - 60)
        assert decision.action == "none" and decision.state == state


def test_an_out_of_order_firing_of_a_resolved_episode_never_acts() -> None:
    run([
        (1100, fire(32), "halve", {"strikes": 1}),
        (1200, resolve(), "resolved", {"resolved_through": EPISODE}),
        (1300, fire(16), "none", {"strikes": 1, "mode": "recovering",  # delayed delivery of the same episode
                                  "skipped": "stale", "says": "out-of-order delivery"}),
        (1301, fire(16, starts_at=EPISODE - 50), "none", {"strikes": 1}),  # an even older one
        (1301, resolve(starts_at=EPISODE - 50), "none", {"resolved_through": EPISODE}),  # the newest resolution stays
        (1302, fire(16, starts_at=1250), "halve", {"strikes": 2}),      # a new episode does act
    ])  # fmt: skip


def test_an_out_of_order_resolution_of_an_older_episode_is_only_recorded() -> None:
    run([
        (1100, fire(32, starts_at=1050), "halve", {"mode": "tripped"}),
        (1110, resolve(starts_at=900), "none", {"mode": "tripped", "resolved_through": 900, "skipped": "recorded",
                                                "says": "out-of-order resolution of an older episode"}),
    ])  # fmt: skip


def test_an_open_breaker_that_hears_no_firing_for_the_silence_takes_its_episode_for_over() -> None:
    """A resolution lost while the hook was down, or a newer alert that nobody resolves (its older twin's
    resolution is only recorded), held the limit at a half, or at a cold start, for good."""
    silence = SETTINGS.firing_silence_seconds
    run([
        (1100, fire(32, starts_at=1050), "halve", {"set_limit": 16}),
        (1200, fire(16, starts_at=1150), "halve", {"set_limit": 8, "strikes": 2}),  # a second, newer alert
        (1210, resolve(starts_at=1050), "none", {"mode": "tripped"}),  # the first resolves: an older episode
        (1230, fire(8, starts_at=1150), "none", {"skipped": "cooldown", "firing_seen_at": 1230}),  # still firing
        (1230 + silence - 1, tick, "none", {"mode": "tripped"}),
        (1230 + silence, tick, "resolved", {"mode": "recovering", "says": "no firing delivery for 1800 s"}),
        (1230 + silence + 300, tick, "raise", {"set_limit": 11}),
    ])  # fmt: skip
    # a held episode's capacity page resolves, and the next episode pages again
    run([
        (0, fire(8, waiting=32), "hold_overload", {"page": "capacity"}),
        (silence, tick, "resolved", {"paged": (), "resolved_pages": ("capacity",)}),
        (silence + 10, fire(8, waiting=32), "hold_overload", {"page": "capacity"}),
    ])  # fmt: skip
    # a cold start saved before the hook kept firing_seen_at goes by its last action
    saved = EngineState(mode="cold_start", strikes=3, original_limit=32, target_limit=1, last_action_at=100.0)
    assert on_tick(saved, now=100 + silence - 1, settings=SETTINGS).action == "none"
    assert on_tick(saved, now=100 + silence, settings=SETTINGS).state.mode == "recovering"
    # ... but not before the hook, back from being down (a rollout), has listened for that long itself
    back = 100 + 2 * silence
    assert on_tick(saved, now=back + 60, settings=SETTINGS, listening_since=back).action == "none"
    assert on_tick(saved, now=back + silence, settings=SETTINGS, listening_since=back).state.mode == "recovering"
    # ... and one saved with neither time, from when the hook began to listen: it is never open for good
    bare = replace(saved, last_action_at=None)
    assert on_tick(bare, now=back + silence - 1, settings=SETTINGS, listening_since=back).action == "none"
    assert on_tick(bare, now=back + silence, settings=SETTINGS, listening_since=back).state.mode == "recovering"


def test_overload_holds_the_limit_counts_no_strike_and_pages_capacity_once() -> None:
    run([
        (0, fire(8, waiting=32), "hold_overload", {"set_limit": None, "strikes": 0, "page": "capacity",
                                                   "says": "32 requests wait behind a batch of 8: demand exceeds"}),
        (30, fire(8, waiting=40), "none", {}),                        # the cooldown applies to holds too
        (61, fire(8, waiting=40), "hold_overload", {"page": None, "strikes": 0, "paged": ("capacity",),
                                                    "says": "Holding the limit; escalating to on-call"}),
        (122, fire(8, waiting=31), "halve", {"set_limit": 4, "strikes": 1}),  # the queue is under 4 batches
    ])  # fmt: skip


def door(pace: float, *, share: float = 0.3) -> Door:
    return Door(cap_tokens=6000, shed_share=share, pace_seconds=pace, tpot_seconds=0.1, prefill_tokens_per_second=3750)


def test_a_capped_door_with_requests_waiting_at_a_good_pace_holds_and_pages_capacity_through_every_firing() -> None:
    # Admission keeps the queue far under 4 batches, so the old overload test never sees it: the door's
    # figures do. Three firings past the cooldown would otherwise be three strikes and a cold start.
    run([
        (0, fire(32, waiting=5, door=door(0.06)), "hold_overload", {
            "set_limit": None, "strikes": 0, "page": "capacity",
            "says": "5 requests wait behind a batch of 32: the door caps the queue at 6000 tokens, from 3750 prefill "
                    "tokens/s and refuses 30% of arrivals; the pace is 60 ms/token, within the SLO's 100 ms: P99 "
                    "comes from the queue"}),
        (61, fire(32, waiting=9, door=door(0.08)), "hold_overload", {"page": None, "strikes": 0}),
        (122, fire(32, waiting=2, door=door(0.09, share=0.0)), "hold_overload", {"strikes": 0, "mode": "closed"}),
        (183, fire(32, waiting=0, door=door(0.09)), "hold_overload", {"strikes": 0}),  # none waits, but some refused
        # The episode ends with no recovery to close it: its page resolves, and the next episode pages again.
        (200, resolve(), "resolved", {"resolved_pages": ("capacity",), "paged": (), "mode": "closed"}),
        (86_400, fire(32, starts_at=86_000, waiting=5, door=door(0.06)), "hold_overload", {"page": "capacity"}),
    ])  # fmt: skip


@pytest.mark.parametrize(
    ("waiting", "pace", "why"),
    [
        (5, 0.15, "the pace breaks the SLO: the batch is too big, so halving is the cure"),
        (0, 0.06, "nobody waits and nothing is refused: the queue is not what breaks P99"),
        (5, math.nan, "no token given in the minute: no pace to judge by"),
    ],
)
def test_a_capped_door_is_no_excuse_when_the_pace_breaks_or_nothing_waits(waiting: int, pace: float, why: str) -> None:
    assert fire(32, waiting=waiting, door=door(pace, share=0.0))(EngineState(), 0).action == "halve", why


def test_one_request_waiting_at_a_pace_just_at_the_slo_is_the_doors_queue_not_a_strike() -> None:
    assert fire(32, waiting=1, door=door(0.1, share=0.0))(EngineState(), 0).action == "hold_overload"


def test_a_batch_of_one_behind_four_waiting_is_overload_not_a_strike() -> None:
    run([(0, fire(1, waiting=4), "hold_overload", {"strikes": 0})])


@pytest.mark.parametrize(
    ("limit", "capacity", "action", "expected"),
    [
        (1, 64, "halve", 1),  # the floor is 1
        (3, 64, "halve", 1),
        (64, 64, "halve", 32),
    ],
)
def test_halving_is_bounded_below_by_one(limit: int, capacity: int, action: str, expected: int) -> None:
    assert fire(limit, capacity=capacity)(EngineState(), 0).set_limit == expected


def test_cold_start_and_recovery_stay_within_the_capacity() -> None:
    settings = Breaker(strikes=1, cold_start_limit=8, recovery_interval_seconds=10)
    obs = Observation(limit=4, capacity=4, running=4, waiting=0)
    decision = on_firing(EngineState(), starts_at=0, now=0, obs=obs, settings=settings)
    assert decision.action == "cold_start" and decision.set_limit == 4  # not 8: the engine holds 4
    state = on_resolved(decision.state, starts_at=0, now=1).state
    assert on_tick(state, now=11, settings=settings).set_limit == 4


def test_a_resolution_while_closed_changes_nothing() -> None:
    decision = on_resolved(EngineState(), starts_at=5, now=10)
    assert decision.action == "none" and decision.state.mode == "closed" and decision.state.resolved_through == 5
    assert decision.reason == "resolved while closed: recorded" and decision.skipped == "recorded"


def test_the_state_survives_a_json_round_trip() -> None:
    state = run([(0, fire(32, waiting=200), "hold_overload", {}), (100, fire(32), "halve", {})])
    assert EngineState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    assert EngineState.from_dict({"mode": "closed"}) == EngineState()  # a state file from before pages were kept
    # One from a newer release, or with a null: what it does not know is left out, not a crash at start
    assert EngineState.from_dict({"mode": "tripped", "new_field": 1, "paged": None}) == EngineState(mode="tripped")


# -- hostile clocks: the webhook's bound on startsAt and the breaker together (both pure) ----------------------

ALERT_TIMES = st.one_of(
    st.floats(0, 253402297199.0),  # anything from 1970 to 9999
    st.sampled_from([EPISODE, EPISODE + MAX_FUTURE_SECONDS, EPISODE + MAX_FUTURE_SECONDS + 1, 253402297199.0]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["firing", "resolved"]), ALERT_TIMES, st.floats(0, 900)), max_size=12))
def test_no_sequence_of_alert_times_keeps_a_later_genuine_episode_from_acting(events) -> None:
    state, now = EngineState(), EPISODE
    for status, starts_at, gap in events:
        now += gap
        payload = WebhookPayload.model_validate(notification(alert("a", status, starts_at=starts_at)))
        for d in deliveries(payload, now=now, instances={"a"}, alertnames={BREAKER_ALERT})[0]:
            state = (fire(32, starts_at=d.starts_at)(state, now) if d.status == "firing"
                     else on_resolved(state, starts_at=d.starts_at, now=now)).state  # fmt: skip
        state = on_tick(state, now=now, settings=SETTINGS).state
    # A genuine episode after all that: it starts a second after the last delivery came, whatever times the
    # deliveries claimed, and is delivered outside the cooldown.
    starts_at, now = now + 1, now + SETTINGS.cooldown_seconds + 1
    fired = fire(32, starts_at=starts_at)(state, now)
    assert fired.skipped != "stale" and fired.state.mode in ("tripped", "cold_start"), (fired.action, fired.reason)
    resolved = on_resolved(fired.state, starts_at=now, now=now + 1)
    assert resolved.action == "resolved", resolved.reason  # and its own resolution is never ignored


def test_a_resolution_dated_ahead_never_blinds_the_next_episode() -> None:
    """Issue 57, item 4: a resolution with startsAt now+290 s (inside the webhook's skew allowance), then a new
    episode from now+5 s. Every firing of it was ignored as stale: a resolution counts as of when it came."""
    now = 5000.0
    payload = WebhookPayload.model_validate(notification(alert("a", "resolved", starts_at=now + 290)))
    [ahead], _ = deliveries(payload, now=now, instances={"a"}, alertnames={BREAKER_ALERT})
    assert ahead.starts_at == now + 290  # taken: within MAX_FUTURE_SECONDS, a clock may be that far ahead
    run([
        (now, resolve(starts_at=ahead.starts_at), "none", {"resolved_through": now}),
        (now + 10, fire(32, starts_at=now + 5), "halve", {"strikes": 1}),
        (now + 200, fire(16, starts_at=now + 5), "halve", {"strikes": 2}),  # its repeat, outside the cooldown
    ])  # fmt: skip


def test_a_state_saved_with_a_time_in_the_future_is_cleared_on_load() -> None:
    wedged = EngineState(mode="tripped", strikes=1, resolved_through=253402297199.0, episode_starts_at=2e11)
    cleared = without_future_times(wedged, now=EPISODE, skew=MAX_FUTURE_SECONDS)
    assert cleared == EngineState(mode="tripped", strikes=1)
    fine = EngineState(resolved_through=EPISODE + MAX_FUTURE_SECONDS)
    assert without_future_times(fine, now=EPISODE, skew=MAX_FUTURE_SECONDS) is fine
