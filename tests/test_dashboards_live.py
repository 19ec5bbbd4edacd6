"""Every dashboard query against a real Prometheus holding real data, and `batchlens report` on it.

The stack: the simulator (standing in for vLLM on a GPU) -> the exporter -> Prometheus 2.42 running the
committed rule files, and the remediation hook (breaker and controller in dry run, fed breaker
notifications). Load runs while the batch limit steps 1 -> 4 -> 16, so the operating points differ.
Grafana is the fake boundary (harness/grafana.py): the test fills the variables, runs each panel's
queries as Grafana would, and applies the panel's transformations to the results.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchlens.admin_api import ADMISSION_PATH
from batchlens.dashboards.overview import GPU_HEALTH_PANELS
from batchlens.prometheus_api import step_for
from batchlens.report.command import REPORT_POINTS
from harness.admin import AdminClient
from harness.browser import visit
from harness.exporter import BATCHLENS, ExporterProcess
from harness.grafana import (
    interpolate,
    panel_results,
    query_annotations,
    run_query,
    table_frames,
    transform,
    walk_panels,
)
from harness.procs import Process, free_port, http_get, wait_until
from harness.prometheus import PrometheusServer
from harness.remediate import RemediateProcess, alert, notification
from harness.simulator import SimulatorProcess

# One worker builds the stack (a module fixture is built once per xdist worker that runs a test of the module).
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("dashboards_live")]
ROOT = Path(__file__).resolve().parent.parent
BOARDS = {path.name: json.loads(path.read_text()) for path in sorted((ROOT / "dashboards").glob("*.json"))}
LIMITS = (1, 4, 16)
#: BATCHLENS_WRITE_SCREENSHOT=1 refreshes docs/report/live.png from the report page test.
WRITE_SCREENSHOT = os.environ.get("BATCHLENS_WRITE_SCREENSHOT") == "1"
PHASE_SECONDS = 15
WINDOW = 60
# No cluster label here: every query must work with the cluster variable on "All".
VARIABLES = {"cluster": ".*", "vllm_instance": "sim", "model_name": ".*", "gpu": ".*", "__rate_interval": "15s",
             "__range": f"{WINDOW}s", "__interval": "5s"}  # fmt: skip
ROUTING_ROW = (
    "Routing: P99 TTFT per class, at the proxy",
    "Routing: decisions (wanted → got)",
    "Routing: fallback share per class",
)
#: Panels this stack cannot fill, and why. Every other panel must return data.
NO_DATA_HERE = {
    "Clocks": "the simulated GPU reports no clocks (test_nvml_source covers the NVML series)",
    "Clock events (throttle reasons)": "the simulated GPU has no throttle reasons",
    "PCIe": "the simulated GPU has no PCIe counters",
    "NVLink": "the simulated GPU has no NVLink",
    **dict.fromkeys(ROUTING_ROW, "no LiteLLM proxy in this stack: tests/test_routing_proxy.py fills the routing row"),
    **dict.fromkeys(
        ("Admission: the queued-token cap, wanted and in force", "Admission: prefill rate the cap rests on"),
        "control.admission is off in this stack: tests/test_control_admission_e2e.py sets and reads the cap",
    ),
    "Data-parallel ranks: load against the mean": "the simulator is one rank; alerts/tests give the rule two",
    **dict.fromkeys(GPU_HEALTH_PANELS, "no GPU fails in this stack: tests/test_gpu_failures_e2e.py fills the row"),
}


@dataclass
class Stack:
    prometheus: PrometheusServer
    sim: SimulatorProcess  # still serving: a test may load it again, and puts it back as it found it

    @property
    def url(self) -> str:
        return self.prometheus.url

    def api(self, path: str, **params: str) -> dict:
        return self.prometheus.api(path, **params)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboards")
    sim = SimulatorProcess(tmp, speed=20, args=("--max-num-seqs", "32"))
    config = tmp / "batchlens.yaml"
    config.write_text(json.dumps({"engines": [{"name": "sim", "url": sim.url, "simulated_gpu": True}]}))
    exporter = ExporterProcess(
        tmp, [], interval=0.5, extra_args=("--config", str(config)), env={"BATCHLENS_ADMIN_TOKEN": sim.token}
    )
    # The hook in dry run: its breaker state, strikes and actions and its controller's estimates and decisions
    # fill the control dashboard, while the batch limit stays the test's to step.
    breaker = {"dry_run": True, "cooldown_seconds": 1, "overload_queue_ratio": 100}
    # With the door (dry run too): the hook reads the queued-token cap in force, and exports it for the page.
    control = {"enabled": True, "dry_run": True, "interval_seconds": 0.5, "admission": True}
    hook = RemediateProcess(tmp, {"engines": [{"name": "sim", "url": sim.url}], "breaker": breaker,
                                  "control": control}, env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
    prometheus = PrometheusServer(
        tmp / "prom",
        [
            {"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]},
            {"job_name": "batchlens-remediate", "static_configs": [{"targets": [f"127.0.0.1:{hook.port}"]}]},
        ],
        rule_files=tuple(str(p) for p in sorted((ROOT / "alerts").glob("*.yml"))),
    )
    admin = AdminClient(sim.url, sim.token)
    request = {"model": "deepseek-sim", "prompt": [1] * 1024, "max_tokens": 200}
    try:
        with sim.clients(8, lambda i: request):
            for limit in LIMITS:
                admin.set_limit(limit)
                hook.post(notification(alert("sim", "firing" if limit < LIMITS[-1] else "resolved")))
                time.sleep(PHASE_SECONDS)
        yield Stack(prometheus, sim)
    finally:
        prometheus.stop()
        hook.stop()
        exporter.stop()
        sim.stop()


def test_every_panel_query_runs_and_the_core_panels_have_data(stack) -> None:
    errors, empty, checked = [], [], 0
    for board in BOARDS.values():
        for panel in walk_panels(board):
            results, failed = panel_results(stack.url, panel, VARIABLES)
            errors += [f"{board['title']}: {e}" for e in failed]
            checked += len(panel["targets"])
            if not any(results.values()) and panel["title"] not in NO_DATA_HERE:
                empty.append(f"{board['title']} / {panel['title']}")
    assert errors == [], "queries Prometheus refused:\n" + "\n".join(errors)
    assert empty == [], f"panels with no data (of {checked} queries): {empty}"


def test_annotations_and_variables_resolve(stack) -> None:
    board = BOARDS["batchlens-overview.json"]
    annotations = dict(query_annotations(board))
    assert {"Batch limit changes", "Remediation actions"} <= annotations.keys()
    for name, expr in annotations.items():
        result, error = run_query(stack.url, interpolate(expr, VARIABLES), instant=False, end=time.time())
        assert not error, (name, error)
        if name == "Batch limit changes":
            assert result, "the batch limit changed three times, but the annotation query found nothing"
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
        selector, label = interpolate(match.group(1), VARIABLES), match.group(2)
        series = stack.api("series", **{"match[]": selector, "start": f"{time.time() - WINDOW}"})
        values = {s.get(label) for s in series} - {None, ""}
        if variable["name"] == "cluster":
            assert not values, "this stack labels no cluster"  # its "All" (.*) matches the missing label
        else:
            assert values, f"variable {variable['name']}: no values"


def test_the_xy_chart_gets_its_four_fields_per_engine(stack) -> None:
    [xy] = [p for p in walk_panels(BOARDS["batchlens-overview.json"]) if p["type"] == "xychart"]
    results, errors = panel_results(stack.url, xy, VARIABLES)
    assert not errors, errors
    frames = transform(xy, table_frames(results, instant=False))
    fields = [xy["options"]["series"][0][dim]["matcher"]["options"] for dim in ("x", "y", "color", "size")]
    assert len(frames) == 1, f"one engine, so one series; got {len(frames)} frames"
    complete = [row for row in frames[0] if all(isinstance(row.get(f), float) for f in fields)]
    assert len(complete) >= 5, f"rows with {fields}: {len(complete)} of {len(frames[0])}; a row: {frames[0][:1]}"


def test_the_operating_point_table_has_a_row_per_batch_limit(stack) -> None:
    [table] = [
        p for p in walk_panels(BOARDS["batchlens-overview.json"]) if p["title"].startswith("Operating points per")
    ]
    results, errors = panel_results(stack.url, table, VARIABLES)
    assert not errors, errors
    [rows] = transform(table, table_frames(results, instant=True))
    limits = {row["batch_limit"] for row in rows}
    assert len(limits) >= 2 and limits <= {str(limit) for limit in LIMITS}, rows
    names = set(table["transformations"][1]["options"]["renameByName"].values())
    assert all(names <= set(row) for row in rows), rows


def test_batchlens_report_on_a_young_deployment_follows_the_data(stack, tmp_path) -> None:
    """Default flags (--range 24h) on a minute of data: the report starts where the data starts, with a step
    that follows it. At REPORT_POINTS a span, 10 minutes of data give 600 points (the pure check below)."""
    done = subprocess.run([BATCHLENS, "report", "--prometheus", stack.url, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    points, span = (float(x) for x in re.search(r"\((\d+) points over (\d+) s", done.stdout).groups())
    assert span < 300 and points >= 0.8 * span, done.stdout  # about one point a second, not 3 for the day
    assert 600 / step_for(600, REPORT_POINTS) >= 100
    png, page = tmp_path / "report.png", (tmp_path / "report.html").read_text()
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 30_000
    points_table = page.split('<table id="operating-points">')[1].split("</table>")[0]  # not the actions table
    limits = {int(row.split("</td><td>")[1]) for row in points_table.split("<tr><td>sim")[1:]}
    assert limits == set(LIMITS), page


def test_report_says_when_prometheus_lacks_the_recording_rules(stack, tmp_path) -> None:
    bare = PrometheusServer(tmp_path / "prom", [])  # no rule files
    try:
        done = subprocess.run([BATCHLENS, "report", "--prometheus", bare.url, "--out", str(tmp_path / "r")],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        bare.stop()
    assert done.returncode == 1 and "has not loaded batchlens' recording rules" in done.stderr, done.stderr
    assert "alerts/batchlens.rules.yml" in done.stderr and not (tmp_path / "r" / "report.png").exists()


def test_batchlens_advise_is_stable_lists_every_limit_and_agrees_with_itself(stack) -> None:
    """Five runs with default flags over the 1 -> 4 -> 16 history: one recommendation, every limit listed with
    the requests behind it, and the verdict consistent with the P99 figures it prints."""
    runs = []
    for _ in range(5):
        done = subprocess.run([BATCHLENS, "advise", "--prometheus", stack.url, "--json"], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        [advice] = json.loads(done.stdout)
        runs.append(advice)
    verdicts = [{r["setting"]: r["value"] for r in advice["recommendations"]} for advice in runs]

    def same(values: list) -> bool:  # a measured threshold moves with "now" between runs; a setting may not
        try:
            numbers = [float(v) for v in values]
        except (TypeError, ValueError):
            return len({str(v) for v in values}) == 1
        return max(numbers) - min(numbers) <= 0.1 * max(abs(n) for n in numbers)

    differ = {k: [v.get(k) for v in verdicts] for k in verdicts[0] if not same([v.get(k) for v in verdicts])}
    assert not differ and all(v.keys() == verdicts[0].keys() for v in verdicts), differ
    print(json.dumps(runs[0], indent=1)[:3000])
    for advice in runs:
        assert [p["limit"] for p in advice["limits"]] == list(LIMITS), advice["limits"]
        assert advice["seconds"] < 600, "the span is the data's, not the 24 h asked for"
    advice, requirement = runs[0], runs[0]["requirement"]
    limit = verdicts[0]["batch limit"]
    judged = {p["limit"]: p["p99"] for p in advice["limits"] if p["requests"] >= 100}
    assert judged, advice["limits"]
    chosen = int(limit.split()[0]) if limit[0].isdigit() else None
    if limit.endswith("(none meets the SLO)"):  # every limit over: so is the whole range
        assert all(p99 > requirement for p99 in judged.values()) and advice["p99_observed"] > requirement
    else:
        assert limit.endswith(("(the knee)", "(keep)")) and judged[chosen] <= requirement, (limit, judged)
    if all(p99 <= requirement for p99 in judged.values()):
        assert advice["p99_observed"] <= requirement * 1.5, "the header contradicts every limit it lists"


def test_the_report_page_shows_the_view_in_a_real_browser(stack, tmp_path) -> None:
    """`batchlens report --watch`: the dashboards' view without Grafana, checked in headless Chromium (Playwright):
    it loads, draws the charts from this Prometheus, lists every batch limit, the alerts that fired and the hook's
    actions with what each means, logs no console error, and says what is wrong when Prometheus is not there.
    Then an overload phase (a batch of 1 under 8 clients, and a queued-token cap set by hand that refuses what
    does not fit): the page, seen during it, tells it (docs/report/live-overload.png)."""
    port, down = free_port(), free_port()
    # every 5 s: the page's own reload comes well after the visit's 1.5 s look at it, on a loaded machine too
    live = Process("report", [BATCHLENS, "report", "--prometheus", stack.url, "--watch", "--every", "5",
                              "--listen", f"127.0.0.1:{port}"], tmp_path / "report.log")  # fmt: skip
    nowhere = Process("report-down", [BATCHLENS, "report", "--prometheus", f"http://127.0.0.1:{free_port()}",
                                      "--watch", "--every", "5", "--listen", f"127.0.0.1:{down}"],
                      tmp_path / "report-down.log")  # fmt: skip
    shots = ROOT / "docs" / "report" if WRITE_SCREENSHOT else tmp_path
    admin = AdminClient(stack.sim.url, stack.sim.token)

    def draws() -> int:
        return json.loads(http_get(url + "/healthz")[1] or b"{}").get("draws", 0)

    try:
        url = f"http://127.0.0.1:{port}"
        live.wait_http(url + "/healthz", 30)
        nowhere.wait_http(f"http://127.0.0.1:{down}/healthz", 30)
        wait_until(lambda: draws() >= 2, timeout=60, what="two drawings")
        seen = visit(url + "/", shots / "live.png")
        assert seen.console_errors == [] and seen.failed_requests == [], (seen.console_errors, seen.failed_requests)
        assert seen.title == "batchlens: batch efficiency trend report"
        [image] = seen.images
        assert image["naturalWidth"] > 1000 and image["naturalHeight"] > 800, image  # the five charts, drawn
        assert seen.tables["operating-points"] == 1 + len(LIMITS), seen.tables  # a header and a row per limit
        assert seen.tables["actions"] > 1 and "controller" in seen.text and "breaker" in seen.text, seen.text
        assert "see docs/control.md" not in seen.text, "a reason on the page has no meaning in the legend"
        assert seen.tables["alerts"] > 1 and "VllmP99LatencyBreaker" in seen.text, seen.text  # the limit-1 phase
        assert "Waiting for data" not in seen.text
        wait_until(lambda: b"cannot read" in http_get(f"http://127.0.0.1:{down}/")[1], what="the error said")
        seen_down = visit(f"http://127.0.0.1:{down}/")
        assert "Waiting for data: cannot read" in seen_down.text and seen_down.console_errors == []
        assert http_get(f"http://127.0.0.1:{down}/report.png")[0] == 404

        request = {"model": "deepseek-sim", "prompt": [1] * 1024, "max_tokens": 200}
        admin.set_limit(1)
        status, _ = admin.request("PUT", ADMISSION_PATH, json.dumps({"max_num_queued_tokens": 3 * 1024}).encode())
        assert status == 200
        try:
            with stack.sim.clients(8, lambda i: request):
                # What the page draws from: the refusals, and the hand's cap as the hook reads it
                for expr, what in (
                    (
                        "sum(vllm_instance_model_name_reason:vllm_admission_rejections:rate1m) > 0",
                        "refusals at the door",
                    ),
                    ("batchlens_admission_cap_tokens == 3072", "the cap"),
                ):
                    wait_until(lambda expr=expr: stack.prometheus.query(expr), timeout=30, what=f"{what} in Prometheus")
                drawn = draws()
                wait_until(lambda: draws() >= drawn + 2, timeout=30, what="drawings during the overload")
                during = visit(url + "/", shots / "live-overload.png")
        finally:
            admin.request("PUT", ADMISSION_PATH, b'{"max_num_queued_tokens": null}')
            admin.set_limit(LIMITS[-1])
        assert during.console_errors == [] and during.failed_requests == [], during.console_errors
        assert during.images[0]["naturalWidth"] > 1000 and during.tables["alerts"] > 1, during.tables
    finally:
        live.stop()
        nowhere.stop()
    assert "Traceback" not in live.log_tail() + nowhere.log_tail()
