"""What the controller sees of an engine: its own /metrics text, sampled each tick. Pure.

A sample holds vLLM's gauges and its cumulative counters and histograms, summed
over engine cores; a :class:`Window` is the change between two samples, with
percentiles estimated from vLLM's bucket bounds as Prometheus'
``histogram_quantile`` does. That is all the controller ever sees, in
production and in a simulated replay alike: never the exact latencies.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

from batchlens.exporter.parser import ExpositionReader
from batchlens.goodput import Slo
from batchlens.rules.recording import KV_USAGE, LATENCIES

#: Each figure under vLLM's current name and, where it was renamed, the older one (the rules' own tables).
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
GENERATED = ("vllm:generation_tokens_total",)
PROMPTED = ("vllm:prompt_tokens_total",)
PREEMPTIONS = ("vllm:num_preemptions_total",)
FINISHED = ("vllm:request_success_total",)
REJECTED = ("vllm:admission_rejections_total",)  # 0.29 and later: every reason summed
TTFT, ITL = LATENCIES["ttft"], LATENCIES["itl"]
#: The families read_sample reads, by their family names (a counter's with _total, as vLLM's TYPE lines name it,
#: or without, as OpenMetrics does): the other families of an exposition (hundreds of series) are skipped.
_READ = frozenset(name for names in (RUNNING, WAITING, GENERATED, PROMPTED, PREEMPTIONS, FINISHED, REJECTED,
                  KV_USAGE, TTFT, ITL) for n in names for name in (n, n.removesuffix("_total")))  # fmt: skip
#: Their sample names (a counter's _total, a histogram's buckets, sum and count): what an engine's exposition needs to
#: hold for read_sample, and all a replay renders for its policies (replay/simulated.py).
SAMPLES_READ = frozenset(name + suffix for name in _READ for suffix in ("", "_total", "_bucket", "_sum", "_count"))


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts per upper bound, sorted, +Inf last (as a Prometheus histogram)."""

    buckets: tuple[tuple[float, float], ...] = ()
    sum: float = 0.0  # of the observations: exact, where a percentile is only as good as the buckets

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    @property
    def mean(self) -> float:
        """The exact mean of the observations (from _sum and _count); NaN empty."""
        return self.sum / self.count if self.count > 0 else math.nan

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made since ``earlier`` (a restarted engine counts from zero)."""
        before = dict(earlier.buckets)
        delta = tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets)
        return self if any(n < 0 for _, n in delta) else Histogram(delta, self.sum - earlier.sum)

    def quantile(self, q: float) -> float:
        """Prometheus' histogram_quantile: linear within the bucket; the highest finite bound past it; NaN empty."""
        if self.count <= 0:
            return math.nan
        rank, lower, below = q * self.count, 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, cumulative
        return lower

    def share_at_most(self, bound: float) -> float:
        """The share of observations at or under ``bound``, linear within its bucket; NaN empty."""
        if self.count <= 0:
            return math.nan
        lower, below = 0.0, 0.0
        for le, cumulative in self.buckets:
            if bound < le:
                inside = 0.0 if math.isinf(le) else (bound - lower) / (le - lower)
                return (below + (cumulative - below) * inside) / self.count
            lower, below = le, cumulative
        return 1.0


@dataclass(frozen=True)
class EngineSample:
    time: float
    running: float
    waiting: float
    kv_usage: float
    generated_tokens: float
    preemptions: float
    ttft: Histogram
    itl: Histogram
    finished: float = 0.0  # requests completed (any finish reason)
    prompt_tokens: float = 0.0  # prompt tokens prefilled
    rejected: float = 0.0  # requests refused at the door by a queued cap


