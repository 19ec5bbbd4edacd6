"""From evidence to advice: the article's decision table, then settings with their reasons. Pure.

The article says continuous batching is a must when any of these holds:
inter-arrival CV above 0.7, peak traffic over 5x the trough, more than 2048
tokens per request on average, more than 30% streamed answers, or an
end-to-end latency requirement under 300 ms. Where none holds, the traffic is
regular enough for static batching: big batches on a schedule, for
throughput. A criterion without data (a vLLM without the batchlens plugin
has no streaming share) is shown as unknown and decides nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from batchlens.advise.evidence import LONG_PROMPT_BOUND, Evidence, LimitSeen
from batchlens.sweep.knee import DEFAULT_MIN_GAIN, find_knee

CV_THRESHOLD = 0.7
PEAK_TROUGH_THRESHOLD = 5.0
MEAN_TOKENS_THRESHOLD = 2048
STREAM_SHARE_THRESHOLD = 0.30
LATENCY_REQUIREMENT_THRESHOLD = 0.3  # seconds
LONG_SHARE_FOR_OWN_INSTANCE = 0.05  # the article's case: 8% of requests took 45% of the compute
CHUNK_FOR_LATENCY = 2048  # vLLM's advice for ITL with chunked prefill
CHUNK_FOR_THROUGHPUT = 8192
BLOCK_SIZE = 16
#: Below this many requests a P99 is the slowest request, and the traffic's shape is noise: no verdict.
MIN_REQUESTS = 100


@dataclass(frozen=True)
class Criterion:
    name: str
    value: float
    threshold: str
    met: bool | None  # None: no data


@dataclass(frozen=True)
class Recommendation:
    setting: str
    value: str
    evidence: str


@dataclass
class Advice:
    vllm_instance: str
    seconds: float
    requests: float
    continuous: bool | None  # None: no criterion had data
    criteria: list[Criterion]
    latency: str
    requirement: float
    p99_observed: float
    resolution: float = math.nan  # the QPS window, seconds
    limits: list[LimitSeen] = field(default_factory=list)  # every batch limit seen, with what it rests on
    recommendations: list[Recommendation] = field(default_factory=list)

    def to_dict(self) -> dict:
        return _finite(asdict(self))


def _finite(value):
    """JSON has no NaN or Infinity: unknown becomes null, an unbounded ratio the string "inf"."""
    if isinstance(value, float):
        return None if math.isnan(value) else "inf" if math.isinf(value) else value
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _criterion(name: str, value: float, threshold: float, shown: str, *, below: bool = False) -> Criterion:
    met = None if math.isnan(value) else (value < threshold if below else value > threshold)
    return Criterion(name, value, shown, met)


def peak_to_trough(e: Evidence) -> float:
    if math.isnan(e.qps_peak) or math.isnan(e.qps_trough):
        return math.nan
    if e.qps_trough <= 0:
        return math.inf if e.qps_peak > 0 else math.nan
    return e.qps_peak / e.qps_trough


def criteria(e: Evidence, requirement: float) -> list[Criterion]:
    return [
        _criterion("inter-arrival CV", e.interarrival_cv, CV_THRESHOLD, f"> {CV_THRESHOLD}"),
        _criterion("peak/trough QPS", peak_to_trough(e), PEAK_TROUGH_THRESHOLD, f"> {PEAK_TROUGH_THRESHOLD:g}"),
        _criterion("mean tokens per request", e.mean_tokens, MEAN_TOKENS_THRESHOLD, f"> {MEAN_TOKENS_THRESHOLD}"),
        _criterion("streaming share", e.stream_share, STREAM_SHARE_THRESHOLD, f"> {STREAM_SHARE_THRESHOLD:.0%}"),
        _criterion(
            "P99 requirement (s)",
            requirement,
            LATENCY_REQUIREMENT_THRESHOLD,
            f"< {LATENCY_REQUIREMENT_THRESHOLD}",
            below=True,
        ),
    ]


def _fmt(value: float, unit: str = "") -> str:
    return "unknown" if math.isnan(value) else f"{value:.4g}{unit}"


def decide(e: Evidence, *, requirement: float, latency: str, min_gain: float = DEFAULT_MIN_GAIN) -> Advice:
    table = criteria(e, requirement)
    known = [c for c in table if c.met is not None and c.name != "P99 requirement (s)"]
    met = [c.name for c in table if c.met]
    enough = e.requests >= MIN_REQUESTS
    continuous = bool(met) if known and enough else None
    advice = Advice(e.vllm_instance, e.seconds, e.requests, continuous, table, latency, requirement, e.p99_observed,
                    resolution=e.resolution, limits=sorted(e.limits, key=lambda p: p.limit))  # fmt: skip
    add = advice.recommendations.append

    if continuous is None:
        add(Recommendation("serving mode", "unknown (too little evidence)",
                           f"{_fmt(e.requests)} requests in {e.seconds:.0f} s of data; at least {MIN_REQUESTS} are "
                           "needed to judge the traffic: widen --range, or wait for more traffic"))  # fmt: skip
    elif continuous:
        add(
            Recommendation(
                "serving mode",
                "continuous batching, latency-bounded batch limit, breaker on",
                f"{len(met)} of {len(table)} criteria hold: {', '.join(met)}",
            )
        )
    else:
        add(
            Recommendation(
                "serving mode",
                "static batching: large batches on a schedule, for throughput",
                "no criterion for continuous batching holds: the traffic is regular, not streamed, "
                "short and without a tight latency requirement",
            )
        )

    slo = requirement if continuous is not False else math.inf
    if (limit := _batch_limit(e, slo, latency, min_gain)) is not None:
        value, recommendation = limit
        add(recommendation)
        if value is not None:
            add(
                Recommendation(
                    "max_num_seqs",
                    str(2 * value),
                    f"at least twice the batch limit {value}, so the breaker and recovery have room",
                )
            )

    if continuous is not None:
        chunk = CHUNK_FOR_LATENCY if continuous else max(CHUNK_FOR_THROUGHPUT, _pow2(e.prompt_p90))
        why = (
            "small chunks keep each decode step short (ITL) while long prompts prefill in pieces"
            if continuous
            else "most prompts prefill in one step, for throughput"
        )
        add(
            Recommendation(
                "max_num_batched_tokens",
                str(chunk),
                f"P90 prompt {_fmt(e.prompt_p90, ' tokens')}; with enable_chunked_prefill, {why}",
            )
        )
        waste = (BLOCK_SIZE - 1) / 2 / e.mean_tokens if e.mean_tokens > 0 else math.nan
        add(
            Recommendation(
                "block_size",
                str(BLOCK_SIZE),
                f"vLLM's default; the half-empty last block wastes {_fmt(waste * 100, '%')} of a mean "
                f"request of {_fmt(e.mean_tokens, ' tokens')}",
            )
        )
    if not math.isnan(e.long_share):
        own = e.long_share >= LONG_SHARE_FOR_OWN_INSTANCE
        add(
            Recommendation(
                "long-context instance",
                "yes: route prompts over 2000 tokens to their own instance (larger max_model_len, lower batch limit)"
                if own
                else "no",
                f"{e.long_share:.1%} of prompts are over {LONG_PROMPT_BOUND} tokens (threshold "
                f"{LONG_SHARE_FOR_OWN_INSTANCE:.0%}); long prompts hold KV blocks and stall the batch around them",
            )
        )
    if not math.isnan(e.interarrival_p90):
        add(
            Recommendation(
                "cold-path threshold (s)",
                # Two digits: it is interpolated inside one of vLLM's buckets, which is all the precision
                # it has (a third digit wobbles with the query's alignment from run to run).
                f"{e.interarrival_p90:.2g}",
                f"the P90 inter-arrival time (P50 {_fmt(e.interarrival_p50, 's')}, P99 "
                f"{_fmt(e.interarrival_p99, 's')}): a gap longer than this is a quiet spell, where the "
                "cold-start limit (batch 1) costs nothing",
            )
        )
    return advice


def _pow2(value: float) -> int:
    return 1 << max(0, math.ceil(math.log2(value))) if value > 0 and not math.isnan(value) else 0


def _seen(p: LimitSeen) -> str:
    return f"{p.limit}: {p.throughput:.0f} tok/s, P99 {_fmt(p.p99, 's')} over {p.requests:.0f} requests"


def _batch_limit(e: Evidence, slo: float, latency: str, min_gain: float) -> tuple[int | None, Recommendation] | None:
    """The batch limit to run, and why: the knee of the limits seen, or what one limit's P99 says.

    Only a limit with MIN_REQUESTS requests behind its P99 is judged; every limit seen is listed.
    """
    shown = "none" if math.isinf(slo) else f"{slo:g}s"
    judged = [p for p in e.limits if p.requests >= MIN_REQUESTS and not math.isnan(p.p99 + p.throughput)]
    seen = "; ".join(_seen(p) for p in sorted(e.limits, key=lambda p: p.limit))
    if not e.limits:
        return None
    if not judged:
        return None, Recommendation(
            "batch limit", "no recommendation (too little evidence)",
            f"no limit has the {MIN_REQUESTS} requests a P99 needs; seen: {seen}: widen --range, or run "
            "`batchlens sweep` to measure each limit",
        )  # fmt: skip
    if len(judged) >= 2:
        knee = find_knee(judged, slo=slo, min_gain=min_gain)
        if knee.limit is None:
            # Over the SLO at every limit is a capacity problem (often queueing): a smaller batch only
            # serves fewer. Run the limit that serves the most, and add replicas or relax the SLO.
            best = max(judged, key=lambda p: p.throughput).limit
            return best, Recommendation(
                "batch limit", f"{best} (none meets the SLO)",
                f"{knee.reason}: add capacity or relax the SLO; meanwhile {best} serves the most; seen: {seen}",
            )  # fmt: skip
        return knee.limit, Recommendation(
            "batch limit", f"{knee.limit} (the knee)", f"{knee.reason}; SLO {shown} on {latency}; seen: {seen}"
        )
    p = judged[0]
    within = p.p99 <= slo
    value = p.limit if within else max(1, p.limit // 2)
    return value, Recommendation(
        "batch limit",
        f"{value} ({'keep' if within else 'halve'})",
        f"only limit {p.limit} has enough requests (P99 {latency} {p.p99:.3g}s against {shown}); seen: {seen}; "
        "run `batchlens sweep` to find the knee",
    )
