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
- ``batchlens_door_requests_total{priority_class}`` and
  ``batchlens_door_refusals_total{priority_class}``: generation requests at the
  door, and those refused there with a queued cap's 503 (vLLM's or the
  plugin's), by the class of their door priority (batchlens.queued_caps). vLLM
  counts its refusals by reason only, and no arrivals at all: these give each
  class's refused share over what reached it.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from batchlens.queued_caps import CLASSES

INTERARRIVAL = "batchlens_request_interarrival_seconds"
INTERARRIVAL_SQUARES = "batchlens_request_interarrival_seconds_squared_total"
REQUESTS = "batchlens_requests_total"
DOOR_REQUESTS = "batchlens_door_requests_total"
DOOR_REFUSALS = "batchlens_door_refusals_total"
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
        door = Counter(DOOR_REQUESTS.removesuffix("_total"), "Generation requests at the admission door, by the "
                       "class of their door priority.", ("priority_class",), registry=registry)  # fmt: skip
        refused = Counter(DOOR_REFUSALS.removesuffix("_total"), "Generation requests refused at the door with a "
                          "queued cap's 503, by the class of their door priority.", ("priority_class",),
                          registry=registry)  # fmt: skip
        self._door = {name: door.labels(name) for name in CLASSES}  # every class from the start: rates need a zero
        self._refused = {name: refused.labels(name) for name in CLASSES}
        self._last: int | None = None  # ns
        self._swap: Callable[[int], int | None] = self._swap_here

    def share_last_arrival(self, swap: Callable[[int], int | None]) -> None:
        """Measure gaps from the last arrival at any of several processes (the API servers of one vLLM server):
        ``swap`` records an arrival at a CLOCK_MONOTONIC time in ns and returns the one before it."""
        self._swap = swap

    def _swap_here(self, now_ns: int) -> int | None:
        previous, self._last = self._last, now_ns
        return previous

    def arrived(self, now: float, priority_class: str = "standard") -> None:
        """A generation request of ``priority_class`` arrived at ``now`` (monotonic seconds)."""
        self._door[priority_class].inc()
        previous = self._swap(int(now * 1e9))
        if previous is not None:
            gap = max(0.0, now - previous / 1e9)
            self._gaps.observe(gap)
            self._squares.inc(gap * gap)

    def answered(self, stream: bool) -> None:
        self._answered[stream].inc()

    def refused(self, priority_class: str) -> None:
        """A request of ``priority_class`` was refused at the door (a queued cap's 503)."""
        self._refused[priority_class].inc()
