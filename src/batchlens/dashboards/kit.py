"""What every batchlens dashboard shares: the datasource, the variables, the links, panel makers, the grid.

Queries read the recording rules (``level:metric:operation``) where one
exists, so a panel and an alert always agree on what a number means. Every
query filters on the template variables through :data:`SEL` (or
:data:`GPU_SEL`), so the dashboards work in a Grafana with other data in it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from grafanalib._gen import DashboardEncoder
from grafanalib.core import (
    GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
    Dashboard,
    DashboardLink,
    GridPos,
    Panel,
    Stat,
    Target,
    Template,
    Templating,
    Threshold,
    Time,
    TimeSeries,
)

#: The Grafana these dashboards are written for, and its dashboard schema version.
GRAFANA_VERSION = "11.5"
SCHEMA_VERSION = 40
TAG = "batchlens"
#: Every panel reads the datasource the user picks: the JSON imports into any Grafana.
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
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


def target(expr: str, legend: str = ENGINE, ref: str = "A", *, fmt: str = "time_series", instant: bool = False):
    return Target(expr=expr, legendFormat=legend, refId=ref, format=fmt, instant=instant, datasource=DATASOURCE)


def targets(*pairs: tuple[str, str]) -> list[Target]:
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
    steps = [
        {"id": "merge", "options": {}},
        {"id": "organize", "options": {"renameByName": rename, "excludeByName": dict.fromkeys(drop, True)}},
    ]
    return queries, steps


def line(value: float, color: str = "red") -> list[Threshold]:
    """Threshold steps that draw one line at ``value``."""
    return [Threshold("green", 0, 0.0), Threshold(color, 1, value)]


def timeseries(title: str, *pairs: tuple[str, str], unit: str = "short", threshold: float | None = None,
               description: str = "", **kwargs) -> TimeSeries:  # fmt: skip
    """A time series of (expr, legend) queries; ``threshold`` draws the alert's line."""
    return TimeSeries(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=targets(*pairs),
        unit=unit,
        thresholds=line(threshold) if threshold is not None else [],
        thresholdsStyleMode="dashed" if threshold is not None else "off",
        **kwargs,
    )


def stat(title: str, expr: str, *, unit: str = "none", threshold: float | None = None, description: str = "") -> Stat:
    return Stat(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=[target(expr)],
        format=unit,
        reduceCalc="lastNotNull",
        thresholds=line(threshold) if threshold is not None else [Threshold("blue", 0, 0.0)],
    )


def variables() -> Templating:
    def query(name: str, label: str, expr: str) -> Template:
        return Template(
            name=name,
            label=label,
            query={"query": expr, "refId": name},
            dataSource=DATASOURCE,
            type="query",
            multi=True,
            includeAll=True,
            allValue=".*",
            default="$__all",
            refresh=2,  # on time range change: engines come and go
            sort=1,
        )

    return Templating(
        [
            Template(
                name="datasource", label="Prometheus", query="prometheus", type="datasource", default="Prometheus"
            ),
            # Without a cluster label the list is empty and "All" (.*) matches the missing label.
            query("cluster", "Cluster", "label_values(vllm:num_requests_running, cluster)"),
            query(
                "vllm_instance",
                "vLLM instance",
                'label_values(vllm:num_requests_running{cluster=~"$cluster"}, vllm_instance)',
            ),
            query(
                "model_name",
                "Model",
                f"label_values(vllm:num_requests_running{{{INSTANCE}}}, model_name)",
            ),
            query(
                "gpu",
                "GPU",
                f"label_values(batchlens_gpu_sm_busy_ratio{{{INSTANCE}}}, gpu)",
            ),
        ]
    )


def place(rows: Iterable[tuple[int, Iterable[tuple[Panel, int]]]]) -> list[Panel]:
    """Lay panels out row by row: each row is (height, [(panel, width), ...]); widths of a row sum to 24."""
    placed, y = [], 0
    for height, row in rows:
        x = 0
        for panel, width in row:
            panel.gridPos = GridPos(h=height, w=width, x=x, y=y)
            placed.append(panel)
            x += width
        if x != 24:
            raise ValueError(f"a dashboard row is {x} wide, not 24: {[p.title for p, _ in row]}")
        y += height
    return placed


#: Batch limit changes, whoever made them, and the remediation hook's actions, as annotations.
ACTIONS = [
    {
        "name": "Batch limit changes",
        "datasource": DATASOURCE,
        "enable": True,
        "iconColor": "orange",
        "expr": f"changes(max by (cluster, vllm_instance) (batchlens_batch_limit{{{INSTANCE}}})[2m:15s]) > 0",
        "step": "30s",
        "titleFormat": "Batch limit changed on {{vllm_instance}}",
        "textFormat": "",
        "tagKeys": "vllm_instance",
    },
    {
        "name": "Remediation actions",
        "datasource": DATASOURCE,
        "enable": True,
        "iconColor": "red",
        "expr": "sum by (cluster, vllm_instance, action, result) (increase(batchlens_remediation_actions_total"
        f"{{{INSTANCE}}}[2m])) > 0",
        "step": "30s",
        "titleFormat": "{{action}} on {{vllm_instance}}: {{result}}",
        "textFormat": "",
        "tagKeys": "vllm_instance,action,result",
    },
]


