"""Alertmanager routing and inhibition (provisioning/alertmanager), with the real amtool and Alertmanager.

Also the Prometheus configuration the stack uses, checked by the real promtool.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from batchlens.config import Breaker
from harness.alertmanager import AlertmanagerServer
from harness.prometheus import require_binary

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "provisioning" / "alertmanager" / "alertmanager.yml"
PROMETHEUS = ROOT / "provisioning" / "prometheus" / "prometheus.yml"


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("amtool", "prometheus-alertmanager"), *args], capture_output=True, text=True)


def test_the_alertmanager_config_is_valid() -> None:
    done = amtool("check-config", str(CONFIG))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("labels", "receivers"),
    [
        # The breaker reaches the hook and pages on-call.
        ({"alertname": "VllmP99LatencyBreaker", "severity": "critical", "vllm_instance": "a"}, "remediation,page"),
        ({"alertname": "SomethingElseCritical", "severity": "critical", "vllm_instance": "a"}, "page"),
        ({"alertname": "VllmKvCacheBlocksHigh", "severity": "warning", "vllm_instance": "a"}, "ticket"),
        ({"alertname": "VllmGpuMemoryBandwidthHigh", "severity": "warning", "vllm_instance": "a"}, "ticket"),
        ({"alertname": "Unlabelled"}, "ticket"),
    ],
)
def test_routes_send_each_alert_to_its_receivers(labels: dict, receivers: str) -> None:
    matchers = [f"{k}={v}" for k, v in labels.items()]
    done = amtool("config", "routes", "test", f"--config.file={CONFIG}", f"--verify.receivers={receivers}", *matchers)
    assert done.returncode == 0, done.stdout + done.stderr


GENERATED = [rule for group in yaml.safe_load((ROOT / "alerts" / "batchlens.alerts.yml").read_text())["groups"]
             for rule in group["rules"]]  # fmt: skip


@pytest.mark.parametrize("rule", GENERATED, ids=[rule["alert"] for rule in GENERATED])
def test_every_generated_alert_reaches_on_call_by_its_severity(rule: dict) -> None:
    """The GPU's alerts among them: critical pages, warning opens a ticket; the breaker also reaches the hook."""
    receivers = {"critical": "page", "warning": "ticket"}[rule["labels"]["severity"]]
    if rule["alert"] == "VllmP99LatencyBreaker":
        receivers = "remediation," + receivers
    matchers = [f"alertname={rule['alert']}", f"severity={rule['labels']['severity']}", "vllm_instance=a"]
    done = amtool("config", "routes", "test", f"--config.file={CONFIG}", f"--verify.receivers={receivers}", *matchers)
    assert done.returncode == 0, done.stdout + done.stderr


def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smh])", duration))


def test_the_breaker_repeats_no_faster_than_the_hooks_cooldown() -> None:
    """Each repeat is a strike outside the cooldown: a repeat inside it would only be recorded."""
    route = yaml.safe_load(CONFIG.read_text())["route"]
    assert route["group_by"] == ["vllm_instance", "alertname"]
    breaker = next(r for r in route["routes"] if r["receiver"] == "remediation")
    assert breaker["continue"] is True
    assert _seconds(breaker["repeat_interval"]) >= Breaker().cooldown_seconds


def test_the_prometheus_config_loads_the_generated_rules() -> None:
    done = subprocess.run(
        [require_binary("promtool", "prometheus"), "check", "config", str(PROMETHEUS)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "batchlens.rules.yml" in done.stdout and "batchlens.alerts.yml" in done.stdout


def _alert(name: str, severity: str, instance: str) -> dict:
    return {"labels": {"alertname": name, "severity": severity, "vllm_instance": instance}, "annotations": {}}


@pytest.mark.e2e
def test_inhibition_silences_warnings_under_a_critical_or_a_down_source(tmp_path) -> None:
    am = AlertmanagerServer(tmp_path, CONFIG)
    try:
        am.post_alerts(
            [
                _alert("VllmP99LatencyBreaker", "critical", "a"),
                _alert("VllmKvCacheBlocksHigh", "warning", "a"),  # inhibited by the breaker on a
                _alert("VllmKvCacheBlocksHigh", "warning", "b"),  # b has no critical: active
                _alert("BatchlensSourceDown", "warning", "c"),
                _alert("VllmGpuMemoryBandwidthHigh", "warning", "c"),  # inhibited: c's source is down
            ]
        )
        deadline = time.monotonic() + 20
        while True:
            states = {
                (a["labels"]["alertname"], a["labels"]["vllm_instance"]): a["status"]["state"] for a in am.alerts()
            }
            if len(states) == 5 and states[("VllmKvCacheBlocksHigh", "a")] == "suppressed":
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.2)
    finally:
        am.stop()
    assert states == {
        ("VllmP99LatencyBreaker", "a"): "active",
        ("VllmKvCacheBlocksHigh", "a"): "suppressed",
        ("VllmKvCacheBlocksHigh", "b"): "active",
        ("BatchlensSourceDown", "c"): "active",
        ("VllmGpuMemoryBandwidthHigh", "c"): "suppressed",
    }
