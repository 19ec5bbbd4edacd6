"""The rules end to end, on real data: simulator -> exporter -> Prometheus (generated rules) -> Alertmanager.

The simulator stands in for vLLM on a GPU (the fake boundary); everything after it is real: the
exporter, Prometheus 2.42 evaluating the generated rule files, Alertmanager 0.25 with the provisioned
routing. Thresholds are lowered in the config so that a small load crosses them within seconds.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import yaml

from batchlens.admin_api import TOKEN_ENV
from harness.admin import AdminClient
from harness.alertmanager import AlertmanagerServer
from harness.exporter import BATCHLENS, ExporterProcess
from harness.prometheus import PrometheusServer
from harness.rule_coverage import FROM_THE_ROUTER, NEEDS_DATA_PARALLEL, NEEDS_SATURATION, coverage
from harness.simulator import SimulatorProcess
from harness.vllm import RELEASE_CAPTURES, release_of

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
FIRING = {"VllmP99LatencyBreaker", "VllmKvCacheBlocksHigh"}


def test_rules_have_data_and_the_breaker_and_kv_alerts_reach_alertmanager(tmp_path) -> None:
    sim = SimulatorProcess(tmp_path, speed=20, args=("--max-num-seqs", "32"))
    config = tmp_path / "batchlens.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "engines": [{"name": "sim", "url": sim.url, "simulated_gpu": True}],
                "thresholds": {"kv_blocks_ratio": 0.001, "kv_blocks_for": "0s"},
            }
        )
    )
    rules = tmp_path / "alerts"
    built = subprocess.run([BATCHLENS, "build", "--config", str(config), "--root", str(tmp_path)], capture_output=True)
    assert built.returncode == 0, built.stderr
    am = AlertmanagerServer(tmp_path / "am", ROOT / "provisioning" / "alertmanager" / "alertmanager.yml")
    exporter = ExporterProcess(
        tmp_path, [], interval=0.5, extra_args=("--config", str(config)), env={"BATCHLENS_ADMIN_TOKEN": sim.token}
    )
    prometheus = PrometheusServer(
        tmp_path / "prom",
        [{"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
        rule_files=(str(rules / "batchlens.rules.yml"), str(rules / "batchlens.alerts.yml")),
        alertmanager=f"127.0.0.1:{am.port}",
    )
    # One request at a time, six clients: a queue builds and TTFT grows far past 0.5 s (simulated).
    AdminClient(sim.url, sim.token).set_limit(1)
    request = {"model": "deepseek-sim", "prompt": [1] * 1024, "max_tokens": 200}
    try:
        with sim.clients(6, lambda i: request):
            deadline = time.monotonic() + 90
            while True:
                firing = {
                    a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"] if a["state"] == "firing"
                }
                received = {a["labels"]["alertname"] for a in am.alerts()}
                if firing >= FIRING and received >= FIRING:
                    break
                assert time.monotonic() < deadline, (
                    f"firing in Prometheus: {firing}; received by Alertmanager: {received}"
                )
                time.sleep(1)
            breaker = next(a for a in am.alerts() if a["labels"]["alertname"] == "VllmP99LatencyBreaker")
            assert (
                breaker["labels"] | {"vllm_instance": "sim", "model_name": "deepseek-sim", "engine": "0"}
                == breaker["labels"]
            )
            assert {r["name"] for r in breaker["receivers"]} == {"remediation", "page"}

            # No dead queries: every recording rule returns data from this real pipeline, but the router's, the
            # ranks' of a data-parallel engine (this one has one rank; alerts/tests give them two) and the scaling
            # capacity's, which a minute of a steady server count at saturation measures (alerts/tests/scaling).
            skip = (FROM_THE_ROUTER, NEEDS_DATA_PARALLEL, NEEDS_SATURATION)
            names = [
                r["record"]
                for g in yaml.safe_load((rules / "batchlens.rules.yml").read_text())["groups"]
                for r in g["rules"]
                if not any(pattern.search(r["record"]) for pattern in skip)
            ]
            # Subqueries step on 10 s boundaries and rates need two samples: give the slowest rule 30 s.
            deadline = time.monotonic() + 30
            while empty := [name for name in names if not prometheus.query(name)]:
                assert time.monotonic() < deadline, f"recording rules with no data: {empty}"
                time.sleep(1)
    finally:
        prometheus.stop()
        exporter.stop()
        am.stop()
        sim.stop()


def test_every_rule_has_data_on_every_releases_series(tmp_path, upstreams) -> None:
    """Each vLLM release's captured /metrics (tests/data/releases) through the exporter into a real Prometheus
    with the generated rules: no recording rule and no alert input is empty on any release's dialect.

    The upstream fake serves the captures (the fake boundary: a vLLM server per release would need the matrix's
    environments); the exporter, Prometheus and the rules are real. GPU rules and alerts need NVML, and the
    cold-start alert the remediation hook: they are listed apart (harness/rule_coverage.py).
    """
    # The batch-limit rules read the admin API: the fake serves it beside each capture.
    state = {"max_num_seqs": 32, "max_num_active_seqs": 4, "num_running": 4, "num_waiting": 8}
    engines = [
        f"{release_of(p)}={upstreams.add(release_of(p), text=p.read_text(), admin=state, admin_token='tok')}"
        for p in RELEASE_CAPTURES
    ]
    assert len(engines) >= 4, "make vllm-matrix captures at least 0.10, 0.11, one 0.2x and 0.32"
    exporter = ExporterProcess(tmp_path, engines, interval=0.5, env={TOKEN_ENV: "tok"})
    prometheus = PrometheusServer(
        tmp_path / "prom",
        [{"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
        rule_files=(str(ROOT / "alerts" / "batchlens.rules.yml"),),
    )
    try:
        for path in RELEASE_CAPTURES:
            text = path.read_text()  # a capture from before the door, or before its classes, lacks their series
            door, classes = "vllm:admission_rejections_total" in text, "batchlens_door_requests_total" in text
            found = coverage(prometheus, release_of(path), release=release_of(path), door_series=door,
                             door_classes=classes)  # fmt: skip
            assert not found.empty_rules and not found.empty_alerts, (release_of(path), found)
            assert found.rules >= 40 and found.alerts >= 6, found
    finally:
        prometheus.stop()
        exporter.stop()
