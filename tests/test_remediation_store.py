"""The hook's store and webhook parsing. Pure but for a temporary SQLite file."""

from __future__ import annotations

import json

import pytest

from batchlens.remediation.breaker import EngineState
from batchlens.remediation.store import Delivery, Store
from batchlens.remediation.webhook import WebhookPayload, deliveries
from harness.remediate import alert, notification


def delivery(instance: str = "a", status: str = "firing") -> Delivery:
    return Delivery(10.0, instance, "VllmP99LatencyBreaker", status, 5.0, "f")


def test_a_delivery_is_pending_until_the_state_it_produced_is_saved(tmp_path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.accept([delivery("a"), delivery("b", "resolved")])
    first, second = store.pending()
    store.save("a", EngineState(mode="tripped", strikes=1), 11.0, done=first, outcome="halve")
    assert [d.vllm_instance for d in store.pending()] == ["b"]
    store.close()
    reopened = Store(tmp_path / "s.sqlite")  # what a restart sees
    assert reopened.states() == {"a": EngineState(mode="tripped", strikes=1)}
    assert [d.id for d in reopened.pending()] == [second.id]


def test_a_save_that_fails_halfway_leaves_state_and_inbox_as_they_were(tmp_path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.accept([delivery()])
    [pending] = store.pending()
    store.save("a", EngineState(strikes=1), 11.0)
    unserializable = EngineState(strikes=2, capacity=object())  # fails inside the transaction
    with pytest.raises(TypeError):
        store.save("a", unserializable, 12.0, done=pending, outcome="halve")
    assert store.states() == {"a": EngineState(strikes=1)}
    assert store.pending() == [pending]


def test_the_action_log_appends_one_json_line_per_entry(tmp_path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.log_action({"action": "halve", "target": 16})
    store.log_action({"action": "set_limit", "result": "ok"})
    lines = store.action_log.read_text().splitlines()
    assert [json.loads(line)["action"] for line in lines] == ["halve", "set_limit"]


def test_deliveries_keep_the_breaker_alerts_of_known_engines_and_count_the_rest() -> None:
    no_instance = alert("a")
    del no_instance["labels"]["vllm_instance"]
    payload = WebhookPayload.model_validate(
        notification(
            alert("a"),
            alert("a", "resolved"),
            alert("ghost"),
            no_instance,
            alert("a", name="VllmRequestsQueueing"),
            truncated=3,
        )
    )
    keep, skipped = deliveries(payload, now=42.0, instances={"a"}, alertnames={"VllmP99LatencyBreaker"})
    assert [(d.vllm_instance, d.status, d.received_at) for d in keep] == [
        ("a", "firing", 42.0),
        ("a", "resolved", 42.0),
    ]
    assert keep[0].starts_at == 1_800_000_000.0
    assert skipped == {"unknown_instance": 1, "missing_vllm_instance": 1, "other_alert": 1, "truncated": 3}


def test_with_a_cluster_set_only_that_clusters_alerts_are_acted_on() -> None:
    def in_cluster(name: str | None) -> dict:
        sent = alert("a")
        if name is not None:
            sent["labels"]["cluster"] = name
        return sent

    payload = WebhookPayload.model_validate(notification(in_cluster("east"), in_cluster("west"), in_cluster(None)))
    alertnames = {"VllmP99LatencyBreaker"}
    keep, skipped = deliveries(payload, now=1.0, instances={"a"}, alertnames=alertnames, cluster="east")
    assert len(keep) == 1 and skipped == {"other_cluster": 1, "missing_cluster": 1}
    keep, skipped = deliveries(payload, now=1.0, instances={"a"}, alertnames=alertnames)  # no cluster: all
    assert len(keep) == 3 and not skipped
