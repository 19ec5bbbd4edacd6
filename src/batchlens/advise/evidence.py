"""What advise measures, per engine, over a range: one instant PromQL query per figure.

The traffic's shape comes from the arrival series that the batchlens vLLM
plugin (and the simulator) add (batchlens.arrivals); the request sizes and
latencies from vLLM's own histograms; the operating points per batch limit
from batchlens' recording rules, as in ``batchlens report``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import aiohttp

from batchlens.arrivals import INTERARRIVAL, INTERARRIVAL_SQUARES, REQUESTS
from batchlens.config import Thresholds
from batchlens.report.data import fetch as fetch_operating_points
from batchlens.rules.recording import LATENCIES, either
from batchlens.sweep.knee import Point

BY = "by (vllm_instance)"
# vLLM's token histograms have 1-2-5 buckets: 2000 is the bound nearest the article's 2048.
LONG_PROMPT_BOUND = 2000


@dataclass
class Evidence:
    vllm_instance: str
    seconds: float  # the range looked at
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
    limits: list[Point] = field(default_factory=list)  # operating points per batch limit seen


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


async def instant(session: aiohttp.ClientSession, prometheus: str, expr: str, at: float) -> dict[str, float]:
    """An instant query -> vllm_instance -> value (NaN kept: it means "no data in the range")."""
    params = {"query": expr, "time": f"{at:.3f}"}
    async with session.get(f"{prometheus.rstrip('/')}/api/v1/query", params=params) as reply:
        body = await reply.json(content_type=None)
        if reply.status != 200 or body.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {expr!r}: {reply.status} {body.get('error', body)}")
    if body["data"]["resultType"] != "vector":
        raise ValueError(f"expected a vector from Prometheus, got {body['data']['resultType']!r}")
    return {s["metric"].get("vllm_instance", ""): float(s["value"][1]) for s in body["data"]["result"]}


async def fetch(
    prometheus: str, thresholds: Thresholds, *, seconds: float, resolution: float, end: float
) -> list[Evidence]:
    range_, step = f"{int(seconds)}s", f"{max(int(resolution), 1)}s"
    found: dict[str, Evidence] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for name, expr in queries(thresholds.p99_latency, range_, step).items():
            for instance, value in (await instant(session, prometheus, expr, end)).items():
                setattr(found.setdefault(instance, Evidence(instance, seconds)), name, value)
    report = await fetch_operating_points(prometheus, thresholds, end - seconds, end, max(seconds / 300, resolution))
    for row in report.per_limit():
        evidence = found.setdefault(row["vllm_instance"], Evidence(row["vllm_instance"], seconds))
        if not (math.isnan(row["throughput"]) or math.isnan(row["p99"])):
            evidence.limits.append(Point(row["batch_limit"], row["throughput"], row["p99"]))
    return [found[i] for i in sorted(found)]
