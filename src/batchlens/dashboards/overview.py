"""The overview: throughput against P99 against GPU utilization, the article's three-dimensional view.

Its centre is an XY chart with one point per instant: x is generation
throughput, y the P99 latency the breaker watches, color the GPU memory busy
ratio and size the SM busy ratio. As the batch limit rises the points walk
right (throughput), then up (latency) and red (memory), and the knee is where
to stop. The three measures come as table-format queries; Grafana merges them
into rows on (Time, vllm_instance, model_name), renames the value columns and
partitions the rows by vllm_instance, one series per engine.

Under the P99, each engine's GPU health (lost GPUs, Xids, clocks held down, rows to remap): a breach whose
cause is a failing GPU shows its cause on the same screen.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import table, xychart
from grafana_foundation_sdk.builders import timeseries as timeseries_panel
from grafana_foundation_sdk.builders.dashboard import FieldColor
from grafana_foundation_sdk.models.common import AxisPlacement
from grafana_foundation_sdk.models.dashboard import DynamicConfigValue, FieldColorModeId
from grafana_foundation_sdk.models.xychart import PointShape, SeriesMapping, XYShowMode

from batchlens.config import Thresholds
from batchlens.dashboards.kit import (
    INSTANCE,
    PLUGIN_VERSION,
    SEL,
    dashboard,
    grid,
    joined,
    legend,
    panel,
    place,
    set_model_fields,
    stat,
    steps,
    timeseries,
    tooltip,
    transformation,
)
from batchlens.gpu_faults import GPU_FAULT_ALERTS as GPU_ALERTS
from batchlens.gpu_faults import THROTTLE_REASONS
from batchlens.rules.recording import LATENCIES, LEVEL, operating_point_measures

THROUGHPUT, P99, MEMORY_BUSY, SM_BUSY = "Throughput", "P99", "Memory busy", "SM busy"
BY = "cluster, vllm_instance, model_name"


def xy_series(x: str, y: str, color: str, size: str) -> xychart.XYSeriesConfig:
    """One series mapping: each dimension reads the field of that name."""

    def field(dimension, name: str):
        return dimension().matcher(xychart.MatcherConfig().id("byName").options(name))

    return (
        xychart.XYSeriesConfig()
        .x(field(xychart.XychartXYSeriesConfigX, x))
        .y(field(xychart.XychartXYSeriesConfigY, y))
        .color(field(xychart.XychartXYSeriesConfigColor, color))
        .size(field(xychart.XychartXYSeriesConfigSize, size))
    )


def operating_points_panel(thresholds: Thresholds) -> xychart.Panel:
    throughput, p99, memory = operating_point_measures(thresholds)
    sm = "vllm_instance_model_name_gpu:batchlens_gpu_sm_busy:ratio"
    columns = {THROUGHPUT: throughput, P99: p99, MEMORY_BUSY: memory, SM_BUSY: sm}
    per_engine = {name: f"max by ({BY}) ({rule}{{{SEL}}})" for name, rule in columns.items()}
    queries, merged = joined(per_engine, drop=("cluster", "model_name"))
    latency = thresholds.p99_latency.upper()
    description = (
        f"One point per instant and engine. Right is more throughput, up is slower P99 {latency} (the breaker "
        f"fires above {thresholds.p99_seconds} s), red is a busier GPU memory and a bigger point a busier SM. "
        "Past the knee a higher batch limit buys latency, not throughput."
    )
    partition = transformation("partitionByValues", fields=["vllm_instance"])
    chart = panel(xychart.Panel(), f"Operating points: throughput × P99 {latency} × utilization", queries,
                  description, [*merged, partition])  # fmt: skip
    for name, unit in ((THROUGHPUT, "short"), (P99, "s"), (MEMORY_BUSY, "percentunit")):
        chart.override_by_name(name, [DynamicConfigValue(id_val="unit", value=unit)])
    return (
        set_model_fields(chart, plugin_version=PLUGIN_VERSION)
        .mapping(SeriesMapping.AUTO)  # the one mapping applies to every frame: one series per engine
        .series([xy_series(x=THROUGHPUT, y=P99, color=MEMORY_BUSY, size=SM_BUSY)])
        .legend(legend())
        .tooltip(tooltip())
        .color_scheme(FieldColor().mode(FieldColorModeId.CONTINUOUS_GR_YL_RD))
        .show(XYShowMode.POINTS)
        .point_shape(PointShape.CIRCLE)
        .point_size(xychart.XychartFieldConfigPointSize().fixed(4).min(4).max(16))
        .fill_opacity(60)
        .axis_placement(AxisPlacement.AUTO)
        .min(0)
        .thresholds(steps())
    )


def operating_point_table(thresholds: Thresholds) -> table.Panel:
    names = ("Throughput (tokens/s)", f"P99 {thresholds.p99_latency.upper()} (s)", "Memory busy")
    measures = [m.replace(f"{LEVEL}:", f"{LEVEL}_batch_limit:") for m in operating_point_measures(thresholds)]
    queries, merged = joined(
        {name: f"avg_over_time({m}{{{SEL}}}[$__range])" for name, m in zip(names, measures, strict=True)},
        instant=True,
        drop=("Time",),
    )
    return grid(
        "Operating points per batch limit (averaged over the time range)",
        queries,
        "Each row is a batch limit the engine ran at in the range, and what it gave on average.",
        [*merged, transformation("sortBy", sort=[{"field": "batch_limit"}])],
    )


def gpu_health() -> list[tuple[timeseries_panel.Panel, int]]:
    """The GPUs' health per engine, under its P99: a breach with a failing GPU is the GPU's (runbooks BatchlensGpu*)."""
    return [
        (timeseries("GPU alerts", (f"count by (cluster, vllm_instance, alertname) (ALERTS{{alertname=~"
                                   f'"{"|".join(GPU_ALERTS)}", alertstate="firing", {INSTANCE}}})',
                                   "{{vllm_instance}} {{alertname}}"),
                    description="The alerts of a failing GPU, firing, per engine: while one fires, the hook does not "
                                "halve the batch for a P99 breach and the controller holds the limit."), 6),
        (timeseries("GPUs lost", (f'1 - batchlens_source_up{{source="nvml", gpu!="", {INSTANCE}}} == 1',
                                  "{{vllm_instance}} GPU {{gpu}}"),
                    description="1 while NVML answers GpuIsLost for the GPU; named with the engine it served."), 6),
        (timeseries("Xids in the last hour", (f"sum by (cluster, vllm_instance, gpu, xid) "
                                              f"(increase(batchlens_gpu_xid_errors_total{{{INSTANCE}}}[1h]))",
                                              "{{vllm_instance}} GPU {{gpu}} Xid {{xid}}"),
                    description="The driver's Xid errors by code (the known ones by number, the rest as other)."), 6),
        (timeseries("Clocks held down, rows to remap",
                    (f'batchlens_gpu_clock_event_active{{reason=~"{THROTTLE_REASONS}", {INSTANCE}}} == 1',
                     "{{vllm_instance}} GPU {{gpu}} {{reason}}"),
                    *((f"batchlens_gpu_row_remapping_{state}{{{INSTANCE}}} == 1",
                       f"{{{{vllm_instance}}}} GPU {{{{gpu}}}} remap {state}") for state in ("pending", "failed")),
                    description="A GPU slowing itself down (heat, power, a hardware signal), and memory rows waiting "
                                "for a reset to be remapped or out of spares."), 6),
    ]  # fmt: skip


#: Their titles: empty wherever no GPU fails (the demo, the live tests; test_gpu_failures_e2e.py fills them).
GPU_HEALTH_PANELS = tuple(panel.build().title for panel, _ in gpu_health())


def overview(thresholds: Thresholds) -> dict:
    throughput, p99, memory = operating_point_measures(thresholds)
    latency = LATENCIES[thresholds.p99_latency][0].removeprefix("vllm:")
    panels = place(
        [
            (
                4,
                [
                    (stat("Batch limit", f"max by ({BY}) (batchlens_batch_limit{{{SEL}}})",
                          description="The admission limit in force (max_num_active_seqs)."), 6),
                    (stat("KV blocks used", f"max(vllm_instance_model_name_engine:vllm_kv_cache_usage:ratio{{{SEL}}})",
                          unit="percentunit", threshold=thresholds.kv_blocks_ratio), 6),
                    (stat("GPU memory busy", f"max(vllm_instance_model_name_gpu:batchlens_gpu_memory_bandwidth:ratio"
                          f"{{{SEL}}})", unit="percentunit", threshold=thresholds.bandwidth_ratio), 6),
                    (stat(f"P99 {thresholds.p99_latency.upper()}", f"max({p99}{{{SEL}}})", unit="s",
                          threshold=thresholds.p99_seconds), 6),
                ],
            ),
            (12, [(operating_points_panel(thresholds), 24)]),
            (
                8,
                [
                    (timeseries("Generation throughput", (f"{throughput}{{{SEL}}}", "{{vllm_instance}}"),
                                unit="short", description="Output tokens per second."), 8),
                    (timeseries(f"P99 {thresholds.p99_latency.upper()} ({latency})",
                                (f"{p99}{{{SEL}}}", "{{vllm_instance}}"), unit="s",
                                threshold=thresholds.p99_seconds), 8),
                    (timeseries("GPU memory busy and SM busy",
                                (f"{memory}{{{SEL}}}", "{{vllm_instance}} memory"),
                                (f"max by ({BY}) (vllm_instance_model_name_gpu:batchlens_gpu_sm_busy:ratio"
                                 f"{{{SEL}}})", "{{vllm_instance}} SM"),
                                unit="percentunit", threshold=thresholds.bandwidth_ratio), 8),
                ],
            ),
            (8, gpu_health()),
            (8, [(operating_point_table(thresholds), 24)]),
        ]
    )  # fmt: skip
    return dashboard(
        "overview",
        "Throughput · P99 · Utilization",
        "Is the batch limit right? Throughput, P99 latency and GPU utilization side by side, per vLLM engine.",
        panels,
    )