def read_sample(
    text: str | Sequence[str], time: float, readers: Sequence[ExpositionReader] | None = None
) -> EngineSample:
    """An engine's /metrics text -> one sample, every engine core summed (KV usage: the fullest core). Several
    texts: the servers of one deployment (one per DP rank or node), summed as the cores of one server are.

    ``readers``: one per text, kept from one reading of its server to the next, whose cache of the series it
    parsed makes the next reading of the same lines 8 times cheaper (the hook reads every engine every tick)."""
    values: dict[str, list[float]] = defaultdict(list)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    sums: dict[str, float] = defaultdict(float)
    texts = [text] if isinstance(text, str) else text
    readers = [ExpositionReader() for _ in texts] if readers is None else readers
    families = [f for reader, t in zip(readers, texts, strict=True) for f in reader.parse(t) if f.name in _READ]
    for family in families:
        for series, value, _ in family.samples:
            if series.name.endswith("_bucket"):
                le = dict(series.labels).get("le")
                if le is not None:
                    buckets[series.name.removesuffix("_bucket")][_bound(series.name, le)] += value
            elif series.name.endswith("_sum"):
                sums[series.name.removesuffix("_sum")] += value
            else:
                values[series.name].append(value)

    def first(names: tuple[str, ...], combine=sum) -> float:
        return next((combine(values[n]) for n in names if values.get(n)), 0.0)

    def histogram(names: tuple[str, ...]) -> Histogram:
        name = next((n for n in names if n in buckets), None)
        found = buckets[name] if name is not None else {}
        return Histogram(tuple(sorted(found.items())), sums.get(name, 0.0) if name is not None else 0.0)

    # vLLM's KV usage is NaN until an engine core has blocks, which is no usage: a core at NaN must not hide
    # another's (max() of a list that starts with NaN is NaN).
    kv_usage = first(KV_USAGE, lambda usages: max((u for u in usages if not math.isnan(u)), default=0.0))
    sample = EngineSample(
        time=time, running=first(RUNNING), waiting=first(WAITING), kv_usage=kv_usage,
        generated_tokens=first(GENERATED), preemptions=first(PREEMPTIONS), ttft=histogram(TTFT), itl=histogram(ITL),
        finished=first(FINISHED), prompt_tokens=first(PROMPTED), rejected=first(REJECTED),
    )  # fmt: skip
    # The text format allows NaN and +Inf anywhere; in these figures they are a broken engine, and a rate or a
    # cap computed from one is not a number either (int(nan) raises, ceil(inf) overflows). Bar one: vLLM's KV
    # usage (above).
    for name, value in _figures(sample):
        if not math.isfinite(value):
            raise NotFinite(f"{name} is {value}: the controller reads only finite figures")
    return sample


def _bound(name: str, le: str) -> float:
    """A bucket's upper bound: a number, +Inf for the last, never NaN (a percentile over it is not a number)."""
    try:
        bound = float(le)
    except ValueError:
        bound = math.nan
    if math.isnan(bound):
        raise NotFinite(f"{name} has a bucket le={le!r}: not a bound")
    return bound


class NotFinite(ValueError):
    """A sample with a NaN or infinite figure: not steered on, as a sample that does not parse."""


def _figures(sample: EngineSample) -> Iterator[tuple[str, float]]:
    for field in fields(sample):
        value = getattr(sample, field.name)
        if isinstance(value, Histogram):
            yield f"{field.name} sum", value.sum
            yield from ((f"{field.name} bucket le={le:g}", count) for le, count in value.buckets)
        else:
            yield field.name, value


@dataclass(frozen=True)
class Window:
    """What happened between two samples, and the gauges at the later one."""

    seconds: float
    running: float
    waiting: float
    kv_usage: float
    tokens_per_second: float
    preemptions: float
    ttft: Histogram  # the first tokens given in the window
    itl: Histogram  # the gaps between tokens in the window
    finished_per_second: float = 0.0
    prompt_tokens_per_second: float = 0.0  # prefilled; with requests waiting, the rate the queue drains at
    rejected_per_second: float = 0.0  # refused at the door
    arrived_per_second: float = 0.0  # finished + refused + the change in running and waiting: what was asked
    waiting_before: float = 0.0  # the waiting gauge at the window's start

    @property
    def shed_share(self) -> float:
        """Of the requests that arrived and were settled in the window, the share refused at the door (0 idle).

        Finished stands in for admitted, which vLLM does not count: the two agree while the queue is steady."""
        settled = self.rejected_per_second + self.finished_per_second
        return self.rejected_per_second / settled if settled > 0 else 0.0

    def attainment(self, slo: Slo) -> float:
        """An estimate of the share of requests within the SLO: P(TTFT ok) x P(a token's gap ok); NaN idle.

        The engine keeps no per-request TPOT, so a token's gap stands in for its request's mean gap: pessimistic
        where gaps vary within a request (docs/control.md measures the error against exact client figures).
        """
        return self.ttft.share_at_most(slo.ttft_seconds) * self.itl.share_at_most(slo.tpot_seconds)

    def goodput(self, slo: Slo) -> float:
        """Estimated good requests per second: finished per second x attainment (0 while nothing finishes)."""
        share = self.attainment(slo)
        return 0.0 if math.isnan(share) else self.finished_per_second * share


def window(earlier: EngineSample, later: EngineSample) -> Window:
    seconds = max(later.time - earlier.time, 1e-9)
    return Window(
        seconds=seconds, running=later.running, waiting=later.waiting, kv_usage=later.kv_usage,
        tokens_per_second=max(later.generated_tokens - earlier.generated_tokens, 0.0) / seconds,
        preemptions=max(later.preemptions - earlier.preemptions, 0.0),
        ttft=later.ttft.minus(earlier.ttft), itl=later.itl.minus(earlier.itl),
        finished_per_second=max(later.finished - earlier.finished, 0.0) / seconds,
        prompt_tokens_per_second=max(later.prompt_tokens - earlier.prompt_tokens, 0.0) / seconds,
        rejected_per_second=max(later.rejected - earlier.rejected, 0.0) / seconds,
        arrived_per_second=max(later.finished - earlier.finished + later.rejected - earlier.rejected
                               + later.running + later.waiting - earlier.running - earlier.waiting, 0.0) / seconds,
        waiting_before=earlier.waiting,
    )  # fmt: skip
