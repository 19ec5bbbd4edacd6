"""A replay's results as rows (JSON and CSV), a table, and a PNG of goodput per policy and the limit over time."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: render to files only

import matplotlib.pyplot as plt
import matplotlib.ticker

from batchlens.goodput import Slo
from batchlens.replay.simulated import Run
from batchlens.replay.traces import TraceRequest
from batchlens.text_table import text_table

COLUMNS = (
    ("policy", "policy", "{}"),
    ("requests", "requests", "{:d}"),
    ("good", "good", "{:d}"),
    ("goodput_rps", "goodput/s", "{:.3f}"),
    ("slo_attainment", "attained", "{:.1%}"),
    ("p50_ttft_s", "P50 TTFT s", "{:.3f}"),
    ("p99_ttft_s", "P99 TTFT s", "{:.3f}"),
    ("p50_tpot_s", "P50 TPOT s", "{:.4f}"),
    ("p99_tpot_s", "P99 TPOT s", "{:.4f}"),
    ("throughput_tokens_s", "tokens/s", "{:.0f}"),
)


def rows(runs: Sequence[Run]) -> list[dict]:
    """One row per run: the policy, its judgement, the requests refused as too long and shed at the door (with
    the sheds estimated to have been needless), how the limit moved. NaN becomes None."""
    out = []
    for run in runs:
        row = {"policy": run.policy, **asdict(run.judgement), "refused": run.refused, "shed": run.shed,
               "refused_queued": run.refused_queued, "false_sheds": run.false_sheds,
               "false_shed_sample": run.false_shed_sample,
               "limit_changes": max(len(run.limits) - 1, 0), "final_limit": run.limits[-1][1] if run.limits else None,
               "decisions": run.decisions or None}  # fmt: skip
        out.append({k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()})
    return out


def table(runs: Sequence[Run], best: Run | None, slo: Slo) -> str:
    shown = [*runs, *([best] if best else [])]
    lines = text_table(COLUMNS, rows(shown), width=11, marks=["  <- oracle" if run is best else "" for run in shown])
    lines.append(f"good: TTFT <= {slo.ttft_seconds:g}s and TPOT <= {slo.tpot_seconds:g}s; goodput over the whole run, "
                 "drain included")  # fmt: skip
    for run in shown:
        if run.refused:  # otherwise a run refused whole reads as an engine that served nothing, with no reason
            lines.append(f"{run.policy}: {run.refused} of {run.judgement.requests} requests refused at arrival as "
                         "longer than --max-model-len (not good)")  # fmt: skip
        if run.shed:
            queued = ""
            if run.refused_queued:
                queued = f", {run.refused_queued} of them while queued (the door's second look)"
            lines.append(f"{run.policy}: {run.shed} of {run.judgement.requests} requests shed at the door by the "
                         f"queued-token cap or the per-request door (not good){queued}; about {run.false_sheds} of "
                         f"them would have met the SLO had they been let in or left queued (from "
                         f"{run.false_shed_sample} replayed so)")  # fmt: skip
    if best:
        base = {run.policy: run.judgement.goodput_rps for run in runs}
        ratios = [f"{policy}/oracle {value / best.judgement.goodput_rps:.2f}" for policy, value in base.items()
                  if best.judgement.goodput_rps > 0]  # fmt: skip
        lines.append(f"oracle: the best static limit for this trace is {best.policy}" +
                     (f" ({', '.join(ratios)})" if ratios else ""))  # fmt: skip
    return "\n".join(lines)


def write_csv(runs: Sequence[Run], best: Run | None, path: Path) -> None:
    """The rows, a column each; a column that holds a mapping (``decisions``) holds it as JSON, which a
    spreadsheet or ``jq`` reads, not as Python's repr of it."""
    shown = rows([*runs, *([best] if best else [])])
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=[*shown[0], "oracle"])
        writer.writeheader()
        for i, row in enumerate(shown):
            cells = {k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v for k, v in row.items()}
            writer.writerow({**cells, "oracle": int(best is not None and i == len(shown) - 1)})


