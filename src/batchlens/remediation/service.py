"""The hook's engine room: the inbox in, breaker decisions through, admin API calls and pages out.

One asyncio task drives the work, a pass at a time (:meth:`Remediator.step`). Each engine's share of a
pass runs as a task of its own, so an engine that hangs (a tenant's, on a shared cluster) delays its own
deliveries and nobody else's; an engine whose last pass is still running gets no new one until it ends. An
engine's pass:

1. decides its pending deliveries, oldest first, and saves the state each produced
   together with the delivery's "done" mark (one transaction);
2. advances recovery on the clock;
3. applies the target limit the admin API has not confirmed yet. A PUT sets an
   absolute value, so repeating one after a crash or a failure never halves
   twice. Failures back off (1, 2, 4, ... 60 s) and are retried until they land.

Beside them, when ``control.enabled``, the controller reads and steers the
engines that are due (remediation/controller.py, a task per engine too): it says which
limit each should have, the breaker's target bounding it while the breaker is
open, and the engine's next pass applies it. Last, the pages the decisions
asked for are posted to Alertmanager, retrying likewise.

The webhook only writes the inbox (:meth:`accept`) and wakes the task, so it
answers in milliseconds whatever the engines are doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import aiohttp

from batchlens.config import Config, Engine, by_instance
from batchlens.prometheus_api import PrometheusError
from batchlens.remediation.admin_client import AdminCallError, AdminClient, DeploymentAdmin
from batchlens.remediation.alertmanager import AlertmanagerClient, AlertmanagerError, PostableAlert, utc
from batchlens.remediation.breaker import (
    Decision,
    EngineState,
    Observation,
    on_firing,
    on_resolved,
    on_tick,
    without_future_times,
)
from batchlens.remediation.confirm import Confirmer, fault_text
from batchlens.remediation.controller import Controller
from batchlens.remediation.store import Delivery, InboxFull, Store
from batchlens.remediation.webhook import BREAKER_ALERT, KV_ALERT, MAX_FUTURE_SECONDS, WebhookPayload, deliveries

if TYPE_CHECKING:
    from batchlens.remediation.leader import Leadership

log = logging.getLogger("batchlens.remediate")
PAGE_ALERT = "VllmBreakerEscalation"
MAX_BACKOFF = 60.0


#: Alerts not acted on that mean something is misconfigured or hostile upstream (the others are routine).
SKIPS_TO_WARN_OF = frozenset({"unknown_instance", "missing_vllm_instance", "missing_cluster", "truncated",
                              "future_starts_at", "other_namespace", "namespace_mismatch"})  # fmt: skip
REFUSALS_SAID_EVERY = 10.0  # seconds: a flood's refusals are logged as one line per this, with their count


@dataclass
class Backoff:
    failures: int = 0
    retry_at: float = 0.0

    def failed(self, now: float) -> float:
        self.failures += 1
        delay = min(MAX_BACKOFF, 2.0 ** (self.failures - 1))
        self.retry_at = now + delay
        return delay


#: Per engine pass, what Prometheus answered for each alert name: firing or not, or why it could not tell.
Asked = dict[str, "bool | str | PrometheusError"]
GPU_FAULTS = "gpu_faults"  # the key of the GPU question in a pass's Asked (alert names are the others)


@dataclass(frozen=True)
class Page:
    instance: str
    reason: str  # cold_start | capacity | unconfirmed | gpu_fault
    text: str
    resolve: bool = False


class Remediator:
    def __init__(
        self,
        config: Config,
        store: Store,
        session: aiohttp.ClientSession,
        environ: Mapping[str, str],
        *,
        alertmanager: AlertmanagerClient | None = None,
        clock: Callable[[], float] = time.time,
        leadership: Leadership | None = None,
    ):
        """``leadership``: one of several hooks (remediate.leader_election): it acts only while it holds the Lease,
        fences every change on it, and keeps its state where the next leader finds it."""
        self.settings = config.breaker
        self.leadership = leadership
        self.acting = leadership is None  # a hook of several starts as a standby, until its first round
        self.cluster = config.remediate.cluster
        prometheus = config.remediate.prometheus_url
        self.confirmer = Confirmer(session, prometheus, self.cluster) if prometheus else None
        self.store = store
        self.clock = clock
        self.alertmanager = alertmanager
        self._environ = environ
        self._session = session
        # Per engine, configured or discovered: joined by _join, left by engines_found. An engine is its
        # vllm_instance: one server, or every server of a deployment (its first in `engines`, all in `servers`).
        self.engines: dict[str, Engine] = {}
        self.servers: dict[str, tuple[Engine, ...]] = {}
        self.admins: dict[str, AdminClient | DeploymentAdmin] = {}
        self.states: dict[str, EngineState] = {}
        self._apply_backoff: dict[str, Backoff] = {}
        self._observe_backoff: dict[str, Backoff] = {}
        self._confirm_backoff: dict[str, Backoff] = {}
        self._paged_at: dict[tuple[str, str], float] = {}  # (engine, reason) -> its last page of a refusal
        self._passes: dict[str, asyncio.Task] = {}  # each engine's pass in flight (step)
        self._joined: dict[str, float] = {}  # when each engine joined: its breaker's silence counts from there
        self._rejoining: set[str] = set()  # pods recreated under their names, between leaving and joining again
        saved = store.states()
        for servers in by_instance(config.engines).values():
            self._join(servers, saved)
        self._configured = frozenset(self.engines)
        self.actions: Counter[tuple[str, str, str]] = Counter()  # (instance, action, result)
        self.deliveries: Counter[str] = Counter()  # outcome
        self.pages: Counter[tuple[str, str]] = Counter()  # (reason, result)
        self._refused, self._refused_said_at = 0, -math.inf  # notifications refused since the last line said so
        self._page_queue: list[Page] = []
        self._page_backoff = Backoff()
        self._kv_reset_at: dict[str, float] = {}
        self._dry_run_said: dict[str, int] = {}  # instance -> the limit a dry run last said it would set
        self.wake = asyncio.Event()
        enabled = config.control.enabled
        self.controller = Controller(config, store, self.admins, self.wake.set, clock) if enabled else None
        self._quiet = min(1.0, config.control.interval_seconds) if self.controller else 1.0
        self._gpus_due, self._gpus_asking = 0.0, None  # the controller's question about every engine's GPUs
        self._gpus_failed = ""

    # --- the webhook's part: fast, no network ------------------------------------------------------------

    async def accept(self, payload: WebhookPayload, scope: Collection[str] | None = None) -> dict[str, int]:
        """Write the notification's deliveries to the inbox, all or none.

        Raises InboxFull when the inbox cannot take them (the webhook answers 503 and Alertmanager retries), and
        sqlite3.Error when it cannot be written. ``scope``: the namespaces whose webhook token sent it (None: the
        service's own token, any engine).
        """
        alertnames = {BREAKER_ALERT, KV_ALERT} if self.settings.reset_prefix_cache else {BREAKER_ALERT}
        namespace_of = {name: e.labels.get("namespace", "") for name, e in self.engines.items()}
        keep, skipped = deliveries(payload, now=self.clock(), instances=self.engines, alertnames=alertnames,
                                   cluster=self.cluster, namespace_of=namespace_of, scope=scope)  # fmt: skip
        if keep:
            try:
                await self.store.run(self.store.accept, keep, namespace_of)
            except InboxFull as exc:
                self.deliveries[exc.reason] += len(keep)
                self._say_refused(exc)
                raise
            self.wake.set()
        for reason, n in skipped.items():
            self.deliveries[reason] += n
            if reason in SKIPS_TO_WARN_OF:
                log.warning("webhook: %d alert(s) not acted on: %s", n, reason.replace("_", " "))
        return {"accepted": len(keep), **skipped}

    def _say_refused(self, exc: InboxFull) -> None:
        """Log a refused notification: the first of a flood at once, the rest as one line every few seconds."""
        self._refused += 1
        now = self.clock()
        if now - self._refused_said_at >= REFUSALS_SAID_EVERY:
            log.warning("webhook: %d notification(s) refused with 503, for Alertmanager to retry: %s", self._refused,
                        exc)  # fmt: skip
            self._refused, self._refused_said_at = 0, now

    async def engines_found(self, engines: Sequence[Engine]) -> None:
        """Discovery's engine set: the new ones join with their saved state; the gone leave it saved.

        A pod that comes back under its name (a StatefulSet's) finds its strikes and limits where it left them.
        """
        wanted = {name: tuple(s) for name, s in by_instance(engines).items() if name not in self._configured}
        # A pod recreated under its name (a StatefulSet's) has a new IP, and its old IP may be another pod's
        # by now: it rejoins at its new address, with its token, before anything is sent to it.
        moved = {name for name, s in wanted.items() if name in self.servers and self.servers[name] != s}
        self._rejoining |= moved  # gone for the await below only: a step then must not drop their deliveries
        for name in (self.engines.keys() - self._configured - wanted.keys()) | moved:
            if (task := self._passes.pop(name, None)) is not None:
                task.cancel()  # nothing more is sent to the address it had
            for table in (self.engines, self.servers, self.admins, self.states, self._apply_backoff,
                          self._observe_backoff, self._confirm_backoff, self._joined):  # fmt: skip
                table.pop(name, None)
            if name not in moved:
                log.info("%s: the pod is gone; its breaker state stays saved", name)
        try:
            saved = await self.store.run(self.store.states)
            for name in wanted.keys() - self.engines.keys():
                self._join(wanted[name], saved)
                log.info("%s: found at %s (breaker %s)", name, ", ".join(s.url for s in wanted[name]),
                         self.states[name].mode)  # fmt: skip
        finally:
            self._rejoining -= moved

    def _join(self, servers: Sequence[Engine], saved: Mapping[str, EngineState]) -> None:
        """Steer the engine of ``servers`` (one, or a deployment's) from now on, from its saved state if it has one."""
        engine = servers[0]
        name = engine.instance
        self.engines[name], self.servers[name] = engine, tuple(servers)
        self._joined[name] = self.clock()
        clients = [self._admin_client(server) for server in servers]
        self.admins[name] = clients[0] if len(clients) == 1 else DeploymentAdmin(clients)
        state = saved.get(name, EngineState())
        self.states[name] = without_future_times(state, now=self.clock(), skew=MAX_FUTURE_SECONDS)
        if self.states[name] != state:  # saved by a release that took any startsAt (issue 30)
            log.warning("%s: its saved state held an alert time in the future; dropped, so alerts act again", name)
        for backoffs in (self._apply_backoff, self._observe_backoff, self._confirm_backoff):
            backoffs[name] = Backoff()

    def _admin_client(self, server: Engine) -> AdminClient:
        token = server.admin_token(self._environ)
        # Said here once: every call's 401 would only say the token does not match. (A discovered pod's token comes
        # from its namespace's Secret, which discovery reads again, and warns of, by itself.)
        if token is None and server.admin_token_from_environment:
            log.error("%s: %s is not set: its admin API will refuse every call (401) until the hook is started "
                      "with it", server.name, server.admin_token_source)  # fmt: skip
        fence = None if self.leadership is None else self.leadership.elector.holds
        return AdminClient(self._session, server.admin_url, token, signed=server.admin_auth == "signed",
                           pod=server.pod, fence=fence)  # fmt: skip

    # --- the worker ------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        if self.acting:
            await self.reconcile()
        while not stop.is_set():
            try:
                if self.acting:
                    await self.step()
            except Exception:  # one bad pass must not end remediation; the next pass retries
                log.exception("remediation pass failed; retrying in 1 s")
            self.wake.clear()
            quiet = self._quiet
            if self.controller is not None and self.acting:  # no later than the next tick due
                quiet = min(quiet, max(0.0, self.controller.next_due() - self.clock()))
            with contextlib.suppress(TimeoutError):  # a quiet second: time to tick recovery and retries
                await asyncio.wait_for(self.wake.wait(), timeout=quiet)
        await self.settle(cancel=True)  # a hanging engine's pass: what it decided is saved, a PUT is retried
        await self._send_pages(last=True)  # what the last passes decided
        if self._gpus_asking is not None:
            self._gpus_asking.cancel()
            await asyncio.gather(self._gpus_asking, return_exceptions=True)
        if self.controller is not None:
            await self.controller.close()

    async def reconcile(self) -> None:
        """At startup: read every engine's limit, all at once (one that hangs holds up nobody), and say what is left
        to apply."""
        await asyncio.gather(*(self._reconcile_one(name) for name in list(self.admins)))

    async def _reconcile_one(self, name: str) -> None:
        state = self.states[name]
        try:
            now = await self.admins[name].get()
        except AdminCallError as exc:
            log.warning("startup: %s: cannot read the batch limit: %s", name, exc)
            return
        pending = state.target_limit is not None and state.target_limit != state.applied_limit
        log.info(
            "startup: %s: limit %d of %d, breaker %s, %d strike(s)%s",
            name, now.max_num_active_seqs, now.max_num_seqs, state.mode, state.strikes,
            f"; target {state.target_limit} not yet confirmed: applying it" if pending else "",
        )  # fmt: skip
        # An engine batchlens never set: the limit in force is where it stands, so nothing is sent to confirm it.
        untouched = state.applied_limit is None and state.target_limit is None
        applied = now.max_num_active_seqs if untouched else state.applied_limit
        await self._save(name, replace(state, capacity=now.max_num_seqs, applied_limit=applied))

    async def step(self) -> None:
        """Start a pass for every engine whose last one is over; the controller's ticks and the pages here."""
        # Engines with no pass in flight, taken before the inbox is read: a pass that ends during the awaits below
        # has decided deliveries that this read still lists, and must not be given them again.
        idle = [name for name in self.engines if name not in self._passes]
        pending: dict[str, list[Delivery]] = {}
        for delivery in await self.store.run(self.store.pending):
            pending.setdefault(delivery.vllm_instance, []).append(delivery)
        for name in pending.keys() - self.engines.keys() - self._rejoining:
            await self._drop_unknown(pending[name])
        for name in idle:
            if name in self.engines:  # not gone during the awaits
                task = asyncio.create_task(self._engine_pass(name, pending.get(name, ())), name=f"remediate-{name}")
                self._passes[name] = task
                task.add_done_callback(lambda t, name=name: self._pass_done(name, t))
        if self.controller is not None:
            self._watch_gpus()
            self.controller.tick(self.clock(), self.states)
        await self._send_pages()

    def _watch_gpus(self) -> None:
        """Once a control interval, ask Prometheus which engines have a failing GPU, for the controller (which
        then holds their limits); one question for every engine, in the background: a slow Prometheus delays no
        tick."""
        now = self.clock()
        if self.confirmer is None or self._gpus_asking is not None or now < self._gpus_due:
            return
        self._gpus_due = now + self.controller.control.interval_seconds
        self._gpus_asking = asyncio.create_task(self._ask_gpus(), name="remediate-gpu-faults")

    async def _ask_gpus(self) -> None:
        try:
            faults = await self.confirmer.gpu_faults()
        except PrometheusError as exc:
            # The last answer stands: a failing GPU stays held through a Prometheus blip, a healthy one steered.
            if str(exc) != self._gpus_failed:
                log.warning("cannot ask Prometheus about the engines' GPUs (%s): the last answer stands", exc)
                self._gpus_failed = str(exc)
            return
        finally:
            self._gpus_asking = None
        self._gpus_failed = ""
        self.controller.gpu_faults = {n: fault_text(series) for n, series in faults.items() if n in self.engines}

    async def settle(self, *, cancel: bool = False) -> None:
        """Wait for the engines' passes in flight; with ``cancel``, end them first (at shutdown)."""
        passes = list(self._passes.values())
        for task in passes if cancel else ():
            task.cancel()
        await asyncio.gather(*passes, return_exceptions=True)

    def _pass_done(self, name: str, task: asyncio.Task) -> None:
        if self._passes.get(name) is task:  # not a pass of a pod that left and came back under its name
            del self._passes[name]
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: a remediation pass failed; the next one retries", name, exc_info=task.exception())

    async def _engine_pass(self, name: str, deliveries: Sequence[Delivery]) -> None:
        asked: Asked = {}  # one question to Prometheus per alert name and pass, however many deliveries came
        for delivery in deliveries:
            if not await self._decide(delivery, asked):
                break  # the engine could not be observed, or a resolution not confirmed: the later ones wait their turn
        decision = on_tick(self.states[name], now=self.clock(), settings=self.settings,
                           listening_since=self._joined[name])  # fmt: skip
        if decision.action != "none":
            await self._conclude(name, decision, self.clock())
        await self._apply(name)

    async def _drop_unknown(self, deliveries: Sequence[Delivery]) -> None:
        """Deliveries for an engine that left (a deleted pod, a config without it): nothing to act on."""
        for delivery in deliveries:
            log.info("%s: %s %s for an engine no longer known: dropped", delivery.vllm_instance, delivery.alertname,
                     delivery.status)  # fmt: skip
            await self.store.run(self.store.mark_done, delivery, self.clock(), "unknown_instance")
            self.deliveries["unknown_instance"] += 1

    async def _decide(self, delivery: Delivery, asked: Asked) -> bool:
        name = delivery.vllm_instance
        state = self.states[name]
        refused = await self._refusal(delivery, asked)
        if refused is None:
            return False
        if not refused and delivery.alertname == BREAKER_ALERT and delivery.status == "firing":
            refused = await self._gpu_cause(delivery, asked)
        if refused or delivery.alertname == KV_ALERT:
            outcome = refused or await self._reset_prefix_cache(delivery)
            await self.store.run(self.store.save, name, state, self.clock(), done=delivery, outcome=outcome)
            self.deliveries[outcome] += 1
            return True
        if delivery.status == "resolved":
            decision = on_resolved(state, starts_at=delivery.starts_at, now=delivery.received_at)
        else:
            obs = await self._observe(name)
            if obs is None:
                return False
            decision = on_firing(
                state, starts_at=delivery.starts_at, now=delivery.received_at, obs=obs, settings=self.settings
            )
        await self._conclude(name, decision, self.clock(), delivery)
        return True

    async def _refusal(self, delivery: Delivery, asked: Asked) -> str | None:
        """What Prometheus says of the delivery: "" when it agrees (or is not asked), the outcome to record instead
        when it does not ("unconfirmed") or cannot tell ("unconfirmable"), None when a resolution must wait for it.

        A firing that is not confirmed moves nothing and pages; a resolution waits, with backoff, until Prometheus
        answers, because Alertmanager sends it once and recovery must not start on a forged one.
        """
        name, firing = delivery.vllm_instance, delivery.status == "firing"
        if self.confirmer is None or (delivery.alertname == KV_ALERT and not firing):
            return ""
        answer = await self._ask(name, delivery.alertname, asked)
        what = f"{delivery.alertname} {delivery.status}"
        if answer is None or (isinstance(answer, PrometheusError) and not firing):
            if answer is not None:  # said once per question: quiet while the backoff runs
                log.warning("%s: %s: cannot confirm it with Prometheus: %s; it waits", name, what, answer)
            return None
        if answer == firing:
            return ""
        if isinstance(answer, PrometheusError):
            why, outcome = f"Prometheus cannot confirm it ({answer}): not acted on", "unconfirmable"
        else:
            shows = "none" if firing else "the alert still firing"
            why = f"Prometheus shows {shows} for this engine: not acted on; was it posted to Alertmanager by hand?"
            outcome = "unconfirmed"
        log.warning("%s: %s: %s", name, what, why)
        if firing:
            self._page_once(name, "unconfirmed", f"{what}: {why}")  # a flood of forgeries is one page
        return outcome

    async def _gpu_cause(self, delivery: Delivery, asked: Asked) -> str:
        """ "gpu_fault" when a GPU of the engine is failing (its alerts fire or are pending in Prometheus): the
        breach is the GPU's, and a halved batch would only cut what the healthy GPUs serve. Paged instead, with
        the GPU's state. "" when none is, or when Prometheus cannot say (then the breaker acts as it would)."""
        name = delivery.vllm_instance
        if self.confirmer is None:
            return ""
        if GPU_FAULTS not in asked:
            try:
                asked[GPU_FAULTS] = fault_text((await self.confirmer.gpu_faults(name)).get(name, []))
            except PrometheusError as exc:
                log.warning("%s: cannot ask Prometheus about the engine's GPUs (%s): the breaker acts without", name,
                            exc)  # fmt: skip
                asked[GPU_FAULTS] = ""
        faults = asked[GPU_FAULTS]
        if not faults:
            return ""
        why = f"P99 breach while a GPU of it fails: {faults}. Not halved: a smaller batch does not mend a GPU"
        log.warning("%s: %s %s: %s", name, delivery.alertname, delivery.status, why)
        self._page_once(name, "gpu_fault", why)
        return "gpu_fault"

    def _page_once(self, name: str, reason: str, text: str) -> None:
        """Queue a page, once per breaker cooldown for the engine and the reason."""
        last = self._paged_at.get((name, reason))
        if last is None or self.clock() - last >= self.settings.cooldown_seconds:
            self._paged_at[(name, reason)] = self.clock()
            self._page_queue.append(Page(name, reason, text))

    async def _ask(self, name: str, alertname: str, asked: Asked) -> bool | PrometheusError | None:
        """Whether Prometheus shows ``alertname`` firing for the engine, once per pass; why it cannot tell; or None
        while the backoff of its last failure runs."""
        if alertname not in asked:
            backoff = self._confirm_backoff[name]
            if self.clock() < backoff.retry_at:
                return None
            try:
                asked[alertname] = await self.confirmer.firing(alertname, name)
                backoff.failures = 0
            except PrometheusError as exc:
                asked[alertname] = PrometheusError(f"{exc}; asked again in {backoff.failed(self.clock()):.0f} s")
        return asked[alertname]

    async def _observe(self, name: str) -> Observation | None:
        backoff, state = self._observe_backoff[name], self.states[name]
        if self.clock() < backoff.retry_at:
            return None
        # The door's figures come from the controller's own readings: an admin API that times out under the very
        # overload the door holds must not turn its hold into strikes and a cold start.
        door = None if self.controller is None else self.controller.door(name)
        try:
            now = await self.admins[name].get()
        except AdminCallError as exc:
            known = state.applied_limit or state.target_limit
            if known is not None and state.capacity is not None:
                log.warning("%s: %s; deciding on the last known limit %d", name, exc, known)
                return Observation(limit=known, capacity=state.capacity, running=0, waiting=0, door=door)
            delay = backoff.failed(self.clock())
            log.warning("%s: %s; the delivery waits, retry in %.0f s", name, exc, delay)
            self.actions[(name, "observe", exc.reason)] += 1
            return None
        backoff.failures = 0
        return Observation(now.max_num_active_seqs, now.max_num_seqs, now.num_running, now.num_waiting, door)

    async def _conclude(self, name: str, decision: Decision, now: float, delivery: Delivery | None = None) -> None:
        """Queue the decision's page, save its state (and the delivery's done mark), log it."""
        # The page first: a pass cancelled during the save (shutdown, a pod that moved) may still land the state,
        # whose ``paged`` says the page went out, and nothing would send it after a restart.
        pages = [Page(name, decision.page, decision.reason)] if decision.page else []
        pages += [Page(name, reason, "recovered", resolve=True) for reason in decision.resolved_pages]
        self._page_queue += pages
        outcome = decision.action if decision.action != "none" else decision.skipped
        try:
            await self._save(name, decision.state, delivery, outcome)
        except Exception:  # not saved, so decided again next pass: its pages go with that decision, not this one
            self._unqueue(pages)
            raise
        if delivery is not None:
            self.deliveries[outcome] += 1
        if decision.action == "none":
            if delivery is not None:
                log.info("%s: %s %s: %s", name, delivery.alertname, delivery.status, decision.reason)
            return
        self._apply_backoff[name] = Backoff()
        entry = {"at": now, "vllm_instance": name, "action": decision.action, "reason": decision.reason,
                 "target": decision.state.target_limit, "strikes": decision.state.strikes,
                 "mode": decision.state.mode, "dry_run": self.settings.dry_run}  # fmt: skip
        await self.store.run(self.store.log_action, entry)
        self.actions[(name, decision.action, "decided")] += 1
        steered = self.target(name)
        # Under control, recovery raises the breaker's ceiling; the controller steers under it.
        under = f" (the breaker's ceiling; the controller steers under it, at {steered})" if (
            decision.action == "raise" and steered != decision.state.target_limit) else ""  # fmt: skip
        log.warning("%s: %s: %s%s%s", name, decision.action, decision.reason, under,
                    " (dry run)" if self.settings.dry_run else "")  # fmt: skip

    async def _save(self, name: str, state: EngineState, delivery: Delivery | None = None, outcome: str = "") -> None:
        await self.store.run(self.store.save, name, state, self.clock(), done=delivery, outcome=outcome)
        self.states[name] = state
        if self.leadership is not None:  # before the act it leads to: a successor must not act on it again
            await self.leadership.keep("engines", {n: s.to_dict() for n, s in self.states.items()})

    async def take_over(self, saved: Mapping[str, Mapping[str, dict]]) -> None:
        """This hook leads now: go on from the state its predecessor kept (``saved``: StateMirror.load()), read
        every engine's limit, and act."""
        now = self.clock()
        for name, data in saved.get("engines", {}).items():
            if name in self.states:
                self.states[name] = EngineState.from_dict(data)
                await self.store.run(self.store.save, name, self.states[name], now)
        if self.controller is not None:
            await self.controller.take_over(saved.get("controllers", {}), now)
        await self.reconcile()
        self.acting = True
        self.wake.set()

    async def stand_by(self) -> None:
        """This hook no longer leads: its passes end, and it acts on nothing until it leads again."""
        self.acting = False
        await self.settle(cancel=True)
        if self.controller is not None:
            await self.controller.cancel_ticks()

    def target(self, name: str) -> int | None:
        """The limit the hook wants in force: the controller's (bounded by an open breaker), else the breaker's."""
        state = self.states[name]
        steered = None if self.controller is None else self.controller.wanted(name, state, self.clock())
        return state.target_limit if steered is None else steered

    async def _apply(self, name: str) -> None:
        state, backoff = self.states[name], self._apply_backoff[name]
        target = self.target(name)
        loud = target == state.target_limit  # the breaker's acts are news; the controller's moves are logged as INFO
        if target is None or target == state.applied_limit or self.clock() < backoff.retry_at:
            return
        if self.settings.dry_run:
            if self._dry_run_said.get(name) != target:  # once per target; nothing is applied, so nothing recorded
                self._dry_run_said[name] = target
                log.warning("%s: dry run: would set the batch limit to %d", name, target)
                self.actions[(name, "set_limit", "dry_run")] += 1
                await self.store.run(self.store.log_action, {"at": self.clock(), "vllm_instance": name,
                                     "action": "set_limit", "target": target, "result": "dry_run"})  # fmt: skip
            return
        try:
            reply = await self.admins[name].put(target)
            log.log(
                logging.WARNING if loud else logging.INFO,
                "%s: batch limit set to %d",
                name,
                reply.max_num_active_seqs,
            )
        except AdminCallError as exc:
            delay = backoff.failed(self.clock())
            self.actions[(name, "set_limit", exc.reason)] += 1
            await self.store.run(self.store.log_action, {"at": self.clock(), "vllm_instance": name,
                                 "action": "set_limit", "target": target, "result": exc.reason,
                                 "retry_in": delay})  # fmt: skip
            log.error("%s: setting the batch limit to %d failed: %s; retry in %.0f s", name, target, exc, delay)
            return
        self.actions[(name, "set_limit", "ok")] += 1
        await self.store.run(self.store.log_action, {"at": self.clock(), "vllm_instance": name, "action": "set_limit",
                             "target": target, "result": "ok"})  # fmt: skip
        await self._save(name, replace(self.states[name], applied_limit=target))

    async def _send_pages(self, *, last: bool = False) -> None:
        """Post the queued pages, unless a failed post's backoff runs; ``last`` (at shutdown): whatever it says."""
        if not self._page_queue or (self.clock() < self._page_backoff.retry_at and not last):
            return
        if self.alertmanager is None:
            for page in self._page_queue:
                if not page.resolve:
                    log.critical("%s: PAGE %s: %s (no Alertmanager configured: the breaker metric is the page)",
                                 page.instance, page.reason, page.text)  # fmt: skip
                self.pages[(page.reason, "no_alertmanager")] += 1
            self._page_queue.clear()
            return
        sending = list(self._page_queue)  # the engines' passes may queue more while the POST is out
        try:
            await self.alertmanager.post_alerts([self._page_alert(p) for p in sending])
        except AlertmanagerError as exc:
            delay = self._page_backoff.failed(self.clock())
            log.error("paging through Alertmanager failed: %s; retry in %.0f s", exc, delay)
            for page in sending:
                self.pages[(page.reason, "error")] += 1
            return
        self._page_backoff = Backoff()
        for page in sending:
            self.pages[(page.reason, "resolved" if page.resolve else "sent")] += 1
        self._unqueue(sending)

    def _unqueue(self, pages: Sequence[Page]) -> None:
        """Take these very pages out of the queue, in place (a post in flight holds a copy of it)."""
        gone = {id(page) for page in pages}
        self._page_queue[:] = [page for page in self._page_queue if id(page) not in gone]

    def _page_alert(self, page: Page) -> PostableAlert:
        now = utc(self.clock())
        return PostableAlert(
            labels={
                "alertname": PAGE_ALERT,
                "severity": "critical",
                "vllm_instance": page.instance,
                "reason": page.reason,
                "source": "batchlens-remediate",
            },
            annotations={
                "summary": f"batchlens breaker on {page.instance}: {page.reason.replace('_', ' ')}",
                "description": page.text,
                "runbook_url": f"docs/runbooks/{PAGE_ALERT}.md",
                "dashboard_url": f"/d/batchlens-breaker/batchlens?var-vllm_instance={page.instance}",
            },
            startsAt=None if page.resolve else now,
            endsAt=now if page.resolve else None,
        )

    async def _reset_prefix_cache(self, delivery: Delivery) -> str:
        """The plugin's prefix-cache reset for a firing KV alert outside the cooldown; what became of the delivery.

        Through the admin API, with the engine's token: never vLLM's dev-mode route, which dev mode serves with
        no authentication beside /collective_rpc and /sleep.
        """
        name = delivery.vllm_instance
        last = self._kv_reset_at.get(name)
        if delivery.status != "firing":
            return "resolved"
        if last is not None and self.clock() - last < self.settings.cooldown_seconds:
            return "cooldown"
        self._kv_reset_at[name] = self.clock()
        try:
            result = "ok" if (await self.admins[name].reset_prefix_cache()).reset else "in_use"
            why = "reset" if result == "ok" else "not reset: running requests hold its blocks"
        except AdminCallError as exc:
            result, why = exc.reason, str(exc)
        self.actions[(name, "reset_prefix_cache", result)] += 1
        log.warning("%s: prefix cache %s", name, why)
        return "reset_prefix_cache"
