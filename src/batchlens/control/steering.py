"""One engine's controller tick as the hook runs it live: the law, plus what a live engine adds. Pure.

The law (control/law.py) knows only signals. Live, three more things decide
who owns the limit, checked in this order each tick:

1. **A hand on the knob.** The limit in force changed since the last tick to a
   value batchlens did not set: somebody set it by hand (or the engine
   restarted). The controller follows it and pauses for
   ``control.manual_hold_seconds``; the log says so.
2. **The breaker.** While it is open it is the outer safety layer: the limit
   is the smaller of the two, so the controller may still cut, never raise.
   Its own limit follows the one in force, and when the breaker closes control
   resumes from there.
3. **No window yet.** The first tick after a start, or after the engine did
   not answer, only takes a sample: never act blind. (An engine that does not
   answer is not steered at all: the hook counts ``no_signal`` and retries.)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields, replace

from batchlens.config import Control
from batchlens.control.admission import AdmissionSettings
from batchlens.control.capacity import Capacity
from batchlens.control.door import DoorState
from batchlens.control.law import Peak, State, Tuning, decide
from batchlens.control.signals import Window
from batchlens.goodput import Slo
from batchlens.predicted_ttft import BACKSTOP

#: Reasons a tick decides nothing of the law's own, as metric labels (besides the law's reasons).
LIVE_REASONS = ("manual_hold", "breaker_open", "gpu_fault", "no_signal", "warming_up", "out_of_bounds")
MODEL_SAVE_SECONDS = 30.0  # the capacity model alone changed: saved at most this often (a store write per tick else)


@dataclass(frozen=True)
class Steering:
    """What the controller keeps of an engine across ticks and restarts (the hook's store holds it)."""

    law: State | None = None  # the law's own state; None until the controller's first tick
    seen_limit: int | None = None  # the limit in force at the last tick
    manual_until: float = 0.0
    door: DoorState = field(default_factory=DoorState)  # the door's queued-token cap (control/door.py)

    @property
    def limit(self) -> int | None:
        """The controller's limit; None until its first tick."""
        return None if self.law is None else self.law.limit

    def with_limit(self, limit: int) -> Steering:
        return replace(self, law=State(limit) if self.law is None else replace(self.law, limit=limit))

    def without_model(self) -> Steering:
        """All but the law's capacity model: what must reach the store at every change. The model moves every
        tick and is learned again in a minute, so the controller saves it only now and then (MODEL_SAVE_SECONDS)."""
        return self if self.law is None else replace(self, law=replace(self.law, capacity=None))

    def without_door(self) -> Steering:
        """All but what it keeps of the door: with admission off, a cap stored by a run with it on is no
        reference."""
        return replace(self, door=DoorState())

    def to_dict(self) -> dict:
        """Flat, as the store has always held it: the law's fields beside the live ones."""
        law = {} if self.law is None else asdict(self.law)  # the peak and the capacity model too, as dicts
        door = {key: getattr(self.door, name) for name, key in _DOOR.items()}
        return {"limit": None, **law, "seen_limit": self.seen_limit, "manual_until": self.manual_until, **door}

    @classmethod
    def from_dict(cls, data: dict) -> Steering:
        door = DoorState(**{name: data[key] for name, key in _DOOR.items() if key in data})  # older: none, or some
        live = cls(seen_limit=data.get("seen_limit"), manual_until=data.get("manual_until", 0.0), door=door)
        if data.get("limit") is None:
            return live
        peak = data.get("peak")
        # A peak stored with the time it was last seen (older stores) loads without it; one stored without the
        # limit it was seen under loads as seen under any (0), as the law judged it then.
        peak = None if peak is None else Peak(peak["batch"], peak["tokens_per_second"], peak.get("limit", 0))
        # A store from before the capacity model, or with one it cannot read, loads without it: the model is
        # learned again in a minute of windows, and a broken one must not stop the controller.
        try:
            capacity = Capacity.from_dict(data["capacity"])
        except (KeyError, TypeError, ValueError):
            capacity = None
        law = {k: data[k] for k in _LAW if k in data}
        return replace(live, law=State(**law, peak=peak, capacity=capacity))


_LAW = tuple(f.name for f in fields(State) if f.name not in ("peak", "capacity"))
#: The door's fields as the store has always held them, flat beside the limit's: cap, cap_seen, cap_sent, ...
_DOOR = {f.name: f.name if f.name == "cap" else f"cap_{f.name}" for f in fields(DoorState)}


@dataclass(frozen=True)
class Tick:
    state: Steering
    reason: str  # one of the law's reasons or LIVE_REASONS
    event: str = ""  # "manual": this tick found a hand on the knob; "resumed": its pause just ended


def tuning(control: Control, capacity: int, door: bool = False) -> Tuning:
    """The law's bounds for an engine: the config's, never above its capacity. ``door``: batchlens keeps a
    queued-token cap on it (admission on, not a dry run, and the engine's cap route answers)."""
    top = min(control.max_limit or capacity, capacity)
    return Tuning(
        min_limit=min(control.min_limit, top), max_limit=top, kv_target=control.kv_target,
        drain_seconds=control.drain_seconds, max_step=control.max_step, past_peak=control.past_peak,
        keep_up=control.keep_up, door=door,
    )  # fmt: skip


def door_settings(control: Control, ttft_seconds: float) -> AdmissionSettings:
    """The door's settings from the config's control: section, live and in a replay alike: with the per-request
    door in front, the cap is its backstop (predicted_ttft.BACKSTOP)."""
    margin = control.admission_margin * (BACKSTOP if control.admission_predict else 1.0)
    return AdmissionSettings(ttft_seconds, margin, control.admission_confidence,
                             control.admission_min_windows, control.admission_stale_seconds)  # fmt: skip


def predicted_ttft_bound(control: Control, ttft_seconds: float) -> float | None:
    """The TTFT past which the plugin's per-request door refuses a request; None: no such door."""
    return ttft_seconds * (1 + control.admission_predict_margin) if control.admission_predict else None


def bounds_said(control: Control, capacity: int) -> tuple[str, bool]:
    """What the controller will use on an engine of ``capacity`` slots, and whether the config asked for more
    (then the text says which settings, and why they were cut)."""
    bounds = tuning(control, capacity)
    start = control.start_limit
    wanted = {"min_limit": control.min_limit, "max_limit": control.max_limit, "start_limit": start}
    over = [f"{key} {value}" for key, value in wanted.items() if value is not None and value > capacity]
    used = f"limits {bounds.min_limit}..{bounds.max_limit}"
    if start is not None:
        used += f", starting at {bounds.clamp(start)}"
    if not over:
        return used, False
    return f"{used}: control.{', control.'.join(over)} above the engine's capacity {capacity} (max_num_seqs)", True


def steer(
    state: Steering,
    *,
    now: float,
    in_force: int,
    set_by_batchlens: Collection[int | None],
    breaker_open: bool,
    signals: Window | None,  # None: the first sample since the start or since the engine last failed
    slo: Slo,
    control: Control,
    capacity: int,
    door: bool = False,
    gpu_fault: bool = False,
) -> Tick:
    """``in_force``: the limit the admin API reports; ``set_by_batchlens``: the limits the hook put or is putting;
    ``door``: batchlens keeps a queued-token cap on the engine (Controller._door_works); ``gpu_fault``: a GPU of
    the engine is failing (gpu_faults.GPU_FAULT_ALERTS fire or are pending for it)."""
    bounds = tuning(control, capacity, door)
    if state.limit is None:  # the first tick: from the configured start, or from where the engine is
        start = in_force if control.start_limit is None else control.start_limit
        state = state.with_limit(bounds.clamp(start))
    moved = state.seen_limit is not None and in_force != state.seen_limit
    state = replace(state, seen_limit=in_force)
    if moved and in_force not in set_by_batchlens:
        held = replace(state.with_limit(in_force), manual_until=now + control.manual_hold_seconds)
        return Tick(held, "manual_hold", "manual")
    if now < state.manual_until:
        return Tick(state.with_limit(in_force), "manual_hold")
    event = "resumed" if state.manual_until else ""
    state = replace(state, manual_until=0.0)
    if breaker_open:
        state = state.with_limit(in_force)
    if bounds.clamp(state.limit) != state.limit and not breaker_open:
        # A hand's limit once its hold is over, or a store from before the bounds changed: the law answers only
        # within them, so the limit comes within them first (the breaker's own cut is the breaker's to lift).
        return Tick(state.with_limit(bounds.clamp(state.limit)), "out_of_bounds", event)
    if gpu_fault:
        # A window of a failing GPU shows the GPU, not the batch: no move, and nothing learned from it (a peak
        # "past" there would hold the limit down long after the GPU was replaced).
        return Tick(state, "gpu_fault", event)
    if signals is None:
        return Tick(state, "warming_up", event)
    decision = decide(state.law, signals, now, slo, bounds)
    if breaker_open and decision.limit >= in_force:
        return Tick(state, "breaker_open", event)
    return Tick(replace(state, law=decision.state), decision.reason, event)