def arrival_rate(trace: Sequence[TraceRequest], target: float = 10.0, most: int = 1000) -> tuple[list, list]:
    """Arrivals per second in equal buckets of about ``target`` seconds that end at the last arrival: no partial
    bucket at the end to read as a drop, and at most ``most`` buckets however long the trace (one gap of a
    year draws a thousand buckets, not three million). Returns the buckets' starts, with the last one's end
    repeated, and the rates, with the last one repeated (for a step plot)."""
    span = trace[-1].t
    n = max(1, min(most, round(span / target)))
    width = span / n if span > 0 else 1.0
    counts = [0] * n
    for request in trace:
        counts[min(int(request.t / width), n - 1)] += 1
    rates = [c / width for c in counts]
    return [i * width for i in range(n + 1)], [*rates, rates[-1]]


def write_png(runs: Sequence[Run], best: Run | None, trace: Sequence[TraceRequest], path: Path, *, title: str) -> None:
    fig = figure(runs, best, trace, title=title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


#: Steered runs' limits are told apart by line as well as by color: a limit two policies share hid one of them.
LINESTYLES = ("-", "--", "-.", ":")


def figure(runs: Sequence[Run], best: Run | None, trace: Sequence[TraceRequest], *, title: str):
    """Goodput per policy; and, one above the other, the arrival rate and each run's batch limit over time."""
    shown = [*runs, *([best] if best else [])]
    steered = [r for r in shown if r.limits]  # a live replay does not know the engine's limit
    fig = plt.figure(figsize=(15, 6.5), constrained_layout=True)
    grid = fig.add_gridspec(2 if steered else 1, 2, width_ratios=(1, 1.4))
    ax_good = fig.add_subplot(grid[:, 0])
    names = [run.policy + (" (oracle)" if run is best else "") for run in shown]
    ax_good.bar(names, [run.judgement.goodput_rps for run in shown], color="tab:blue")
    ax_good.set(title=f"Goodput per policy: {title}", ylabel="good requests/s")
    ax_good.tick_params(axis="x", rotation=30)
    ax_rate = fig.add_subplot(grid[0, 1])
    starts, rates = arrival_rate(trace)
    ax_rate.step(starts, rates, where="post", color="gray")
    ax_rate.set(title="Arrival rate over time", ylabel="arrivals/s (10 s buckets)", ylim=(0, max(rates) * 1.1 or 1))
    if not steered:
        ax_rate.set_xlabel("seconds")
        return fig
    ax_limit = fig.add_subplot(grid[1, 1], sharex=ax_rate)
    for i, run in enumerate(steered):
        times = [t for t, _ in run.limits] + [run.judgement.seconds]
        limits = [limit for _, limit in run.limits] + [run.limits[-1][1]]
        label = run.policy + (" (oracle)" if run is best else "")
        ax_limit.step(times, limits, where="post", label=label, color=f"C{i % 10}",
                      linestyle=LINESTYLES[i % len(LINESTYLES)], linewidth=2.2 - 1.2 * i / max(1, len(steered) - 1),
                      zorder=len(steered) - i)  # fmt: skip
    ax_limit.set_yscale("log", base=2)  # from 1 to the capacity: every doubling as far apart
    ax_limit.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax_limit.set(title="Batch limit over time", xlabel="seconds", ylabel="batch limit (sequences, log scale)")
    ax_limit.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines, never over them
    adaptive = [run for run in steered if run.policy.startswith(("adaptive", "pid"))]
    if adaptive:
        ax_limit.annotate(f"adaptive starts at {adaptive[0].limits[0][1]}: control.start_limit, or an eighth of the "
                          "capacity (live control starts from the limit in force)", (0.99, 0.02),
                          xycoords="axes fraction", ha="right", fontsize=7, color="dimgray")  # fmt: skip
    return fig
