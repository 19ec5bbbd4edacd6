"""The report's data: a few range queries, aligned into one row per engine and instant. Pure, but for ``fetch``.

Each measure is one PromQL query over the recording rules, aggregated by
``vllm_instance``; :func:`align` joins them on timestamps, so a row is one
operating point: throughput, P99, GPU memory busy, KV usage, running batch,
batch limit, the door's cap, the requests finished and refused, all at the same
instant. Beside them, the story of the range: the alerts that fired, and what
the breaker and the controller did.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from batchlens.config import Thresholds
from batchlens.prometheus_api import Prometheus, PrometheusError
from batchlens.rules.recording import LEVEL, p99_name

Series = dict[str, dict[float, float]]  # vllm_instance -> timestamp -> value


def queries(thresholds: Thresholds) -> dict[str, str]:
    by = "by (vllm_instance)"
    return {
        "throughput": f"sum {by} ({LEVEL}:vllm_generation_tokens:rate1m)",
        "p99": f"max {by} ({p99_name(thresholds)})",
        "memory_busy": f"max {by} ({LEVEL}:batchlens_gpu_memory_busy:max)",
        "kv_usage": f"max {by} ({LEVEL}_engine:vllm_kv_cache_usage:ratio)",
        "running": f"sum {by} ({LEVEL}:vllm_num_requests_running:avg1m)",
        "efficiency": f"max {by} ({LEVEL}:vllm_batch_efficiency:ratio1m)",
        "batch_limit": f"max {by} (batchlens_batch_limit)",
        # the hook's, with control.admission: +Inf while the door is open
        "admission_cap": f"min {by} (batchlens_admission_cap_tokens)",
        "finished": f"sum {by} ({LEVEL}:vllm_request_success:rate1m)",
        "refused": f"sum {by} ({LEVEL}_reason:vllm_admission_rejections:rate1m)",
    }


#: The alerts the page lists: every one that fired, by name and engine.
ALERTS_QUERY = 'max by (alertname, vllm_instance, severity) (ALERTS{alertstate="firing"})'


@dataclass(frozen=True)
class Firing:
    """An alert that fired over the range: from its first step firing to its last (None: still at the end)."""

    alertname: str
    vllm_instance: str
    severity: str
    start: float
    end: float | None


def firings(series: dict[tuple[str, str, str], list[float]], step: float, range_end: float) -> list[Firing]:
    """Each run of consecutive steps an alert fired in, as one firing (a gap of more than a step ends one)."""
    out = []
    for (name, instance, severity), times in series.items():
        times = sorted(times)
        first = prev = times[0]
        for t in [*times[1:], math.inf]:
            if t - prev > 1.5 * step:
                out.append(Firing(name, instance, severity, first, None if prev >= range_end - 1.5 * step else prev))
                first = t
            prev = t
    return sorted(out, key=lambda f: (f.start, f.alertname, f.vllm_instance))


@dataclass
class Point:
    time: float
    values: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.values.get(name, math.nan)


@dataclass(frozen=True)
class Action:
    """What the breaker or the controller did to an engine over the report's range, and how often."""

    vllm_instance: str
    by: str  # "breaker" or "controller"
    what: str  # the breaker's action and its result, or the controller's reason
    count: int


#: by -> the counter of its actions, and the labels that say what each series counts.
ACTION_COUNTERS = {
    "breaker": ("batchlens_remediation_actions_total", ("action", "result")),
    "controller": ("batchlens_controller_decisions_total", ("reason",)),
}
#: How far before the range a counter's samples are read: a sample there is the count the range starts from.
#: Prometheus' own lookback: a series without one was born in the range, and its first sample counts.
LOOKBACK_SECONDS = 300.0


def counted(samples: list[tuple[float, float]], start: float) -> float:
    """How much a counter counted after ``start``, from its raw samples.

    ``increase()`` misses a series' first sample: a counter that first appears at 1 (the hook's first halving)
    counts 0. Here a series with no sample at or before ``start`` was born in the range, from 0; and a drop is a
    restart, from 0 again."""
    last = next((v for t, v in reversed(samples) if t <= start), 0.0)
    total = 0.0
    for t, v in samples:
        if t > start:
            total += v - last if v >= last else v
            last = v
    return total


