"""Which generated rules have data in a running Prometheus, for one vLLM instance: no dead queries per release."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from batchlens.simulator.dialect import QUEUED_CAPS, series_of
from harness.prometheus import PrometheusServer

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "batchlens.rules.yml"
ALERTS = ROOT / "alerts" / "batchlens.alerts.yml"
# Alert inputs no CPU server can give: NVML's GPU series (and its driver's), and the remediation hook's own
# breaker state.
NEEDS_OTHER_SOURCES = re.compile(r"gpu|nvml|breaker_|remediation|batchlens_routing_")
#: vLLM's admission counter came with its queued caps (0.29). Before, the plugin's door counts under the same name,
#: but captures taken before the door (tests/data/releases) lack it: rules over it are empty there.
NEEDS_QUEUED_CAPS = re.compile(r"admission_rejections")
#: The plugin's per-class door counters (batchlens_door_*) came later still: captures taken before them lack them.
NEEDS_DOOR_CLASSES = re.compile(r"batchlens_door_")
#: The routing plugin's series live on the LiteLLM proxy's /metrics, not the exporter's: tests/test_routing_proxy.py
#: checks their rules against a real proxy.
FROM_THE_ROUTER = re.compile(r"batchlens_routing_")
#: Rules over the ranks of a data-parallel engine: an instance of one engine core has one rank, so no data. The
#: promtool tests (alerts/tests) give them two.
NEEDS_DATA_PARALLEL = re.compile(r"dp_rank")
#: The scaling signal's capacity is measured only while a deployment is saturated (docs/scaling.md): a capture that
#: never queued nor shed has none, and desired_replicas then holds the replicas serving (which it shows).
NEEDS_SATURATION = re.compile(r"replica_served|replica_capacity|desired_replicas:raw")
# Recording rules (level:metric:operation), and raw batchlens_* or vllm:* series.
SERIES_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+|batchlens_[a-z_0-9]+|vllm:[a-z_0-9]+")


def recording_rules() -> list[str]:
    return [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def alert_inputs() -> dict[str, set[str]]:
    """Each alert's series names (recording rules or raw series) as its expression uses them."""
    inputs = {}
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            inputs[rule["alert"]] = set(SERIES_NAME.findall(rule["expr"]))
    return inputs


@dataclass
class Coverage:
    rules: int  # recording rules over vLLM's series
    empty_rules: list[str]
    alerts: int  # alerts over vLLM's series
    empty_alerts: dict[str, list[str]]  # alert -> its inputs without data
    other_rules: list[str]  # fed by NVML, which no CPU server has
    other_alerts: list[str]  # fed by NVML or the remediation hook


def coverage(
    prometheus: PrometheusServer,
    instance: str,
    *,
    release: str,
    door_series: bool = True,
    door_classes: bool = True,
    wait: float = 30,
) -> Coverage:
    """Ask until every rule has data for ``instance`` or ``wait`` seconds pass (rates need two samples).

    ``release``: the vLLM release behind the instance. ``door_series``: whether a release before the queued caps
    has the plugin door's admission series (a live server does; a capture from before the door does not).
    ``door_classes``: whether the instance has the plugin's per-class door counters (likewise).
    """
    selector = f'{{vllm_instance="{instance}"}}'
    absent = "|".join(p.pattern for p in (NEEDS_OTHER_SOURCES, NEEDS_DATA_PARALLEL, NEEDS_SATURATION))
    if series_of(release) < QUEUED_CAPS and not door_series:
        absent += "|" + NEEDS_QUEUED_CAPS.pattern
    if not door_classes:
        absent += "|" + NEEDS_DOOR_CLASSES.pattern
    other_rules = [name for name in recording_rules() if re.search(absent, name)]
    rules = [name for name in recording_rules() if name not in other_rules]
    inputs = alert_inputs()
    other = sorted(a for a, names in inputs.items() if any(re.search(absent, n) for n in names))
    deadline = time.monotonic() + wait
    while True:
        empty = [name for name in rules if not prometheus.query(name + selector)]
        empty_alerts = {
            alert: missing
            for alert, names in inputs.items()
            if alert not in other and (missing := sorted(n for n in names if not prometheus.query(n + selector)))
        }
        if (not empty and not empty_alerts) or time.monotonic() > deadline:
            return Coverage(len(rules), empty, len(inputs) - len(other), empty_alerts, other_rules, other)
        time.sleep(1)
