"""Advice as an operator reads it: the decision table, then each setting with its evidence."""

from __future__ import annotations

import math

from batchlens.advise.decide import Advice


def _value(value: float, name: str) -> str:
    if math.isnan(value):
        return "unknown"
    if math.isinf(value):
        return "inf (idle spells)"
    return f"{value:.0%}" if "share" in name else f"{value:.4g}"


def format_advice(advice: Advice) -> str:
    verdict = {True: "continuous batching", False: "static batching", None: "no verdict (too little data)"}[
        advice.continuous
    ]
    windows = "" if math.isnan(advice.resolution) else f", QPS in {advice.resolution:.0f}s windows"
    requests = "no" if math.isnan(advice.requests) else f"{advice.requests:.0f}"
    lines = [
        f"{advice.vllm_instance}: {requests} requests over {advice.seconds:.0f}s of data{windows} -> {verdict}",
        f"  {'criterion (article)':28} {'value':>16}  {'threshold':>10}  holds",
    ]
    for c in advice.criteria:
        holds = {True: "yes", False: "no", None: "?"}[c.met]
        lines.append(f"  {c.name:28} {_value(c.value, c.name):>16}  {c.threshold:>10}  {holds}")
    if math.isnan(advice.p99_observed):
        lines.append(f"  observed P99 {advice.latency}: no data")
    else:
        within = "within" if advice.p99_observed <= advice.requirement else "OVER"
        observed = f"{advice.p99_observed:.3g}s, {within} the {advice.requirement:g}s requirement"
        lines.append(f"  observed P99 {advice.latency}: {observed}")
    lines.append("  recommendations:")
    for r in advice.recommendations:
        lines.append(f"    {r.setting}: {r.value}")
        lines.append(f"      because {r.evidence}")
    return "\n".join(lines)
