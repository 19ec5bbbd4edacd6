"""The routing decision for one request, with the live signals it rests on and the counters that show it.

Framework-neutral: the LiteLLM adapter (``batchlens.routing.litellm``) turns a
proxy request into :class:`~batchlens.routing.classify.Request` facts and the
returned :class:`Decision` into LiteLLM's tags and vLLM's priority. The
exporter is read every ``signals_ttl_seconds`` in the background, with a short
timeout; while it cannot be read every engine is ``unknown`` and requests go
where their role says (signals only ever move traffic away from an engine, so
their absence must not).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from batchlens.config import ROLES, Config, Engine
from batchlens.masking import mask_url
from batchlens.routing.classify import Choice, Request, classify
from batchlens.routing.door_retry import OUTCOMES
from batchlens.routing.gaps import ArrivalGaps
from batchlens.routing.pick import Route, pick
from batchlens.routing.signals import EngineSignal, engine_signals
from batchlens.routing.trust import CLAIMS

log = logging.getLogger("batchlens.routing")
ENGINE_TAG = "batchlens-engine:"  # the tag that names one engine's deployment in the proxy config
#: The request's class, as a tag no deployment carries (so it never changes where LiteLLM sends it): what the
#: latency histogram is labelled by when LiteLLM reports the request done.
WANTED_TAG = "batchlens-wanted:"
#: TTFT buckets: the article's 100-200 ms interactive class to a queue of minutes.
TTFT_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


def engine_tag(engine: Engine) -> str:
    return ENGINE_TAG + engine.name


@dataclass(frozen=True)
class Decision:
    choice: Choice  # the role the request wanted, and why
    route: Route  # where it goes
    priority: int | None  # vLLM's request priority; None: not every engine of the route schedules by priority
    door_priority: int = 0  # the engine door's (x-batchlens-priority): below 0 sheddable, above 0 critical

    @property
    def tags(self) -> list[str]:
        return [WANTED_TAG + self.choice.role, *(ENGINE_TAG + name for name in self.route.engines)]


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.decisions = counter(
            "batchlens_routing_decisions",
            "Requests routed, by the role they wanted, why, and the role they got "
            "(fallback: why the wanted role was left; empty when it was not).",
            ("wanted", "reason", "role", "fallback"),
        )
        self.signal_errors = counter(
            "batchlens_routing_signal_errors", "Failed reads of the exporter's signals, by reason.", ("reason",)
        )
        self.errors = counter(
            "batchlens_routing_errors", "Requests the routing plugin could not route (they went on unrouted)."
        )
        self.ttft = Histogram(
            "batchlens_routing_time_to_first_token_seconds",
            "Time to the first token of routed requests at the proxy, by the role they wanted (for a request not "
            "streamed, the whole request).",
            ("wanted",), buckets=TTFT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.failures = counter(
            "batchlens_routing_failures", "Routed requests that failed after every retry and fallback.", ("wanted",)
        )
        self.untrusted = counter(
            "batchlens_routing_untrusted_claims",
            "Requests whose own claim (the interactive class, an engine or role tag, vLLM's priority) was ignored "
            "because their key is not trusted (routing.trusted_keys, docs/routing.md), by claim.",
            ("claim",),
        )
        self.door_retries = counter(
            "batchlens_routing_door_retries",
            "Requests an engine's admission door refused (HTTP 503), by the role the router chose and what came of "
            "it: served or refused_again or failed on another engine of that role, or not retried for want of one "
            "with room (no_engine_with_room) or of TTFT budget (past_budget); docs/routing.md.",
            ("role", "outcome"),
        )
        self.signals_up = Gauge(
            "batchlens_routing_signals_up",
            "1 when the last read of the exporter's signals succeeded.",
            registry=registry,
        )
        self.cold_gap = Gauge(
            "batchlens_routing_cold_gap_seconds",
            "The cold-path threshold in force (NaN: auto, too few gaps yet).",
            registry=registry,
        )
        for claim in CLAIMS:
            self.untrusted.labels(claim)
        for role in ROLES:  # every role's series from the start, so rates and alerts see the first request
            self.decisions.labels(role, "default" if role == "main" else _REASON[role], role, "")
            self.ttft.labels(role)
            self.failures.labels(role)
            for outcome in OUTCOMES:
                self.door_retries.labels(role, outcome)


_REASON = {"long": "long_prompt", "interactive": "latency_header", "cold": "cold_gap"}


def wanted_of(tags: list | None) -> str | None:
    """The role a finished request wanted, from the tags the router gave it; None: not routed by batchlens."""
    found = (t.removeprefix(WANTED_TAG) for t in tags or () if isinstance(t, str) and t.startswith(WANTED_TAG))
    return next((role for role in found if role in ROLES), None)


class SignalCache:
    """The exporter's /metrics, read every ``ttl`` seconds in the background; failures counted and logged once.

    A request never waits on the exporter: it takes the latest signals there are (a read in its path put the
    exporter's latency, up to the timeout, into the tail of every request that found the cache expired).
    """

    def __init__(self, url: str, ttl: float, timeout: float, metrics: RoutingMetrics):
        self._url, self._ttl, self._timeout, self._metrics = url + "/metrics", ttl, timeout, metrics
        self._signals: dict[str, EngineSignal] = {}
        self._failing: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._reader: asyncio.Task | None = None

    def signals(self) -> dict[str, EngineSignal]:
        """The latest signals, at once; the first call (in the proxy's event loop) starts the reader."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._keep_reading())
        return self._signals

    async def _keep_reading(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a bug here must not end the reading: log it, and go on with what there is
                log.exception("reading the exporter's signals failed unexpectedly")
            await asyncio.sleep(self._ttl)

    async def refresh(self) -> None:
        self._signals = await self._read()

    async def _read(self) -> dict[str, EngineSignal]:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        try:
            timeout = aiohttp.ClientTimeout(total=self._timeout)
            async with self._session.get(self._url, timeout=timeout) as resp:
                if resp.status != 200:
                    return self._failed(f"http_{resp.status}", f"HTTP {resp.status}")
                text = await resp.text(errors="replace")
        except TimeoutError:
            return self._failed("timeout", f"no answer within {self._timeout:g} s")
        except aiohttp.ClientError as exc:
            return self._failed("connect", str(exc) or type(exc).__name__)
        signals = await asyncio.to_thread(engine_signals, text)  # parsing is milliseconds: off the proxy's loop
        if self._failing is not None:
            log.info("exporter signals readable again at %s (%d engines)", mask_url(self._url), len(signals))
        self._failing = None
        self._metrics.signals_up.set(1)
        return signals

    def _failed(self, reason: str, detail: str) -> dict[str, EngineSignal]:
        self._metrics.signal_errors.labels(reason).inc()
        self._metrics.signals_up.set(0)
        if self._failing != reason:
            log.warning("cannot read the exporter's signals at %s: %s; routing by role alone until it answers",
                        mask_url(self._url), detail)  # fmt: skip
        self._failing = reason
        return {}

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._session is not None:
            await self._session.close()


class Router:
    def __init__(self, config: Config, *, registry: CollectorRegistry = REGISTRY,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):  # fmt: skip
        self.rules = config.routing
        self.engines = list(config.engines)
        self.roles = {role: [e.name for e in self.engines if role in e.role] for role in ROLES}
        self._priority_engines = {e.name for e in self.engines if e.scheduling_policy == "priority"}
        self.metrics = RoutingMetrics(registry)
        self.gaps = ArrivalGaps(self.rules)
        self.signals = SignalCache(self.rules.exporter_url, self.rules.signals_ttl_seconds,
                                   self.rules.signals_timeout_seconds, self.metrics)  # fmt: skip
        self._clock, self._wall = clock, wall
        self.ttft_budget = config.slo.ttft_seconds  # a door's refusal is retried only within it (door_retry.py)

    def clock(self) -> float:
        """The router's clock (monotonic seconds): what a request's TTFT budget is counted on."""
        return self._clock()

    def states(self) -> dict[str, str]:
        """Each engine's signal state now (ok, saturated, down, unknown), from the latest signals there are."""
        now = self._wall()
        return {name: s.state(now, self.rules) for name, s in self.signals.signals().items()}

    async def decide(self, tokens: int | None, latency_class: str | None, tags: tuple[str, ...]) -> Decision:
        gap = self.gaps.arrived(self._clock())
        threshold = self.gaps.threshold()
        self.metrics.cold_gap.set(math.nan if threshold is None else threshold)
        choice = classify(Request(tokens, latency_class, tags, gap), self.rules, threshold)
        route = pick(choice.role, self.roles, self.states(), self.rules)
        self.metrics.decisions.labels(choice.role, choice.reason, route.role, route.fallback).inc()
        priority = self.rules.priority.get(choice.role)
        if not route.engines or not set(route.engines) <= self._priority_engines:
            priority = None  # only --scheduling-policy priority acts on it; vLLM 0.10's V0 engine refuses it otherwise
        return Decision(choice, route, priority, self.rules.door_priority.get(choice.role, 0))
