"""How requests arrive: the inter-arrival times and the streaming share, which vLLM does not export.

The article's decision table starts from the traffic's shape: the coefficient
of variation of inter-arrival times, their P90 (the cold-path threshold) and
the share of streamed answers. vLLM counts requests only when they finish,
so the batchlens vLLM plugin observes arrivals at the API server (an ASGI
middleware) and the simulator does the same; both export these series beside
vLLM's own, where the exporter passes them through with ``vllm_instance``:

- ``batchlens_request_interarrival_seconds`` (histogram): the gap since the
  previous generation request; its quantiles give P50/P90/P99.
- ``batchlens_request_interarrival_seconds_squared_total``: the sum of the
  squared gaps. With the histogram's ``_sum`` and ``_count`` it gives the
  exact variance over any window, which buckets alone cannot.
- ``batchlens_requests_total{stream="true"|"false"}``: answered requests,
  by whether the answer was a stream.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

INTERARRIVAL = "batchlens_request_interarrival_seconds"
INTERARRIVAL_SQUARES = "batchlens_request_interarrival_seconds_squared_total"
REQUESTS = "batchlens_requests_total"
# From a busy server's milliseconds to a quiet night's minutes.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
# The OpenAI routes that start a generation.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


class ArrivalMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        self._gaps = Histogram(
            INTERARRIVAL, "Seconds between the arrivals of consecutive generation requests.", buckets=BUCKETS,
            registry=registry,
        )  # fmt: skip
        self._squares = Counter(
            INTERARRIVAL_SQUARES.removesuffix("_total"),
            "Sum of squared seconds between consecutive arrivals, for the variance.",
            registry=registry,
        )
        requests = Counter(REQUESTS.removesuffix("_total"), "Answered generation requests.", ("stream",),
                           registry=registry)  # fmt: skip
        self._answered = {True: requests.labels(stream="true"), False: requests.labels(stream="false")}
        self._last: float | None = None

    def arrived(self, now: float) -> None:
        """A generation request arrived at ``now`` (monotonic seconds)."""
        if self._last is not None:
            gap = max(0.0, now - self._last)
            self._gaps.observe(gap)
            self._squares.inc(gap * gap)
        self._last = now

    def answered(self, stream: bool) -> None:
        self._answered[stream].inc()
