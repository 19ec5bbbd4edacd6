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
from dataclasses import dataclass, replace

from batchlens.config import Config, by_instance
from batchlens.control.admission import (
    CapDecision,
    Saturated,
    queued_token_cap,
    saturated,
    worth_setting,
)
from batchlens.control.law import one_slot
from batchlens.control.signals import EngineSample, NotFinite, Window, read_sample, window
from batchlens.control.steering import MODEL_SAVE_SECONDS, Steering, Tick, bounds_said, door_settings, steer
from batchlens.exporter.http_get import HttpGetter
from batchlens.exporter.parser import ParseError
from batchlens.exporter.sampler import SourceError
from batchlens.remediation.admin_client import AdminCallError, AdminClient, DeploymentAdmin
from batchlens.remediation.breaker import Door, EngineState
from batchlens.remediation.store import Store

log = logging.getLogger("batchlens.control")
ESTIMATE_SECONDS = 60.0  # the attainment and goodput estimates cover about this much of the past
UNSET = object()  # a cap batchlens has not set yet on an engine (None is "no cap")


@dataclass(frozen=True)
class Estimate:
    attainment: float  # NaN while nothing was served
    goodput_rps: float


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
        # Each engine's /metrics: one server's, or every server's of a deployment, judged as one engine.
        self._urls = {
            name: [s.url + "/metrics" for s in servers] for name, servers in by_instance(config.engines).items()
        }
        saved = store.controls()
        self.states = {name: saved.get(name, Steering()) for name in self._urls}
        if not config.control.admission:  # a cap stored by an earlier run with the door on is no reference now
            self.states = {name: s.without_door() for name, s in self.states.items()}
        self._started = started = clock()
        for name, state in self.states.items():
            if state.manual_until > started:  # a restart must not hide that a hand still holds the knob
                log.warning("%s: a limit set by hand still holds control off for %.0f s (manual_hold_seconds), at %s",
                            name, state.manual_until - started, state.limit)  # fmt: skip
            if state.cap_manual_until > started:
                log.warning("%s: a queued-token cap set by hand still holds the door's control off for %.0f s "
                            "(manual_hold_seconds), at %s", name, state.cap_manual_until - started,
                            _cap(state.cap))  # fmt: skip
        self.decisions: Counter[tuple[str, str]] = Counter()  # (instance, reason)
        self.estimates: dict[str, Estimate] = {}
        self._minutes: dict[str, Window] = {}  # instance -> its last minute, for the breaker's view of the door
        self._samples: dict[str, deque[EngineSample]] = {name: deque() for name in self._urls}
        self._due = dict.fromkeys(self._urls, 0.0)
        self._failing: dict[str, str] = {}  # instance -> the failure last logged
        self._in_flight: dict[str, asyncio.Task] = {}
        self._on_decided = on_decided
        self._admission = door_settings(config.control, config.slo.ttft_seconds) if config.control.admission else None
        self._saturated: dict[str, deque[Saturated]] = {name: deque(maxlen=64) for name in self._urls}
        self._saved_at: dict[str, float] = {}  # when each engine's state last went to the store
        self.caps: dict[str, CapDecision] = {}  # the cap each engine should have, and why
        self._admission_failing: dict[str, str] = {}  # instance -> the cap failure last logged
        self._door_answers: dict[str, bool] = {}  # instance -> its cap route answered the last tick's calls
        self._capacity: dict[str, int] = {}  # instance -> the max_num_seqs its bounds were last said for
        self._dry_run_said: dict[str, int | None] = {}  # instance -> the cap a dry run last said it would set
        self._behind_said: dict[str, list[int]] = {}  # instance -> its API servers without the caps, last said
        #: instance -> what ails a GPU of it (remediation.confirm.fault_text), as the hook last asked Prometheus
        self.gpu_faults: dict[str, str] = {}
        self._fault_said: dict[str, str] = {}

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
        return state.cap if state is not None and state.cap_seen else UNSET

    def _door_works(self, name: str) -> bool:
        """Whether batchlens keeps a door on the engine: admission on, not a dry run, and its cap route answers.

        A door that fails open for want of figures still counts: the backlog that growth builds gives it its
        saturated windows within a few ticks, and then it sheds. A route that errs (a release without caps and
        without the plugin's middleware) never will."""
        return self._admission is not None and not self.door_dry_run and self._door_answers.get(name, False)

    def door(self, name: str) -> Door | None:
        """The engine's door for the breaker: None unless batchlens holds a queued-token cap in force on it."""
        cap, minute = self.cap_in_force(name), self._minutes.get(name)
        if self._admission is None or not isinstance(cap, int) or minute is None:
            return None
        rate = self.caps[name].prefill_tokens_per_second if name in self.caps else None
        return Door(cap, minute.shed_share, minute.itl.mean, self.slo.tpot_seconds, rate)

    def tick(self, now: float, breakers: Mapping[str, EngineState]) -> None:
        """Start a read-and-decide for every engine that is due; each runs on its own, so a hanging engine
        delays nobody else. ``on_decided`` is called when one finishes, for the hook to apply what it chose."""
        for name, at in self._due.items():
            # Due, or the wall clock stepped back (NTP) past the interval: a tick now, not in an hour.
            if (now >= at or at - now > self.control.interval_seconds) and name not in self._in_flight:
                self._due[name] = now + self.control.interval_seconds
                task = asyncio.create_task(self._tick_one(name, now, breakers), name=f"control-{name}")
                self._in_flight[name] = task
                task.add_done_callback(lambda _t, name=name: self._done(name))

    def _done(self, name: str) -> None:
        task = self._in_flight.pop(name)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: a controller tick failed", name, exc_info=task.exception())
        self._on_decided()

    async def close(self) -> None:
        for task in list(self._in_flight.values()):
            task.cancel()
        await asyncio.gather(*self._in_flight.values(), return_exceptions=True)
        await self._http.aclose()

    async def _tick_one(self, name: str, now: float, breakers: Mapping[str, EngineState]) -> None:
        batch = None
        try:
            async with asyncio.timeout(self.control.timeout_seconds):
                batch = await self._admins[name].get()
                sample = read_sample(await self._fetch(name), now)
        except Exception as exc:  # whatever an engine answers, a failed reading is counted, never fatal
            why = f"no answer within {self.control.timeout_seconds:g} s (control.timeout_seconds)" if isinstance(
                exc, TimeoutError) else str(exc)  # fmt: skip
            foreseen = isinstance(exc, (TimeoutError, AdminCallError, SourceError, ParseError, NotFinite))
            if not foreseen and self._failing.get(name) != why:  # its traceback once, not every tick
                log.error("%s: an engine's answer the controller cannot read", name, exc_info=exc)
            self._not_steered(name, why)
            if self._admission is not None:
                # No window to estimate from, and the cap must still go once its figures are stale (the door fails
                # open, never shut): the cap route may answer where the engine core or /metrics does not.
                await self._admit(name, None, now)
            return
        if self._failing.pop(name, None) is not None:
            log.info("%s: answering again: steering resumes after one more reading", name)
        if self._capacity.get(name) != batch.max_num_seqs:  # once, and again if the engine came back resized
            self._capacity[name] = batch.max_num_seqs
            said, clamped = bounds_said(self.control, batch.max_num_seqs)
            log.log(logging.WARNING if clamped else logging.INFO, "%s: the controller uses %s", name, said)
        signals = self._remember(name, sample)
        before, breaker = self.states[name], breakers[name]  # the breaker as it is now, after the reads
        fault = self.gpu_faults.get(name, "")
        if fault != self._fault_said.get(name, ""):
            if fault:
                log.warning("%s: a GPU of it is failing (%s): the controller holds the limit and learns nothing "
                            "from its windows until the GPU alerts clear", name, fault)  # fmt: skip
            else:
                log.info("%s: its GPU alerts cleared: steering resumes", name)
            self._fault_said[name] = fault
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
            result.state != before and now - self._saved_at.get(name, -math.inf) >= MODEL_SAVE_SECONDS
        ):
            await self.store.run(self.store.save_control, name, result.state, now)
            self._saved_at[name] = now
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
        try:
            admission = await self._admins[name].admission()
        except AdminCallError as exc:
            self._admission_failed(name, f"cannot read its queued-token cap: {exc}")
            return
        in_force = admission.max_num_queued_tokens
        if admission.api_servers_behind != self._behind_said.get(name, []):
            self._behind_said[name] = admission.api_servers_behind
            if admission.api_servers_behind:
                log.warning("%s: API server(s) %s of %d do not have the door's caps in force: hung, or started "
                            "without the plugin (VLLM_PLUGINS=batchlens must reach the whole vllm serve); the caps "
                            "do not hold for the requests they take", name, admission.api_servers_behind,
                            admission.api_servers)  # fmt: skip
        state = self.states[name]
        ours, sent = self.cap_in_force(name), state.cap_sent if state.cap_sent_seen else UNSET
        self._door(name, cap_sent=None, cap_sent_seen=False)
        if ours is not UNSET and in_force != ours and in_force != sent:  # a PUT that timed out may have landed
            log.warning("%s: the queued-token cap is %s where batchlens last set or found %s: set by hand (or the "
                        "engine restarted, or a second hook steers it); the controller leaves the cap alone for %g s",
                        name, _cap(in_force), _cap(ours), self.control.manual_hold_seconds)  # fmt: skip
            self._door(name, cap_manual_until=now + self.control.manual_hold_seconds)
        self._door(name, cap=in_force, cap_seen=True)  # the first tick, a restart (kill -9) or a hand: go on from it
        hold_until = self.states[name].cap_manual_until
        # The door answers (until a set fails below), unless a hand opened it: then nothing sheds while it holds.
        self._door_answers[name] = in_force is not None or now >= hold_until
        if signals is not None and (window_seen := saturated(signals, now)) is not None:
            self._saturated[name].append(window_seen)
        decision = self.caps[name] = queued_token_cap(self._saturated[name], now, self._admission)
        # While the cap in force stands, it is also the target the hook exports: +Inf would read as a door about
        # to open.
        if now < hold_until:
            self.caps[name] = CapDecision(in_force, "manual_hold", decision.prefill_tokens_per_second)
            self.decisions[(name, "admission_manual_hold")] += 1
            return
        if (decision.cap is None and decision.reason in ("no_signal", "too_few_windows") and in_force is not None
                and now < self._started + self._admission.stale_seconds):  # fmt: skip
            # Just started (a restart after kill -9, or onto a cap set at launch): the cap in force stands until
            # the estimate is sure or has had the time to be. Lifting it would open the door on a loaded engine.
            self.caps[name] = CapDecision(in_force, "resumed", None)
            self.decisions[(name, "admission_resumed")] += 1
            return
        self.decisions[(name, f"admission_{decision.reason}")] += 1
        if not worth_setting(in_force, decision.cap, self._admission):
            return
        if self.door_dry_run:
            said = self._dry_run_said.get(name, UNSET)
            # Nothing is set, so the cap in force never moves: said again only where it would be set again.
            if said is UNSET or worth_setting(said, decision.cap, self._admission):
                self._dry_run_said[name] = decision.cap
                log.info("%s: dry run: would set the queued-token cap %s -> %s (%s)", name, _cap(in_force),
                         _cap(decision.cap), decision.reason)  # fmt: skip
            return
        rate = decision.prefill_tokens_per_second  # the engine's 503s announce the drain time from it
        # Kept, and stored, before the PUT, which may land and still fail or time out: then neither the next tick
        # nor a restart after a kill -9 must take the cap it finds for a hand's.
        self._door(name, cap_sent=decision.cap, cap_sent_seen=True)
        await self.store.run(self.store.save_control, name, self.states[name], now)  # a kill -9 during the PUT
        try:
            await self._admins[name].set_admission(max_num_queued_tokens=decision.cap, prefill_tokens_per_second=rate)
        except AdminCallError as exc:
            self._admission_failed(name, f"cannot set its queued-token cap: {exc}")
            return
        why = "no cap: the door fails open" if rate is None else f"prefill {rate:.0f} tokens/s"
        self._admission_failing.pop(name, None)
        log.info("%s: queued-token cap %s -> %s (%s; %s)", name, _cap(in_force), _cap(decision.cap), decision.reason,
                 why)  # fmt: skip
        self._door(name, cap=decision.cap, cap_seen=True)

    def _door(self, name: str, **fields: object) -> None:
        """Change what the engine's Steering keeps of its door (the cap, and a hand's hold on it)."""
        self.states[name] = replace(self.states[name], **fields)

    def _admission_failed(self, name: str, why: str) -> None:
        """The cap could not be read or set; the limit is steered all the same (a release without caps: 501)."""
        self.decisions[(name, "admission_error")] += 1
        self._door_answers[name] = False
        if self._admission_failing.get(name) != why:
            log.warning("%s: %s; the batch limit does not wait on it, and the cap is retried every %g s", name, why,
                        self.control.interval_seconds)  # fmt: skip
            self._admission_failing[name] = why

    def _not_steered(self, name: str, why: str) -> None:
        self._samples[name].clear()  # the next good answer starts a fresh window
        self._minutes.pop(name, None)  # and the breaker judges no door on a minute that has ended
        self._door_answers.pop(name, None)  # what answers when it is back (another release?) is asked again
        self.decisions[(name, "no_signal")] += 1
        if self._failing.get(name) != why:  # once per kind of failure, not every tick
            log.warning("%s: not steered: %s; holding the limit, retrying every %g s", name, why,
                        self.control.interval_seconds)  # fmt: skip
            self._failing[name] = why

    async def _fetch(self, name: str) -> list[str]:
        """The engine's /metrics, from each of its servers: a deployment is steered on all of them, or none."""
        get = self._http.text
        return list(await asyncio.gather(*(get(url, timeout=self.control.timeout_seconds, limit=self._limit)
                                           for url in self._urls[name])))  # fmt: skip

    def _remember(self, name: str, sample: EngineSample) -> Window | None:
        """Keep about a minute of samples: the law judges the last tick, the estimates the whole minute."""
        samples = self._samples[name]
        if samples and sample.time <= samples[-1].time:
            # The wall clock stepped back (NTP): a window of negative length has no rates, and the door's windows
            # would count again, as new, once the clock caught up with their stamps.
            samples.clear()
            self._saturated[name].clear()
        previous = samples[-1] if samples else None
        samples.append(sample)
        while len(samples) > 2 and sample.time - samples[1].time >= ESTIMATE_SECONDS:
            samples.popleft()
        if previous is None:
            return None
        minute = self._minutes[name] = window(samples[0], sample)
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