@dataclass
class Report:
    thresholds: Thresholds
    start: float
    end: float
    points: dict[str, list[Point]]  # vllm_instance -> points in time order
    actions: list[Action] = field(default_factory=list)
    alerts: list[Firing] = field(default_factory=list)

    def per_limit(self) -> list[dict]:
        """Averages per (engine, batch limit): the operating points table."""
        groups: dict[tuple[str, float], list[Point]] = defaultdict(list)
        for instance, points in self.points.items():
            for p in points:
                if not math.isnan(p.get("batch_limit")):
                    groups[(instance, p.get("batch_limit"))].append(p)
        rows = []
        for (instance, limit), points in sorted(groups.items()):
            row = {"vllm_instance": instance, "batch_limit": int(limit), "samples": len(points)}
            for name in ("throughput", "p99", "memory_busy", "kv_usage", "efficiency"):
                values = [v for p in points if not math.isnan(v := p.get(name))]
                row[name] = statistics.fmean(values) if values else math.nan
            rows.append(row)
        return rows


def align(thresholds: Thresholds, start: float, end: float, measures: dict[str, Series]) -> Report:
    points: dict[str, dict[float, Point]] = defaultdict(dict)
    for name, series in measures.items():
        for instance, values in series.items():
            for t, v in values.items():
                points[instance].setdefault(t, Point(t)).values[name] = v
    return Report(thresholds, start, end, {i: [by_t[t] for t in sorted(by_t)] for i, by_t in sorted(points.items())})


async def fetch(prometheus: Prometheus, thresholds: Thresholds, start: float, end: float, step: float) -> Report:
    """Run the report's queries from ``start`` to ``end`` and align them, with the actions taken meanwhile."""
    measures = {name: await prometheus.range(expr, start, end, step) for name, expr in queries(thresholds).items()}
    report = align(thresholds, start, end, measures)
    for by, (counter, kinds) in ACTION_COUNTERS.items():
        counts: dict[tuple[str, str], float] = defaultdict(float)
        for labels, samples in await prometheus.samples(counter, end - start + LOOKBACK_SECONDS, end):
            what = ": ".join(labels.get(kind, "?") for kind in kinds)
            counts[(labels.get("vllm_instance", ""), what)] += counted(samples, start)
        report.actions += [Action(instance, by, what, round(n)) for (instance, what), n in counts.items() if n > 0]
    report.actions.sort(key=lambda a: (a.vllm_instance, a.by, -a.count, a.what))
    fired: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for labels, values in await prometheus.matrix(ALERTS_QUERY, start, end, step):
        key = (labels.get("alertname", "?"), labels.get("vllm_instance", ""), labels.get("severity", ""))
        fired[key] += list(values)
    report.alerts = firings(fired, step, end)
    return report


def rules_needed(thresholds: Thresholds) -> set[str]:
    """The recording rules the report's queries read."""
    return {name for expr in queries(thresholds).values() for name in re.findall(rf"\b{LEVEL}\w*:[\w:]+", expr)}


async def available(prometheus: Prometheus, thresholds: Thresholds, seconds: float, end: float) -> tuple[float, float]:
    """The part of the last ``seconds`` that holds data: (start, end). A young deployment has less than asked.

    Fails, saying how to fix it, when the recording rules are not loaded (the report would be blank) or
    when there is no data at all.
    """
    missing = rules_needed(thresholds) - await prometheus.recording_rules()
    if missing:
        raise PrometheusError(
            f"{prometheus.url} has not loaded batchlens' recording rules ({', '.join(sorted(missing)[:2])}, ...): "
            "add alerts/batchlens.rules.yml to its rule_files (`batchlens build --root DIR` writes it) and reload"
        )
    first = await prometheus.first_sample(queries(thresholds)["throughput"], end - seconds, end)
    if first is None:
        raise PrometheusError(
            f"no batchlens data in {prometheus.url} over the last {seconds:.0f} s: does it scrape the exporter, "
            "and has it evaluated the recording rules yet?"
        )
    return first, end
