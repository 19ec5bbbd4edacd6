"""A plan's results: rows (JSON, CSV), a table, and a PNG of goodput and cost against replicas per profile."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: render to files only

import matplotlib.pyplot as plt

from batchlens.goodput import Slo
from batchlens.plan.search import Point, Rule
from batchlens.text_table import text_table

COLUMNS = (
    ("profile", "profile", "{}"),
    ("replicas", "replicas", "{:d}"),
    ("gpus", "GPUs", "{:d}"),
    ("limit", "batch limit", "{:.0f}"),
    ("door", "door cap", "{:d}"),
    ("goodput_rps", "goodput/s", "{:.2f}"),
    ("slo_attainment", "attained", "{:.2%}"),
    ("shed_share", "shed", "{:.2%}"),
    ("p99_ttft_s", "P99 TTFT s", "{:.3f}"),
    ("p99_tpot_s", "P99 TPOT s", "{:.4f}"),
    ("gpu_hours", "GPU-h", "{:.2f}"),
    ("usd_per_million_good_tokens", "$/M good tok", "{:.4f}"),
    ("meets", "meets SLO", "{}"),
)


def rows(points: Sequence[Point]) -> list[dict]:
    """One row per point; NaN and infinity become None (JSON has neither)."""
    return [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in asdict(p).items()}
            for p in points]  # fmt: skip


def table(points: Sequence[Point], slo: Slo, rule: Rule, *, policy: str, balancer: str) -> str:
    shown = [{**row, "meets": "yes" if row["meets"] else "no"} for row in rows(points)]
    lines = text_table(COLUMNS, shown, width=8, marks=[mark(p) for p in points])
    lines.append(f"each replica under {policy}, behind a {balancer} balancer; {rule.describe(slo)}")
    lines.append("batch limit: averaged over time and replicas; door cap: the queued-token cap at the end (median "
                 "over replicas; - open); $/M good tok: GPU-hours x price / the good requests' tokens")  # fmt: skip
    if any(p.stopped_at is not None for p in points):
        lines.append("stopped at: a fleet sure to miss (more requests not good, or shed, than the SLO allows over "
                     "the whole trace) stops there; its figures are until then (--whole: to the end)")  # fmt: skip
    cheapest = next((p for p in points if p.cheapest), None)
    if cheapest is None:
        lines.append("no fleet tried meets the SLO: raise plan.max_replicas (--max-replicas), or try other profiles")
    else:
        lines.append(f"cheapest that meets the SLO: {cheapest.replicas} x {cheapest.profile} ({cheapest.gpus} GPUs), "
                     f"${cheapest.usd_per_million_good_tokens:.4f} per million good tokens")  # fmt: skip
    return "\n".join(lines)


def mark(point: Point) -> str:
    if point.cheapest:
        return "  <- cheapest"
    return f"  stopped at {point.stopped_at:.0f} s: sure to miss" if point.stopped_at is not None else ""


def write_csv(points: Sequence[Point], path: Path) -> None:
    shown = rows(points)
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(shown[0]))
        writer.writeheader()
        writer.writerows(shown)


def write_png(points: Sequence[Point], path: Path, *, title: str) -> None:
    """Goodput (left) and cost per million good tokens (right) against replicas, a line per profile; a filled
    marker where the fleet meets the SLO, a ring around the cheapest."""
    fig, (ax_good, ax_cost) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    profiles = list(dict.fromkeys(p.profile for p in points))
    for i, name in enumerate(profiles):
        mine = sorted((p for p in points if p.profile == name), key=lambda p: p.replicas)
        color = f"C{i % 10}"
        for ax, key in ((ax_good, "goodput_rps"), (ax_cost, "usd_per_million_good_tokens")):
            xs = [p.replicas for p in mine]
            ys = [getattr(p, key) if math.isfinite(getattr(p, key)) else math.nan for p in mine]
            ax.plot(xs, ys, color=color, label=name, linewidth=1.5)
            for p, y in zip(mine, ys, strict=True):
                ax.plot(p.replicas, y, "o", color=color, markerfacecolor=color if p.meets else "white", zorder=3)
                if p.cheapest:  # a ring around it, the point still seen
                    ax.plot(p.replicas, y, "o", markersize=18, markerfacecolor="none", markeredgecolor="black",
                            markeredgewidth=1.5, zorder=4)  # fmt: skip
                    ax.annotate("cheapest", (p.replicas, y), xytext=(12, 8), textcoords="offset points", fontsize=8)
    ax_good.set(title=f"Goodput against replicas: {title}", xlabel="replicas", ylabel="good requests/s")
    ax_cost.set(title="Cost per million good tokens", xlabel="replicas", ylabel="USD per million good tokens")
    ax_cost.set_yscale("log")
    for ax in (ax_good, ax_cost):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=8)
    stopped = "; a fleet stopped as sure to miss has no cost per good token" if any(
        p.stopped_at is not None for p in points) else ""  # fmt: skip
    fig.suptitle(f"filled: the fleet meets the SLO; open: it misses it; ringed: the cheapest that meets it{stopped}",
                 fontsize=9, color="dimgray")  # fmt: skip
    fig.savefig(path, dpi=100)
    plt.close(fig)
