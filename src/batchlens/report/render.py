"""The report as pictures and a page: one PNG with three charts, one HTML page around it. No I/O but the files.

1. Operating points: throughput against P99, colored by GPU memory busy, the
   breaker's line across. The knee of the batch limit is where points stop
   moving right and start moving up.
2. Batch efficiency decay: tokens/s per running sequence against the running
   batch. It falls as the batch grows; where it falls fastest, the batch is
   paying for itself in latency.
3. KV blocks and GPU memory busy over time, with the 80% and 70% lines.
"""

from __future__ import annotations

import datetime as dt
import html
import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: render to files only

import matplotlib.pyplot as plt

from batchlens.report.data import Report

MARKERS = "osD^vP*X"


def _xy(points, x: str, y: str, *extra: str) -> list[tuple[float, ...]]:
    rows = [(p.get(x), p.get(y), *(p.get(e) for e in extra)) for p in points]
    return [r for r in rows if not any(math.isnan(v) for v in r[:2])]


def figure(report: Report):
    t = report.thresholds
    fig, (ax_op, ax_eff, ax_time) = plt.subplots(1, 3, figsize=(18, 5.5), constrained_layout=True)
    latency = t.p99_latency.upper()

    scatter = None
    for i, (instance, points) in enumerate(report.points.items()):
        rows = _xy(points, "throughput", "p99", "memory_busy")
        if not rows:
            continue
        xs, ys, colors = zip(*rows, strict=True)
        colors = [0.0 if math.isnan(c) else c for c in colors]
        scatter = ax_op.scatter(xs, ys, c=colors, cmap="RdYlGn_r", vmin=0, vmax=1, marker=MARKERS[i % len(MARKERS)],
                                s=28, edgecolors="black", linewidths=0.3, label=instance)  # fmt: skip
    ax_op.axhline(t.p99_seconds, color="red", linestyle="--", linewidth=1, label=f"breaker {t.p99_seconds} s")
    ax_op.set(title=f"Operating points: throughput × P99 {latency}", xlabel="generation throughput (tokens/s)",
              ylabel=f"P99 {latency} (s)")  # fmt: skip
    ax_op.legend(loc="upper left", fontsize=8)
    if scatter is not None:
        fig.colorbar(scatter, ax=ax_op, label="GPU memory busy")

    for i, (instance, points) in enumerate(report.points.items()):
        rows = sorted(_xy(points, "running", "efficiency"))
        if rows:
            xs, ys = zip(*rows, strict=True)
            ax_eff.plot(xs, ys, MARKERS[i % len(MARKERS)], markersize=4, alpha=0.7, label=instance)
    ax_eff.set(
        title="Batch efficiency decay",
        xlabel="running sequences (1 m average)",
        ylabel="tokens/s per running sequence",
    )
    ax_eff.legend(fontsize=8)

    for instance, points in report.points.items():
        times = [dt.datetime.fromtimestamp(p.time, dt.UTC) for p in points]
        ax_time.plot(times, [p.get("kv_usage") for p in points], label=f"{instance} KV blocks used")
        ax_time.plot(times, [p.get("memory_busy") for p in points], label=f"{instance} GPU memory busy")
    ax_time.axhline(t.kv_blocks_ratio, color="orange", linestyle="--", linewidth=1, label=f"KV {t.kv_blocks_ratio:.0%}")
    ax_time.axhline(t.bandwidth_ratio, color="red", linestyle=":", linewidth=1,
                    label=f"bandwidth {t.bandwidth_ratio:.0%}")  # fmt: skip
    ax_time.set(title="KV blocks and GPU memory busy", ylabel="ratio", ylim=(0, 1.05), xlabel="time (UTC)")
    ax_time.tick_params(axis="x", labelrotation=30)
    ax_time.legend(fontsize=7)
    return fig


def _cell(value) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.3g}"
    return html.escape(str(value))


def _actions(report: Report) -> str:
    if not report.actions:
        return "<p>No breaker or controller action over this range.</p>"
    head = "<tr><th>vllm_instance</th><th>by</th><th>what</th><th>count</th></tr>"
    body = "".join(f"<tr><td>{_cell(a.vllm_instance)}</td><td>{_cell(a.by)}</td><td>{_cell(a.what)}</td>"
                   f"<td>{a.count}</td></tr>" for a in report.actions)  # fmt: skip
    return f'<table id="actions">{head}{body}</table>'


def page(report: Report, png_name: str, *, refresh: float | None = None, banner: str = "") -> str:
    """The report's page; ``refresh`` (seconds) makes the browser reload it, ``banner`` says what went wrong."""
    rows = report.per_limit()
    columns = ("vllm_instance", "batch_limit", "samples", "throughput", "p99", "memory_busy", "kv_usage", "efficiency")
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r[c])}</td>" for c in columns) + "</tr>" for r in rows)
    start, end = (
        dt.datetime.fromtimestamp(x, dt.UTC).strftime("%Y-%m-%d %H:%M UTC") for x in (report.start, report.end)
    )
    t = report.thresholds
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>batchlens: batch efficiency trend report</title>
<link rel="icon" href="data:,">
{f'<meta http-equiv="refresh" content="{refresh:g}">' if refresh else ""}
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:100%}}
.banner{{background:#fee;border:1px solid #c00;padding:6px}}</style></head>
<body><h1>Batch efficiency trend report</h1>
{f'<p class="banner">{html.escape(banner)}</p>' if banner else ""}
<p>{start} to {end}. Engines: {html.escape(", ".join(report.points) or "none")}.
Thresholds: P99 {html.escape(t.p99_latency)} {t.p99_seconds} s, KV blocks {t.kv_blocks_ratio:.0%},
GPU memory {t.bandwidth_ratio:.0%}.</p>
<img src="{html.escape(png_name)}" alt="operating points, batch efficiency decay, KV blocks and bandwidth">
<h2>Operating points per batch limit</h2>
<p>Averages over the range while each batch limit was in force. Throughput in tokens/s, P99 in seconds,
efficiency in tokens/s per running sequence.</p>
<table id="operating-points"><tr>{head}</tr>{body}</table>
<h2>What the breaker and the controller did</h2>
<p>Counts over the range: the breaker's actions and their results, the controller's decisions by reason.</p>
{_actions(report)}
</body></html>
"""


def png_bytes(report: Report) -> bytes:
    """The report's three charts as one PNG."""
    fig = figure(report)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def write(report: Report, out: Path) -> tuple[Path, Path]:
    """Write report.png and report.html into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    png, page_path = out / "report.png", out / "report.html"
    png.write_bytes(png_bytes(report))
    page_path.write_text(page(report, png.name))
    return png, page_path
