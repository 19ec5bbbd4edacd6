"""Alertmanager's webhook payload (version 4) and what the hook takes from it. Pure: no HTTP.

Alertmanager posts one notification per alert group; it may mix firing and
resolved alerts, for several engines. :func:`deliveries` turns it into one
:class:`Delivery` per alert the hook acts on, and counts, with a reason, the
alerts it will not act on, so a bad payload is visible in the metrics and the
log and never silently dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from batchlens.remediation.store import Delivery

BREAKER_ALERT = "VllmP99LatencyBreaker"
KV_ALERT = "VllmKvCacheBlocksHigh"
MAX_ALERTS = 1000  # Alertmanager's own max_alerts is unlimited by default; a group this big is a bug upstream
MAX_FINGERPRINT = 64  # Alertmanager's are 16 hex digits: anything longer is not from it, and is not stored
#: How far in the future a startsAt may be (clock skew between Prometheus and this host). A later one is refused:
#: kept, it would mark every real firing before it "already resolved", or hold a resolution off for good.
MAX_FUTURE_SECONDS = 300.0


class WebhookAlert(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    # With their zone, as Alertmanager sends them: a naive time would be read in this host's zone (hours off).
    startsAt: AwareDatetime
    endsAt: AwareDatetime | None = None
    fingerprint: str = Field("", max_length=MAX_FINGERPRINT)


class WebhookPayload(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    receiver: str = ""
    groupKey: str = ""
    # Bounded: it is added to a counter that /metrics renders as a float (a 400-digit count broke it for good)
    truncatedAlerts: int = Field(0, ge=0, le=10**9)
    alerts: list[WebhookAlert] = Field(max_length=MAX_ALERTS)


def deliveries(
    payload: WebhookPayload,
    *,
    now: float,
    instances: Collection[str],
    alertnames: Collection[str],
    cluster: str = "",
    namespace_of: Mapping[str, str] | None = None,
    scope: Collection[str] | None = None,
) -> tuple[list[Delivery], Counter[str]]:
    """The deliveries to act on, and a count of the alerts skipped, by reason.

    With ``cluster`` set, only alerts labelled with that cluster are acted on: an Alertmanager shared by
    several clusters (or a Thanos/Mimir ruler above them) may send another cluster's engine of the same name.

    An engine in a namespace (``namespace_of``, a discovered one) is acted on only by an alert labelled with that
    namespace, and, with ``scope`` (the namespaces whose tenant's token sent the notification), only when it is
    one of them: a tenant's credential never reaches another tenant's engines.

    One notification gives at most one delivery per engine, alert and status, the newest ``startsAt``: all the
    breaker needs. The rest are counted ``duplicate``, so that a thousand copies cost one row of the inbox.
    """
    keep: dict[tuple[str, str, str], Delivery] = {}
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
        elif scope is not None and (namespace_of or {}).get(instance, "") not in scope:
            skipped["other_namespace"] += 1
        elif (namespace_of or {}).get(instance, "") not in ("", alert.labels.get("namespace")):
            skipped["namespace_mismatch"] += 1
        elif alert.startsAt.timestamp() > now + MAX_FUTURE_SECONDS:
            skipped["future_starts_at"] += 1
        else:
            delivery = Delivery(now, instance, name, alert.status, alert.startsAt.timestamp(), alert.fingerprint)
            key = (instance, name, alert.status)
            if key in keep:
                skipped["duplicate"] += 1
            if key not in keep or delivery.starts_at > keep[key].starts_at:
                keep[key] = delivery
    return list(keep.values()), skipped
