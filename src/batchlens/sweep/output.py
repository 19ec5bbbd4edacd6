"""A sweep's results as a table, a CSV and a PNG of the throughput, P99 and utilization curves."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: render to files only

import matplotlib.pyplot as plt

from batchlens.sweep.knee import Knee
from batchlens.sweep.run import StepResult
from batchlens.text_table import text_table

COLUMNS = (
    ("limit", "limit", "{:d}"),
    ("clients", "clients", "{:d}"),
    ("requests", "requests", "{:d}"),
    ("errors", "errors", "{:d}"),
    ("throughput", "tokens/s", "{:.1f}"),
    ("gain", "gain/2x", "{:.2f}"),
    ("ttft_p99", "P99 TTFT s", "{:.3f}"),
    ("itl_p99", "P99 ITL s", "{:.3f}"),
    ("e2e_p99", "P99 E2E s", "{:.3f}"),
    ("kv_usage", "KV usage", "{:.3f}"),
    ("gpu_memory_busy", "mem busy", "{:.3f}"),
    ("gpu_dram_bandwidth", "DRAM bw", "{:.3f}"),
)


def rows(steps: Sequence[StepResult], knee: Knee) -> list[dict]:
    return [
        {key: knee.gains.get(s.limit, math.nan) if key == "gain" else getattr(s, key) for key, _, _ in COLUMNS}
        for s in steps
    ]


def table(steps: Sequence[StepResult], knee: Knee) -> str:
    shown = rows(steps, knee)
    marks = ["  <- knee" if row["limit"] == knee.limit else "" for row in shown]
    verdict = f"knee: batch limit {knee.limit}" if knee.limit is not None else "knee: none"
    return "\n".join([*text_table(COLUMNS, shown, width=10, marks=marks), f"{verdict} ({knee.reason})"])


def write_csv(steps: Sequence[StepResult], knee: Knee, path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow([key for key, _, _ in COLUMNS] + ["knee"])
        for row in rows(steps, knee):
            cells = ["" if isinstance(v, float) and math.isnan(v) else v for v in row.values()]
            writer.writerow([*cells, int(row["limit"] == knee.limit)])


def write_png(steps: Sequence[StepResult], knee: Knee, path: Path, *, slo: float, latency: str, title: str) -> None:
    limits = [s.limit for s in steps]
    fig, (ax_tp, ax_util) = plt.subplots(1, 2, figsize=(14, 5), constrained_layout=True)
    ax_tp.plot(limits, [s.throughput for s in steps], "o-", color="tab:blue", label="throughput")
    ax_tp.set(
        xlabel="batch limit (max_num_active_seqs)", ylabel="output tokens/s", title=f"Throughput and P99: {title}"
    )
    ax_lat = ax_tp.twinx()
    ax_lat.plot(limits, [s.ttft_p99 for s in steps], "s--", color="tab:orange", label="P99 TTFT")
    ax_lat.plot(limits, [s.itl_p99 for s in steps], "d--", color="tab:purple", label="P99 ITL")
    ax_lat.plot(limits, [s.e2e_p99 for s in steps], "^--", color="tab:red", label="P99 E2E")
    ax_lat.axhline(slo, color="gray", linestyle=":", label=f"SLO {slo:g}s ({latency})")
    ax_lat.set(ylabel="P99 latency (s)", yscale="log")
    for ax in (ax_tp, ax_util):
        if knee.limit is not None:
            ax.axvline(knee.limit, color="green", linewidth=2, alpha=0.5, label=f"knee {knee.limit}")
    handles = [h for ax in (ax_tp, ax_lat) for h in ax.get_legend_handles_labels()[0]]
    ax_tp.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)

    ax_util.plot(limits, [s.kv_usage for s in steps], "o-", label="KV cache usage")
    ax_util.plot(limits, [s.gpu_memory_busy for s in steps], "s-", label="GPU memory busy")
    if any(not math.isnan(s.gpu_dram_bandwidth) for s in steps):
        ax_util.plot(limits, [s.gpu_dram_bandwidth for s in steps], "^-", label="GPU DRAM bandwidth")
    ax_util.axhline(0.8, color="tab:purple", linestyle=":", linewidth=1, label="KV 80%")
    ax_util.axhline(0.7, color="tab:brown", linestyle=":", linewidth=1, label="bandwidth 70%")
    ax_util.set(xlabel="batch limit", ylabel="ratio", ylim=(0, 1.05), title="Utilization")
    for ax in (ax_tp, ax_util):
        ax.set_xscale("log", base=2)
        ax.set_xticks(limits, [str(x) for x in limits])
        ax.minorticks_off()
    ax_util.legend(loc="upper left", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
