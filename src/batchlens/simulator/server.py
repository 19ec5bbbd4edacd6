"""``batchlens simulate``: the simulated engine behind an OpenAI-compatible HTTP server.

One task steps the engine, paced so that simulated time runs at ``speed``
times the wall clock, and hands each step's tokens to the waiting requests.
Requests are stamped with their simulated arrival time, and a slow host makes
the simulation run late rather than make the latencies it reports larger.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batchlens import __version__
from batchlens.admin_api import (
    ADMISSION_PATH,
    BATCH_PATH,
    CACHE_RESET_PATH,
    INFO_PATH,
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
from batchlens.admin_auth import AdminAuth, own_pod
from batchlens.arrivals import ArrivalMetrics
from batchlens.http_server import application, run_app
from batchlens.predicted_ttft import Seen, Watch, late_in_queue, predict, refuses
from batchlens.queued_caps import (
    PREDICTED_TTFT,
    PREDICTED_TTFT_HEADER,
    PRIORITY_HEADER,
    door_priority,
    plugin_refusal,
    priority_class,
    refusal,
    refusal_body,
)
from batchlens.simulator import openai_api as api
from batchlens.simulator.dialect import DEFAULT_VLLM_VERSION, QUEUED_CAPS, series_of
from batchlens.simulator.engine import Engine, SimRequest
from batchlens.simulator.gpu import SimulatedGpu
from batchlens.simulator.vllm_metrics import VllmMetrics
from batchlens.vllm_plugin.compat import PLUGIN_DOOR, VLLM_DOOR

log = logging.getLogger("batchlens.simulator")

GPU_PATH = "/batchlens/v1/sim/gpu"
MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass
class Pending:
    request: SimRequest
    tokens: asyncio.Queue[int | None]  # the count of output tokens after each step; None when finished
    refused: bool = False  # by the per-request door's second look, while queued: its client gets the 503


class Simulator:
    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        max_model_len: int,
        speed: float = 1.0,
        admin_token: str | None = None,
        vllm_version: str = DEFAULT_VLLM_VERSION,
    ):
        self.engine = engine
        self.vllm_version = vllm_version
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.speed = speed
        self.metrics = VllmMetrics(engine, model_name, vllm_version=vllm_version)
        self.arrivals = ArrivalMetrics(self.metrics.registry)  # what the batchlens vLLM plugin adds
        self.gpu = SimulatedGpu(engine)
        self._auth = AdminAuth(admin_token, pod=own_pod(os.environ))
        self._pending: dict[str, Pending] = {}
        self._wake = asyncio.Event()
        self._arrivals: deque[SimRequest] = deque()  # submitted, not yet reached by simulated time
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        #: vLLM's queued caps (docs/admission.md), None: no cap; set at runtime through the admin API.
        self.caps: dict[str, int | float | None] = {
            "max_num_queued_tokens": None, "max_num_queued_reqs": None, "max_predicted_ttft_seconds": None,
        }  # fmt: skip
        self.prefill_rate: float | None = None  # the controller's estimate, for a refusal's Retry-After
        self.watch = Watch()  # the plugin's per-request door learns from what vLLM's API server sees, as here

    # -- simulated time -----------------------------------------------------

    def now(self) -> float:
        """Simulated seconds since the start: the wall clock x speed."""
        return (time.monotonic() - self._t0) * self.speed

    def _busy(self) -> bool:
        return bool(self.engine.running or self.engine.waiting)

    async def run(self) -> None:
        """Step the engine in simulated time, paced to the wall clock, never ahead of it.

        A request enters the engine only once simulated time has reached its arrival,
        and steps follow each other in simulated time. When the host cannot keep up,
        the simulation runs late in wall-clock terms, but what it simulates (and so the
        latencies it reports) stays what it would have been on an idle host.
        """
        clock: float | None = None  # simulated time of the next step, while there is work
        while True:
            if not self._busy() and not self._arrivals:
                clock = None
                self._wake.clear()
                await self._wake.wait()
                continue
            if clock is None:
                clock = self.now()
            if not self._busy() and self._arrivals[0].arrival > clock:
                clock = self._arrivals[0].arrival  # idle until the next arrival
            while self._arrivals and self._arrivals[0].arrival <= clock:
                self.engine.add(self._arrivals.popleft())
            step = self.engine.step(clock)
            clock += step.duration
            await asyncio.sleep(max(0.0, self._t0 + clock / self.speed - time.monotonic()))
            self.metrics.observe_step(step)
            self.gpu.record(step)
            if self.caps["max_predicted_ttft_seconds"] is not None:
                self.watch.sample(clock, self._states(), self.engine.max_num_active_seqs)
                self._second_look(clock)
            # A client may have gone away during the sleep: its request was aborted and has no one to tell.
            for request in step.produced:
                if (pending := self._pending.get(request.id)) is not None:
                    pending.tokens.put_nowait(request.generated)
            for request in step.finished:
                if (pending := self._pending.pop(request.id, None)) is not None:
                    pending.tokens.put_nowait(None)

    def admission(self) -> AdmissionState:
        """The caps, and what they count: every request not finished, and the prompts of those in prefill."""
        queued = self.engine.queued_tokens + sum(r.prompt_tokens for r in self._arrivals)  # all in prefill
        unfinished = len(self._arrivals) + self.engine.unfinished
        return AdmissionState(**self.caps, num_queued_tokens=queued, num_unfinished_reqs=unfinished,
                              prefill_tokens_per_second=self.prefill_rate,
                              learned_prefill_tokens_per_second=self.watch.rates.prefill_tokens_per_second)  # fmt: skip

    def _states(self) -> dict[str, Seen]:
        """What vLLM's API server has of each unfinished request, oldest first: its prompt, whether its first token
        came, its output so far and its max_tokens."""
        requests = (*self.engine.running, *self.engine.waiting, *self._arrivals)
        return {r.id: Seen(r.prompt_tokens, r.first_token_at is None, r.generated, r.max_tokens) for r in requests}

    def predicted(self, prompt_tokens: int) -> tuple[str | None, float | None]:
        """The plugin's per-request door (predicted_ttft.py): (PREDICTED_TTFT to refuse, its predicted TTFT)."""
        bound = self.caps["max_predicted_ttft_seconds"]
        if bound is None:
            return None, None
        limit = self.engine.max_num_active_seqs
        prediction = predict(self.watch.sample(self.now(), self._states(), limit), prompt_tokens, self.watch.rates,
                             limit)  # fmt: skip
        seconds = None if prediction is None else prediction.ttft_seconds
        return (PREDICTED_TTFT if refuses(prediction, bound) else None), seconds

    def _second_look(self, now: float) -> None:
        """The plugin's second look (vllm_plugin/second_look.py): the requests in prefill that would now miss their
        TTFT are aborted, and their clients answered the door's 503."""
        engine = self.engine
        queued = engine.awaiting_first_token
        late = late_in_queue([r.prompt_tokens for r in queued], [now - r.arrival for r in queued],
                             engine.unfinished - len(queued), engine.max_num_active_seqs,
                             engine.max_num_batched_tokens, self.watch.rates,
                             self.caps["max_predicted_ttft_seconds"])  # fmt: skip
        for request in (queued[i] for i in late):
            if (pending := self._pending.get(request.id)) is not None:
                pending.refused = True
                self.abort(pending)
                self.metrics.admission_rejections[PREDICTED_TTFT].inc()
                pending.tokens.put_nowait(None)

    def submit(self, prompt_tokens: int, max_tokens: int) -> Pending:
        request = SimRequest(uuid.uuid4().hex, prompt_tokens, max_tokens, self.now())
        pending = self._pending[request.id] = Pending(request, asyncio.Queue())
        self._arrivals.append(request)
        self._wake.set()
        return pending

    def abort(self, pending: Pending) -> None:
        """The client went away: stop spending simulated GPU time on it."""
        if self._pending.pop(pending.request.id, None) is not None:
            if pending.request in self._arrivals:
                self._arrivals.remove(pending.request)
            self.engine.abort(pending.request, self.now())
            self.metrics.success["abort"].inc()
            self.metrics.update_gauges()

    # -- OpenAI-compatible routes -------------------------------------------

    async def completions(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.read()
            req = api.parse(body, chat=chat, served_model=self.model_name, max_model_len=self.max_model_len)
        except web.HTTPRequestEntityTooLarge:
            return _error(api.ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes"))
        except api.ApiError as exc:
            return _error(exc)
        except ConnectionError:  # the client went away mid-body (a proxy stopped): nobody to answer, nothing to run
            log.info("a client closed its connection before its request arrived whole")
            return web.Response(status=400)
        priority = door_priority(request.headers.getall(PRIORITY_HEADER, ()))
        door_class = priority_class(priority)
        self.arrivals.arrived(time.monotonic(), door_class)
        state = self.admission()
        # As the plugin, then vLLM, do: before any work for the request. Where vLLM keeps the caps, the plugin
        # refuses only the sheddable class early (uncounted by vLLM), and vLLM refuses every other class alike.
        vllm_door = series_of(self.vllm_version) >= QUEUED_CAPS
        by_plugin = plugin_refusal(lambda: state, priority, vllm_caps=vllm_door)
        reason, predicted = by_plugin or (refusal(state) if vllm_door else None), None
        if reason is None:
            reason, predicted = self.predicted(req.prompt_tokens)
        if reason is not None:
            self.arrivals.refused(door_class)
            if not (vllm_door and by_plugin):  # vLLM's counter: its own refusals, or the plugin door's before 0.29
                self.metrics.admission_rejections[reason].inc()
            return self._refused(reason, state)
        pending = self.submit(req.prompt_tokens, req.max_tokens)
        request_id = api.new_id(chat)
        said = {} if predicted is None else {PREDICTED_TTFT_HEADER: f"{predicted:.3f}"}  # as the plugin tells it
        try:
            # As the plugin holds an answer's start: until the first token, the door may still refuse it.
            first = await pending.tokens.get()
            if pending.refused:
                self.arrivals.refused(door_class)
                return self._refused(PREDICTED_TTFT, self.admission())
            self.arrivals.answered(req.stream)  # as the plugin counts an answer: when its start goes out
            if req.stream:
                return await self._stream(request, req, request_id, pending, said, first)
            while first is not None:
                first = await pending.tokens.get()
        except asyncio.CancelledError:
            self.abort(pending)
            raise
        done = pending.request
        reply = api.reply(req, request_id, done.generated, done.finish_reason or "length")
        return web.json_response(reply, headers=said)

    @staticmethod
    def _refused(reason: str, state: AdmissionState) -> web.Response:
        refused = web.json_response(refusal_body(reason), status=503)
        refused.headers["Retry-After"] = str(retry_after(state))  # as the plugin adds it to vLLM's 503
        return refused

    async def _stream(
        self, request: web.Request, req: api.Completion, request_id: str, pending: Pending, said: Mapping[str, str],
        first: int | None,
    ) -> web.StreamResponse:  # fmt: skip
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **said}
        )

        async def send(payload: object) -> None:
            await response.write(
                b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"
            )

        sent, count = 0, first
        try:
            await response.prepare(request)  # the client may be gone already, before the headers
            while count is not None:
                for index in range(sent, count):
                    await send(api.chunk(req, request_id, index, None))
                sent = count
                count = await pending.tokens.get()
            await send(api.chunk(req, request_id, sent, pending.request.finish_reason or "length"))
            if req.include_usage:
                await send(api.usage_chunk(req, request_id, pending.request.generated))
            await send(b"[DONE]")
            await response.write_eof()
        except ConnectionResetError:  # the client went away mid-stream: stop generating, nobody to tell
            self.abort(pending)
        return response

    async def models(self, _request: web.Request) -> web.Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": self.vllm_version, "simulator": f"batchlens {__version__}"})

    async def prometheus(self, _request: web.Request) -> web.Response:
        self.metrics.update_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def sim_gpu(self, _request: web.Request) -> web.Response:
        return web.json_response({"gpus": [self.gpu.report(self.now())]})

    # -- the batchlens admin API (admin_api.py: the same contract as the vLLM plugin) ----

    def _batch(self) -> BatchState:
        e = self.engine
        return combine(
            [
                {
                    "engine": 0,
                    "max_num_seqs": e.max_num_seqs,
                    "max_num_active_seqs": e.max_num_active_seqs,
                    "num_running": len(e.running),
                    "num_waiting": len(e.waiting),
                }
            ]
        )

    async def _get_batch(self, _request: web.Request) -> BatchState:
        return self._batch()

    async def _put_batch(self, request: web.Request) -> BatchState:
        before = self.engine.max_num_active_seqs
        limit = parse_update(await request.read(), self.engine.max_num_seqs)
        self.engine.set_limit(limit)
        self._wake.set()  # a raised limit admits waiting requests at the next step
        log.info("max_num_active_seqs %d -> %d, requested by %s", before, limit, request.remote or "unknown")
        return self._batch()

    async def _get_admission(self, _request: web.Request) -> AdmissionState:
        return self.admission()

    async def _put_admission(self, request: web.Request) -> AdmissionState:
        changes = parse_admission(await request.read())
        self.prefill_rate = changes.pop("prefill_tokens_per_second", self.prefill_rate)
        before = dict(self.caps)
        self.caps.update(changes)
        log.info("admission caps %s -> %s", before, self.caps)
        return self.admission()

    async def _reset_prefix_cache(self, _request: web.Request) -> CacheReset:
        """The contract's answer; no prefix caching is simulated, so there is nothing to empty."""
        log.info("prefix cache reset requested (no prefix caching is simulated)")
        return CacheReset(reset=True)

    async def _info(self, _request: web.Request) -> AdminInfo:
        e = self.engine
        return AdminInfo(
            vllm_version=self.vllm_version,
            batchlens_version=__version__,
            engines=1,
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
            block_size=e.block_size,
            queued_caps=series_of(self.vllm_version) >= QUEUED_CAPS,
            door=VLLM_DOOR if series_of(self.vllm_version) >= QUEUED_CAPS else PLUGIN_DOOR,
            num_gpu_blocks=e.num_gpu_blocks,
        )

    def _admin(self, handler: Callable[[web.Request], Awaitable[BatchState | AdminInfo | CacheReset | AdmissionState]]):
        async def route(request: web.Request) -> web.Response:
            try:
                self._auth.check(request.headers.get("Authorization"), request.method, request.path,
                                 await request.read())  # fmt: skip
                reply = await handler(request)
            except AdminError as exc:
                return web.json_response(exc.body(), status=exc.status)
            return web.json_response(reply.model_dump(mode="json"))

        return route

    # -- the app ----------------------------------------------------------------

    async def _start(self, _app: web.Application) -> None:
        self._t0 = time.monotonic()
        self._task = asyncio.create_task(self.run(), name="simulated engine")
        self._task.add_done_callback(_engine_stopped)

    async def _stop(self, _app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()

    def _add_admin_routes(self, app: web.Application) -> None:
        app.router.add_get(BATCH_PATH, self._admin(self._get_batch))
        app.router.add_put(BATCH_PATH, self._admin(self._put_batch))
        app.router.add_get(INFO_PATH, self._admin(self._info))
        app.router.add_post(CACHE_RESET_PATH, self._admin(self._reset_prefix_cache))
        app.router.add_get(ADMISSION_PATH, self._admin(self._get_admission))
        app.router.add_put(ADMISSION_PATH, self._admin(self._put_admission))

    def app(self, admin_listen: tuple[str, int] | None = None) -> web.Application:
        """The server; with ``admin_listen``, the admin API on that address alone, as the plugin's own port."""
        app = application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", lambda r: self.completions(r, chat=False))
        app.router.add_post("/v1/chat/completions", lambda r: self.completions(r, chat=True))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get(GPU_PATH, self.sim_gpu)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        if admin_listen is None:
            self._add_admin_routes(app)
        else:
            admin = application(client_max_size=MAX_BODY_BYTES)
            self._add_admin_routes(admin)
            app.cleanup_ctx.append(lambda _app: _serving(admin, *admin_listen))
        return app


async def _serving(app: web.Application, host: str, port: int) -> AsyncIterator[None]:
    """A second aiohttp app on its own address, for the main app's lifetime (a port that is taken fails the start)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("admin API on its own port, http://%s:%d; the API port answers 404 for it", host, port)
        yield
    finally:
        await runner.cleanup()


def _engine_stopped(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.critical("the simulated engine stopped; requests will hang", exc_info=task.exception())


def _error(exc: api.ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def admin_token(environ: Mapping[str, str], variable: str) -> str | None:
    token = environ.get(variable) or None
    if token is None:
        log.warning(
            "%s is not set: the admin API answers 503 to every change until the simulator restarts with it "
            "(reads need none)",
            variable,
        )
    return token


def serve(simulator: Simulator, host: str, port: int, admin_port: int | None = None) -> None:
    ready = f"batchlens simulator (vLLM {simulator.vllm_version} API) serving {simulator.model_name} on http://{host}:{port}"
    app = simulator.app(None if admin_port is None else (host, admin_port))
    run_app(app, host, port, logger=log, ready=ready, access_log=None, shutdown_timeout=2)
