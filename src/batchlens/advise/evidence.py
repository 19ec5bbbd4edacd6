"""What advise measures, per engine, over the data there is: one instant PromQL query per figure.

The traffic's shape comes from the arrival series that the batchlens vLLM
plugin (and the simulator) add (batchlens.arrivals); the request sizes and
latencies from vLLM's own histograms and counters; the batch limit from the
exporter's ``batchlens_batch_limit``.

Everything follows the data, not the flags alone: the span is where the data
starts (a young deployment has less than --range), the tile that finds the
batch limits is a few scrape intervals (so every limit held that long is
seen), and each limit's P99, request count and throughput come from vLLM's
own histogram and token counter, counted over the tiles at that limit: the
same requests and the same method as the overall P99, so the two can be
compared. Throughput is over the busy tiles only, so the quiet after the
traffic stops never dilutes the limit it stopped at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from batchlens.arrivals import INTERARRIVAL, INTERARRIVAL_SQUARES, REQUESTS
from batchlens.config import Thresholds
from batchlens.prometheus_api import MAX_POINTS, Prometheus, step_for
from batchlens.rules.recording import LATENCIES, either
from batchlens.sweep.knee import Point

BY = "by (vllm_instance)"
# vLLM's token histograms have 1-2-5 buckets: 2000 is the bound nearest the article's 2048.
LONG_PROMPT_BOUND = 2000
GENERATED = "vllm:generation_tokens_total"
#: A series every engine has, scraped at the exporter's pace: where the data starts, and how often.
PRESENCE = "vllm:num_requests_running"
ARTICLE_RESOLUTION = 300.0  # the article compares QPS over 5-minute windows
WINDOWS_PER_SPAN = 10  # at least this many QPS windows over the data, for a peak and a trough
TILES_PER_SPAN = 1000  # the finest tiling of the span that finds the batch limits
SCRAPES_PER_TILE = 4  # a tile holds a few scrapes (and a 10% margin), so increase() within it is sound


#: Tile lengths, in seconds. A tile is the smallest of these that holds a few scrapes: an estimate of the
#: scrape interval that wobbles by one sample from run to run must not change the tiles, or every figure
#: counted over them moves with it.
NICE_TILES = (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)


def nice_seconds(seconds: float) -> int:
    """The smallest nice tile of at least ``seconds`` (whole hours past the table)."""
    return next((t for t in NICE_TILES if t >= seconds), 3600 * math.ceil(seconds / 3600))


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


def over_tiles(inner: str, range_: str, tile: str, *, by: str = "vllm_instance", where: str = "",
               fold: str = "sum_over_time") -> str:  # fmt: skip
    """``inner`` (a per-tile increase) folded over the tiles of the range, optionally only where ``where`` holds.

    Tiles sit at fixed multiples of their length, so a tile's increase never changes once it is past: a
    figure over finished traffic is the same whenever it is asked for. (One increase() over the whole range
    extrapolates to its moving edges, per bucket, and its quantiles drift in the third digit from run to run.)
    """
    return f"sum by ({by}) ({fold}((sum by ({by}) ({inner}) {where})[{range_}:{tile}]))"


def queries(latency: str, range_: str, resolution: str, tile: str) -> dict[str, str]:
    def inc(metric: str) -> str:
        return over_tiles(f"increase({metric}[{tile}])", range_, tile)

    def quantile(q: float, metric: str) -> str:
        buckets = over_tiles(f"increase({metric}_bucket[{tile}])", range_, tile, by="vllm_instance, le")
        return f"histogram_quantile({q}, {buckets})"

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
    """Over the tiles in which the batch limit was ``limit``: requests and P99 of the latency histogram,
    output tokens, and how many of those tiles were busy (tokens made). Throughput is tokens over busy
    time, so the idle spells at a limit (no traffic, or after it stopped) do not dilute it."""
    at = f"and on (vllm_instance) (max {BY} (batchlens_batch_limit) == {limit})"
    names = LATENCIES[latency]
    buckets = [over_tiles(f"increase({n}_bucket[{tile}])", range_, tile, by="vllm_instance, le", where=at)
               for n in names]  # fmt: skip
    tokens = f"increase({GENERATED}[{tile}])"
    return {
        "requests": either(*(over_tiles(f"increase({n}_count[{tile}])", range_, tile, where=at) for n in names)),
        "p99": either(*(f"histogram_quantile(0.99, {b})" for b in buckets)),
        "tokens": over_tiles(tokens, range_, tile, where=at),
        "busy_tiles": over_tiles(f"{tokens} > 0", range_, tile, where=at, fold="count_over_time"),
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
    tile = nice_seconds(max(SCRAPES_PER_TILE * scrape * 1.1, span / TILES_PER_SPAN))
    if resolution is None:
        resolution = min(ARTICLE_RESOLUTION, nice_seconds(max(span / WINDOWS_PER_SPAN, tile)))
    elif resolution * 2 > span:
        raise EvidenceError(
            f"--resolution {resolution:g}s is more than half of the {span:.0f} s of data there is: "
            f"pick at most {span / 2:.0f}s, or leave it out to choose from the data"
        )
    # The queries' window reaches a tile and the first-sample search's own step before the data: wherever
    # that search lands, no run cuts the data's start, and every tile with data is counted.
    margin = tile + step_for(seconds, MAX_POINTS)
    range_, step, tile_ = f"{math.ceil(span + margin)}s", f"{max(int(resolution), 1)}s", f"{tile}s"
    found: dict[str, Evidence] = {}

    def evidence(instance: str) -> Evidence:
        return found.setdefault(instance, Evidence(instance, span, resolution=resolution))

    for name, expr in queries(thresholds.p99_latency, range_, step, tile_).items():
        for instance, value in (await prometheus.instant(expr, end)).items():
            setattr(evidence(instance), name, value)
    seen = await prometheus.range(f"max {BY} (batchlens_batch_limit)", first, end, tile)
    for limit in sorted({int(v) for values in seen.values() for v in values.values()}):
        figures = {
            name: await prometheus.instant(expr, end)
            for name, expr in per_limit_queries(thresholds.p99_latency, limit, range_, tile_).items()
        }  # fmt: skip
        for instance in sorted(instance for instance, values in seen.items() if limit in values.values()):
            busy = figures["busy_tiles"].get(instance, 0.0) * tile
            evidence(instance).limits.append(LimitSeen(
                limit, figures["tokens"].get(instance, 0.0) / busy if busy else math.nan,
                figures["p99"].get(instance, math.nan), requests=figures["requests"].get(instance, 0.0), seconds=busy,
            ))  # fmt: skip
    return [found[i] for i in sorted(found)]
