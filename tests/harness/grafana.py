"""The fake Grafana boundary: what Grafana does between Prometheus and a panel, for what batchlens uses.

Grafana cannot run here. This module stands in for the three things the
dashboards rely on, as Grafana documents them, so the tests can run every
panel's queries against a real Prometheus and check what each panel would get:

- variable interpolation ($vllm_instance, $__rate_interval, ...);
- table-format frames: one row per sample, label columns, the value column named
  "Value" for a single query and "Value #<refId>" for several;
- the transformations merge, organize (rename, exclude) and partitionByValues.

Everything else (rendering, field matchers beyond byName) stays untested here.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
from pathlib import Path

from harness.procs import http_get

Row = dict[str, object]
Frame = list[Row]


def walk_panels(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def query_annotations(dashboard: dict):
    """(name, expr) of each annotation that runs a Prometheus query (its target, as Grafana keeps it)."""
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation.get("target", {}):
            yield annotation["name"], annotation["target"]["expr"]


SCHEMA_CHECK = Path(__file__).resolve().parent / "grafana_schema"


def check_grafana_schema(boards: dict[str, dict], tmp: Path) -> subprocess.CompletedProcess:
    """tests/harness/grafana_schema/check.mjs: each dashboard against @grafana/schema, 11.5 and the newest."""
    if not (SCHEMA_CHECK / "node_modules").is_dir():
        raise AssertionError("Grafana's schema is not installed: run `make grafana-schema` (npm)")
    listing = tmp / "dashboards.json"
    listing.write_text(json.dumps(boards))
    return subprocess.run(
        ["node", str(SCHEMA_CHECK / "check.mjs"), str(listing)], capture_output=True, text=True, timeout=300
    )


def interpolate(expr: str, variables: dict[str, str]) -> str:
    """Replace $name and ${name} the way Grafana does for a regex-formatted multi-value variable."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"query uses ${name}, which the test does not fill: {expr}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def table_frames(results: dict[str, list[dict]], *, instant: bool) -> list[Frame]:
    """refId -> Prometheus result list (matrix or vector) -> one table frame per query."""
    frames = []
    single = len(results) == 1
    for ref, series_list in results.items():
        column = "Value" if single else f"Value #{ref}"
        rows: Frame = []
        for series in series_list:
            labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
            samples = [series["value"]] if instant else series["values"]
            rows += [{"Time": float(t), **labels, column: float(v)} for t, v in samples]
        frames.append(rows)
    return frames


def merge(frames: list[Frame]) -> list[Frame]:
    """Rows with equal values in the fields they share (time and labels) become one row."""
    merged: dict[tuple, Row] = {}
    for frame in frames:
        for row in frame:
            key = tuple(sorted((k, v) for k, v in row.items() if not k.startswith("Value")))
            merged.setdefault(key, {}).update(row)
    return [list(merged.values())]


def organize(frames: list[Frame], options: dict) -> list[Frame]:
    rename, exclude = options.get("renameByName", {}), options.get("excludeByName", {})
    return [[{rename.get(k, k): v for k, v in row.items() if not exclude.get(k)} for row in frame] for frame in frames]


def partition_by_values(frames: list[Frame], options: dict) -> list[Frame]:
    fields = options["fields"]
    parts: dict[tuple, Frame] = {}
    for frame in frames:
        for row in frame:
            key = tuple(row.get(f) for f in fields)
            kept = row if options.get("keepFields") else {k: v for k, v in row.items() if k not in fields}
            parts.setdefault(key, []).append(kept)
    return list(parts.values())


TRANSFORMS = {
    "merge": lambda frames, options: merge(frames),
    "organize": organize,
    "partitionByValues": partition_by_values,
    "sortBy": lambda frames, options: frames,  # order does not change which fields exist
}


def transform(panel: dict, frames: list[Frame]) -> list[Frame]:
    for step in panel.get("transformations", []):
        if step["id"] not in TRANSFORMS:
            raise NotImplementedError(f"panel {panel['title']!r} uses transformation {step['id']!r}, not emulated here")
        frames = TRANSFORMS[step["id"]](frames, step.get("options", {}))
    return frames


def run_query(
    prometheus: str, expr: str, *, instant: bool, end: float, window: float = 60
) -> tuple[list[dict] | None, str]:
    """(result, "") or (None, Prometheus' error)."""
    params = {"query": expr, "time": f"{end}"} if instant else {
        "query": expr, "start": f"{end - window}", "end": f"{end}", "step": "5"}  # fmt: skip
    path = "query" if instant else "query_range"
    status, body = http_get(f"{prometheus}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30)
    reply = json.loads(body)
    if status != 200 or reply.get("status") != "success":
        return None, f"{status} {reply.get('error', body)}"
    return reply["data"]["result"], ""


def panel_results(prometheus: str, panel: dict, variables: dict[str, str]) -> tuple[dict[str, list[dict]], list[str]]:
    results, errors = {}, []
    end = time.time()  # one time range for all of a panel's queries, as Grafana sends it
    for target in panel["targets"]:
        expr = interpolate(target["expr"], variables)
        result, error = run_query(prometheus, expr, instant=target.get("instant", False), end=end)
        if error:
            errors.append(f"{panel['title']} [{target['refId']}]: {error}\n    {expr}")
        else:
            results[target["refId"]] = result
    return results, errors
