"""The report as pictures and a page: one PNG with five charts, one HTML page around it. No I/O but the files.

1. Operating points: throughput against P99 (a log axis, so that an overload's
   seconds leave the normal points and the breaker's line readable), colored by
   GPU memory busy. The knee of the batch limit is where points stop moving
   right and start moving up.
2. Batch efficiency decay: tokens/s per running sequence against the running
   batch. It falls as the batch grows; where it falls fastest, the batch is
   paying for itself in latency.
3. KV blocks and GPU memory busy over time, with the 80% and 70% lines.
4. The story of the range: each engine's batch limit and the door's queued-token
   cap over time, with the alerts that fired shaded behind.
5. Requests finished and refused at the door, per second, over time.
"""

from __future__ import annotations

import datetime as dt
import html
import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: render to files only

import matplotlib.dates as mdates
import matplotlib.pyplot as plt

from batchlens.report.data import Report
from batchlens.report.reasons import meaning

MARKERS = "osD^vP*X"
SEVERITY_COLORS = {"critical": "tab:red", "warning": "tab:orange"}


def _xy(points, x: str, y: str, *extra: str) -> list[tuple[float, ...]]:
    rows = [(p.get(x), p.get(y), *(p.get(e) for e in extra)) for p in points]
    return [r for r in rows if not any(math.isnan(v) for v in r[:2])]


def _when(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.UTC)


def _time_axis(ax, report: Report) -> None:
    """The time of day in UTC (the day would crowd the labels), to the second over a range of minutes."""
    short = report.end - report.start < 900
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S" if short else "%H:%M", tz=dt.UTC))
    ax.tick_params(axis="x", labelrotation=30)
    ax.set_xlabel("time (UTC)")


def _headroom(ax) -> None:
    """From 0, with a quarter of room on top: the alerts' names go there."""
    ax.set_ylim(0, max(ax.get_ylim()[1], 1) * 1.25)


def _finite(value: float) -> float:
    """A value to plot: +Inf (the door open) and NaN are gaps."""
    return value if math.isfinite(value) else math.nan


def figure(report: Report):
    fig = plt.figure(figsize=(18, 10.5), constrained_layout=True)
    grid = fig.add_gridspec(2, 3)
    _operating_points(fig, fig.add_subplot(grid[0, 0]), report)
    _efficiency(fig.add_subplot(grid[0, 1]), report)
    _kv_and_memory(fig.add_subplot(grid[0, 2]), report)
    _limits_and_alerts(fig.add_subplot(grid[1, :2]), report)
    _finished_and_refused(fig.add_subplot(grid[1, 2]), report)
    return fig


def _operating_points(fig, ax, report: Report) -> None:
    t = report.thresholds
    latency = t.p99_latency.upper()
    scatter, seen = None, [t.p99_seconds]
    for i, (instance, points) in enumerate(report.points.items()):
        rows = [r for r in _xy(points, "throughput", "p99", "memory_busy") if r[1] > 0]  # a log axis shows no 0
        if not rows:
            continue
        xs, ys, colors = zip(*rows, strict=True)
        seen += ys
        colors = [0.0 if math.isnan(c) else c for c in colors]
        scatter = ax.scatter(xs, ys, c=colors, cmap="RdYlGn_r", vmin=0, vmax=1, marker=MARKERS[i % len(MARKERS)],
                             s=28, edgecolors="black", linewidths=0.3, label=instance)  # fmt: skip
    ax.axhline(t.p99_seconds, color="red", linestyle="--", linewidth=1, label=f"breaker {t.p99_seconds:g} s")
    ax.set_yscale("log")
    ax.set_ylim(min(seen) / 1.5, max(seen) * 1.5)  # the breaker's line always in view
    ax.set(title=f"Operating points: throughput × P99 {latency}", xlabel="generation throughput (tokens/s)",
           ylabel=f"P99 {latency} (s, log)")  # fmt: skip
    ax.legend(loc="upper left", fontsize=8)
    if scatter is not None:
        fig.colorbar(scatter, ax=ax, label="GPU memory busy")


def _efficiency(ax, report: Report) -> None:
    for i, (instance, points) in enumerate(report.points.items()):
        rows = sorted(_xy(points, "running", "efficiency"))
        if rows:
            xs, ys = zip(*rows, strict=True)
            ax.plot(xs, ys, MARKERS[i % len(MARKERS)], markersize=4, alpha=0.7, label=instance)
    ax.set(title="Batch efficiency decay", xlabel="running sequences (1 m average)",
           ylabel="tokens/s per running sequence")  # fmt: skip
    ax.legend(fontsize=8)


def _kv_and_memory(ax, report: Report) -> None:
    t = report.thresholds
    for instance, points in report.points.items():
        times = [_when(p.time) for p in points]
        ax.plot(times, [p.get("kv_usage") for p in points], label=f"{instance} KV blocks used")
        ax.plot(times, [p.get("memory_busy") for p in points], label=f"{instance} GPU memory busy")
    ax.axhline(t.kv_blocks_ratio, color="orange", linestyle="--", linewidth=1, label=f"KV {t.kv_blocks_ratio:.0%}")
    ax.axhline(t.bandwidth_ratio, color="red", linestyle=":", linewidth=1, label=f"bandwidth {t.bandwidth_ratio:.0%}")
    ax.set(title="KV blocks and GPU memory busy", ylabel="ratio", ylim=(0, 1.05))
    _time_axis(ax, report)
    ax.legend(fontsize=7)


