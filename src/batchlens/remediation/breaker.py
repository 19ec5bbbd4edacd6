"""The P99 breaker of one engine, as a pure state machine: (state, event) -> decision. No clock, no I/O.

The hook feeds it three events, each with the time it happened:

- **firing**: Alertmanager delivered ``VllmP99LatencyBreaker`` firing, with the
  alert's ``startsAt`` and what the admin API says now (:class:`Observation`);
- **resolved**: Alertmanager delivered it resolved;
- **tick**: time passed (recovery is driven by the clock, not by alerts).

The rules (docs/architecture.md, "Breaker semantics"):

- A firing delivery outside the cooldown halves the limit (floor 1) and counts a
  strike. The strike that reaches ``strikes`` sets the cold-start limit instead
  and pages once for the episode. Inside the cooldown a delivery is only
  recorded: retries, HA duplicates, replays and early repeats never act twice.
- A firing delivery whose ``startsAt`` is no newer than a resolution already
  seen belongs to a finished episode (an out-of-order delivery) and never acts.
  A resolution counts as of no later than it arrived, whatever its ``startsAt``
  says: one dated ahead must not mark the next real episode "already resolved".
- **The overload trap.** When the queue is already ``overload_queue_ratio``
  batches long, latency comes from missing capacity, not from the batch size:
  halving would cut throughput and lengthen the queue. The breaker then holds
  the limit, counts no strike (cold start would be the worst answer), and
  escalates "capacity" to on-call once per episode.
- **The door holds the queue.** With admission on (a queued-token cap in
  force), the queue is kept short by refusing arrivals, so it never looks
  long; when requests wait or the door refuses some, and the pace is within
  the SLO, P99 still comes from the queue, and halving would only shed more.
  The breaker holds and pages "capacity" the same way, with the door's
  figures in the reason.
- **Silence ends an episode.** Alertmanager repeats a firing alert every
  repeat_interval. An open breaker (tripped, cold start, or holding with a
  page out) that has had no firing delivery for ``firing_silence_seconds``,
  counted at the earliest from when the hook began to hear the engine (its
  start, or the engine joining), takes the episode for over,
  as if it had resolved: its resolution was lost (the hook was down when it
  came), or the firing was one that nobody will resolve, and either would
  hold the limit down for good. An Alertmanager silence or inhibition of the
  breaker alert stops the repeats too, and so ends the episode the same way.
- Recovery starts when the alert resolves. Each ``recovery_interval_seconds``
  without a new trigger adds max(1, 10% of the original limit), up to the
  limit the engine had before the first strike; reaching it closes the breaker
  and clears the strikes. A trigger during recovery halves again.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from batchlens.config import Breaker as Settings

RECOVERY_STEP = 0.10  # of the original limit, per recovery interval
HOLDING = "Holding the limit; escalating to on-call"


@dataclass(frozen=True)
class Observation:
    """The engine as its admin API reports it just before a decision."""

    limit: int  # max_num_active_seqs
    capacity: int  # max_num_seqs
    running: int
    waiting: int
    door: Door | None = None  # the admission cap in force, when the controller has set one


@dataclass(frozen=True)
class Door:
    """The engine's door as the controller last saw it: a queued-token cap in force, and the minute behind it."""

    cap_tokens: int
    shed_share: float  # of the minute's arrivals, refused at the door (0 when nothing arrived)
    pace_seconds: float  # the minute's mean gap between tokens (NaN when no token was given)
    tpot_seconds: float  # the SLO's bound on that gap
    prefill_tokens_per_second: float | None  # the rate the cap was set from

    def queue_bound(self, waiting: int) -> bool:
        """Demand is past what the door admits (requests wait, or it refused some) while the batch keeps its pace
        (a NaN pace, no token seen, is not within the SLO)."""
        return (waiting > 0 or self.shed_share > 0) and self.pace_seconds <= self.tpot_seconds

    def said(self) -> str:
        rate = (
            ""
            if self.prefill_tokens_per_second is None
            else f", from {self.prefill_tokens_per_second:.0f} prefill tokens/s"
        )
        return (f"the door caps the queue at {self.cap_tokens} tokens{rate} and refuses {self.shed_share:.0%} of "
                f"arrivals; the pace is {self.pace_seconds * 1e3:.0f} ms/token, within the SLO's "
                f"{self.tpot_seconds * 1e3:.0f} ms")  # fmt: skip


