"""The dashboards' structure and the report's rendering. Pure: no servers (the live queries are in
test_dashboards_live.py). Grafana cannot run here; these check the JSON Grafana 11.5 would load."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from batchlens.config import Thresholds, load_config
from batchlens.control.admission import CAP_REASONS
from batchlens.control.law import REASONS as LAW_REASONS
from batchlens.control.steering import LIVE_REASONS
from batchlens.dashboards import dashboards
from batchlens.dashboards.kit import SCHEMA_VERSION, UIDS
from batchlens.prometheus_api import parse_matrix
from batchlens.remediation.breaker import ACTIONS as BREAKER_ACTIONS
from batchlens.report.data import Action, Firing, Point, Report, align
from batchlens.report.reasons import BREAKER, CONTROLLER
from batchlens.report.render import write
from harness.exporter import BATCHLENS
from harness.grafana import check_grafana_schema, query_annotations, walk_panels
from harness.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
BOARDS = {path.name: json.loads(path.read_text()) for path in sorted((ROOT / "dashboards").glob("*.json"))}
VARIABLES = {"datasource", "cluster", "vllm_instance", "model_name", "gpu"}


def version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:2])


def test_every_generated_dashboard_is_committed_and_valid_json() -> None:
    assert set(BOARDS) == set(dashboards(Thresholds())) and len(BOARDS) == 5


def test_uids_are_unique_and_stable() -> None:
    uids = [board["uid"] for board in BOARDS.values()]
    assert sorted(uids) == sorted(UIDS.values()) and len(set(uids)) == len(uids)
    assert BOARDS["batchlens-overview.json"]["uid"] == "batchlens-overview"  # the alerts link to it


def test_every_dashboard_is_in_grafanas_own_schema_old_and_new(tmp_path) -> None:
    """@grafana/schema 11.5 (the oldest Grafana the README promises) and 13.2, with no unknown key anywhere."""
    done = check_grafana_schema(BOARDS, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("grafana-schema-11.5, grafana-schema-13.2: 0 problems"), done.stdout


def test_the_schema_check_names_the_dashboard_panel_and_key_it_does_not_know(tmp_path) -> None:
    boards = json.loads(json.dumps(BOARDS))
    overview, gpu = boards["batchlens-overview.json"], boards["batchlens-gpu.json"]
    stat = next(p for p in overview["panels"] if p["type"] == "stat")
    stat["options"]["reduceOptionz"] = stat["options"].pop("reduceOptions")  # a misspelt option
    series = next(p for p in gpu["panels"] if p["type"] == "timeseries")
    series["fieldConfig"]["defaults"]["custom"]["lineWidht"] = 2
    series["span"] = 6  # the legacy grid (Grafana before 5)
    gpu["templating"]["list"][0]["useTags"] = False
    gpu["annotations"]["list"][-1]["expr"] = "up"  # the legacy place of a Prometheus annotation's query
    done = check_grafana_schema(boards, tmp_path)
    assert done.returncode == 1, done.stdout
    annotation = gpu["annotations"]["list"][-1]["name"]
    for release in ("grafana-schema-11.5", "grafana-schema-13.2"):
        for where in (f'batchlens-overview.json: panel "{stat["title"]}" (stat) options: key reduceOptionz',
                      f'batchlens-gpu.json: panel "{series["title"]}" (timeseries) fieldConfig.defaults.custom: '
                      "key lineWidht", f'batchlens-gpu.json: panel "{series["title"]}" (timeseries): key span',
                      'batchlens-gpu.json: variable "datasource": key useTags',
                      f'batchlens-gpu.json: annotation "{annotation}": key expr'):  # fmt: skip
            assert f"{release}: {where}: " in done.stdout, (where, done.stdout)
    assert done.stdout.strip().endswith(": 10 problems"), done.stdout


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panels_have_unique_ids_a_datasource_and_queries(name: str) -> None:
    board = BOARDS[name]
    assert board["schemaVersion"] == SCHEMA_VERSION
    panels = list(walk_panels(board))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and None not in ids, ids
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_every_raw_vllm_series_a_panel_reads_exists_on_every_release(release_capture: Path) -> None:
    """Panels read recording rules (covered per release in test_rules_e2e) and a few raw vLLM series: each
    query must name at least one series the release exposes (a renamed one is read under both names)."""
    exposed = set(re.findall(r"^(vllm:[a-z_0-9]+)", release_capture.read_text(), re.M))
    for name, board in BOARDS.items():
        for panel in walk_panels(board):
            for target in panel.get("targets", []):
                read = set(re.findall(r"vllm:[a-z_0-9]+", target["expr"]))
                assert not read or read & exposed, (name, panel["title"], sorted(read))


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panels_tile_the_grid_without_overlap(name: str) -> None:
    cells = set()
    for panel in walk_panels(BOARDS[name]):
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_variables_and_links_are_shared(name: str) -> None:
    board = BOARDS[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == VARIABLES
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["vllm_instance"]["multi"] and variables["vllm_instance"]["includeAll"]
    assert [link["tags"] for link in board["links"]] == [["batchlens"]] and "batchlens" in board["tags"]
    used = {m for p in walk_panels(board) for t in p["targets"] for m in re.findall(r"\$\{?(\w+)", t["expr"])}
    assert used - {"__rate_interval", "__range", "__interval"} <= VARIABLES, used


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_query_keeps_the_cluster_apart(name: str) -> None:
    """Several clusters in one Prometheus (Thanos, Mimir): no query mixes them, and none needs the label."""
    board = BOARDS[name]
    cluster = {v["name"]: v for v in board["templating"]["list"]}["cluster"]
    assert cluster["includeAll"] and cluster["allValue"] == ".*"  # matches a series without the label
    exprs = [t["expr"] for p in walk_panels(board) for t in p["targets"]]
    exprs += [expr for _, expr in query_annotations(board)]
    for expr in exprs:
        if "$vllm_instance" in expr:
            assert 'cluster=~"$cluster"' in expr, expr
        for labels in re.findall(r"\bby \(([^)]*)\)", expr):
            if "vllm_instance" in labels:
                assert "cluster" in labels.split(", "), expr


def test_the_alerts_dashboard_urls_open_a_dashboard_with_those_variables() -> None:
    alerts = yaml.safe_load((ROOT / "alerts" / "batchlens.alerts.yml").read_text())["groups"][0]["rules"]
    by_uid = {board["uid"]: board for board in BOARDS.values()}
    for alert in alerts:
        url = urlparse(alert["annotations"]["dashboard_url"])
        uid = url.path.split("/")[2]
        assert uid in by_uid, alert["alert"]
        names = {v["name"] for v in by_uid[uid]["templating"]["list"]}
        assert {k.removeprefix("var-") for k in parse_qs(url.query)} <= names, alert["alert"]


def test_the_xy_chart_maps_fields_its_transformations_produce() -> None:
    [xy] = [p for p in walk_panels(BOARDS["batchlens-overview.json"]) if p["type"] == "xychart"]
    assert version(xy["pluginVersion"]) >= (11, 1)
    assert xy["options"]["mapping"] == "auto"
    [series] = xy["options"]["series"]
    wanted = {dim: series[dim]["matcher"]["options"] for dim in ("x", "y", "color", "size")}
    assert all(series[dim]["matcher"]["id"] == "byName" for dim in wanted)
    steps = {s["id"]: s.get("options", {}) for s in xy["transformations"]}
    assert list(steps) == ["merge", "organize", "partitionByValues"]
    renamed = steps["organize"]["renameByName"]
    # Several table queries: Grafana names their value columns "Value #<refId>", which organize renames.
    assert set(renamed) == {f"Value #{t['refId']}" for t in xy["targets"]}
    assert set(wanted.values()) == set(renamed.values())
    assert all(t["format"] == "table" for t in xy["targets"])
    assert steps["partitionByValues"]["fields"] == ["vllm_instance"]


def test_thresholds_come_from_the_config() -> None:
    config = load_config(None, {"thresholds": {"kv_blocks_ratio": 0.9, "p99_seconds": 1.0, "bandwidth_ratio": 0.6}}, {})
    board = json.loads(dashboards(config.thresholds)["batchlens-overview.json"])
    steps = {
        p["title"]: [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]
        for p in walk_panels(board)
        if p["type"] == "stat"
    }
    assert steps["KV blocks used"][-1] == 0.9 and steps["P99 TTFT"][-1] == 1.0 and steps["GPU memory busy"][-1] == 0.6
    itl = json.loads(dashboards(Thresholds(p99_latency="itl"))["batchlens-overview.json"])
    assert "vllm_inter_token_latency_seconds:p99_1m" in json.dumps(itl)


def test_the_grafana_provisioning_names_fixed_uids_and_the_batchlens_folder() -> None:
    sources = yaml.safe_load((ROOT / "provisioning/grafana/datasources/batchlens.yml").read_text())["datasources"]
    assert {s["type"]: s["uid"] for s in sources} == {
        "prometheus": "batchlens-prometheus",
        "alertmanager": "batchlens-alertmanager",
    }
    [provider] = yaml.safe_load((ROOT / "provisioning/grafana/dashboards/batchlens.yml").read_text())["providers"]
    assert provider["folder"] == "batchlens" and provider["type"] == "file"


# --- the report, from data made here -------------------------------------------------------------------


def matrix(instance: str, values: list[tuple[float, float]]) -> dict:
    return {"resultType": "matrix", "result": [{"metric": {"vllm_instance": instance},
                                                "values": [[t, str(v)] for t, v in values]}]}  # fmt: skip


def test_align_joins_measures_on_time_and_drops_nan() -> None:
    measures = {
        "throughput": parse_matrix(matrix("a", [(1, 100), (2, 200)])),
        "p99": parse_matrix(matrix("a", [(2, 0.3), (3, math.nan)])),
    }
    report = align(Thresholds(), 0, 3, measures)
    assert [(p.time, p.values) for p in report.points["a"]] == [
        (1.0, {"throughput": 100.0}),
        (2.0, {"throughput": 200.0, "p99": 0.3}),
    ]
    with pytest.raises(ValueError, match="matrix"):
        parse_matrix({"resultType": "vector", "result": []})


def test_per_limit_averages_each_limit_separately() -> None:
    points = [Point(t, {"batch_limit": limit, "throughput": tput, "p99": p99})
              for t, (limit, tput, p99) in enumerate([(4, 100, 0.1), (4, 300, 0.3), (16, 500, 0.9)])]  # fmt: skip
    rows = Report(Thresholds(), 0, 3, {"a": points}).per_limit()
    assert [(r["batch_limit"], r["samples"], r["throughput"], r["p99"]) for r in rows] == [
        (4, 2, 200.0, pytest.approx(0.2)),
        (16, 1, 500.0, 0.9),
    ]
    assert math.isnan(rows[0]["memory_busy"])


def test_the_report_writes_a_png_and_a_page_with_the_table(tmp_path) -> None:
    points = [
        Point(1_800_000_000 + t, {"batch_limit": 8, "throughput": 100.0 + t, "p99": 0.1 * t, "memory_busy": 0.5,
                                  "kv_usage": 0.2, "running": 8, "efficiency": 12.5})
        for t in range(20)
    ]  # fmt: skip
    png, page = write(Report(Thresholds(), points[0].time, points[-1].time, {"<sim>": points}), tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = page.read_text()
    assert 'src="report.png"' in text and "<td>8</td>" in text and "&lt;sim&gt;" in text and "<sim>" not in text
    assert "No alert fired over this range." in text and "No breaker or controller action" in text


def test_the_page_tells_the_story_of_the_range_alerts_actions_and_what_each_means(tmp_path) -> None:
    """Issue 58, item 2: the page lists the alerts that fired and what each action and reason means, and draws the
    limit, the door's cap (+Inf: none) and the refusals without choking on an open door or a P99 of 9.5 s."""
    t0 = 1_800_000_000
    points = [Point(t0 + t, {"batch_limit": 32 if t < 10 else 16, "throughput": 100.0 + t,
                             "p99": 9.5 if 10 <= t < 15 else 0.2, "admission_cap": math.inf if t < 12 else 3072.0,
                             "finished": 4.0, "refused": 0.0 if t < 12 else 2.5, "running": 8, "efficiency": 12.5})
              for t in range(30)]  # fmt: skip
    report = Report(Thresholds(), t0, t0 + 29, {"a": points},
                    [Action("a", "breaker", "halve: decided", 1), Action("a", "controller", "admission_no_signal", 3),
                     Action("a", "controller", "a_reason_nobody_knows", 1)],
                    [Firing("VllmP99LatencyBreaker", "a", "critical", t0 + 10, t0 + 15),
                     Firing("VllmAdmissionShedding", "a", "warning", t0 + 20, None)])  # fmt: skip
    png, page = write(report, tmp_path)
    assert png.stat().st_size > 20_000
    text = page.read_text()
    assert "<td>VllmP99LatencyBreaker</td><td>a</td><td>critical</td>" in text and "still firing" in text
    assert "batch limit halved, a strike counted; the decision, as taken" in text
    assert "the door open" in text  # admission_no_signal, explained
    assert "see docs/control.md" in text  # a reason the legend does not know is not left bare


def test_the_legend_knows_every_action_and_reason_the_code_can_say() -> None:
    src = ROOT / "src" / "batchlens"
    door = re.findall(r'"admission_(\w+)"', (src / "remediation" / "controller.py").read_text())  # hold, resumed...
    calls = re.findall(r'self\.actions\[\(name, "(\w+)"', (src / "remediation" / "service.py").read_text())
    controller = {*LAW_REASONS, *LIVE_REASONS, *(f"admission_{r}" for r in (*CAP_REASONS, *door))}
    assert door and calls and controller - CONTROLLER.keys() == set()
    assert {*BREAKER_ACTIONS, *calls} - BREAKER.keys() == set()


def test_the_report_names_an_unreachable_prometheus(tmp_path) -> None:
    done = subprocess.run(
        [BATCHLENS, "report", "--prometheus", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "cannot read http://127.0.0.1:" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "report.png").exists()
