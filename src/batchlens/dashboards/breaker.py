"""Control and breaker: who set each engine's batch limit, to what, and why.

The controller steers the limit (its target, its SLO-attainment and goodput
estimates, its decisions by reason); the breaker is the safety layer around it
(state, strikes, actions, the alerts that drove it). The uid stays
``batchlens-breaker`` so that links in pages and runbooks keep working.
"""

from __future__ import annotations

from grafana_foundation_sdk.models.dashboard import ValueMap, ValueMappingResult

from batchlens.config import Thresholds
from batchlens.dashboards.kit import (
    INSTANCE,
    annotation,
    dashboard,
    grid,
    place,
    state_timeline,
    target,
    timeseries,
    transformation,
)
from batchlens.remediation.states import BREAKER_STATES

BY = "cluster, vllm_instance"
COLORS = {"closed": "green", "recovering": "yellow", "tripped": "orange", "cold_start": "red"}


def state_code() -> str:
    """One number per engine: the severity code of its current state (0 when closed)."""
    parts = [
        f'batchlens_breaker_state{{{INSTANCE}, state="{state}"}} * {code}' for code, state in enumerate(BREAKER_STATES)
    ]
    return f"max by ({BY}) ({' or '.join(parts)})"


def breaker(thresholds: Thresholds) -> dict:
    states = {str(code): ValueMappingResult(text=state, color=COLORS[state], index=code)
              for code, state in enumerate(BREAKER_STATES)}  # fmt: skip
    timeline = state_timeline(
        "Breaker state",
        target(state_code()),
        "; ".join(f"{s}: {meaning}" for s, meaning in BREAKER_STATES.items()),
        [ValueMap(options=states)],
    )
    firing = f'max by (alertname, severity, cluster, vllm_instance) (ALERTS{{alertstate="firing", {INSTANCE}}})'
    alerts = grid(
        "Alerts firing",
        [target(firing, "", fmt="table", instant=True)],
        "batchlens alerts firing now for the selected engines (Prometheus' ALERTS series).",
        [transformation("organize", excludeByName={"Time": True, "Value": True})],
    )
    panels = place(
        [
            (
                8,
                [
                    (timeseries("SLO attainment (the controller's estimate)",
                                (f"max by ({BY}) (batchlens_controller_slo_attainment{{{INSTANCE}}})",
                                 "{{vllm_instance}}"),
                                unit="percentunit",
                                description="Share of requests within the SLO over the last minute, estimated from "
                                            "the engine's own histograms (TTFT within slo.ttft_seconds and token "
                                            "gaps within slo.tpot_seconds)."), 8),
                    (timeseries("Goodput (the controller's estimate)",
                                (f"max by ({BY}) (batchlens_controller_goodput_rps{{{INSTANCE}}})",
                                 "{{vllm_instance}}"), unit="reqps",
                                description="Requests finished per second x the estimated SLO attainment."), 8),
                    (timeseries("Controller decisions by reason",
                                ("sum by (reason) (increase(batchlens_controller_decisions_total"
                                 f"{{{INSTANCE}}}[$__rate_interval]))", "{{reason}}"),
                                bars=True,
                                description="What each tick decided: headroom and slow_start grow; pace_over, "
                                            "kv_ceiling, keep_up and past_peak cut; drain waits after a cut; ttft_flat "
                                            "holds: growth would buy nothing and make first tokens late; "
                                            "manual_hold, breaker_open and no_signal mean control is paused "
                                            "(docs/control.md)."),
                     8),
                ],
            ),
            (6, [(timeline, 24)]),
            (
                8,
                [
                    (timeseries("Strikes", (f"max by ({BY}) (batchlens_breaker_strikes{{{INSTANCE}}})",
                                            "{{vllm_instance}}"),
                                description="Consecutive breaker actions; cold start at the configured strikes."), 8),
                    (timeseries("Batch limit: in force, the hook's target, the controller's",
                                (f"max by ({BY}) (batchlens_batch_limit{{{INSTANCE}}})",
                                 "{{vllm_instance}} in force"),
                                (f"max by ({BY}) (batchlens_batch_limit_target{{{INSTANCE}}})",
                                 "{{vllm_instance}} target"),
                                (f"max by ({BY}) (batchlens_controller_target_limit{{{INSTANCE}}})",
                                 "{{vllm_instance}} controller"),
                                description="The controller's limit is in force unless the breaker is open (then "
                                            "the smaller one), a hand set it, or control is in dry run."), 8),
                    (timeseries("Remediation actions",
                                ("sum by (action, result) (increase(batchlens_remediation_actions_total"
                                 f"{{{INSTANCE}}}[$__rate_interval]))", "{{action}} {{result}}"),
                                bars=True), 8),
                ],
            ),
            (
                8,
                [
                    (timeseries("Admission: the queued-token cap, wanted and in force",
                                (f"max by ({BY}) (batchlens_admission_cap_target_tokens{{{INSTANCE}}} < +Inf)",
                                 "{{vllm_instance}} wanted"),
                                (f"max by ({BY}) (batchlens_admission_cap_tokens{{{INSTANCE}}} < +Inf)",
                                 "{{vllm_instance}} in force"),
                                description="control.admission: slo.ttft x the measured prefill rate x the margin; "
                                            "a gap is no cap (the door open: too few windows, stale, or off). "
                                            "docs/admission.md."), 8),
                    (timeseries("Admission: prefill rate the cap rests on",
                                (f"max by ({BY}) (batchlens_admission_prefill_tokens_per_second{{{INSTANCE}}})",
                                 "{{vllm_instance}}"),
                                description="The median prompt tokens/s of the recent windows in which requests "
                                            "waited: the rate the queue drains at."), 8),
                    (timeseries("Admission: refused at the door",
                                (f"sum by ({BY}, reason) (vllm_instance_model_name_reason:"
                                 f"vllm_admission_rejections:rate1m{{{INSTANCE}}})", "{{vllm_instance}} {{reason}}"),
                                (f"max by ({BY}) (vllm_instance_model_name:vllm_admission_rejections:ratio5m"
                                 f"{{{INSTANCE}}})", "{{vllm_instance}} share of arrivals (5m)"),
                                (f"max by ({BY}, priority_class) (vllm_instance_model_name_class:"
                                 f"batchlens_door_refusals:ratio5m{{{INSTANCE}}})",
                                 "{{vllm_instance}} {{priority_class}} share (5m)"),
                                unit="short",
                                description="vLLM's own count of requests its queued caps refused with a 503, by "
                                            "reason; the refused share of all arrivals; and each door class's "
                                            "refused share (x-batchlens-priority: critical, standard, "
                                            "sheddable), which VllmAdmissionShedding pages on."),
                     8),
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
        "Control and breaker",
        "Per engine: the controller's batch limit and its SLO estimates, and the P99 breaker around it (its "
        "state, strikes, the limits it set, and the alerts that drove it).",
        panels,
        annotations=[PAUSED],
    )


#: When control stops steering an engine: a hand set the limit, the breaker opened, or the engine went silent.
PAUSED = annotation(
    "Controller paused",
    "purple",
    "sum by (cluster, vllm_instance, reason) (increase(batchlens_controller_decisions_total"
    f'{{{INSTANCE}, reason=~"manual_hold|breaker_open|no_signal"}}[1m])) > 0',
    "Controller paused on {{vllm_instance}}: {{reason}}",
    "vllm_instance,reason",
)
