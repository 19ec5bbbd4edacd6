"""The door's live rules: what becomes of an engine's queued-token cap at a tick. Pure.

control/admission.py estimates the cap from the saturated windows. Live, more
decides whether it is set, checked in this order each tick (as
``steering.steer`` does for the limit):

1. **A hand on the cap.** The cap in force is neither the one batchlens last
   set or found nor the one it last sent (a PUT that failed or was cut off may
   have landed): somebody set it (or the engine restarted). It stands for
   ``manual_hold_seconds``, and while it stands it is also the target.
2. **Just started onto a cap.** After a restart (``kill -9``) or onto a cap set
   at launch, the cap in force stands until the estimate is sure or has had
   ``stale_seconds`` to be: lifting it would open the door on a loaded engine.
3. **Worth a change.** A cap within the tolerance of the one in force is not
   set again; opening or closing the door always is.

The hook (remediation/controller.py) reads the cap in force, calls
:func:`admit` and sends what it says; a replay (replay/policies.py) calls the
same function, where no hand moves the cap and nothing restarts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from batchlens.control.admission import AdmissionSettings, CapDecision, Saturated, queued_token_cap, worth_setting


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: A cap batchlens has neither read nor set on an engine (None is "no cap").
UNSET = _Unset()


@dataclass(frozen=True)
class DoorState:
    """What the controller keeps of an engine's door across ticks and restarts (the hook's store holds it)."""

    cap: int | None = None  # the cap batchlens last set or found in force (None: no cap)
    seen: bool = False  # whether it ever read or set one: a restart goes on from it
    manual_until: float = 0.0  # until when a cap set by hand stands
    # The cap last sent, where sent_seen, until the next read: a PUT that failed or was cut off may have landed,
    # so finding it is no hand's.
    sent: int | None = None
    sent_seen: bool = False

    @property
    def known(self) -> int | _Unset | None:
        """The cap batchlens last set or found (None: no cap), or UNSET: none yet."""
        return self.cap if self.seen else UNSET

    def sending(self, cap: int | None) -> DoorState:
        """Before a PUT of ``cap``, kept (and stored) so that neither the next tick nor a restart after a kill -9
        takes the cap it finds for a hand's, should the PUT land and still fail or time out."""
        return replace(self, sent=cap, sent_seen=True)

    def landed(self, cap: int | None) -> DoorState:
        """After the PUT of ``cap`` succeeded."""
        return replace(self, cap=cap, seen=True)

    def opened_by_hand(self, now: float) -> bool:
        """A hand lifted the cap and its hold stands: nothing sheds until it is over."""
        return self.cap is None and now < self.manual_until


@dataclass(frozen=True)
class DoorTick:
    state: DoorState  # the cap in force taken as known, and a hand's hold where one was found
    decision: CapDecision  # the cap the engine should have, and why (CAP_REASONS, manual_hold or resumed)
    change: bool = False  # set decision.cap now (the caller marks it sent, then landed)
    manual: bool = False  # this tick found a hand on the cap


def admit(
    state: DoorState,
    *,
    now: float,
    in_force: int | None,
    history: Sequence[Saturated],
    settings: AdmissionSettings,
    manual_hold_seconds: float,
    resume_until: float = float("-inf"),
) -> DoorTick:
    """``in_force``: the cap the engine's admin API reports; ``history``: the saturated windows seen (oldest
    first); ``resume_until``: until when a cap found in force at the start stands for want of an estimate."""
    sent = state.sent if state.sent_seen else UNSET
    manual = state.known is not UNSET and in_force != state.known and in_force != sent
    until = now + manual_hold_seconds if manual else state.manual_until
    state = DoorState(cap=in_force, seen=True, manual_until=until)  # the first tick, a restart or a hand: go on
    estimate = queued_token_cap(history, now, settings)
    if now < until:
        # The cap in force stands, and is the target too: +Inf would read as a door about to open.
        return DoorTick(state, CapDecision(in_force, "manual_hold", estimate.prefill_tokens_per_second), manual=manual)
    if (estimate.cap is None and estimate.reason in ("no_signal", "too_few_windows") and in_force is not None
            and now < resume_until):  # fmt: skip
        return DoorTick(state, CapDecision(in_force, "resumed", None))
    return DoorTick(state, estimate, change=worth_setting(in_force, estimate.cap, settings))
