"""Breaker and remediation: what the hook did to each engine's batch limit, and why."""

from __future__ import annotations

from grafanalib.core import StateTimeline, Table

from batchlens.config import Thresholds
from batchlens.dashboards.kit import DATASOURCE, dashboard, place, target, timeseries
from batchlens.remediation.states import BREAKER_STATES

INSTANCE = 'vllm_instance=~"$vllm_instance"'
COLORS = {"closed": "green", "recovering": "yellow", "tripped": "orange", "cold_start": "red"}


def state_code() -> str:
    """One number per engine: the severity code of its current state (0 when closed)."""
    parts = [
        f'batchlens_breaker_state{{{INSTANCE}, state="{state}"}} * {code}' for code, state in enumerate(BREAKER_STATES)
    ]
    return f"max by (vllm_instance) ({' or '.join(parts)})"


def breaker(thresholds: Thresholds) -> dict:
    timeline = StateTimeline(
        title="Breaker state",
        description="; ".join(f"{s}: {meaning}" for s, meaning in BREAKER_STATES.items()),
        dataSource=DATASOURCE,
        targets=[target(state_code())],
        mappings=[
            {
                "type": "value",
                "options": {
                    str(code): {"text": state, "color": COLORS[state], "index": code}
                    for code, state in enumerate(BREAKER_STATES)
                },
            }
        ],
        mergeValues=True,
    )
    alerts = Table(
        title="Alerts firing",
        description="batchlens alerts firing now for the selected engines (Prometheus' ALERTS series).",
        dataSource=DATASOURCE,
        targets=[
            target(
                f'max by (alertname, severity, vllm_instance) (ALERTS{{alertstate="firing", {INSTANCE}}})',
                "",
                fmt="table",
                instant=True,
            )
        ],
        transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}],
    )
    panels = place(
        [
            (6, [(timeline, 24)]),
            (
                8,
                [
                    (timeseries("Strikes", (f"max by (vllm_instance) (batchlens_breaker_strikes{{{INSTANCE}}})",
                                            "{{vllm_instance}}"),
                                description="Consecutive breaker actions; cold start at the configured strikes."), 8),
                    (timeseries("Batch limit: in force and the hook's target",
                                (f"max by (vllm_instance) (batchlens_batch_limit{{{INSTANCE}}})",
                                 "{{vllm_instance}} in force"),
                                (f"max by (vllm_instance) (batchlens_batch_limit_target{{{INSTANCE}}})",
                                 "{{vllm_instance}} target")), 8),
                    (timeseries("Remediation actions",
                                ("sum by (action, result) (increase(batchlens_remediation_actions_total"
                                 f"{{{INSTANCE}}}[$__rate_interval]))", "{{action}} {{result}}"),
                                drawStyle="bars"), 8),
                ],
            ),
            (
                8,
                [
                    (alerts, 16),
                    (timeseries("Webhook deliveries by status",
                                ("sum by (code) (rate(batchlens_webhook_requests_total[$__rate_interval]))",
                                 "{{code}}"), unit="reqps"), 8),
                ],
            ),
        ]
    )  # fmt: skip
    return dashboard(
        "breaker",
        "Breaker and remediation",
        "The P99 breaker per engine: its state, strikes, the limits it set, and the alerts that drove it.",
        panels,
    )
