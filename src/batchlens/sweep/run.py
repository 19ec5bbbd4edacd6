"""Drive an engine through batch limits under a fixed load, and measure each step.

At each limit the admin API sets ``max_num_active_seqs``; then ``limit x
load_factor`` closed-loop clients (the load of ``batchlens load``: the same
prompt and output lengths, seeded, every answer streamed) keep the batch full.
With a load factor of 1 nothing queues, so the step's P99 is the engine's
and not the queue's. After ``settle`` seconds the step is measured for
``measure`` seconds:

- throughput: output tokens per second, from the engine's own counter
  ``vllm:generation_tokens_total`` (requests cut off at the step's end count
  for the tokens they produced);
- P99 TTFT, ITL and E2E: from the clients, over requests that started after
  the settle time and finished in the step;
- KV usage: ``vllm:kv_cache_usage_perc``, sampled every second;
- GPU memory busy and DRAM bandwidth: from the batchlens exporter, when given
  one (``batchlens_gpu_*_ratio`` of the engine's GPUs).

The limit in force before the sweep is restored however the sweep ends: at
the end, on an error, and when a signal cancels it (batchlens.stopping). A
restore that cannot be done is logged with the request that does it by hand.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from batchlens.exporter.gpu_metrics import DRAM_BANDWIDTH, MEMORY_BUSY
from batchlens.exporter.parser import ExpositionReader, ParseError
from batchlens.load.client import first_model, send
from batchlens.load.plan import Planned, Result
from batchlens.quantiles import percentile
from batchlens.remediation.admin_client import AdminCallError, AdminClient
from batchlens.rules.recording import KV_USAGE
from batchlens.stopping import finish

GENERATED = "vllm:generation_tokens_total"
SAMPLE_SECONDS = 1.0
ERROR_PAUSE_SECONDS = 0.5

log = logging.getLogger("batchlens.sweep")


@dataclass(frozen=True)
class SweepSpec:
    limits: tuple[int, ...]
    settle_seconds: float = 5.0
    measure_seconds: float = 20.0
    load_factor: float = 1.0
    prompt_tokens: tuple[int, ...] = (512,)
    output_tokens: tuple[int, ...] = (128,)
    request_timeout: float = 300.0
    seed: int = 1

    def clients(self, limit: int) -> int:
        return max(1, round(limit * self.load_factor))


@dataclass
class StepResult:
    limit: int
    clients: int
    requests: int = 0  # measured: started after the settle time, finished in the step
    errors: int = 0
    throughput: float = math.nan  # output tokens per second
    ttft_p99: float = math.nan
    e2e_p99: float = math.nan
    kv_usage: float = math.nan
    gpu_memory_busy: float = math.nan
    gpu_dram_bandwidth: float = math.nan
    itl_p99: float = math.nan  # over every gap between two tokens of the measured requests
    samples: dict[str, list[float]] = field(default_factory=dict, repr=False)


class SweepError(Exception):
    """The sweep cannot start or go on: the message says why and what to check."""


def metric_values(text: str, names: Sequence[str], labels: dict[str, str] | None = None) -> list[float]:
    """Every sample of the first of ``names`` present in an exposition, filtered by ``labels``."""
    try:
        families = {f.name: f for f in ExpositionReader().parse(text)}
    except ParseError:
        return []
    for name in names:
        family = families.get(name)
        if family is None:
            continue
        want = set((labels or {}).items())
        values = [v for series, v, _ in family.samples if series.name == name and want <= set(series.labels)]
        if values:
            return values
    return []


class Sweep:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        engine_url: str,
        admin_token: str | None,
        spec: SweepSpec,
        *,
        exporter_url: str | None = None,
        vllm_instance: str | None = None,
        on_second: Callable[[], None] = lambda: None,
        admin_url: str | None = None,
        signed: bool = True,
    ):
        self.session = session
        self.url = engine_url.rstrip("/")
        self.admin = AdminClient(session, admin_url or self.url, admin_token, timeout=10, signed=signed)
        self.spec = spec
        self.exporter_url = exporter_url.rstrip("/") if exporter_url else None
        self.vllm_instance = vllm_instance
        self.on_second = on_second
        self._rng = random.Random(spec.seed)

    async def check_exporter(self) -> None:
        """Before anything changes: the exporter answers and knows the engine, or the GPU columns would be empty."""
        if not self.exporter_url:
            return
        text = await self._get(self.exporter_url + "/metrics")
        if self.vllm_instance is None:
            return
        try:
            families = list(ExpositionReader().parse(text))
        except ParseError as exc:
            raise SweepError(f"{self.exporter_url}/metrics is not a Prometheus exposition: {exc}") from None
        engines = {dict(series.labels).get("vllm_instance") for f in families for series, _, _ in f.samples}
        engines.discard(None)
        engines.discard("")
        if self.vllm_instance not in engines:
            raise SweepError(
                f"the exporter at {self.exporter_url} knows no vllm_instance {self.vllm_instance!r} "
                f"(it knows: {', '.join(sorted(engines)) or 'none'}): pass one of those to --vllm-instance"
            )
        if not metric_values(text, (MEMORY_BUSY,), {"vllm_instance": self.vllm_instance}):
            log.warning("the exporter at %s has no GPU mapped to %s: the GPU columns will be empty",
                        self.exporter_url, self.vllm_instance)  # fmt: skip

    async def run(self) -> list[StepResult]:
        await self.check_exporter()
        state = await self.admin.get()
        too_big = [limit for limit in self.spec.limits if limit > state.max_num_seqs]
        if too_big:
            raise SweepError(f"limits {too_big} exceed the engine's max_num_seqs {state.max_num_seqs}")
        model = await first_model(self.session, self.url)
        try:
            return [await self._step(limit, model) for limit in self.spec.limits]
        finally:
            try:
                await finish(self.admin.put(state.max_num_active_seqs))
                log.info("sweep: batch limit put back to %d", state.max_num_active_seqs)
            except AdminCallError as exc:
                log.error(
                    "could not put the batch limit back to %d: %s. Set it with PUT %s",
                    state.max_num_active_seqs, exc, self.admin.url,
                )  # fmt: skip

    async def _get(self, url: str) -> str:
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as reply:
                if reply.status != 200:
                    raise SweepError(f"{url} answered {reply.status}")
                return await reply.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SweepError(f"cannot read {url}: {exc or type(exc).__name__}") from None

    async def _generated(self) -> float:
        values = metric_values(await self._get(self.url + "/metrics"), (GENERATED,))
        if not values:
            raise SweepError(f"{self.url}/metrics has no {GENERATED}: is this a vLLM server?")
        return sum(values)

    async def _sample(self, step: StepResult) -> None:
        """One second's KV and GPU figures; a missed sample is logged and skipped, not fatal."""
        try:
            text = await self._get(self.url + "/metrics")
        except SweepError as exc:
            log.warning("sweep: %s", exc)
            return
        step.samples.setdefault("kv_usage", []).extend(metric_values(text, KV_USAGE)[:1])
        if self.exporter_url:
            try:
                gpu = await self._get(self.exporter_url + "/metrics")
            except SweepError as exc:
                log.warning("sweep: %s", exc)
                return
            labels = {"vllm_instance": self.vllm_instance} if self.vllm_instance else None
            for key, name in (("gpu_memory_busy", MEMORY_BUSY), ("gpu_dram_bandwidth", DRAM_BANDWIDTH)):
                if values := metric_values(gpu, (name,), labels):
                    step.samples.setdefault(key, []).append(statistics.fmean(values))

    def _request(self) -> Planned:
        return Planned(0.0, self._rng.choice(self.spec.prompt_tokens), self._rng.choice(self.spec.output_tokens), True)

    async def _step(self, limit: int, model: str) -> StepResult:
        await self.admin.put(limit)
        step = StepResult(limit, self.spec.clients(limit))
        loop = asyncio.get_running_loop()
        finished: list[tuple[float, Result]] = []

        async def client() -> None:
            while True:
                started = loop.time()
                result = await send(self.session, self.url, model, self._request(), self.spec.request_timeout)
                finished.append((started, result))
                if not result.ok:
                    await asyncio.sleep(ERROR_PAUSE_SECONDS)  # a failing engine is not hammered in a tight loop

        clients = [asyncio.create_task(client()) for _ in range(step.clients)]
        try:
            for _ in range(math.ceil(self.spec.settle_seconds / SAMPLE_SECONDS)):
                await asyncio.sleep(SAMPLE_SECONDS)
                self.on_second()
            t0, g0 = loop.time(), await self._generated()
            while loop.time() - t0 < self.spec.measure_seconds:
                await asyncio.sleep(min(SAMPLE_SECONDS, self.spec.measure_seconds - (loop.time() - t0)))
                await self._sample(step)
                self.on_second()
            t1, g1 = loop.time(), await self._generated()
        finally:
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
        measured = [r for started, r in finished if started >= t0]
        ok = [r for r in measured if r.ok]
        step.requests, step.errors = len(ok), len(measured) - len(ok)
        step.throughput = (g1 - g0) / (t1 - t0)
        step.ttft_p99 = _or_nan(percentile([r.ttft for r in ok if r.ttft is not None], 99))
        step.itl_p99 = _or_nan(percentile([gap for r in ok for gap in r.itl], 99))
        step.e2e_p99 = _or_nan(percentile([r.e2e for r in ok], 99))
        for key, values in step.samples.items():
            setattr(step, key, statistics.fmean(values) if values else math.nan)
        return step


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value
