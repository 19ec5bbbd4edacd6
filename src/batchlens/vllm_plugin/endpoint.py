"""The API-server side of the admin API: ``/batchlens/v1/*`` routes over the engine-side methods.

Every route needs the token from ``BATCHLENS_ADMIN_TOKEN`` (the contract's
401/503), reads or changes every engine core behind the server (data
parallelism) and answers in the contract's shapes (batchlens.admin_api).
On a vLLM the plugin refuses (compat.py), every route answers 501 with the
reason. vLLM 0.32 and later serve the routes through an endpoint plugin
(:class:`BatchlensEndpoint`); older releases through ``--middleware``
(middleware.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from batchlens import __version__
from batchlens.admin_api import (
    ADMISSION_PATH,
    BATCH_PATH,
    CACHE_RESET_PATH,
    INFO_PATH,
    MAX_BODY_BYTES,
    TOKEN_ENV,
    AdminError,
    AdminInfo,
    AdmissionState,
    BatchState,
    CacheReset,
    combine,
    parse_admission,
    parse_update,
    retry_after,
)
from batchlens.admin_auth import AdminAuth, PodIdentity, own_pod, refuse_encoded
from batchlens.predicted_ttft import Backlog, Watch, predict, refuses
from batchlens.queued_caps import PREDICTED_TTFT, plugin_refusal
from batchlens.vllm_plugin.admin_port import admin_listen, start_admin_server
from batchlens.vllm_plugin.arrival_middleware import ArrivalMiddleware
from batchlens.vllm_plugin.arrival_middleware import metrics as arrival_metrics
from batchlens.vllm_plugin.compat import PLUGIN_DOOR, VLLM_DOOR, Support, check_installed_vllm
from batchlens.vllm_plugin.door import PluginDoor, VllmDoor, predicted_rejections, request_states
from batchlens.vllm_plugin.engine_side import BATCH_UTILITY, INFO_UTILITY
from batchlens.vllm_plugin.second_look import SecondLook, Ticket
from batchlens.vllm_plugin.siblings import Caps, SiblingTable, open_table, private_table

log = logging.getLogger("vllm.batchlens")

ENGINE_TIMEOUT_SECONDS = 10.0
#: How often each API server puts its siblings' caps in force and publishes its own counts (siblings.py).
SIBLING_TICK_SECONDS = 0.025
#: How long a PUT of the caps waits for every sibling to have them in force before it answers.
SIBLING_WAIT_SECONDS = 2.0
STATE_KEY = "batchlens_admin"


class AdminService:
    """The engine client, the token, and a lock that applies changes one at a time."""

    def __init__(
        self, engine_client: Any, token: str | None, support: Support, pod: PodIdentity,
        siblings: SiblingTable | None = None,
    ):  # fmt: skip
        #: The caps and counts this API server shares with its siblings (siblings.py); its own alone if none.
        self.siblings = siblings or private_table()
        # A signed call taken by any sibling is a replay to the others: a captured PUT may land on any of them.
        self.auth = AdminAuth(token, pod=pod, shared=self.siblings.remember if self.siblings.count > 1 else None)
        self._client = engine_client
        self._support = support
        # Without it (and the siblings' lock, for the other API servers), two PUTs could reach the engines of
        # a data-parallel server in different orders and leave them with different limits.
        self._lock = asyncio.Lock()
        self._prefill_rate: float | None = None  # the controller's estimate, for a refusal's Retry-After
        doors = {VLLM_DOOR: VllmDoor, PLUGIN_DOOR: PluginDoor}
        self._door = doors[support.door](engine_client) if engine_client is not None and support.door else None
        self._applied = 0  # the generation of the shared caps this process has in force
        # The per-request door (predicted_ttft.py): its bound, shared like the caps, and what it learns.
        self._predicted_ttft: float | None = None
        self._watch = Watch()
        self._second_look = SecondLook()
        self._said_unreadable = self._said_unjudged = False
        self._predicted_refusals = predicted_rejections(engine_client) if self._door is not None else None
        if self._door is not None and self.siblings.count > 1:
            self._door.count_server_wide(lambda: self.siblings.totals(*self._door.counts(), time.monotonic_ns()))

    def apply_shared_caps(self) -> None:
        """Put the caps the siblings share in force here, if one of them changed them: before every request
        the door judges (a few loads from shared memory) and on every tick."""
        if (door := self._door) is None:
            return
        caps = self.siblings.caps()
        if caps.generation != self._applied:
            door.caps.max_num_queued_tokens = caps.max_num_queued_tokens
            door.caps.max_num_queued_reqs = caps.max_num_queued_reqs
            self._prefill_rate = caps.prefill_tokens_per_second
            self._predicted_ttft = caps.max_predicted_ttft_seconds
            self._applied = caps.generation

    def sync(self) -> None:
        """One tick: the shared caps in force here, this process's counts published to its siblings, and what the
        per-request door learns from its requests' states."""
        self.apply_shared_caps()
        if (door := self._door) is not None:
            self._sample()
            if self.predicts():
                self._look_again()
            if self.siblings.count > 1:
                self.siblings.publish(*door.counts(), self._applied, time.monotonic_ns())

    def _sample(self) -> Backlog | None:
        """The request states, into what the per-request door learns; None where they cannot be read (a release
        that moved vLLM's internals): said once, and the door then admits unjudged, never fails a request."""
        try:
            return self._watch.sample(time.monotonic(), request_states(self._client), self._slots)
        except Exception:
            if not self._said_unreadable:
                self._said_unreadable = True
                log.exception("batchlens: the per-request door cannot read vLLM's request states: it admits "
                              "every request unjudged")  # fmt: skip
            return None

    def _look_again(self) -> None:
        """The door's second look at the requests it admitted (second_look.py); where vLLM's request states cannot
        be read so, said once, and the door judges at arrival alone."""
        try:
            refused = self._second_look.judge(self._client, self._watch.rates, self._slots, self._step_tokens,
                                              self._predicted_ttft)  # fmt: skip
        except Exception:
            if not self._said_unjudged:
                self._said_unjudged = True
                log.exception("batchlens: the per-request door cannot judge vLLM's queued requests again: it judges "
                              "each request at its arrival alone")  # fmt: skip
            return
        self._predicted_refusals.inc(refused)

    def start(self) -> asyncio.Task | None:
        """The tick, as a task of vLLM's running loop (held by the caller, so that the loop does not drop it):
        the per-request door's sampler, and where there are siblings to keep in step with, the caps and counts
        they share, and the arrivals' gaps measured over all of them."""
        if self.siblings.count > 1:
            arrival_metrics().share_last_arrival(self.siblings.swap_last_arrival)
        if self._door is None:
            return None

        async def tick() -> None:
            while True:
                try:
                    self.sync()
                except Exception:  # the counts read vLLM's internals: one bad tick must not end the others
                    log.exception("batchlens: could not sample or share this API server's door state")
                await asyncio.sleep(SIBLING_TICK_SECONDS)

        if self.siblings.count > 1:
            log.info(
                "batchlens: API server %d of %d: the queued caps and counts are shared with its siblings (%s)",
                self.siblings.index, self.siblings.count, self.siblings.where,
            )  # fmt: skip
        return asyncio.get_running_loop().create_task(tick(), name="batchlens-door")

    async def _all(self, method: str, *args: Any) -> list[Any]:
        """Call a batchlens utility method on every engine core; one result each."""
        if self._client is None:
            raise AdminError(503, "this server has no engine (a render-only server): there is no batch to limit")
        core = self._client.engine_core
        call_all = getattr(core, "call_utility_all_async", None)
        try:
            async with asyncio.timeout(ENGINE_TIMEOUT_SECONDS):
                if call_all is not None:
                    return list(await call_all(method, *args))
                return [await core.call_utility_async(method, *args)]
        except TimeoutError:
            raise AdminError(504, f"the engine did not answer {method} within {ENGINE_TIMEOUT_SECONDS:g}s") from None
        except Exception as exc:
            raise AdminError(
                503,
                f"the engine could not run {method} ({exc}); the engine side of the batchlens plugin loads "
                "with the general plugin 'batchlens': is VLLM_PLUGINS=batchlens set for the whole server?",
            ) from None

    async def batch(self) -> BatchState:
        return self._seen(combine(await self._all(BATCH_UTILITY)))

    def _seen(self, state: BatchState) -> BatchState:
        """The server's batch slots, for the per-request door of every sibling."""
        self.siblings.set_slots(state.max_num_active_seqs * len(state.engines))
        return state

    @property
    def _slots(self) -> int | None:
        """This process's share of the server's batch slots, once a batch read or set through any sibling said
        them; None before (the door then predicts no slot wait)."""
        slots = self.siblings.slots()
        return None if slots is None else max(1, slots // self.siblings.count)

    @property
    def _step_tokens(self) -> int | None:
        """This process's share of what the engines prefill in a step (``max_num_batched_tokens`` each); None
        where this release does not say."""
        config = getattr(self._client, "vllm_config", None)
        tokens = getattr(getattr(config, "scheduler_config", None), "max_num_batched_tokens", None)
        parallel = getattr(config, "parallel_config", None)
        if getattr(parallel, "data_parallel_external_lb", False):
            engines = 1  # each API server feeds its own engine
        elif getattr(parallel, "data_parallel_hybrid_lb", False):
            engines = getattr(parallel, "data_parallel_size_local", 1)  # this node's API servers, its engines
        else:
            engines = getattr(parallel, "data_parallel_size", 1)
        if not isinstance(tokens, int) or not isinstance(engines, int):
            return None
        return max(1, tokens * engines // self.siblings.count)

    async def set_batch(self, body: bytes, client: str) -> BatchState:
        async with self._lock, self.siblings.exclusive():
            before = combine(await self._all(BATCH_UTILITY))
            limit = parse_update(body, before.max_num_seqs)
            after = self._seen(combine(await self._all(BATCH_UTILITY, limit)))
        log.info(
            "batchlens: max_num_active_seqs %d -> %d on %d engine(s), requested by %s",
            before.max_num_active_seqs, after.max_num_active_seqs, len(after.engines), client,
        )  # fmt: skip
        return after

    def _open_door(self) -> VllmDoor | PluginDoor:
        """The door whose caps the admission route reads and sets (501 where this release has none)."""
        if self._support.door is None:
            raise AdminError(501, f"the admission caps are not available here: {self._support.door_refusal}")
        if self._door is None:
            raise AdminError(503, "this server has no engine (a render-only server): there is nothing to admit")
        return self._door

    def _admission(self, door: VllmDoor | PluginDoor) -> AdmissionState:
        now = time.monotonic_ns()
        queued_tokens, unfinished = self.siblings.totals(*door.counts(), now)
        return AdmissionState(
            max_num_queued_tokens=door.caps.max_num_queued_tokens,
            max_num_queued_reqs=door.caps.max_num_queued_reqs,
            num_queued_tokens=queued_tokens,
            num_unfinished_reqs=unfinished,
            prefill_tokens_per_second=self._prefill_rate,
            max_predicted_ttft_seconds=self._predicted_ttft,
            learned_prefill_tokens_per_second=self._watch.rates.prefill_tokens_per_second,
            api_servers=self.siblings.count,
            api_servers_behind=self._behind(now),
        )

    def _behind(self, now: int) -> list[int]:
        """The siblings without the caps this process has in force (never this process: it just synced)."""
        if self.siblings.count == 1:
            return []
        return [i for i in self.siblings.behind(self._applied, now) if i != self.siblings.index]

    def retry_after(self) -> int:
        """What a refusal's Retry-After says: the backlog over the measured prefill rate (1 where unknown)."""
        return 1 if self._door is None else retry_after(self._admission(self._door))

    def refusal(self, priority: int) -> str | None:
        """The plugin's verdict on a request of door ``priority`` arriving now (a reason of queued_caps.MESSAGES),
        or None.

        The plugin's door applies every class's rule and counts in vLLM's series. Where vLLM's own door applies
        the caps, vLLM refuses standard and critical requests alike in its serving code, so the plugin refuses
        only the sheddable ones it must refuse first (counted in batchlens_door_refusals_total alone: vLLM's
        counter is vLLM's).
        """
        if (door := self._door) is None:
            return None
        self.apply_shared_caps()  # the caps a sibling set are in force before this request meets them
        reason = plugin_refusal(lambda: self._admission(door), priority, vllm_caps=isinstance(door, VllmDoor))
        if reason is not None and isinstance(door, PluginDoor):
            door.rejections[reason].inc()
        return reason

    def predicts(self) -> bool:
        """Whether the per-request door is on: then the middleware reads each request's prompt for it (asked after
        :meth:`refusal`, which put the shared caps in force)."""
        return self._door is not None and self._predicted_ttft is not None

    def predicted(self, prompt_tokens: int | None) -> tuple[str | None, float | None]:
        """The per-request door's verdict on a request of ``prompt_tokens`` arriving now: (PREDICTED_TTFT to refuse
        it, else None; its predicted TTFT, None where the door cannot say yet). Every class alike: it refuses only
        what it predicts would miss, a critical request too. With several API servers each one predicts from its
        own requests, the rates it saw them served at and its share of the slots: the shares cancel."""
        budget = self._predicted_ttft
        if self._door is None or budget is None or prompt_tokens is None:
            return None, None
        if (backlog := self._sample()) is None:
            return None, None
        prediction = predict(backlog, prompt_tokens, self._watch.rates, self._slots)
        if not refuses(prediction, budget):
            return None, None if prediction is None else prediction.ttft_seconds
        self._predicted_refusals.inc()
        return PREDICTED_TTFT, prediction.ttft_seconds

    def track(self) -> Ticket | None:
        """A ticket for a request the door admitted, which its second look may still refuse while it is queued
        (second_look.py); None where the per-request door is off."""
        return self._second_look.track() if self.predicts() else None

    def untrack(self, ticket: Ticket) -> None:
        self._second_look.untrack(ticket)

    def _bound(self, name: str) -> int | float | None:
        """A cap in force here, or the per-request door's bound, by its name in the admission route."""
        return self._predicted_ttft if name == "max_predicted_ttft_seconds" else getattr(self._door.caps, name)

    async def admission(self) -> AdmissionState:
        return self._admission(self._open_door())

    async def set_admission(self, body: bytes, client: str) -> AdmissionState:
        """Set the caps for every API server of this server: in the shared table, in force here at once, and
        answered once every sibling has them in force too (or SIBLING_WAIT_SECONDS passed: the answer then
        names the ones behind)."""
        door = self._open_door()
        changes = parse_admission(body)
        async with self._lock, self.siblings.exclusive():
            self.apply_shared_caps()  # what a sibling set last is what this change starts from
            before = {name: self._bound(name) for name in changes if name != "prefill_tokens_per_second"}
            current = Caps(0, door.caps.max_num_queued_tokens, door.caps.max_num_queued_reqs, self._prefill_rate,
                           self._predicted_ttft)  # fmt: skip
            self.siblings.set_caps(changes, current)
            self.sync()
        said = ", ".join(f"{name} {cap} -> {self._bound(name)}" for name, cap in before.items())
        log.info("batchlens: admission %s on %d API server(s), requested by %s", said, self.siblings.count, client)
        deadline = time.monotonic() + SIBLING_WAIT_SECONDS
        while self._behind(time.monotonic_ns()) and time.monotonic() < deadline:
            await asyncio.sleep(SIBLING_TICK_SECONDS)
        state = self._admission(door)
        if state.api_servers_behind:
            log.warning(
                "batchlens: API server(s) %s of %d do not have the new caps in force after %gs: hung, or started "
                "without the plugin (is VLLM_PLUGINS=batchlens set for the whole server?)",
                state.api_servers_behind, state.api_servers, SIBLING_WAIT_SECONDS,
            )  # fmt: skip
        return state

    async def reset_prefix_cache(self, client: str) -> CacheReset:
        """vLLM's own reset, on every engine core: what its dev-mode route does, behind our token."""
        if self._client is None:
            raise AdminError(503, "this server has no engine (a render-only server): there is no cache to reset")
        try:
            async with asyncio.timeout(ENGINE_TIMEOUT_SECONDS):
                done = await self._client.reset_prefix_cache()
        except TimeoutError:
            raise AdminError(504, f"the engine did not reset its cache within {ENGINE_TIMEOUT_SECONDS:g}s") from None
        reset = done is not False  # releases before 0.11 answer None: they reset or raise
        log.info("batchlens: prefix cache %s, requested by %s", "reset" if reset else "not reset (in use)", client)
        return CacheReset(reset=reset)

    async def info(self) -> AdminInfo:
        engines = await self._all(INFO_UTILITY)
        first = engines[0]
        return AdminInfo(
            vllm_version=self._support.vllm_version,
            batchlens_version=__version__,
            engines=len(engines),
            api_route=self._support.api_route,
            queued_caps=self._support.caps_refusal is None,
            door=self._support.door,
            **first,
        )


class Refused:
    """The admin state on a vLLM the plugin does not know: every route says why, and changes nothing."""

    def __init__(self, reason: str):
        self.reason = reason


def admin_state(engine_client: Any, support: Support) -> AdminService | Refused:
    """What the routes serve, logged once when the server starts."""
    if support.refusal is not None:
        return Refused(support.refusal)
    token, pod = os.environ.get(TOKEN_ENV) or None, own_pod(os.environ)
    if token:
        log.info(
            "batchlens: admin API on %s and %s (token from %s; admission by %s, served by vLLM's %s); signed "
            "calls that name a pod must name %s",
            BATCH_PATH, INFO_PATH, TOKEN_ENV, support.mechanism, support.api_route, pod,
        )  # fmt: skip
    else:
        log.warning(
            "batchlens: %s is not set: the admin API answers 503 to every change until the server restarts "
            "with it (reads need none)",
            TOKEN_ENV,
        )
    if support.door == VLLM_DOOR:
        log.info("batchlens: %s sets vLLM's own queued caps at runtime", ADMISSION_PATH)
    elif support.door == PLUGIN_DOOR:
        log.info(
            "batchlens: %s sets the plugin's queued caps at runtime (%s): its middleware refuses by vLLM 0.29's rules",
            ADMISSION_PATH, support.caps_refusal,
        )  # fmt: skip
    else:
        log.info("batchlens: %s answers 501: %s", ADMISSION_PATH, support.door_refusal)
    return AdminService(engine_client, token, support, pod, siblings_of(engine_client))


def siblings_of(engine_client: Any) -> SiblingTable:
    """The table this API server shares with the other API servers of its ``vllm serve`` (siblings.py).

    vLLM numbers them on the engine client (``client_index`` of ``client_count``); one API server, or a table
    that cannot be had (logged: each process then holds its own caps, as vLLM would), is a private table."""
    core = getattr(engine_client, "engine_core", None)
    index, count = int(getattr(core, "client_index", 0) or 0), int(getattr(core, "client_count", 1) or 1)
    try:
        return open_table(index, count)
    except (OSError, ValueError) as exc:
        log.error(
            "batchlens: API server %d of %d cannot share its caps with its siblings (%s): a cap set through it "
            "holds for its share of the requests alone", index, count, exc,
        )  # fmt: skip
        return private_table(index, count)


class NoDoor:
    """Before the admin state exists, or where the plugin refused this vLLM: nothing is refused."""

    def refusal(self, priority: int) -> None:
        return None

    def predicts(self) -> bool:
        return False

    def predicted(self, prompt_tokens: int | None) -> tuple[None, None]:
        return None, None

    def track(self) -> None:
        return None

    def untrack(self, ticket: Ticket) -> None:
        return None

    def retry_after(self) -> int:
        return 1


def door_of(state: Any) -> AdminService | NoDoor:
    """What answers for the door on an app's state: the admin service once it exists."""
    service = getattr(state, STATE_KEY, None)
    return service if isinstance(service, AdminService) else NoDoor()


def log_refusal(support: Support) -> None:
    if support.refusal is not None:
        log.warning(
            "batchlens: admin API not installed: %s. vLLM runs as usual, without it; %s answers 501 with this reason.",
            support.refusal, INFO_PATH,
        )  # fmt: skip


Handler = Callable[[AdminService, Request, bytes], Awaitable[BaseModel]]


async def _read_body(request: Request) -> bytes:
    """The body, read no further than the contract allows: the signature covers it, so it is read before the
    token is checked, and a stranger's gigabyte must not be held in memory for that."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise AdminError(400, f"body larger than {MAX_BODY_BYTES} bytes")
    return body


def _route(handler: Handler) -> Callable[[Request], Awaitable[JSONResponse]]:
    """Token first (401/503), then the handler; an AdminError becomes its status and message."""

    async def route(request: Request) -> JSONResponse:
        service: AdminService | Refused | None = getattr(request.app.state, STATE_KEY, None)
        try:
            if service is None:
                raise AdminError(503, "the batchlens admin API is not initialised yet")
            if isinstance(service, Refused):
                raise AdminError(501, f"the batchlens plugin refused this vLLM: {service.reason}")
            refuse_encoded(request.headers.get("content-encoding"))
            body = await _read_body(request)
            service.auth.check(request.headers.get("authorization"), request.method, request.url.path, body)
            reply = await handler(service, request, body)
        except AdminError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse(reply.model_dump(mode="json"))

    return route


def _client(request: Request) -> str:
    """Who asked for a change, for the log line that records it."""
    return request.client.host if request.client else "unknown"


async def _get_batch(service: AdminService, _request: Request, _body: bytes) -> BaseModel:
    return await service.batch()


async def _put_batch(service: AdminService, request: Request, body: bytes) -> BaseModel:
    return await service.set_batch(body, _client(request))


async def _get_info(service: AdminService, _request: Request, _body: bytes) -> BaseModel:
    return await service.info()


async def _get_admission(service: AdminService, _request: Request, _body: bytes) -> BaseModel:
    return await service.admission()


async def _put_admission(service: AdminService, request: Request, body: bytes) -> BaseModel:
    return await service.set_admission(body, _client(request))


async def _reset_prefix_cache(service: AdminService, request: Request, _body: bytes) -> BaseModel:
    return await service.reset_prefix_cache(_client(request))


def attach_routes(app: FastAPI) -> None:
    app.add_api_route(BATCH_PATH, _route(_get_batch), methods=["GET"], include_in_schema=False)
    app.add_api_route(BATCH_PATH, _route(_put_batch), methods=["PUT"], include_in_schema=False)
    app.add_api_route(INFO_PATH, _route(_get_info), methods=["GET"], include_in_schema=False)
    app.add_api_route(CACHE_RESET_PATH, _route(_reset_prefix_cache), methods=["POST"], include_in_schema=False)
    app.add_api_route(ADMISSION_PATH, _route(_get_admission), methods=["GET"], include_in_schema=False)
    app.add_api_route(ADMISSION_PATH, _route(_put_admission), methods=["PUT"], include_in_schema=False)


def admin_app() -> FastAPI:
    """The routes as an app of their own: for ``--middleware`` and for the admin API's own port."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    attach_routes(app)
    return app


class BatchlensEndpoint:
    """vLLM's EndpointPlugin protocol (vllm/plugins/endpoint_plugins/interface.py), vLLM 0.32 and later."""

    name = "batchlens"
    required_tasks = None  # any server with an engine; a render-only server gets 503s

    def __init__(self) -> None:
        self.support = check_installed_vllm()
        self.listen = admin_listen(os.environ)
        self.own_port: FastAPI | None = None  # the admin API's app, where it has a port of its own
        self._server: asyncio.Task | None = None  # held, so that the loop does not drop it
        self._tick: asyncio.Task | None = None  # the siblings' tick (AdminService.start)

    def attach_router(self, app: FastAPI) -> None:
        log_refusal(self.support)
        if self.listen.separate:
            self.own_port = admin_app()
        else:
            attach_routes(app)
        # Arrivals feed `batchlens advise` (inter-arrival times, streaming share): see batchlens.arrivals.
        app.add_middleware(ArrivalMiddleware, arrivals=arrival_metrics(), door=lambda: door_of(app.state))

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        service = admin_state(engine_client, self.support)
        setattr(state, STATE_KEY, service)
        self._tick = service.start() if isinstance(service, AdminService) else None
        if self.own_port is not None:
            setattr(self.own_port.state, STATE_KEY, service)
            if serves_own_port(service):
                self._server = start_admin_server(self.own_port, self.listen)


def serves_own_port(service: AdminService | Refused) -> bool:
    """Whether this API server binds the admin API's own port: exactly one of the siblings does (the first),
    and what it sets holds in all of them (the shared table)."""
    if isinstance(service, AdminService) and service.siblings.index != 0:
        log.info(
            "batchlens: API server %d of %d: the admin API's own port is API server 0's; the caps set there hold "
            "here too", service.siblings.index, service.siblings.count,
        )  # fmt: skip
        return False
    return True
