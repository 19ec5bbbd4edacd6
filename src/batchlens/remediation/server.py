"""`batchlens remediate`: the Alertmanager webhook receiver, its /metrics and /healthz.

``POST /alertmanager`` takes Alertmanager's webhook payload (version 4) with
``Authorization: Bearer <token>``: the service's token (``remediate.webhook_token_env``),
which may act on any engine, or a namespace's own (discovery reads it from that namespace's
admin-token Secret, key ``kubernetes.webhook_token_key``), which acts on that namespace's
engines only. Without any token configured the route answers 503, secure by default. It answers:

- 200 once the deliveries are in the inbox: the work happens after the reply;
- 400 for a body that is not a version-4 payload, 401 for a wrong token,
  413 for a body over 1 MiB: Alertmanager does not retry these;
- 503 when the inbox cannot take the notification (its engine's or namespace's share of deliveries waiting, or
  the store's byte budget), 500 when it cannot be written: Alertmanager retries both, so no alert is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import sqlite3
from collections import Counter
from collections.abc import Mapping

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from pydantic import ValidationError

from batchlens import __version__
from batchlens.admin_auth import bearer_matches
from batchlens.config import Config, parse_listen
from batchlens.discovery.kubernetes import DiscoveryError, PodLister
from batchlens.http_server import application, run_app
from batchlens.masking import mask_url
from batchlens.remediation.alertmanager import AlertmanagerClient
from batchlens.remediation.controller import TICK_BUCKETS, UNSET, Controller
from batchlens.remediation.service import Remediator
from batchlens.remediation.states import BREAKER_STATES
from batchlens.remediation.store import InboxFull, Store
from batchlens.remediation.webhook import WebhookPayload

log = logging.getLogger("batchlens.remediate")
MAX_BODY = 1024 * 1024
RETRY_AFTER_SECONDS = 10  # a full inbox drains as the engines' passes decide it: seconds, not minutes
WEBHOOK_PATH = "/alertmanager"


class HookCollector:
    """The hook's metrics, rendered from the remediator's state at scrape time (client_python's Collector)."""

    def __init__(self, server: RemediationServer):
        self._server = server

    def collect(self):
        r = self._server.remediator
        state = GaugeMetricFamily(
            "batchlens_breaker_state",
            "1 for the breaker's current state, per engine.",
            labels=["vllm_instance", "state"],
        )
        strikes = GaugeMetricFamily(
            "batchlens_breaker_strikes", "Consecutive breaker actions.", labels=["vllm_instance"]
        )
        target = GaugeMetricFamily(
            "batchlens_batch_limit_target", "The batch limit the hook wants in force.", labels=["vllm_instance"]
        )
        # A standby's states are its last term's, or none: only the leader's are the engines' (leader election).
        for name, s in sorted(r.states.items() if r.acting else ()):
            for known in BREAKER_STATES:
                state.add_metric([name, known], 1.0 if s.mode == known else 0.0)
            strikes.add_metric([name], s.strikes)
            if (wanted := r.target(name)) is not None:
                target.add_metric([name], wanted)
        yield from (state, strikes, target)
        if r.controller is not None and r.acting:
            yield from _controller_families(r.controller)
        yield _counter(
            "batchlens_remediation_actions", "Decisions and admin API calls, by result.",
            ["vllm_instance", "action", "result"], r.actions,
        )  # fmt: skip
        yield _counter("batchlens_remediation_deliveries", "Alert deliveries, by what became of them.", ["outcome"],
                       {(k,): v for k, v in r.deliveries.items()})  # fmt: skip
        yield _counter("batchlens_remediation_pages", "Pages to on-call, by reason and result.", ["reason", "result"],
                       r.pages)  # fmt: skip
        yield _counter("batchlens_webhook_requests", "Webhook requests, by HTTP status.", ["code"],
                       {(str(k),): v for k, v in self._server.requests.items()})  # fmt: skip
        store = self._server.store
        yield GaugeMetricFamily("batchlens_remediation_store_bytes", "What the hook's state store takes on "
                                "disk: the database, its journal and the action log.",
                                value=store.bytes_on_disk())  # fmt: skip
        yield GaugeMetricFamily("batchlens_remediation_store_budget_bytes", "The state store's byte budget "
                                "(remediate.store_max_bytes).", value=store.budget.total)  # fmt: skip
        yield _counter("batchlens_remediation_discovery_errors", "Failed looks at the vLLM pods, by reason.",
                       ["reason"], {(k,): v for k, v in self._server.discovery_errors.items()})  # fmt: skip
        if self._server.leadership is not None:
            yield GaugeMetricFamily("batchlens_remediation_leader", "1 while this hook leads (holds the Lease and "
                                    "acts), 0 while it stands by.", value=1.0 if r.acting else 0.0)  # fmt: skip


def _controller_families(c: Controller):
    target = GaugeMetricFamily("batchlens_controller_target_limit", "The batch limit the controller wants.",
                               labels=["vllm_instance"])  # fmt: skip
    attainment = GaugeMetricFamily(
        "batchlens_controller_slo_attainment",
        "Estimated share of requests within the SLO over the last minute, from the engine's histograms.",
        labels=["vllm_instance"],
    )
    goodput = GaugeMetricFamily(
        "batchlens_controller_goodput_rps", "Estimated good requests per second over the last minute.",
        labels=["vllm_instance"],
    )  # fmt: skip
    for name, steering in sorted(c.states.items()):
        if steering.limit is not None:
            target.add_metric([name], steering.limit)
        if (estimate := c.estimates.get(name)) is not None:
            attainment.add_metric([name], estimate.attainment)
            goodput.add_metric([name], estimate.goodput_rps)
    yield from (target, attainment, goodput)
    yield from _admission_families(c)
    yield _counter("batchlens_controller_decisions", "Controller ticks, by what they decided.",
                   ["vllm_instance", "reason"], c.decisions)  # fmt: skip
    times, cumulative = c.tick_times, list(itertools.accumulate(c.tick_times.counts))
    yield HistogramMetricFamily(
        "batchlens_controller_tick_seconds", "How long each engine's controller tick took, from its start due "
        "(reads, decision, door): one past control.interval_seconds is late.",
        buckets=[*((f"{b:g}", n) for b, n in zip(TICK_BUCKETS, cumulative, strict=True)), ("+Inf", times.count)],
        sum_value=times.sum,
    )  # fmt: skip


def _admission_families(c: Controller):
    """The second knob per engine: the cap wanted, the cap in force (+Inf: no cap) and the prefill estimate."""
    wanted = GaugeMetricFamily("batchlens_admission_cap_target_tokens", "The queued-token cap the controller "
                               "wants (+Inf: no cap, the door open; under a hand's hold, the hand's cap).",
                               labels=["vllm_instance"])  # fmt: skip
    in_force = GaugeMetricFamily("batchlens_admission_cap_tokens", "The queued-token cap in force on the engine, "
                                 "as batchlens last set or read it, a hand's included (+Inf: no cap).",
                                 labels=["vllm_instance"])  # fmt: skip
    rate = GaugeMetricFamily("batchlens_admission_prefill_tokens_per_second", "Estimated prefill throughput "
                             "the cap rests on: the median of recent windows with requests waiting.",
                             labels=["vllm_instance"])  # fmt: skip
    for name, decision in sorted(c.caps.items()):
        wanted.add_metric([name], math.inf if decision.cap is None else decision.cap)
        if decision.prefill_tokens_per_second is not None:
            rate.add_metric([name], decision.prefill_tokens_per_second)
    for name in sorted(c.states):
        if (cap := c.cap_in_force(name)) is not UNSET:
            in_force.add_metric([name], math.inf if cap is None else cap)
    yield from (wanted, in_force, rate)


def _counter(name: str, doc: str, labels: list[str], counts: Mapping[tuple, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in sorted(counts.items()):
        family.add_metric(list(key), value)
    return family


class RemediationServer:
    def __init__(self, config: Config, environ: Mapping[str, str] | None = None):
        self.config = config
        self.environ = os.environ if environ is None else environ
        # Stripped, as a discovered token is: a Secret mounted --from-file ends in a newline, which no sender sends
        self.token = (self.environ.get(config.remediate.webhook_token_env) or "").strip() or None
        self.requests: Counter[int] = Counter()
        self.store = Store(config.remediate.state_path, config.remediate.store_max_bytes)
        self.remediator: Remediator | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self._session: aiohttp.ClientSession | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Every node's vLLM pods; built here so that a missing extra or API config stops the command at once.
        self._lister = PodLister(config.kubernetes) if config.kubernetes.discover else None
        self._discovery: asyncio.Task | None = None
        self.discovery_errors: Counter[str] = Counter()
        self._discovery_failing: str | None = None
        self._token_failing: dict[str, str] = {}  # namespace -> why its admin token Secret is not read
        self.namespace_tokens: dict[str, str] = {}  # namespace -> its tenant's webhook token (from discovery)
        self.leadership = None  # one hook of several (remediate.leader_election): remediation/leader.py
        if config.remediate.leader_election.enabled:
            from batchlens.remediation.leader import Leadership

            self.leadership = Leadership(config.remediate.leader_election, config.kubernetes, self.environ)
        self._leading: asyncio.Task | None = None

    async def start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(headers={"User-Agent": f"batchlens/{__version__}"})
        am_url = self.config.remediate.alertmanager_url
        am = AlertmanagerClient(self._session, am_url) if am_url else None
        self.remediator = Remediator(self.config, self.store, self._session, self.environ, alertmanager=am,
                                     leadership=self.leadership)  # fmt: skip
        self.registry.register(HookCollector(self))
        if self._lister is not None:
            await self.discover()  # before the first alert: an alert for a pod not yet known is not acted on
            self._discovery = asyncio.create_task(self._discover_every(), name="discovery")
        self._task = asyncio.create_task(self.remediator.run(self._stop), name="remediator")
        if self.leadership is not None:
            self._leading = asyncio.create_task(self._lead(), name="leader election")
        if self.token is None:
            log.error("%s is not set: the webhook answers 503 until it is", self.config.remediate.webhook_token_env)
        prometheus = self.config.remediate.prometheus_url
        if not prometheus:
            log.warning("remediate.prometheus_url is not set: alerts are acted on as delivered, unconfirmed, so "
                        "whoever can post an alert to Alertmanager can halve an engine (docs/security.md)")  # fmt: skip
        log.info(
            "engines: %s; alertmanager: %s; alerts confirmed by: %s; state: %s (budget %s); controller: %s%s",
            ", ".join(self.remediator.engines) or "none", mask_url(am_url) if am_url else "none (pages are logged)",
            mask_url(prometheus) if prometheus else "nobody", self.store.path,
            f"{self.config.remediate.store_max_bytes / 2**20:g} MiB", self._control_summary(),
            "; DRY RUN" if self.config.breaker.dry_run else "",
        )  # fmt: skip

    async def discover(self) -> None:
        """One look at the vLLM pods: a vllm_instance "<namespace>/<pod>" resolves to its pod's admin URL."""
        assert self._lister is not None and self.remediator is not None
        try:
            found = await self._lister.engines()
        except DiscoveryError as exc:
            if self._discovery_failing != exc.reason:  # once per outage and reason, as the exporter's sampler
                log.warning("discovery: %s [reason=%s]; the engines found so far stay", exc, exc.reason)
            self._discovery_failing = exc.reason
            self.discovery_errors[exc.reason] += 1
            return
        if self._discovery_failing is not None:
            log.info("discovery: the API answers again")
            self._discovery_failing = None
        for namespace, exc in found.token_errors.items():
            if self._token_failing.get(namespace) != exc.reason:  # once per namespace and reason
                log.warning("discovery: %s [reason=token_%s]; its engines get no token", exc, exc.reason)
            self.discovery_errors[f"token_{exc.reason}"] += 1
        self._token_failing = {ns: exc.reason for ns, exc in found.token_errors.items()}
        # A Secret that cannot be read this time is not a revoked one: its namespace keeps the token it had.
        kept = {ns: t for ns, t in self.namespace_tokens.items() if ns in found.token_errors}
        self.namespace_tokens = {**kept, **found.webhook_tokens}
        await self.remediator.engines_found(found.engines)

    async def _lead(self) -> None:
        """Each round: renew or try the Lease; take over, or stand by, as it says; keep the controllers' state."""
        lead, r = self.leadership, self.remediator
        assert lead is not None and r is not None
        settings = self.config.remediate.leader_election
        log.info("leader election: this hook is %s, on the Lease %s/%s; every %g s, a failover within %g s",
                 lead.elector.me, lead.elector.namespace, settings.lease_name, settings.retry_period_seconds,
                 settings.lease_duration_seconds + settings.retry_period_seconds)  # fmt: skip
        while True:
            try:
                await self._lead_round(lead, r)
            except Exception:  # a round that fails (the store, say) must not end the election: the next retries
                log.exception("leader election: a round failed; retrying in %g s", settings.retry_period_seconds)
            await asyncio.sleep(settings.retry_period_seconds)

    @staticmethod
    async def _lead_round(lead, r: Remediator) -> None:
        leading = await lead.elector.round()
        if leading and not r.acting and (saved := await lead.saved()) is not None:
            log.warning("leader election: this hook (%s) leads: it acts from now on, from the state the last leader "
                        "kept", lead.elector.me)  # fmt: skip
            await r.take_over(saved)
        elif not leading and r.acting:
            log.warning("leader election: this hook no longer leads (%s does): standing by",
                        lead.elector.holder or "nobody")  # fmt: skip
            await r.stand_by()
        if leading and r.controller is not None:
            await lead.keep("controllers", {n: s.to_dict() for n, s in r.controller.states.items()})

    async def _discover_every(self) -> None:
        while True:
            await asyncio.sleep(self.config.kubernetes.interval_seconds)
            await self.discover()

    def _control_summary(self) -> str:
        c = self.config.control
        if not c.enabled:
            # The door is the controller's second knob: on its own it does nothing, which must not go unsaid.
            return "off (control.enabled)" + (", so no admission cap either (control.admission needs it)"
                                              if c.admission else "")  # fmt: skip
        top, slo = c.max_limit or "capacity", self.config.slo
        door = "admission cap on" if c.admission else "no admission cap (control.admission)"
        return (f"every {c.interval_seconds:g} s, limits {c.min_limit}..{top}, {door}, SLO TTFT "
                f"{slo.ttft_seconds:g} s TPOT {slo.tpot_seconds:g} s{', dry run' if c.dry_run else ''}")  # fmt: skip

    async def stop(self, _app: web.Application) -> None:
        self._stop.set()
        if self._leading is not None:
            self._leading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._leading
        if self._discovery is not None:
            self._discovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discovery
        if self._lister is not None:
            await self._lister.aclose()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=10)
        if self.leadership is not None:  # after the last act: a standby takes over at its next round
            await self.leadership.elector.release()
            await self.leadership.aclose()
        if self._session is not None:
            await self._session.close()
        self.store.close()
        log.info("stopped")

    @web.middleware
    async def count_requests(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if request.path == WEBHOOK_PATH:
                self.requests[exc.status] += 1
            raise
        if request.path == WEBHOOK_PATH:
            self.requests[response.status] += 1
        return response

    async def handle_webhook(self, request: web.Request) -> web.Response:
        if self.token is None and not self.namespace_tokens:
            return _error(503, f"no webhook token configured: set {self.config.remediate.webhook_token_env}")
        if self.remediator is not None and not self.remediator.acting:  # Alertmanager retries: the leader takes it
            holder = self.leadership.elector.holder if self.leadership is not None else ""
            return _error(503, f"a standby: {holder or 'another hook'} leads; retry", retry_after=RETRY_AFTER_SECONDS)
        given = request.headers.get("Authorization")
        scopes = [ns for ns, token in self.namespace_tokens.items() if bearer_matches(given, token)]
        if self.token is not None and bearer_matches(given, self.token):
            scope = None  # the service's own token: any engine
        elif scopes:
            scope = frozenset(scopes)  # the namespaces whose Secret holds this token (one, unless copied)
        else:
            log.warning("webhook: rejected a request from %s: missing or wrong bearer token", request.remote)
            return _error(401, "missing or wrong bearer token")
        body = await request.read()  # aiohttp answers 413 past client_max_size
        try:
            payload = WebhookPayload.model_validate_json(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            log.warning("webhook: rejected a payload: %s: %s", where, first["msg"])
            return _error(400, f"not an Alertmanager version 4 payload: {where}: {first['msg']}")
        try:
            summary = await self.remediator.accept(payload, scope)
        except InboxFull as exc:  # said by the remediator, a flood as one line every few seconds
            return _error(503, f"{exc}; retry", retry_after=RETRY_AFTER_SECONDS)
        except sqlite3.Error as exc:
            log.error("webhook: cannot write the inbox (%s): answering 500 so that Alertmanager retries", exc)
            return _error(500, "cannot store the notification; retry")
        return web.json_response({"status": "accepted", **summary})

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    async def handle_healthz(self, _request: web.Request) -> web.Response:
        r = self.remediator
        # target_limit: what the hook wants in force, the controller's or the breaker's, as
        # batchlens_batch_limit_target says; applied_limit: the last limit it set, or the one in force it found at
        # start on an engine it never set (a dry run sets none).
        # breaker_limit: the breaker's own (a ceiling the controller steers under while it recovers).
        engines = {name: {"mode": s.mode, "strikes": s.strikes, "target_limit": r.target(name),
                          "breaker_limit": s.target_limit, "applied_limit": s.applied_limit}
                   for name, s in r.states.items()}  # fmt: skip
        return web.json_response(
            {
                "status": "ok",
                "version": __version__,
                "engines": engines,
                "webhook_token": self.token is not None,
                "confirmed_by": mask_url(self.config.remediate.prometheus_url) or None,
                "dry_run": self.config.breaker.dry_run,
                "control": self._control_health(),
                **self._leader_health(),
            }
        )

    def _leader_health(self) -> dict:
        if self.leadership is None:
            return {}
        elector = self.leadership.elector
        return {"leader": {"me": elector.me, "leading": self.remediator.acting, "holder": elector.holder or None}}

    def _control_health(self) -> dict:
        c = self.remediator.controller
        if c is None:
            return {"enabled": False}
        now = self.remediator.clock()
        # limit: the controller's; limit_in_force: what the engine reported at its last tick (null before one).
        # The holds are in force now, a limit's or a cap's set by hand, kept over a restart.
        engines = {name: {"limit": s.limit, "limit_in_force": s.seen_limit, "manual_hold": s.manual_until > now,
                          "cap_manual_hold": s.door.manual_until > now} for name, s in c.states.items()}  # fmt: skip
        if self.config.control.admission:
            # The door beside it: the cap in force at the last read and the cap wanted (null: no cap), each once known.
            for name, health in engines.items():
                if (cap := c.cap_in_force(name)) is not UNSET:
                    health["cap_in_force"] = cap
                if name in c.caps:
                    health["cap_target"] = c.caps[name].cap
        return {"enabled": True, "dry_run": self.config.control.dry_run, "engines": engines}

    def app(self) -> web.Application:
        app = application(client_max_size=MAX_BODY, middlewares=(self.count_requests,))
        app.router.add_post(WEBHOOK_PATH, self.handle_webhook)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/healthz", self.handle_healthz)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


def _error(status: int, message: str, *, retry_after: int | None = None) -> web.Response:
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    return web.Response(status=status, text=json.dumps({"error": message}), content_type="application/json",
                        headers=headers)  # fmt: skip


def serve(config: Config) -> None:
    """Run the hook until SIGINT or SIGTERM, then shut down cleanly."""
    host, port = parse_listen(config.remediate.listen)
    server = RemediationServer(config)
    ready = f"batchlens remediate {__version__}: webhook on http://{config.remediate.listen}{WEBHOOK_PATH}"
    run_app(server.app(), host, port, logger=log, ready=ready, access_log=None, shutdown_timeout=5)
