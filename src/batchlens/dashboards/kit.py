"""What every batchlens dashboard shares: the datasource, the variables, the links, panel makers, the grid.

The dashboards are built with Grafana's own SDK (``grafana-foundation-sdk``,
generated from Grafana's schema; the release line in pyproject.toml is the
Grafana the dashboards are written for). Queries read the recording rules
(``level:metric:operation``) where one exists, so a panel and an alert always
agree on what a number means. Every query filters on the template variables
through :data:`SEL` (or :data:`GPU_SEL`), so the dashboards work in a Grafana
with other data in it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TypeVar

from grafana_foundation_sdk.builders import common, prometheus, statetimeline, table
from grafana_foundation_sdk.builders import dashboard as grafana
from grafana_foundation_sdk.builders import stat as stat_panel
from grafana_foundation_sdk.builders import timeseries as timeseries_panel
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as options
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

#: The Grafana these dashboards are written for, and its dashboard schema version.
GRAFANA_VERSION = "11.5"
SCHEMA_VERSION = 40
#: The pluginVersion of the XY chart and the heatmaps: a panel without it is taken for an old save and migrated,
#: which for the XY chart rewrites the series mapping and breaks it (11.1 is the oldest that reads its JSON).
PLUGIN_VERSION = f"{GRAFANA_VERSION}.0"
TAG = "batchlens"
#: Every panel reads the datasource the user picks: the JSON imports into any Grafana.
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
#: Where a series comes from; a missing cluster label is matched by "All" (.*), so one cluster needs none.
INSTANCE = 'cluster=~"$cluster", vllm_instance=~"$vllm_instance"'
SEL = INSTANCE + ', model_name=~"$model_name"'
GPU_SEL = INSTANCE + ', gpu=~"$gpu"'
ENGINE = "{{vllm_instance}}"

#: uid -> title: the alerts' dashboard_url points at "batchlens-overview".
UIDS = {
    "overview": "batchlens-overview",
    "kv_cache": "batchlens-kv-cache",
    "gpu": "batchlens-gpu",
    "workload": "batchlens-workload",
    "breaker": "batchlens-breaker",
}

Panel = TypeVar("Panel", bound=cogbuilder.Builder[model.Panel])


# --- Where the SDK falls short: the one place that reaches past its builders ---------------------------------
B = TypeVar("B", bound=cogbuilder.Builder)


def set_model_fields(builder: B, part: str = "", **fields: object) -> B:
    """Set fields of the SDK's model (of its ``part``, where given) that its builders do not offer.

    Set: the dashboard's ``schema_version`` (the model writes 39; Grafana 11.5 saves 40) and a panel's
    ``plugin_version`` (only the generic panel builder sets it, not the XY chart's or the heatmap's).
    Cleared (None: not written): defaults the model writes that @grafana/schema has no key for, in 11.5 or
    in 13.2: the interval variable's ``auto``, ``auto_min``, ``auto_count`` on every variable, the
    time picker's ``time_options`` and the table's ``footer`` option (Grafana's default: no footer).
    """
    built = builder.build()  # the builder's own model object, which it goes on building
    built = getattr(built, part) if part else built
    for name, value in fields.items():
        if not hasattr(built, name):
            raise AttributeError(f"the SDK's {type(built).__name__} has no field {name}")
        setattr(built, name, value)
    return builder


class PrometheusAnnotation(cogbuilder.Builder):
    """An annotation from a Prometheus query, which the SDK's ``AnnotationQuery`` cannot hold.

    The SDK types an annotation's ``target`` as the built-in Grafana annotation's (tags, limit) and has no
    place for the options that the Prometheus data source's annotation editor keeps on the annotation
    (``titleFormat``, ``textFormat``, ``tagKeys``), whose query is its target (``refId``, ``expr``,
    ``interval``). This writes them over the SDK's JSON; the schema check (tests/test_dashboards.py) reads
    the result against @grafana/schema, with these Prometheus options declared beside it.
    """

    def __init__(self, query: grafana.AnnotationQuery, **prometheus_keys: object) -> None:
        self.query, self.keys = query.build(), prometheus_keys

    def build(self) -> PrometheusAnnotation:
        return self

    def to_json(self) -> dict[str, object]:
        return {**self.query.to_json(), **self.keys}


# -----------------------------------------------------------------------------------------------------------


def target(expr: str, legend: str = ENGINE, ref: str = "A", *, fmt: str = "time_series", instant: bool = False):
    query = (
        prometheus.Dataquery()
        .expr(expr)
        .legend_format(legend)
        .ref_id(ref)
        .format(PromQueryFormat(fmt))
        .interval_factor(2)  # with max_data_points(100): the step these panels have always queried at
        .datasource(DATASOURCE)
    )
    return query.instant() if instant else query.range()


def targets(*pairs: tuple[str, str]) -> list[prometheus.Dataquery]:
    """(expr, legend) pairs as targets A, B, C, ..."""
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(pairs)]


def joined(columns: dict[str, str], *, instant: bool = False, drop: tuple[str, ...] = ()) -> tuple[list, list]:
    """Table-format queries, one per named column, merged by Grafana into one row per time and label set.

    Several table queries name their value columns "Value #<refId>"; ``organize`` gives them the names.
    Returns (targets, transformations).
    """
    refs = [chr(ord("A") + i) for i in range(len(columns))]
    exprs = zip(refs, columns.values(), strict=True)
    queries = [target(expr, "", ref, fmt="table", instant=instant) for ref, expr in exprs]
    rename = {f"Value #{ref}": name for ref, name in zip(refs, columns, strict=True)}
    merged = [
        transformation("merge"),
        transformation("organize", renameByName=rename, excludeByName=dict.fromkeys(drop, True)),
    ]
    return queries, merged


def transformation(kind: str, **settings: object) -> model.DataTransformerConfig:
    return model.DataTransformerConfig(id_val=kind, options=settings)


def panel(builder: Panel, title: str, queries: list, description: str = "", transformations: Iterable = ()) -> Panel:
    """What every panel has: its title and description, the datasource variable, its queries."""
    return (
        builder.title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(queries)
        .max_data_points(100)
        .transformations(list(transformations))
    )


def steps(*pairs: tuple[str, float | None]) -> grafana.ThresholdsConfig:
    """Absolute threshold steps (color, from); the first one's value is None: it starts at -Infinity."""
    colors = [model.Threshold(color=color, value=value) for color, value in pairs]
    return grafana.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(colors)


def line(value: float, color: str = "red") -> grafana.ThresholdsConfig:
    """Threshold steps that draw one line at ``value``."""
    return steps(("green", None), (color, value))


def legend() -> common.VizLegendOptions:
    return (
        common.VizLegendOptions()
        .display_mode(options.LegendDisplayMode.LIST)
        .placement(options.LegendPlacement.BOTTOM)
        .show_legend(True)
    )


def tooltip() -> common.VizTooltipOptions:
    return common.VizTooltipOptions().mode(options.TooltipDisplayMode.SINGLE).sort(options.SortOrder.NONE)


def timeseries(title: str, *pairs: tuple[str, str], unit: str = "short", threshold: float | None = None,
               description: str = "", bars: bool = False) -> timeseries_panel.Panel:  # fmt: skip
    """A time series of (expr, legend) queries; ``threshold`` draws the alert's line."""
    style = options.GraphThresholdsStyleMode.DASHED if threshold is not None else options.GraphThresholdsStyleMode.OFF
    return (
        panel(timeseries_panel.Panel(), title, targets(*pairs), description)
        .unit(unit)
        .thresholds(line(threshold) if threshold is not None else steps())
        .thresholds_style(common.GraphThresholdsStyleConfig().mode(style))
        .draw_style(options.GraphDrawStyle.BARS if bars else options.GraphDrawStyle.LINE)
        .color_scheme(grafana.FieldColor().mode(model.FieldColorModeId.PALETTE_CLASSIC))
        .mappings([])
        .axis_label("")
        .axis_placement(options.AxisPlacement.AUTO)
        .bar_alignment(options.BarAlignment.CENTER)
        .fill_opacity(0)
        .gradient_mode(options.GraphGradientMode.NONE)
        .hide_from(common.HideSeriesConfig().legend(False).tooltip(False).viz(False))
        .line_interpolation(options.LineInterpolation.LINEAR)
        .line_width(1)
        .point_size(5)
        .scale_distribution(common.ScaleDistributionConfig().type(options.ScaleDistribution.LINEAR).log(2))
        .show_points(options.VisibilityMode.AUTO)
        .span_nulls(False)
        .legend(legend().calcs([]))
        .tooltip(tooltip())
    )


def stat(title: str, expr: str, *, unit: str = "none", threshold: float | None = None,
         description: str = "") -> stat_panel.Panel:  # fmt: skip
    return (
        panel(stat_panel.Panel(), title, [target(expr)], description)
        .unit(unit)
        .no_value("none")
        .mappings([])
        .thresholds(line(threshold) if threshold is not None else steps(("blue", None)))
        .color_mode(options.BigValueColorMode.VALUE)
        .graph_mode(options.BigValueGraphMode.AREA)
        .justify_mode(options.BigValueJustifyMode.AUTO)
        .orientation(options.VizOrientation.AUTO)
        .text_mode(options.BigValueTextMode.AUTO)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
    )


def grid(title: str, queries: list, description: str, transformations: Iterable) -> table.Panel:
    """A table of the queries' columns, as the transformations leave them."""
    grid = (
        panel(table.Panel(), title, queries, description, transformations)
        .unit("")
        .thresholds(steps())
        .align(options.FieldTextAlignment.AUTO)
        .display_mode(options.TableCellDisplayMode.AUTO)
        .filterable(False)
        .show_header(True)
        .sort_by([])
    )
    return set_model_fields(grid, "options", footer=None)


def state_timeline(title: str, query: prometheus.Dataquery, description: str,
                   mappings: Iterable[model.ValueMap] = ()) -> statetimeline.Panel:  # fmt: skip
    """One row per series, a state per value (merged while it holds); colored by ``mappings`` where given."""
    return (
        panel(statetimeline.Panel(), title, [query], description)
        .color_scheme(grafana.FieldColor().mode(model.FieldColorModeId.THRESHOLDS))
        .fill_opacity(70)
        .line_width(0)
        .mappings(list(mappings))
        .thresholds(steps())
        .align_value(options.TimelineValueAlignment.LEFT)
        .legend(legend())
        .merge_values(True)
        .row_height(0.9)
        .show_value(options.VisibilityMode.AUTO)
        .tooltip(tooltip())
    )


def variables() -> list[grafana.QueryVariable | grafana.DatasourceVariable]:
    every = model.VariableOption(selected=True, text="$__all", value="$__all")

    def query(name: str, label: str, expr: str) -> grafana.QueryVariable:
        return (
            grafana.QueryVariable(name)
            .label(label)
            .query({"query": expr, "refId": name})
            .datasource(DATASOURCE)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(every)
            .options([])
            .hide(model.VariableHide.DONT_HIDE)
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)  # engines come and go
            .sort(model.VariableSort.ALPHABETICAL_ASC)
        )

    prometheus_source = (
        grafana.DatasourceVariable("datasource")
        .label("Prometheus")
        .type("prometheus")
        .current(model.VariableOption(selected=True, text="Prometheus", value="Prometheus"))
        .hide(model.VariableHide.DONT_HIDE)
    )
    every_variable = [
        prometheus_source,
        # Without a cluster label the list is empty and "All" (.*) matches the missing label.
        query("cluster", "Cluster", "label_values(vllm:num_requests_running, cluster)"),
        query(
            "vllm_instance",
            "vLLM instance",
            'label_values(vllm:num_requests_running{cluster=~"$cluster"}, vllm_instance)',
        ),
        query("model_name", "Model", f"label_values(vllm:num_requests_running{{{INSTANCE}}}, model_name)"),
        query("gpu", "GPU", f"label_values(batchlens_gpu_sm_busy_ratio{{{INSTANCE}}}, gpu)"),
    ]
    return [set_model_fields(variable, auto=None, auto_min=None, auto_count=None) for variable in every_variable]


