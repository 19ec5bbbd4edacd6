"""Alertmanager's webhook payload (version 4) and what the hook takes from it. Pure: no HTTP.

Alertmanager posts one notification per alert group; it may mix firing and
resolved alerts, for several engines. :func:`deliveries` turns it into one
:class:`Delivery` per alert the hook acts on, and counts, with a reason, the
alerts it will not act on, so a bad payload is visible in the metrics and the
log and never silently dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from batchlens.remediation.store import Delivery

BREAKER_ALERT = "VllmP99LatencyBreaker"
KV_ALERT = "VllmKvCacheBlocksHigh"
MAX_ALERTS = 1000  # Alertmanager's own max_alerts is unlimited by default; a group this big is a bug upstream


class WebhookAlert(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: datetime
    endsAt: datetime | None = None
    fingerprint: str = ""


class WebhookPayload(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    receiver: str = ""
    groupKey: str = ""
    truncatedAlerts: int = Field(0, ge=0)
    alerts: list[WebhookAlert] = Field(max_length=MAX_ALERTS)


def deliveries(
    payload: WebhookPayload,
    *,
    now: float,
    instances: Collection[str],
    alertnames: Collection[str],
    cluster: str = "",
) -> tuple[list[Delivery], Counter[str]]:
    """The deliveries to act on, and a count of the alerts skipped, by reason.

    With ``cluster`` set, only alerts labelled with that cluster are acted on: an Alertmanager shared by
    several clusters (or a Thanos/Mimir ruler above them) may send another cluster's engine of the same name.
    """
    keep: list[Delivery] = []
    skipped: Counter[str] = Counter()
    if payload.truncatedAlerts:
        skipped["truncated"] += payload.truncatedAlerts  # never sent to us: counted so that it shows
    for alert in payload.alerts:
        name = alert.labels.get("alertname", "")
        instance = alert.labels.get("vllm_instance", "")
        if name not in alertnames:
            skipped["other_alert"] += 1
        elif cluster and "cluster" not in alert.labels:
            skipped["missing_cluster"] += 1
        elif cluster and alert.labels["cluster"] != cluster:
            skipped["other_cluster"] += 1
        elif not instance:
            skipped["missing_vllm_instance"] += 1
        elif instance not in instances:
            skipped["unknown_instance"] += 1
        else:
            keep.append(Delivery(now, instance, name, alert.status, alert.startsAt.timestamp(), alert.fingerprint))
    return keep, skipped
