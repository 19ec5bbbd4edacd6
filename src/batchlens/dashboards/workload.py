"""Workload profile: what the clients send. The same batch limit suits one workload and ruins another."""

from __future__ import annotations

from grafana_foundation_sdk.builders import heatmap as heatmap_panel
from grafana_foundation_sdk.models.common import AxisPlacement, HeatmapCellLayout, TooltipDisplayMode
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode, HeatmapColorScale

from batchlens.config import Thresholds
from batchlens.dashboards.kit import (
    PLUGIN_VERSION,
    SEL,
    dashboard,
    panel,
    place,
    set_model_fields,
    steps,
    target,
    timeseries,
)
from batchlens.rules.recording import ARRIVALS, CURRENT_REPLICAS, DESIRED_REPLICAS, LATENCIES, LEVEL


def heatmap(title: str, metrics: tuple[str, ...], unit: str, description: str = "") -> heatmap_panel.Panel:
    """Buckets of a vLLM histogram over time (pre-bucketed: format heatmap); a renamed one is read under both names."""
    expr = " or ".join(f"sum by (le) (increase({m}_bucket{{{SEL}}}[$__rate_interval]))" for m in metrics)
    colors = (
        heatmap_panel.HeatmapColorOptions()
        .mode(HeatmapColorMode.SCHEME)
        .scheme("Oranges")
        .scale(HeatmapColorScale.EXPONENTIAL)
        .exponent(0.5)
        .steps(64)  # Grafana's default (2 to 128): the SDK's model writes 0, which leaves the scheme no colors
        .fill("dark-orange")  # Grafana's default, for the opacity mode; the SDK's model writes ""
    )
    query = target(expr, "{{le}}", fmt="heatmap")
    return (
        set_model_fields(panel(heatmap_panel.Panel(), title, [query], description), plugin_version=PLUGIN_VERSION)
        .thresholds(steps())
        .calculate(False)
        .y_axis(heatmap_panel.YAxisConfig().unit(unit).axis_placement(AxisPlacement.LEFT))
        .rows_frame(heatmap_panel.RowsHeatmapOptions().layout(HeatmapCellLayout.LE))
        .color(colors)
        .cell_gap(1)
        .mode(TooltipDisplayMode.SINGLE)
        .show_y_histogram()
        .show_legend()
        .exemplars_color("rgba(255,0,255,0.7)")
    )


ROUTED = 'cluster=~"$cluster"'  # the routing plugin's series are per proxy: no engine to select


def routing_row(thresholds: Thresholds) -> tuple[int, list]:
    """The router's view (docs/routing.md): what each class waits for, where it went, and how often it fell back."""
    ttft = thresholds.p99_seconds if thresholds.p99_latency == "ttft" else None
    return (
        8,
        [
            (timeseries("Routing: P99 TTFT per class, at the proxy",
                        (f"wanted:batchlens_routing_time_to_first_token_seconds:p99_1m{{{ROUTED}}}", "{{wanted}}"),
                        unit="s", threshold=ttft,
                        description="Time to first token as clients see it through the LiteLLM proxy, by the role "
                        "each request wanted. The interactive class should stay far under the others; a long "
                        "prompt's TTFT is its prefill."), 8),
            (timeseries("Routing: decisions (wanted → got)",
                        (f"wanted_role:batchlens_routing_decisions:rate1m{{{ROUTED}}}", "{{wanted}} → {{role}}"),
                        unit="reqps", description="Requests per second by the role they wanted and the engines' role "
                        "they were sent to. A class landing on another role's engines is a fallback."), 8),
            (timeseries("Routing: fallback share per class",
                        (f"wanted:batchlens_routing_fallback:ratio5m{{{ROUTED}}}", "{{wanted}}"),
                        (f'max(batchlens_source_up{{source="litellm", {ROUTED}}})', "proxy up"),
                        unit="percentunit", description="The share of each class sent elsewhere because its "
                        "engines were down or saturated, and whether the proxy answers the exporter."), 8),
        ],
    )  # fmt: skip