@dataclass(frozen=True)
class EngineState:
    mode: str = "closed"  # one of remediation.states.BREAKER_STATES
    strikes: int = 0
    original_limit: int | None = None  # the limit before the first strike of the episode
    target_limit: int | None = None  # the limit the hook wants in force
    applied_limit: int | None = None  # the last target the admin API confirmed, or the limit found at start
    capacity: int | None = None
    last_action_at: float | None = None  # start of the cooldown
    episode_starts_at: float | None = None  # startsAt of the firing alert last acted on
    resolved_through: float | None = None  # newest startsAt seen resolved
    recovering_since: float | None = None  # when recovery began or last stepped
    paged: tuple[str, ...] = ()  # reasons already paged in this episode
    firing_seen_at: float | None = None  # when the newest firing delivery of the episode came (acted on or not)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> EngineState:
        """A saved state; fields it does not know (a newer release's) are left out, and a null ``paged`` is none."""
        known = {f.name for f in fields(cls)} - {"paged"}
        return cls(**{k: v for k, v in data.items() if k in known}, paged=tuple(data.get("paged") or ()))


#: What a decision can do ("none" aside).
ACTIONS = ("halve", "cold_start", "hold_overload", "raise", "recovered", "resolved")


@dataclass(frozen=True)
class Decision:
    state: EngineState
    action: str  # one of ACTIONS, or none
    reason: str
    set_limit: int | None = None  # the absolute limit to PUT: replaying it never halves twice
    page: str | None = None  # "cold_start" or "capacity": page on-call for this, once per episode
    resolved_pages: tuple[str, ...] = ()  # the episode ended: resolve these pages
    skipped: str = ""  # why no action, as a metric label: cooldown | stale | cold_start_hold | recorded

    @property
    def acted(self) -> bool:
        return self.set_limit is not None


def _none(state: EngineState, reason: str, skipped: str = "recorded") -> Decision:
    return Decision(state, "none", reason, skipped=skipped)


def without_future_times(state: EngineState, *, now: float, skew: float) -> EngineState:
    """The state less any alert time later than ``now + skew``: such a time marks every real firing before it
    stale, or holds off its own episode's resolution, for good. The webhook refuses them; this clears a state
    saved before it did."""
    future = {f: None for f in ("resolved_through", "episode_starts_at") if (getattr(state, f) or 0) > now + skew}
    return replace(state, **future) if future else state