def _limits_and_alerts(ax, report: Report) -> None:
    """Each engine's batch limit (steps) and the door's cap (dashed, its own axis), over the alerts that fired."""
    caps = ax.twinx()
    drawn_cap = False
    for i, (instance, points) in enumerate(report.points.items()):
        times = [_when(p.time) for p in points]
        color = f"C{i % 10}"
        ax.step(times, [p.get("batch_limit") for p in points], where="post", color=color, linewidth=2,
                label=f"{instance} batch limit")  # fmt: skip
        cap = [_finite(p.get("admission_cap")) for p in points]
        if any(not math.isnan(c) for c in cap):
            drawn_cap = True
            caps.step(times, cap, where="post", color=color, linestyle="--", linewidth=1.2,
                      label=f"{instance} door's cap")  # fmt: skip
    for n, firing in enumerate(report.alerts):
        end = firing.end if firing.end is not None else report.end
        color = SEVERITY_COLORS.get(firing.severity, "tab:gray")
        ax.axvspan(_when(firing.start), _when(end), color=color, alpha=0.12, linewidth=0)
        ax.annotate(f"{firing.alertname} {firing.vllm_instance}", (_when(firing.start), 1 - 0.07 * (n % 5)),
                    xycoords=("data", "axes fraction"), fontsize=7, color=color, va="top")  # fmt: skip
    ax.set(title="Batch limit and the door's cap over time; alerts that fired, shaded",
           ylabel="batch limit (sequences)")  # fmt: skip
    _time_axis(ax, report)
    _headroom(ax)
    caps.set_ylabel("door's queued-token cap (tokens)" if drawn_cap else "no door's cap in force over the range")
    _headroom(caps)
    if not drawn_cap:
        caps.set_yticks([])
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = caps.get_legend_handles_labels()
    ax.legend(handles + more, labels + more_labels, loc="lower left", fontsize=7)


def _finished_and_refused(ax, report: Report) -> None:
    for i, (instance, points) in enumerate(report.points.items()):
        times = [_when(p.time) for p in points]
        color = f"C{i % 10}"
        ax.plot(times, [p.get("finished") for p in points], color=color, label=f"{instance} finished")
        ax.plot(times, [p.get("refused") for p in points], color=color, linestyle="--",
                label=f"{instance} refused at the door")  # fmt: skip
    ax.set(title="Requests finished and refused at the door", ylabel="requests/s (1 m rate)")
    _time_axis(ax, report)
    _headroom(ax)
    ax.legend(fontsize=7)


def _cell(value) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.3g}"
    return html.escape(str(value))


def _actions(report: Report) -> str:
    if not report.actions:
        return "<p>No breaker or controller action over this range.</p>"
    head = "<tr><th>vllm_instance</th><th>by</th><th>what</th><th>count</th><th>what it means</th></tr>"
    body = "".join(f"<tr><td>{_cell(a.vllm_instance)}</td><td>{_cell(a.by)}</td><td>{_cell(a.what)}</td>"
                   f'<td>{a.count}</td><td class="meaning">{_cell(meaning(a.by, a.what) or "see docs/control.md")}'
                   "</td></tr>" for a in report.actions)  # fmt: skip
    return f'<table id="actions">{head}{body}</table>'


def _alerts(report: Report) -> str:
    if not report.alerts:
        return "<p>No alert fired over this range.</p>"
    head = "<tr><th>alert</th><th>vllm_instance</th><th>severity</th><th>from</th><th>to</th><th>minutes</th></tr>"
    rows = []
    for f in report.alerts:
        end = report.end if f.end is None else f.end
        to = "still firing" if f.end is None else _when(f.end).strftime("%H:%M:%S")
        rows.append(f"<tr><td>{_cell(f.alertname)}</td><td>{_cell(f.vllm_instance)}</td><td>{_cell(f.severity)}</td>"
                    f"<td>{_when(f.start).strftime('%H:%M:%S')}</td><td>{to}</td>"
                    f"<td>{(end - f.start) / 60:.1f}</td></tr>")  # fmt: skip
    return f'<table id="alerts">{head}{"".join(rows)}</table>'


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
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td.meaning{{text-align:left}}img{{max-width:100%}}
.banner{{background:#fee;border:1px solid #c00;padding:6px}}</style></head>
<body><h1>Batch efficiency trend report</h1>
{f'<p class="banner">{html.escape(banner)}</p>' if banner else ""}
<p>{start} to {end}. Engines: {html.escape(", ".join(report.points) or "none")}.
Thresholds: P99 {html.escape(t.p99_latency)} {t.p99_seconds} s, KV blocks {t.kv_blocks_ratio:.0%},
GPU memory {t.bandwidth_ratio:.0%}.</p>
<img src="{html.escape(png_name)}" alt="operating points, batch efficiency decay, KV blocks and bandwidth, the batch
limit and the door's cap with the alerts that fired, requests finished and refused">
<h2>Alerts that fired</h2>
<p>From Prometheus' own <code>ALERTS</code>: each run of firing over the range, in UTC. Runbooks:
docs/runbooks/&lt;alert&gt;.md.</p>
{_alerts(report)}
<h2>Operating points per batch limit</h2>
<p>Averages over the range while each batch limit was in force. Throughput in tokens/s, P99 in seconds,
efficiency in tokens/s per running sequence.</p>
<table id="operating-points"><tr>{head}</tr>{body}</table>
<h2>What the breaker and the controller did</h2>
<p>Counts over the range: the breaker's actions and their results, the controller's decisions by reason, each
with what it means (docs/remediation.md, docs/control.md).</p>
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