def scaling_row(thresholds: Thresholds) -> tuple[int, list]:
    """The scaling signal (docs/scaling.md): the replicas the arrivals need against those serving, and why."""
    deployment = f'{SEL}, vllm_instance!=""'  # the per-role series have no vllm_instance, which ".*" would match
    roles = 'cluster=~"$cluster", role!=""'
    capacity = f"{LEVEL}:batchlens_replica_capacity:max1h"
    return (
        8,
        [
            (timeseries("Replicas: desired against current",
                        (f"{DESIRED_REPLICAS}{{{deployment}}}", "{{vllm_instance}} desired"),
                        (f"{CURRENT_REPLICAS}{{{deployment}}}", "{{vllm_instance}} current"),
                        (f"{DESIRED_REPLICAS}{{{roles}}}", "role {{role}} desired"),
                        (f"{CURRENT_REPLICAS}{{{roles}}}", "role {{role}} current"),
                        description="batchlens:desired_replicas, what an autoscaler reads: the arrivals with "
                        f"{thresholds.scale_headroom:.0%} headroom over what a replica served at saturation, up "
                        f"after {thresholds.scale_up_window} of wanting more, down after "
                        f"{thresholds.scale_down_window} of wanting less; against the servers serving. Desired above "
                        "current for 15 minutes: BatchlensReplicasShort."), 12),
            (timeseries("Scaling: arrivals against capacity",
                        (f"{ARRIVALS}{{{SEL}}}", "{{vllm_instance}} arrivals"),
                        (f"{capacity}{{{SEL}}} * on (cluster, namespace, vllm_instance, model_name) "
                         f'{CURRENT_REPLICAS}{{vllm_instance!=""}}', "{{vllm_instance}} capacity of its replicas"),
                        unit="reqps", description="Requests arriving per second, admitted plus shed (finished, "
                        "refused at the door, and the growth of what the engines hold), against what the replicas "
                        "serving can serve: one replica's capacity, measured at saturation, times their number. "
                        "No capacity line until the deployment has been saturated once."), 12),
        ],
    )  # fmt: skip


def workload(thresholds: Thresholds) -> dict:
    panels = place(
        [
            (
                8,
                [
                    (timeseries("Request rate", (f"{LEVEL}:vllm_request_success:rate1m{{{SEL}}}", "{{vllm_instance}}"),
                                unit="reqps", description="Finished requests per second."), 8),
                    (timeseries("Burstiness (coefficient of variation)",
                                (f"{LEVEL}:vllm_request_success:cv5m{{{SEL}}}", "{{vllm_instance}}"),
                                description="Standard deviation over mean of the request rate in 30 s slices, over "
                                "5 minutes. Near 0: steady. Above 1: bursts that a fixed batch limit handles badly."),
                     8),
                    (timeseries("Finish reasons",
                                (f"sum by (finished_reason) (rate(vllm:request_success_total{{{SEL}}}"
                                 "[$__rate_interval]))", "{{finished_reason}}"), unit="reqps"), 8),
                ],
            ),
            (
                8,
                [
                    (heatmap("Prompt length", ("vllm:request_prompt_tokens",), "short",
                             "vLLM's buckets nearest the article's 256/512/1024/2048 are 200/500/1000/2000."), 12),
                    (heatmap("Generation length", ("vllm:request_generation_tokens",), "short"), 12),
                ],
            ),
            (
                8,
                [
                    (heatmap("Time to first token", LATENCIES["ttft"], "s"), 8),
                    (heatmap("Inter-token latency", LATENCIES["itl"], "s"), 8),
                    (heatmap("End-to-end latency", LATENCIES["e2e"], "s"), 8),
                ],
            ),
            routing_row(thresholds),
            scaling_row(thresholds),
        ]
    )  # fmt: skip
    return dashboard(
        "workload",
        "Workload profile",
        "Request rate, burstiness, prompt and output lengths, finish reasons, latency distributions, how the "
        "router splits the traffic, and the replicas it needs.",
        panels,
    )