def on_firing(state: EngineState, *, starts_at: float, now: float, obs: Observation, settings: Settings) -> Decision:
    if state.resolved_through is not None and starts_at <= state.resolved_through:
        return _none(state, "out-of-order delivery: this episode has already resolved", "stale")
    state = replace(state, firing_seen_at=now)  # the episode still fires: silence has not ended it
    if state.last_action_at is not None and now - state.last_action_at < settings.cooldown_seconds:
        left = settings.cooldown_seconds - (now - state.last_action_at)
        return _none(state, f"inside the cooldown ({left:.0f} s left): recorded, not acted on", "cooldown")
    if state.mode == "cold_start":
        return _none(state, "already in cold-start mode: waiting for the alert to resolve", "cold_start_hold")
    original = state.original_limit if state.mode in ("tripped", "recovering") else obs.limit
    state = replace(state, capacity=obs.capacity, episode_starts_at=starts_at)
    # A capped door that has requests waiting or refuses some, at a pace within the SLO: the queue breaks P99.
    door = obs.door if obs.door is not None and obs.door.queue_bound(obs.waiting) else None
    if door is not None or obs.waiting >= settings.overload_queue_ratio * max(obs.limit, 1):
        page = None if "capacity" in state.paged else "capacity"
        state = replace(state, paged=(*state.paged, "capacity") if page else state.paged, last_action_at=now)
        why = (
            f"{door.said()}: P99 comes from the queue, not the batch, and halving would only refuse more"
            if door is not None
            else "demand exceeds capacity, and halving would lengthen the queue"
        )
        reason = f"{obs.waiting} requests wait behind a batch of {obs.limit}: {why}. " + HOLDING
        return Decision(state, "hold_overload", reason, page=page)
    strikes = state.strikes + 1
    base = replace(state, strikes=strikes, original_limit=original, last_action_at=now, recovering_since=None)
    if strikes >= settings.strikes:
        limit = min(settings.cold_start_limit, obs.capacity)
        page = None if "cold_start" in state.paged else "cold_start"
        paged = (*state.paged, "cold_start") if page else state.paged
        new = replace(base, mode="cold_start", target_limit=limit, paged=paged)
        reason = f"strike {strikes} of {settings.strikes}: cold start at {limit}"
        return Decision(new, "cold_start", reason, limit, page)
    limit = max(1, obs.limit // 2)
    new = replace(base, mode="tripped", target_limit=limit)
    return Decision(new, "halve", f"strike {strikes} of {settings.strikes}: {obs.limit} -> {limit}", limit)


def on_resolved(state: EngineState, *, starts_at: float, now: float) -> Decision:
    # What a resolution marks over is dated no later than it came: an episode that starts after that is a new one,
    # whatever startsAt the resolution claims (a clock ahead of ours, or a forgery dated ahead to blind the breaker).
    through = min(starts_at, now)
    newest = through if state.resolved_through is None else max(state.resolved_through, through)
    state = replace(state, resolved_through=newest)
    if state.episode_starts_at is not None and starts_at < state.episode_starts_at:
        return _none(state, "out-of-order resolution of an older episode: recorded")
    if state.mode in ("tripped", "cold_start"):
        return Decision(replace(state, mode="recovering", recovering_since=now), "resolved", "recovery begins")
    if state.mode == "closed" and state.paged:
        # An episode that only held (hold_overload) ends here, with no recovery to close it: its page resolves,
        # and the next episode may page again.
        return Decision(replace(state, paged=()), "resolved", "the held episode is over", resolved_pages=state.paged)
    return _none(state, f"resolved while {state.mode}: recorded")


def on_tick(state: EngineState, *, now: float, settings: Settings, listening_since: float = 0.0) -> Decision:
    """``listening_since``: when the hook began to take the engine's deliveries (its start, or the engine joining):
    before, Alertmanager's repeats went unheard, and that is no silence."""
    heard = state.firing_seen_at if state.firing_seen_at is not None else state.last_action_at  # saved before the field
    # Neither saved (a store written by hand, or by no release of ours): silence counts from when the hook listened.
    quiet = now - max(listening_since if heard is None else heard, listening_since)
    if quiet >= settings.firing_silence_seconds:
        silence = (f"no firing delivery for {quiet:.0f} s (breaker.firing_silence_seconds): the episode is "
                   "taken for over, its resolution lost")  # fmt: skip
        if state.mode in ("tripped", "cold_start"):
            return Decision(replace(state, mode="recovering", recovering_since=now), "resolved",
                            f"{silence}; recovery begins")  # fmt: skip
        if state.mode == "closed" and state.paged:
            return Decision(replace(state, paged=()), "resolved", silence, resolved_pages=state.paged)
    if state.mode != "recovering" or state.recovering_since is None:
        return _none(state, "")
    if now - state.recovering_since < settings.recovery_interval_seconds:
        return _none(state, "")
    original = state.original_limit or 1
    ceiling = min(original, state.capacity or original)
    step = max(1, math.floor(RECOVERY_STEP * original))
    limit = min(ceiling, (state.target_limit or 1) + step)
    if limit >= ceiling:
        closed = EngineState(
            capacity=state.capacity,
            resolved_through=state.resolved_through,
            target_limit=limit,
            applied_limit=state.applied_limit,
        )
        return Decision(closed, "recovered", f"back to {limit}: breaker closed", limit, resolved_pages=state.paged)
    return Decision(replace(state, target_limit=limit, recovering_since=now), "raise", f"recovery: -> {limit}", limit)