def place(rows: Iterable[tuple[int, Iterable[tuple[Panel, int]]]]) -> list[Panel]:
    """Lay panels out row by row: each row is (height, [(panel, width), ...]); widths of a row sum to 24."""
    placed, y = [], 0
    for height, row in rows:
        x = 0
        for builder, width in row:
            placed.append(builder.grid_pos(model.GridPos(h=height, w=width, x=x, y=y)))
            x += width
        if x != 24:
            raise ValueError(f"a dashboard row is {x} wide, not 24: {[p.build().title for p, _ in row]}")
        y += height
    return placed


def annotation(name: str, color: str, expr: str, title: str, tags: str) -> PrometheusAnnotation:
    """A Prometheus query's results as annotations, every 30 s, tagged with the labels ``tags`` names."""
    query = grafana.AnnotationQuery().name(name).datasource(DATASOURCE).enable(True).icon_color(color)
    prometheus_query = {"refId": "Anno", "expr": expr, "interval": "30s"}
    return PrometheusAnnotation(query, target=prometheus_query, titleFormat=title, textFormat="", tagKeys=tags)


#: Batch limit changes, whoever made them, and the remediation hook's actions, as annotations.
ACTIONS = [
    annotation(
        "Batch limit changes",
        "orange",
        f"changes(max by (cluster, vllm_instance) (batchlens_batch_limit{{{INSTANCE}}})[2m:15s]) > 0",
        "Batch limit changed on {{vllm_instance}}",
        "vllm_instance",
    ),
    annotation(
        "Remediation actions",
        "red",
        "sum by (cluster, vllm_instance, action, result) (increase(batchlens_remediation_actions_total"
        f"{{{INSTANCE}}}[2m])) > 0",
        "{{action}} on {{vllm_instance}}: {{result}}",
        "vllm_instance,action,result",
    ),
]


REFRESH = ["5s", "10s", "30s", "1m", "5m", "15m", "30m", "1h", "2h", "1d"]


def dashboard(key: str, title: str, description: str, panels: list, annotations: Iterable = ()) -> dict:
    """The dashboard's JSON: shared variables, links to its siblings, ids assigned in order."""
    board = (
        grafana.Dashboard(f"batchlens · {title}")
        .uid(UIDS[key])
        .description(description)
        .tags([TAG])
        .variables(variables())
        .annotations([*ACTIONS, *annotations])
        .link(
            grafana.DashboardLink("batchlens")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags([TAG])
            .as_dropdown(False)
            .include_vars(True)
            .keep_time(True)
            .icon("external link")
            .tooltip("")
            .url("")
            .target_blank(False)
        )
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .timezone("browser")
        .refresh("30s")
        .time("now-1h", "now")
        .timepicker(set_model_fields(grafana.TimePicker().hidden(False).refresh_intervals(REFRESH), time_options=None))
        .version(0)
    )
    for number, builder in enumerate(panels, start=1):
        board.with_panel(builder.id(number))
    return json.loads(json.dumps(set_model_fields(board, schema_version=SCHEMA_VERSION).build(), cls=JSONEncoder))