def dashboard(key: str, title: str, description: str, panels: list[Panel], annotations: Iterable[dict] = ()) -> dict:
    """The dashboard's JSON: shared variables, links to its siblings, ids assigned."""
    board = Dashboard(
        title=f"batchlens · {title}",
        uid=UIDS[key],
        description=description,
        tags=[TAG],
        panels=panels,
        templating=variables(),
        links=[
            DashboardLink(
                title="batchlens",
                type="dashboards",
                tags=[TAG],
                asDropdown=False,
                includeVars=True,
                keepTime=True,
            )
        ],
        graphTooltip=GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
        timezone="browser",
        refresh="30s",
        time=Time("now-1h", "now"),
        schemaVersion=SCHEMA_VERSION,
    ).auto_panel_ids()
    data = json.loads(json.dumps(board.to_json_data(), cls=DashboardEncoder))  # plain dicts, all the way down
    data["annotations"]["list"].extend([*ACTIONS, *annotations])
    return grafana_model(data)


# The keys of Grafana's dashboard model (@grafana/schema, the same in 11.5 and 13.2): grafanalib also writes
# keys of Grafana's legacy model (rows, span, height, threshold steps with index and op, ...), which Grafana
# ignores or migrates away. tests/harness/grafana_schema checks the result against both schema releases.
_DASHBOARD = {
    "annotations", "description", "editable", "fiscalYearStartMonth", "gnetId", "graphTooltip", "id", "links",
    "liveNow", "panels", "preload", "refresh", "revision", "schemaVersion", "snapshot", "tags", "templating",
    "time", "timepicker", "timezone", "title", "uid", "version", "weekStart",
    "__inputs", "__requires",  # read by Grafana's import, outside the model
}  # fmt: skip
_PANEL = {
    "cacheTimeout", "datasource", "description", "fieldConfig", "gridPos", "hideTimeOverride", "id", "interval",
    "libraryPanel", "links", "maxDataPoints", "maxPerRow", "options", "pluginVersion", "queryCachingTTL", "repeat",
    "repeatDirection", "targets", "timeFrom", "timeShift", "title", "transformations", "transparent", "type",
}  # fmt: skip
_FIELD_DEFAULTS = {
    "color", "custom", "decimals", "description", "displayName", "displayNameFromDS", "filterable", "links",
    "mappings", "max", "min", "noValue", "path", "thresholds", "unit", "writeable",
}  # fmt: skip
_VARIABLE = {
    "allValue", "allowCustomValue", "current", "datasource", "description", "hide", "includeAll", "label", "multi",
    "name", "options", "query", "refresh", "regex", "skipUrlSync", "sort", "type",
}  # fmt: skip
_OPTION = {"selected", "text", "value"}
_TIMEPICKER = {"hidden", "nowDelay", "refresh_intervals"}
#: An annotation of the model, plus the Prometheus data source's own options, which its annotation editor keeps
#: on the annotation (the query itself is its target).
_ANNOTATION = {"builtIn", "datasource", "enable", "filter", "hide", "iconColor", "name", "target", "type",
               "titleFormat", "textFormat", "tagKeys", "useValueForTime"}  # fmt: skip
#: A Prometheus query (the data source's PromQuery): grafanalib's generic target adds metric, query, step, target.
_PROMETHEUS_QUERY = {"datasource", "expr", "format", "hide", "instant", "interval", "intervalFactor",
                     "legendFormat", "refId", "range", "exemplar"}  # fmt: skip


def _keep(obj: dict, keys: set[str]) -> dict:
    """Only the model's keys, and none whose value is null (the model has no nulls where grafanalib writes them)."""
    return {k: v for k, v in obj.items() if k in keys and v is not None}


def _panel(panel: dict) -> dict:
    out = _keep(panel, _PANEL)
    out["targets"] = [_keep(t, _PROMETHEUS_QUERY) for t in panel.get("targets", [])]
    config = out.get("fieldConfig")
    if config:
        defaults = _keep(config.get("defaults", {}), _FIELD_DEFAULTS)
        if "custom" in defaults:  # the plugin's own field config: its keys are checked, its nulls dropped
            defaults["custom"] = {k: v for k, v in defaults["custom"].items() if v is not None}
        thresholds = defaults.get("thresholds")
        if thresholds:  # the base step's value is null in the model; grafanalib writes the string "null"
            steps = [{"color": t["color"], "value": None if t["value"] == "null" else t["value"]}
                     for t in thresholds.get("steps", [])]  # fmt: skip
            defaults["thresholds"] = {"mode": thresholds["mode"], "steps": steps}
        out["fieldConfig"] = {**config, "defaults": defaults}
    return out


def _variable(variable: dict) -> dict:
    out = _keep(variable, _VARIABLE)
    if "current" in out:
        out["current"] = _keep(out["current"], _OPTION)
    out["options"] = [_keep(o, _OPTION) for o in out.get("options", [])]
    return out


def _annotation(annotation: dict) -> dict:
    out = _keep(annotation, _ANNOTATION)
    if "expr" in annotation:  # the legacy top-level query, as Grafana's Prometheus data source migrates it
        out["target"] = {"refId": "Anno", "expr": annotation["expr"], "interval": annotation.get("step", "")}
    return out


def grafana_model(data: dict) -> dict:
    """grafanalib's dashboard JSON reduced to Grafana's own model: the one place where the two meet."""
    out = _keep(data, _DASHBOARD)
    out["panels"] = [_panel(p) for p in data.get("panels", [])]
    out["templating"] = {"list": [_variable(v) for v in data["templating"]["list"]]}
    out["annotations"] = {"list": [_annotation(a) for a in data["annotations"]["list"]]}
    out["timepicker"] = _keep(data["timepicker"], _TIMEPICKER)
    return out
