"""What advise measures, per engine, over the data there is: one instant PromQL query per figure.

The traffic's shape comes from the arrival series that the batchlens vLLM
plugin (and the simulator) add (batchlens.arrivals); the request sizes and
latencies from vLLM's own histograms; throughput per batch limit from
batchlens' recording rules, as in ``batchlens report``.

Everything follows the data, not the flags alone: the span is where the data
starts (a young deployment has less than --range), the tile that finds the
batch limits is a few scrape intervals (so every limit held that long is
seen), and each limit's P99 and request count come from vLLM's histogram
counted over the tiles at that limit: the same requests and the same method as
the overall P99, so the two can be compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchlens.arrivals import INTERARRIVAL, INTERARRIVAL_SQUARES, REQUESTS
from batchlens.config import Thresholds
from batchlens.prometheus_api import Prometheus
from batchlens.report.data import fetch as fetch_operating_points
from batchlens.rules.recording import LATENCIES, either
from batchlens.sweep.knee import Point

BY = "by (vllm_instance)"
# vLLM's token histograms have 1-2-5 buckets: 2000 is the bound nearest the article's 2048.
LONG_PROMPT_BOUND = 2000
#: A series every engine has, scraped at the exporter's pace: where the data starts, and how often.
PRESENCE = "vllm:num_requests_running"
ARTICLE_RESOLUTION = 300.0  # the article compares QPS over 5-minute windows
WINDOWS_PER_SPAN = 10  # at least this many QPS windows over the data, for a peak and a trough
TILES_PER_SPAN = 1000  # the finest tiling of the span that finds the batch limits
SCRAPES_PER_TILE = 4  # a tile holds a few scrapes, so increase() within it is sound


class EvidenceError(Exception):
    """The evidence cannot be gathered as asked (a resolution the data cannot carry): the message says why."""


@dataclass(frozen=True)
class LimitSeen(Point):
    """An operating point with what it rests on: requests served at the limit, and time spent there."""

    requests: float = 0.0
    seconds: float = 0.0


@dataclass
class Evidence:
    vllm_instance: str
    seconds: float  # the span of data looked at (at most --range)
    requests: float = math.nan
    interarrival_mean: float = math.nan
    interarrival_cv: float = math.nan
    interarrival_p50: float = math.nan
    interarrival_p90: float = math.nan
    interarrival_p99: float = math.nan
    qps_mean: float = math.nan
    qps_peak: float = math.nan
    qps_trough: float = math.nan
    mean_tokens: float = math.nan  # prompt + generation, per request
    prompt_p90: float = math.nan
    long_share: float = math.nan  # share of prompts over LONG_PROMPT_BOUND tokens
    stream_share: float = math.nan  # NaN: unknown (a vLLM without the batchlens plugin)
    p99_observed: float = math.nan
    resolution: float = math.nan  # the QPS window, seconds
    limits: list[LimitSeen] = field(default_factory=list)  # every batch limit seen, in order


def queries(latency: str, range_: str, resolution: str) -> dict[str, str]:
    def inc(metric: str) -> str:
        return f"sum {BY} (increase({metric}[{range_}]))"

    def quantile(q: float, metric: str) -> str:
        return f"histogram_quantile({q}, sum by (vllm_instance, le) (increase({metric}_bucket[{range_}])))"

    def rate(metric: str) -> str:
        return f"sum {BY} (rate({metric}[{resolution}]))"

    arrivals = either(rate(INTERARRIVAL + "_count"), rate("vllm:request_success_total"))
    mean = f"({inc(INTERARRIVAL + '_sum')} / {inc(INTERARRIVAL + '_count')})"
    long_bucket = f'vllm:request_prompt_tokens_bucket{{le="{LONG_PROMPT_BOUND:.1f}"}}'
    streamed = REQUESTS + '{stream="true"}'
    return {
        "requests": inc("vllm:request_success_total"),
        "interarrival_mean": mean,
        # Var = E[X^2] - E[X]^2, exact from the running sums; CV = sd / mean.
        "interarrival_cv": f"sqrt(clamp_min({inc(INTERARRIVAL_SQUARES)} / {inc(INTERARRIVAL + '_count')} "
        f"- {mean} ^ 2, 0)) / {mean}",
        "interarrival_p50": quantile(0.5, INTERARRIVAL),
        "interarrival_p90": quantile(0.9, INTERARRIVAL),
        "interarrival_p99": quantile(0.99, INTERARRIVAL),
        "qps_mean": f"avg_over_time(({arrivals})[{range_}:{resolution}])",
        "qps_peak": f"max_over_time(({arrivals})[{range_}:{resolution}])",
        "qps_trough": f"min_over_time(({arrivals})[{range_}:{resolution}])",
        "mean_tokens": f"({inc('vllm:request_prompt_tokens_sum')} + {inc('vllm:request_generation_tokens_sum')}) "
        f"/ {inc('vllm:request_prompt_tokens_count')}",
        "prompt_p90": quantile(0.9, "vllm:request_prompt_tokens"),
        "long_share": f"1 - {inc(long_bucket)} / {inc('vllm:request_prompt_tokens_count')}",
        "stream_share": f"{inc(streamed)} / {inc(REQUESTS)}",
        "p99_observed": either(*(quantile(0.99, name) for name in LATENCIES[latency])),
    }


def per_limit_queries(latency: str, limit: int, range_: str, tile: str) -> dict[str, str]:
    """Requests and P99 of the latency histogram over the tiles in which the batch limit was ``limit``."""
    at_limit = f"and on (vllm_instance) (max {BY} (batchlens_batch_limit) == {limit})"

    def over_tiles(inner: str, by: str) -> str:
        return f"sum by ({by}) (sum_over_time((sum by ({by}) ({inner}) {at_limit})[{range_}:{tile}]))"

    names = LATENCIES[latency]
    buckets = [over_tiles(f"increase({n}_bucket[{tile}])", "vllm_instance, le") for n in names]
    return {
        "requests": either(*(over_tiles(f"increase({n}_count[{tile}])", "vllm_instance") for n in names)),
        "p99": either(*(f"histogram_quantile(0.99, {b})" for b in buckets)),
    }


async def fetch(
    prometheus: Prometheus, thresholds: Thresholds, *, seconds: float, resolution: float | None, end: float
) -> list[Evidence]:
    """The evidence per engine over the data in the last ``seconds`` (``resolution`` None: chosen from the data)."""
    first = await prometheus.first_sample(f"count {BY} ({PRESENCE})", end - seconds, end)
    if first is None:
        return []
    span = max(end - first, 1.0)
    window = min(span, ARTICLE_RESOLUTION)
    per_window = await prometheus.instant(f"max(count_over_time({PRESENCE}[{int(window)}s]))", end)
    scrape = window / per_window[""] if per_window.get("", 0) > 1 else 15.0
    tile = max(SCRAPES_PER_TILE * scrape, span / TILES_PER_SPAN)
    if resolution is None:
        resolution = min(ARTICLE_RESOLUTION, max(span / WINDOWS_PER_SPAN, tile))
    elif resolution * 2 > span:
        raise EvidenceError(
            f"--resolution {resolution:g}s is more than half of the {span:.0f} s of data there is: "
            f"pick at most {span / 2:.0f}s, or leave it out to choose from the data"
        )
    # The queries' window reaches a tile before the first sample, so that no run cuts the data's start.
    range_, step, tile_ = f"{math.ceil(span + tile)}s", f"{max(int(resolution), 1)}s", f"{math.ceil(tile)}s"
    found: dict[str, Evidence] = {}

    def evidence(instance: str) -> Evidence:
        return found.setdefault(instance, Evidence(instance, span, resolution=resolution))

    for name, expr in queries(thresholds.p99_latency, range_, step).items():
        for instance, value in (await prometheus.instant(expr, end)).items():
            setattr(evidence(instance), name, value)
    report = await fetch_operating_points(prometheus, thresholds, first, end, math.ceil(tile))
    for row in report.per_limit():
        figures = {
            name: await prometheus.instant(expr, end)
            for name, expr in per_limit_queries(thresholds.p99_latency, row["batch_limit"], range_, tile_).items()
        }  # fmt: skip
        instance = row["vllm_instance"]
        evidence(instance).limits.append(LimitSeen(
            row["batch_limit"], row["throughput"], figures["p99"].get(instance, math.nan),
            requests=figures["requests"].get(instance, 0.0), seconds=row["samples"] * math.ceil(tile),
        ))  # fmt: skip
    return [found[i] for i in sorted(found)]
