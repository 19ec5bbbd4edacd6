"""The generated rules: fresh, lint-clean, and right on vLLM 0.32's real series (promtool). No fakes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from batchlens.artifacts import rule_files
from batchlens.config import ConfigError, Thresholds, load_config
from batchlens.rules.recording import CURRENT_REPLICAS, DESIRED_REPLICAS, le, recording_rules
from harness.exporter import BATCHLENS
from harness.prometheus import require_binary

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "alerts"


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_committed_rule_files_are_what_the_code_generates() -> None:
    done = run(BATCHLENS, "build", "--check")
    assert done.returncode == 0, done.stderr


def test_build_check_fails_on_a_stale_file(tmp_path) -> None:
    assert run(BATCHLENS, "build", "--root", str(tmp_path)).returncode == 0
    (tmp_path / "alerts" / "batchlens.alerts.yml").write_text("# edited by hand\n")
    done = run(BATCHLENS, "build", "--check", "--root", str(tmp_path))
    assert done.returncode != 0 and "batchlens.alerts.yml" in done.stderr


def test_promtool_lints_the_rules_clean() -> None:
    promtool = require_binary("promtool", "prometheus")
    done = run(promtool, "check", "rules", "--lint=all", *map(str, sorted(ALERTS.glob("*.yml"))))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_pass() -> None:
    promtool = require_binary("promtool", "prometheus")
    done = run(promtool, "test", "rules", *map(str, sorted((ALERTS / "tests").glob("*.yml"))))
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout + done.stderr


def test_promtool_tests_fix_the_group_order() -> None:
    # promtool evaluates groups in random order unless told; an alert reading a recording rule then sees
    # this or the previous evaluation at random, and its $value flakes (CI once printed 14 for 15).
    for path in sorted((ALERTS / "tests").glob("*.yml")):
        suite = yaml.safe_load(path.read_text())
        files = [yaml.safe_load((path.parent / f).read_text()) for f in suite["rule_files"]]
        groups = [group["name"] for rules in files for group in rules["groups"]]
        if len(groups) > 1:
            assert suite.get("group_eval_order") == groups, f"{path.name}: group_eval_order must be {groups}"


def test_thresholds_come_from_the_config() -> None:
    config = load_config(None, {"thresholds": {"kv_blocks_ratio": 0.9, "p99_latency": "e2e", "p99_seconds": 1.0}}, {})
    alerts = rule_files(config)["batchlens.alerts.yml"]
    assert "vllm_kv_cache_usage:ratio > 0.9" in alerts
    assert "vllm_e2e_request_latency_seconds:slow_ratio1m > 0.01" in alerts
    rules = rule_files(config)["batchlens.rules.yml"]
    assert 'le="1.0"' in rules and 'le="1"' not in rules


def test_bucket_bounds_are_written_as_vllm_writes_them() -> None:
    assert [le(0.5), le(1), le(120)] == ["0.5", "1.0", "120.0"]


def test_a_breaker_threshold_that_is_no_bucket_bound_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"0\.45 is not a bucket bound .* ttft histogram"):
        recording_rules(Thresholds(p99_seconds=0.45))


def test_every_recording_rule_is_named_level_metric_operation() -> None:
    """But the scaling signal's public pair, which autoscalers query (docs/scaling.md): each is recorded twice, per
    deployment and per role, under one name."""
    names = [r["record"] for r in recording_rules(Thresholds())]
    public = [name for name in names if name in (DESIRED_REPLICAS, CURRENT_REPLICAS)]
    assert sorted(public) == sorted([DESIRED_REPLICAS, CURRENT_REPLICAS] * 2)
    names = [name for name in names if name not in public]
    assert len(names) == len(set(names))
    assert all(len(name.split(":")) == 3 for name in names), names


def test_the_scaling_signal_reads_its_headroom_and_windows_from_the_config() -> None:
    config = load_config(None, {"thresholds": {"scale_headroom": 0.5, "scale_up_window": "2m",
                                               "scale_down_window": "30m"}}, {})  # fmt: skip
    rules = rule_files(config)["batchlens.rules.yml"]
    assert "* 1.5 /" in rules and "[2m]) > batchlens:current_replicas" in rules
    assert "[30m]) < batchlens:current_replicas" in rules
    with pytest.raises(ConfigError, match=r"scale_down_window"):
        load_config(None, {"thresholds": {"scale_down_window": "15 minutes"}}, {})


def test_every_alert_has_its_runbook() -> None:
    alerts = yaml.safe_load((ALERTS / "batchlens.alerts.yml").read_text())["groups"][0]["rules"]
    for alert in alerts:
        runbook = ROOT / alert["annotations"]["runbook_url"]
        assert runbook.exists(), f"{alert['alert']}: no {runbook.relative_to(ROOT)}"
        text = runbook.read_text()
        for section in ("**What it means.**", "**Look at.**", "**What the hook does", "**What a human does.**"):
            assert section in text, f"{runbook.name} lacks {section}"


def test_no_rule_aggregates_the_cluster_away() -> None:
    """Thanos Ruler and Mimir evaluate these rules over several clusters: each must keep them apart. The
    namespace passes too: the Prometheus Operator routes an AlertmanagerConfig's alerts by it."""
    config = load_config(None, {}, {})
    for text in rule_files(config).values():
        for rule in yaml.safe_load(text)["groups"][0]["rules"]:
            for labels in re.findall(r"\b(?:by|on) \(([^)]*)\)", rule["expr"]):
                if "vllm_instance" in labels:
                    assert {"cluster", "namespace"} <= set(labels.split(", ")), rule.get("record") or rule["alert"]


def test_links_make_the_alert_annotations_absolute() -> None:
    links = {"grafana_url": "https://grafana.example.com/", "runbook_url": "https://git.example.com/batchlens/runbooks"}
    alerts = yaml.safe_load(rule_files(load_config(None, {"links": links}, {}))["batchlens.alerts.yml"])
    for alert in alerts["groups"][0]["rules"]:
        notes = alert["annotations"]
        assert notes["runbook_url"] == f"https://git.example.com/batchlens/runbooks/{alert['alert']}.md"
        assert notes["dashboard_url"].startswith("https://grafana.example.com/d/batchlens-overview/batchlens?")
    with pytest.raises(ConfigError, match=r"links\.grafana_url"):
        load_config(None, {"links": {"grafana_url": "grafana:3000"}}, {})
