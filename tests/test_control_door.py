"""The door's live rules (control/door.py), pure: a hand on the cap, a PUT that may have landed, a restart onto a
cap, and what is worth a change. The hook's own tests (test_control_live.py) run the same rules through it."""

from __future__ import annotations

from batchlens.control.admission import AdmissionSettings, Saturated
from batchlens.control.door import UNSET, DoorState, admit
from batchlens.control.steering import Steering

SETTINGS = AdmissionSettings(ttft_seconds=2.0, min_windows=3, stale_seconds=60.0)
SURE = [Saturated(at, 2000.0) for at in (96.0, 98.0, 100.0)]  # three saturated windows: a cap of 4000


def tick(state: DoorState, in_force: int | None, history=(), **kw):
    return admit(state, now=100.0, in_force=in_force, history=history, settings=SETTINGS, manual_hold_seconds=300,
                 **kw)  # fmt: skip


def test_the_first_reading_is_taken_as_known_and_no_hand_is_seen_in_it() -> None:
    assert DoorState().known is UNSET
    first = tick(DoorState(), 5000)
    assert not first.manual and first.state == DoorState(cap=5000, seen=True) and first.state.known == 5000
    assert (first.decision.cap, first.decision.reason, first.change) == (None, "no_signal", True)  # the door opens


def test_a_cap_batchlens_neither_set_nor_sent_is_a_hands_and_stands_as_the_target() -> None:
    held = tick(DoorState(cap=3000, seen=True), 5000, SURE)
    assert held.manual and held.state.manual_until == 400.0 and not held.change
    assert (held.decision.cap, held.decision.reason) == (5000, "manual_hold")
    assert held.decision.prefill_tokens_per_second == 2000.0  # the estimate is still said
    later = admit(held.state, now=399.0, in_force=5000, history=SURE, settings=SETTINGS, manual_hold_seconds=300)
    assert not later.manual and later.decision.reason == "manual_hold"
    over = admit(held.state, now=400.0, in_force=5000, history=SURE, settings=SETTINGS, manual_hold_seconds=300)
    assert over.decision.reason == "stale" and over.change, "the hold is over at its end: the door opens"


def test_a_cap_found_as_sent_is_no_hands_the_put_landed() -> None:
    assert DoorState().landed(4000).known == 4000, "a cap set is a cap known"
    sent = DoorState(cap=3000, seen=True).sending(4000)
    found = tick(sent, 4000, SURE)
    assert not found.manual and found.state == DoorState(cap=4000, seen=True)  # what was sent is forgotten
    assert (found.decision.reason, found.change) == ("estimated", False)  # 4000 is what it wants: no change


def test_a_hand_that_lifts_the_cap_opens_the_door_until_its_hold_ends() -> None:
    opened = tick(DoorState(cap=3000, seen=True), None).state
    assert opened.opened_by_hand(100.0) and not opened.opened_by_hand(400.0)
    assert not DoorState(cap=3000, seen=True, manual_until=400.0).opened_by_hand(100.0)


def test_a_restart_onto_a_cap_keeps_it_until_the_estimate_is_sure_or_had_the_time_to_be() -> None:
    resumed = tick(DoorState(cap=3000, seen=True), 3000, SURE[:1], resume_until=160.0)
    assert (resumed.decision.cap, resumed.decision.reason, resumed.change) == (3000, "resumed", False)
    assert resumed.state == DoorState(cap=3000, seen=True)
    blind = tick(DoorState(cap=3000, seen=True), 3000, (), resume_until=160.0)  # no window yet at all
    assert (blind.decision.cap, blind.decision.reason) == (3000, "resumed")
    late = tick(DoorState(cap=3000, seen=True), 3000, SURE[:1], resume_until=100.0)
    assert (late.decision.cap, late.decision.reason, late.change) == (None, "too_few_windows", True)
    sure = tick(DoorState(cap=3000, seen=True), 3000, SURE, resume_until=160.0)
    assert (sure.decision.cap, sure.change) == (4000, True)


def test_a_cap_within_tolerance_is_not_set_again() -> None:
    assert not tick(DoorState(cap=3700, seen=True), 3700, SURE).change
    assert tick(DoorState(cap=3500, seen=True), 3500, SURE).change


def test_the_store_keeps_the_door_flat_as_it_always_has() -> None:
    state = Steering(door=DoorState(cap=3000, seen=True, manual_until=9.0, sent=4000, sent_seen=True))
    flat = state.to_dict()
    assert {k: flat[k] for k in ("cap", "cap_seen", "cap_manual_until", "cap_sent", "cap_sent_seen")} == {
        "cap": 3000, "cap_seen": True, "cap_manual_until": 9.0, "cap_sent": 4000, "cap_sent_seen": True}  # fmt: skip
    assert Steering.from_dict(flat) == state
    assert Steering.from_dict({"limit": None, "cap": 3000}).door == DoorState(cap=3000)  # an older store: some
    assert state.without_door().door == DoorState()
