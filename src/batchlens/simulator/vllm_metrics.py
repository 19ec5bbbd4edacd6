"""The simulator's /metrics, under vLLM's own names, types, labels and buckets, in a chosen release's dialect.

Dashboards, rules and the exporter read the simulator exactly as they read a
real vLLM, so the families here must not drift from vLLM's:
tests/test_simulator.py compares them with a real exposition of each release
the matrix captured (tests/data/releases). vLLM renders its metrics with
prometheus_client, and so does this module.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from batchlens.queued_caps import MESSAGES
from batchlens.simulator.dialect import DEFAULT_VLLM_VERSION, TPOT, dialect
from batchlens.simulator.engine import Engine, SimRequest, StepResult

# vLLM 0.32's bucket bounds (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
LABELS = ("model_name", "engine")
# A finished request's phases: phase -> (vLLM's histogram, its help). All share REQUEST_TIME_BUCKETS.
REQUEST_TIMES = {
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    "queue": ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
    "prefill": ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
    "decode": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
    "inference": ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
}


class Twins:
    """A metric and its deprecated twin: vLLM updates both, so every update goes to both."""

    def __init__(self, *metrics: Gauge | Counter | Histogram):
        self._metrics = metrics

    def set(self, value: float) -> None:
        for metric in self._metrics:
            metric.set(value)  # type: ignore[union-attr]

    def inc(self, amount: float = 1) -> None:
        for metric in self._metrics:
            metric.inc(amount)  # type: ignore[union-attr]

    def observe(self, value: float) -> None:
        for metric in self._metrics:
            metric.observe(value)  # type: ignore[union-attr]


class VllmMetrics:
    """The engine's counters, gauges and histograms; :meth:`render` gives the text exposition."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        engine_index: int = 0,
        gpu_memory_utilization: float = 0.9,
        vllm_version: str = DEFAULT_VLLM_VERSION,
    ):
        self.registry = CollectorRegistry()
        old_names = dialect(vllm_version)
        self._engine = engine
        labels = {"model_name": model_name, "engine": str(engine_index)}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(**labels)

        def renamed(make: Callable[..., Any], name: str, old_name: str, doc: str, *args: Any) -> Any:
            """The metric, and where this release still has it, its deprecated twin under the old name."""
            if old_name not in old_names:
                return make(name, doc, *args)
            return Twins(make(name, doc, *args), make(old_name, f"{doc} DEPRECATED: Use {name} instead.", *args))

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = renamed(
            gauge, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        #: Requests the queued caps refused, labelled without an engine: vLLM's own count from 0.29, the plugin
        #: door's on older releases, under the same name (vllm_plugin/door.py).
        rejections = Counter(
            "vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
            ("model_name", "reason"), registry=r,
        )  # fmt: skip
        self.admission_rejections = {reason: rejections.labels(model_name, reason) for reason in MESSAGES}
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        # No prefix caching is simulated: every prompt token is a query, none a hit.
        self.prefix_queries = renamed(
            counter, "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )  # fmt: skip
        self.prefix_hits = renamed(
            counter, "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )  # fmt: skip
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", (*LABELS, "finished_reason"),
            registry=r,
        )  # fmt: skip
        self.success = {reason: success.labels(**labels, finished_reason=reason) for reason in FINISHED_REASONS}
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = renamed(
            histogram, "vllm:inter_token_latency_seconds", TPOT, "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )  # fmt: skip
        self.request_time = {
            phase: histogram(name, doc, REQUEST_TIME_BUCKETS) for phase, (name, doc) in REQUEST_TIMES.items()
        }
        # No model_name, as in vLLM; the engine and cache facts are labels.
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "cache_dtype", "enable_prefix_caching", "engine", "gpu_memory_utilization",
             "num_cpu_blocks", "num_gpu_blocks"),
            registry=r,
        ).labels(
            block_size=str(engine.block_size), cache_dtype="auto", enable_prefix_caching="False",
            engine=str(engine_index), gpu_memory_utilization=str(gpu_memory_utilization), num_cpu_blocks="None",
            num_gpu_blocks=str(engine.num_gpu_blocks),
        ).set(1)  # fmt: skip
        self.update_gauges()

    def update_gauges(self) -> None:
        self.running.set(len(self._engine.running))
        self.waiting.set(len(self._engine.waiting))
        self.kv_usage.set(self._engine.kv_usage)

    def observe_step(self, step: StepResult) -> None:
        if step.scheduled_tokens:
            self.iteration_tokens.observe(step.scheduled_tokens)
        # As vLLM 0.32 counts it: a prompt whole, with its request's first token, and never again when a
        # preempted request recomputes it ("not post-preemption repeat prefills", v1/core/sched/scheduler.py).
        self.prompt_tokens.inc(sum(r.prompt_tokens for r in step.produced if r.generated == 1))
        self.prefix_queries.inc(step.prefill_tokens)
        self.generation_tokens.inc(len(step.produced))
        self.preemptions.inc(step.preempted)
        for request in step.produced:
            if len(request.itl) and request.generated > 1:
                self.itl.observe(request.itl[-1])
            elif request.generated == 1:
                self.ttft.observe(request.first_token_at - request.arrival)
        for request in step.finished:
            self.observe_finished(request)
        self.update_gauges()

    def observe_finished(self, request: SimRequest) -> None:
        self.success[request.finish_reason or "length"].inc()
        self.request_prompt_tokens.observe(request.prompt_tokens)
        self.request_generation_tokens.observe(request.generated)
        admitted = request.admitted_at if request.admitted_at is not None else request.arrival
        first = request.first_token_at if request.first_token_at is not None else request.finished_at
        seconds = {
            "e2e": request.finished_at - request.arrival,
            "queue": admitted - request.arrival,
            "prefill": first - admitted,
            "decode": request.finished_at - first,
            "inference": request.finished_at - admitted,
        }
        for phase, value in seconds.items():
            self.request_time[phase].observe(value)

    def render(self, names: Collection[str] | None = None) -> bytes:
        """The exposition; ``names``: only the series of these sample names (a replay renders what its policy
        reads, every tick of every simulated engine: the whole registry was half of a fleet's replay time)."""
        return generate_latest(self.registry if names is None else self.registry.restricted_registry(names))
