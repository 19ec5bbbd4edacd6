"""The controller's loop in `batchlens remediate`: read each engine, steer, say what the limit should be.

Every ``control.interval_seconds`` each engine is read directly, not through
Prometheus (whose scrape lag is too slow for a loop): the admin API for the
limit in force, and the engine's own ``/metrics`` for the signals. Engines are
read concurrently and decided independently. The hook's actuator then applies
:meth:`Controller.wanted` with the breaker's target, so one process, one store
and one admin client own every limit.

An engine that does not answer, answers late, or answers something that is not
its metrics is not steered: the tick counts ``no_signal``, logs it once, and its
next good answer starts a fresh window.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from batchlens.config import Config, by_instance
from batchlens.control.admission import CapDecision, Saturated, saturated, worth_setting
from batchlens.control.door import UNSET, DoorState, admit
from batchlens.control.law import one_slot
from batchlens.control.signals import EngineSample, NotFinite, Window, read_sample, window
from batchlens.control.steering import (
    MODEL_SAVE_SECONDS,
    Steering,
    Tick,
    bounds_said,
    door_settings,
    predicted_ttft_bound,
    steer,
)
from batchlens.exporter.http_get import HttpGetter
from batchlens.exporter.parser import ExpositionReader, ParseError
from batchlens.exporter.sampler import SourceError
from batchlens.remediation.admin_client import AdminCallError, AdminClient, DeploymentAdmin
from batchlens.remediation.breaker import Door, EngineState
from batchlens.remediation.store import Store

log = logging.getLogger("batchlens.control")
ESTIMATE_SECONDS = 60.0  # the attainment and goodput estimates cover about this much of the past
__all__ = ["UNSET", "Controller", "Estimate", "holds"]  # UNSET: the door's, re-exported for the hook's server


@dataclass(frozen=True)
class Estimate:
    attainment: float  # NaN while nothing was served
    goodput_rps: float


TICK_BEATS = 8  # the engines' ticks are spread over this many beats of the interval
#: Upper bounds of batchlens_controller_tick_seconds' buckets: a tick past the interval (2 s by default) is late.
TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass
class TickTimes:
    """How long the engines' ticks took, from the start due to the decision made: one histogram for the hook (a
    label per engine would grow with the fleet). A tick that waits for the event loop counts that wait too."""

    counts: list[int] = field(default_factory=lambda: [0] * len(TICK_BUCKETS))  # per bucket, not cumulative
    count: int = 0
    sum: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        for i, bound in enumerate(TICK_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                return


@dataclass
class _Engine:
    """What the controller knows of one engine while it runs, beside its Steering (which the store keeps): learned
    again after a restart, or said again in the log."""

    urls: list[str]  # its /metrics: one server's, or every server's of a deployment, judged as one engine
    readers: list[ExpositionReader] = field(default_factory=list)  # one per url: its series parsed, kept
    samples: deque[EngineSample] = field(default_factory=deque)  # about a minute of them
    minute: Window | None = None  # its last minute, for the breaker's view of the door
    saturated: deque[Saturated] = field(default_factory=lambda: deque(maxlen=64))  # the door's windows
    due: float = 0.0
    in_flight: asyncio.Task | None = None
    started: float = 0.0  # time.monotonic() at the start of the tick in flight
    saved_at: float = -math.inf  # when its state last went to the store
    capacity: int | None = None  # the max_num_seqs its bounds were last said for
    door_answers: bool = False  # its cap route answered the last tick's calls
    failing: str | None = None  # the reading's failure last logged
    admission_failing: str | None = None  # the cap's failure last logged
    dry_run_said: object = UNSET  # the cap a dry run last said it would set
    behind_said: list[int] = field(default_factory=list)  # its API servers without the caps, last said
    fault_said: str = ""  # the GPU fault last said


def holds(breaker: EngineState) -> bool:
    """Whether the breaker's limit holds the controller's: tripped or in cold start, the controller may cut, never
    raise. Recovering, the breaker's limit is a ceiling that grows a step per recovery interval, and the
    controller steers under it (:meth:`Controller.wanted`): held instead, it stayed where the breaker had cut it
    while the log said the breaker raised, until the breaker closed."""
    return breaker.mode in ("tripped", "cold_start")


class Controller:
    def __init__(
        self,
        config: Config,
        store: Store,
        admins: Mapping[str, AdminClient | DeploymentAdmin],
        on_decided: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ):
        self.control = config.control
        # The hook's own dry run (breaker.dry_run, remediate --dry-run) sets no limit that the controller wants,
        # and the door, which the controller sets itself, must not shed what that run leaves alone.
        self.door_dry_run = config.control.dry_run or config.breaker.dry_run
        self.slo = config.slo
        self.store = store
        self._http = HttpGetter()  # the exporter's GET: one pool of kept-alive connections to the engines
        self._admins = admins
        self._limit = config.exporter.max_response_bytes
        deployments = by_instance(config.engines)
        self._engines = {name: _Engine([s.url + "/metrics" for s in servers], [ExpositionReader() for _ in servers])
                         for name, servers in deployments.items()}  # fmt: skip
        saved = store.controls()
        # The controller's outputs, by engine: what it keeps (stored), the caps and estimates the hook exports.
        self.states = {name: saved.get(name, Steering()) for name in self._engines}
        if not config.control.admission:  # a cap stored by an earlier run with the door on is no reference now
            self.states = {name: s.without_door() for name, s in self.states.items()}
        self._started = started = clock()
        for i, engine in enumerate(self._engines.values()):
            # Spread over the interval in a few beats: a fleet's ticks all at once queue behind each other (at 256
            # engines the last waited most of an interval), and a beat per engine would run the hook's pass as often.
            engine.due = started + config.control.interval_seconds * (i % TICK_BEATS) / TICK_BEATS
        for name, state in self.states.items():
            if state.manual_until > started:  # a restart must not hide that a hand still holds the knob
                log.warning("%s: a limit set by hand still holds control off for %.0f s (manual_hold_seconds), at %s",
                            name, state.manual_until - started, state.limit)  # fmt: skip
            if state.door.manual_until > started:
                log.warning("%s: a queued-token cap set by hand still holds the door's control off for %.0f s "
                            "(manual_hold_seconds), at %s", name, state.door.manual_until - started,
                            _cap(state.door.cap))  # fmt: skip
        self.decisions: Counter[tuple[str, str]] = Counter()  # (instance, reason)
        self.estimates: dict[str, Estimate] = {}
        self.caps: dict[str, CapDecision] = {}  # the cap each engine should have, and why
        self.tick_times = TickTimes()
        #: instance -> what ails a GPU of it (remediation.confirm.fault_text), as the hook last asked Prometheus
        self.gpu_faults: dict[str, str] = {}
        self._on_decided = on_decided
        self._admission = door_settings(config.control, config.slo.ttft_seconds) if config.control.admission else None
        self._predicted_bound = predicted_ttft_bound(config.control, config.slo.ttft_seconds)

    def wanted(self, name: str, breaker: EngineState, now: float) -> int | None:
        """The limit the hook should have in force: the controller's, or the smaller one while the breaker is open
        (its limit a floor it holds to while tripped, a ceiling while recovering).

        None leaves the breaker's target alone: control is off for this engine (dry run, paused by hand, or not
        yet started).
        """
        state = self.states.get(name)  # None: an engine found after start (discovery), which control never read
        if self.control.dry_run or state is None or state.limit is None or now < state.manual_until:
            return None
        if breaker.mode != "closed" and breaker.target_limit is not None:
            return min(breaker.target_limit, state.limit)
        return state.limit

    def cap_in_force(self, name: str) -> object:
        """The queued-token cap batchlens last set or found on the engine (None: no cap), or UNSET: none yet."""
        state = self.states.get(name)
        return UNSET if state is None else state.door.known

    def _door_works(self, name: str) -> bool:
        """Whether batchlens keeps a door on the engine: admission on, not a dry run, and its cap route answers.

        A door that fails open for want of figures still counts: the backlog that growth builds gives it its
        saturated windows within a few ticks, and then it sheds. A route that errs (a release without caps and
        without the plugin's middleware) never will."""
        return self._admission is not None and not self.door_dry_run and self._engines[name].door_answers

    def door(self, name: str) -> Door | None:
        """The engine's door for the breaker: None unless batchlens holds a queued-token cap in force on it."""
        cap, minute = self.cap_in_force(name), self._engines[name].minute if name in self._engines else None
        if self._admission is None or not isinstance(cap, int) or minute is None:
            return None
        rate = self.caps[name].prefill_tokens_per_second if name in self.caps else None
        return Door(cap, minute.shed_share, minute.itl.mean, self.slo.tpot_seconds, rate)

    def tick(self, now: float, breakers: Mapping[str, EngineState]) -> None:
        """Start a read-and-decide for every engine that is due; each runs on its own, so a hanging engine
        delays nobody else. ``on_decided`` is called when one finishes, for the hook to apply what it chose."""
        interval = self.control.interval_seconds
        for name, engine in self._engines.items():
            # Due, or the wall clock stepped back (NTP) past the interval: a tick now, not in an hour.
            at = engine.due
            if (now >= at or at - now > interval) and engine.in_flight is None:
                # On the interval's beat, not from whenever the hook's pass came round to it: a tick taken late
                # does not push every later one back (unless it is a whole interval late: then from now).
                engine.due = at + interval if 0 <= now - at < interval else now + interval
                task = asyncio.create_task(self._tick_one(name, now, breakers), name=f"control-{name}")
                engine.in_flight, engine.started = task, time.monotonic()
                task.add_done_callback(lambda _t, name=name: self._done(name))

    def next_due(self) -> float:
        """When the next tick is due (the hook's loop waits no longer), +inf while every engine has one in flight."""
        return min((e.due for e in self._engines.values() if e.in_flight is None), default=math.inf)

    def _done(self, name: str) -> None:
        engine = self._engines[name]
        task, engine.in_flight = engine.in_flight, None
        assert task is not None
        self.tick_times.add(time.monotonic() - engine.started)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: a controller tick failed", name, exc_info=task.exception())
        self._on_decided()

    async def close(self) -> None:
        await self.cancel_ticks()
        await self._http.aclose()

    async def cancel_ticks(self) -> None:
        tasks = [e.in_flight for e in self._engines.values() if e.in_flight is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def take_over(self, saved: Mapping[str, dict], now: float) -> None:
        """Go on from the steering another hook kept (leader election), and read each engine afresh."""
        for name, data in saved.items():
            if name in self.states:
                self.states[name] = Steering.from_dict(data)
                await self.store.run(self.store.save_control, name, self.states[name], now)
        for engine in self._engines.values():  # windows from before the move are another hook's, or old
            engine.samples.clear()
            engine.saturated.clear()
            engine.minute = None

    async def _tick_one(self, name: str, now: float, breakers: Mapping[str, EngineState]) -> None:
        batch = None
        try:
            async with asyncio.timeout(self.control.timeout_seconds):
                batch = await self._admins[name].get()
                sample = read_sample(await self._fetch(name), now, self._engines[name].readers)
        except Exception as exc:  # whatever an engine answers, a failed reading is counted, never fatal
            why = f"no answer within {self.control.timeout_seconds:g} s (control.timeout_seconds)" if isinstance(
                exc, TimeoutError) else str(exc)  # fmt: skip
            foreseen = isinstance(exc, (TimeoutError, AdminCallError, SourceError, ParseError, NotFinite))
            if not foreseen and self._engines[name].failing != why:  # its traceback once, not every tick
                log.error("%s: an engine's answer the controller cannot read", name, exc_info=exc)
            self._not_steered(name, why)
            if self._admission is not None:
                # No window to estimate from, and the cap must still go once its figures are stale (the door fails
                # open, never shut): the cap route may answer where the engine core or /metrics does not.
                await self._admit(name, None, now)
            return
        engine = self._engines[name]
        if engine.failing is not None:
            engine.failing = None
            log.info("%s: answering again: steering resumes after one more reading", name)
        if engine.capacity != batch.max_num_seqs:  # once, and again if the engine came back resized
            engine.capacity = batch.max_num_seqs
            said, clamped = bounds_said(self.control, batch.max_num_seqs)
            log.log(logging.WARNING if clamped else logging.INFO, "%s: the controller uses %s", name, said)
        signals = self._remember(name, sample)
        before, breaker = self.states[name], breakers[name]  # the breaker as it is now, after the reads
        fault = self.gpu_faults.get(name, "")
        if fault != engine.fault_said:
            if fault:
                log.warning("%s: a GPU of it is failing (%s): the controller holds the limit and learns nothing "
                            "from its windows until the GPU alerts clear", name, fault)  # fmt: skip
            else:
                log.info("%s: its GPU alerts cleared: steering resumes", name)
            engine.fault_said = fault
        # Limits the hook set or is setting right now (a PUT may land between our read and its bookkeeping).
        ours = {breaker.applied_limit, breaker.target_limit, before.limit}
        result = steer(
            before, now=now, in_force=batch.max_num_active_seqs, set_by_batchlens=ours,
            breaker_open=holds(breaker), signals=signals, slo=self.slo, control=self.control,
            capacity=batch.max_num_seqs, door=self._door_works(name), gpu_fault=bool(fault),
        )  # fmt: skip
        self.decisions[(name, result.reason)] += 1
        # In force in memory before the log says so: a scrape between the two must not miss the target.
        self.states[name] = result.state
        self._report(name, before, result, signals, batch.max_num_active_seqs)
        if result.state.without_model() != before.without_model() or (
            result.state != before and now - engine.saved_at >= MODEL_SAVE_SECONDS
        ):
            await self.store.run(self.store.save_control, name, result.state, now)
            engine.saved_at = now
        if self._admission is not None:
            await self._admit(name, signals, now)

    async def _admit(self, name: str, signals: Window | None, now: float) -> None:
        """The second knob: the queued-token cap from the prefill rate of the saturated windows, or no cap.

        The cap in force is read every tick: one that is not what batchlens set was set by hand (or the engine
        restarted), and pauses this knob for ``manual_hold_seconds``, as a hand on the batch limit does. What it
        learned of the cap goes to the store, so that a restart (``kill -9``) goes on from it.
        """
        before = self.states[name]
        try:
            async with asyncio.timeout(self.control.timeout_seconds):  # a slow cap route must not stall the limit
                await self._door_tick(name, signals, now)
        except TimeoutError:
            self._admission_failed(name, f"its cap route gave no answer within {self.control.timeout_seconds:g} s "
                                   "(control.timeout_seconds)")  # fmt: skip
        if self.states[name] != before:
            await self.store.run(self.store.save_control, name, self.states[name], now)

    async def _door_tick(self, name: str, signals: Window | None, now: float) -> None:
        assert self._admission is not None
        engine = self._engines[name]
        try:
            admission = await self._admins[name].admission()
        except AdminCallError as exc:
            self._admission_failed(name, f"cannot read its queued-token cap: {exc}")
            return
        in_force = admission.max_num_queued_tokens
        if not await self._predicting(name, admission.max_predicted_ttft_seconds):
            return
        if admission.api_servers_behind != engine.behind_said:
            engine.behind_said = admission.api_servers_behind
            if admission.api_servers_behind:
                log.warning("%s: API server(s) %s of %d do not have the door's caps in force: hung, or started "
                            "without the plugin (VLLM_PLUGINS=batchlens must reach the whole vllm serve); the caps "
                            "do not hold for the requests they take", name, admission.api_servers_behind,
                            admission.api_servers)  # fmt: skip
        if signals is not None and (window_seen := saturated(signals, now)) is not None:
            engine.saturated.append(window_seen)
        door = admit(
            self.states[name].door, now=now, in_force=in_force, history=engine.saturated, settings=self._admission,
            manual_hold_seconds=self.control.manual_hold_seconds,
            resume_until=self._started + self._admission.stale_seconds,
        )  # fmt: skip
        if door.manual:
            log.warning("%s: the queued-token cap is %s where batchlens last set or found %s: set by hand (or the "
                        "engine restarted, or a second hook steers it); the controller leaves the cap alone for %g s",
                        name, _cap(in_force), _cap(self.states[name].door.known),
                        self.control.manual_hold_seconds)  # fmt: skip
        self._door(name, door.state)
        # The door answers (until a set fails below), unless a hand opened it: then nothing sheds while it holds.
        engine.door_answers = not door.state.opened_by_hand(now)
        decision = self.caps[name] = door.decision
        self.decisions[(name, f"admission_{decision.reason}")] += 1
        if not door.change:
            return
        if self.door_dry_run:
            # Nothing is set, so the cap in force never moves: said again only where it would be set again.
            if engine.dry_run_said is UNSET or worth_setting(engine.dry_run_said, decision.cap, self._admission):
                engine.dry_run_said = decision.cap
                log.info("%s: dry run: would set the queued-token cap %s -> %s (%s)", name, _cap(in_force),
                         _cap(decision.cap), decision.reason)  # fmt: skip
            return
        rate = decision.prefill_tokens_per_second  # the engine's 503s announce the drain time from it
        self._door(name, door.state.sending(decision.cap))
        await self.store.run(self.store.save_control, name, self.states[name], now)  # a kill -9 during the PUT
        try:
            await self._admins[name].set_admission(max_num_queued_tokens=decision.cap, prefill_tokens_per_second=rate)
        except AdminCallError as exc:
            self._admission_failed(name, f"cannot set its queued-token cap: {exc}")
            return
        why = "no cap: the door fails open" if rate is None else f"prefill {rate:.0f} tokens/s"
        engine.admission_failing = None
        log.info("%s: queued-token cap %s -> %s (%s; %s)", name, _cap(in_force), _cap(decision.cap), decision.reason,
                 why)  # fmt: skip
        self._door(name, self.states[name].door.landed(decision.cap))

    async def _predicting(self, name: str, in_force: float | None) -> bool:
        """The per-request door's bound in force on the engine, where control.admission_predict wants one (a restarted
        engine has none): False where setting it failed (counted and logged as the cap's failures are)."""
        wanted = self._predicted_bound
        if wanted is None or self.door_dry_run or (in_force is not None and abs(in_force - wanted) < 1e-3):
            return True
        try:
            await self._admins[name].set_admission(max_predicted_ttft_seconds=wanted)
        except AdminCallError as exc:
            self._admission_failed(name, f"cannot set its per-request door: {exc}")
            return False
        log.info("%s: per-request door on: a request predicted to take over %g s to its first token is refused "
                 "(was %s)", name, wanted, "off" if in_force is None else f"{in_force:g} s")  # fmt: skip
        return True

    def _door(self, name: str, door: DoorState) -> None:
        """Keep what the engine's Steering knows of its door (the cap, and a hand's hold on it)."""
        self.states[name] = replace(self.states[name], door=door)

    def _admission_failed(self, name: str, why: str) -> None:
        """The cap could not be read or set; the limit is steered all the same (a release without caps: 501)."""
        self.decisions[(name, "admission_error")] += 1
        engine = self._engines[name]
        engine.door_answers = False
        if engine.admission_failing != why:
            log.warning("%s: %s; the batch limit does not wait on it, and the cap is retried every %g s", name, why,
                        self.control.interval_seconds)  # fmt: skip
            engine.admission_failing = why

    def _not_steered(self, name: str, why: str) -> None:
        engine = self._engines[name]
        engine.samples.clear()  # the next good answer starts a fresh window
        engine.minute = None  # and the breaker judges no door on a minute that has ended
        engine.door_answers = False  # what answers when it is back (another release?) is asked again
        self.decisions[(name, "no_signal")] += 1
        if engine.failing != why:  # once per kind of failure, not every tick
            log.warning("%s: not steered: %s; holding the limit, retrying every %g s", name, why,
                        self.control.interval_seconds)  # fmt: skip
            engine.failing = why

    async def _fetch(self, name: str) -> list[str]:
        """The engine's /metrics, from each of its servers: a deployment is steered on all of them, or none."""
        get = self._http.text
        return list(await asyncio.gather(*(get(url, timeout=self.control.timeout_seconds, limit=self._limit)
                                           for url in self._engines[name].urls)))  # fmt: skip

    def _remember(self, name: str, sample: EngineSample) -> Window | None:
        """Keep about a minute of samples: the law judges the last tick, the estimates the whole minute."""
        engine = self._engines[name]
        samples = engine.samples
        if samples and sample.time <= samples[-1].time:
            # The wall clock stepped back (NTP): a window of negative length has no rates, and the door's windows
            # would count again, as new, once the clock caught up with their stamps.
            samples.clear()
            engine.saturated.clear()
        previous = samples[-1] if samples else None
        samples.append(sample)
        while len(samples) > 2 and sample.time - samples[1].time >= ESTIMATE_SECONDS:
            samples.popleft()
        if previous is None:
            return None
        minute = engine.minute = window(samples[0], sample)
        self.estimates[name] = Estimate(minute.attainment(self.slo), minute.goodput(self.slo))
        return window(previous, sample)

    def _report(self, name: str, before: Steering, tick: Tick, signals: Window | None, in_force: int) -> None:
        if tick.event == "manual":
            log.warning("%s: the limit is %d where the controller last saw or set %s: set by hand (or the engine "
                        "restarted, or a second hook steers it); the controller follows it and pauses for %g s",
                        name, in_force, before.seen_limit, self.control.manual_hold_seconds)  # fmt: skip
        elif tick.event == "resumed":
            log.info("%s: the manual hold is over: the controller steers again from %d", name, in_force)
        if tick.state.limit == before.limit or tick.reason in ("manual_hold", "breaker_open"):
            return
        # The pace the law judged (the mean gap between tokens), not another estimate of it.
        facts = (
            ""
            if signals is None
            else (
                f"; pace {signals.itl.mean * 1e3:.0f} ms/token of {self.slo.tpot_seconds * 1e3:.0f} ms, "
                f"{signals.running:.0f} running, {signals.waiting:.0f} waiting, KV {signals.kv_usage:.0%}"
            )
        )
        capacity = tick.state.law.capacity if tick.state.law is not None else None
        if tick.reason == "keep_up" and capacity is not None and before.limit is not None:
            facts += "; " + capacity.said(before.limit)
        if (
            tick.reason == "headroom"
            and tick.state.law is not None
            and (why := one_slot(tick.state.law, self._door_works(name)))
        ):
            facts += f"; {why}: one slot a tick"
        moved = f"{before.limit} -> {tick.state.limit}"
        if before.limit is None:  # where it starts, and what it moves the engine from if that is elsewhere
            moved = f"starts at {tick.state.limit}" + (
                f", from the engine's {in_force} (control.start_limit, min_limit, max_limit)"
                if in_force != tick.state.limit else "")  # fmt: skip
        log.info("%s: limit %s (%s%s)%s", name, moved, tick.reason, facts,
                 " (dry run)" if self.control.dry_run else "")  # fmt: skip


def _cap(cap: object) -> str:
    return "unset" if cap is UNSET else "none" if cap is None else str(cap)
