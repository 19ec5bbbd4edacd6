"""The report's data: a few range queries, aligned into one row per engine and instant. Pure, but for ``fetch``.

Each measure is one PromQL query over the recording rules, aggregated by
``vllm_instance``; :func:`align` joins them on timestamps, so a row is one
operating point: throughput, P99, GPU memory busy, KV usage, running batch,
batch limit, all at the same instant.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import aiohttp

from batchlens.config import Thresholds
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
    }


@dataclass
class Point:
    time: float
    values: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.values.get(name, math.nan)


@dataclass
class Report:
    thresholds: Thresholds
    start: float
    end: float
    points: dict[str, list[Point]]  # vllm_instance -> points in time order

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


def parse_matrix(data: dict) -> Series:
    """A Prometheus range query result (resultType matrix) -> instance -> time -> value; NaN dropped."""
    if data.get("resultType") != "matrix":
        raise ValueError(f"expected a matrix from Prometheus, got {data.get('resultType')!r}")
    out: Series = {}
    for series in data["result"]:
        instance = series["metric"].get("vllm_instance", "")
        values = {float(t): float(v) for t, v in series["values"] if not math.isnan(float(v))}
        out.setdefault(instance, {}).update(values)
    return out


def align(thresholds: Thresholds, start: float, end: float, measures: dict[str, Series]) -> Report:
    points: dict[str, dict[float, Point]] = defaultdict(dict)
    for name, series in measures.items():
        for instance, values in series.items():
            for t, v in values.items():
                points[instance].setdefault(t, Point(t)).values[name] = v
    return Report(thresholds, start, end, {i: [by_t[t] for t in sorted(by_t)] for i, by_t in sorted(points.items())})


async def fetch(prometheus: str, thresholds: Thresholds, start: float, end: float, step: float) -> Report:
    """Run the report's queries against ``prometheus`` (its base URL) and align them."""
    measures: dict[str, Series] = {}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for name, expr in queries(thresholds).items():
            params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:.3f}"}
            async with session.get(f"{prometheus.rstrip('/')}/api/v1/query_range", params=params) as reply:
                body = await reply.json(content_type=None)
                if reply.status != 200 or body.get("status") != "success":
                    raise RuntimeError(f"Prometheus refused {name} ({expr}): {reply.status} {body.get('error', body)}")
            measures[name] = parse_matrix(body["data"])
    return align(thresholds, start, end, measures)
