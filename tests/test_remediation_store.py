"""The hook's store and webhook parsing, pure but for a temporary SQLite file; and the hook's worker in process,
where a test must catch it between two awaits (its admin and Alertmanager clients faked, each test says which)."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections import Counter

import aiohttp
import pytest
from pydantic import ValidationError

from batchlens.config import Config, Engine
from batchlens.remediation.breaker import EngineState
from batchlens.remediation.server import RemediationServer
from batchlens.remediation.service import Remediator
from batchlens.remediation.store import (
    INBOX_KEEP_SECONDS,
    MAX_PENDING_PER_ENGINE,
    MAX_PENDING_PER_NAMESPACE,
    Delivery,
    InboxFull,
    Store,
)
from batchlens.remediation.webhook import MAX_FUTURE_SECONDS, WebhookPayload, deliveries
from harness.inprocess import Alertmanager, GatedAdmin
from harness.procs import free_port
from harness.remediate import alert, notification

NOW = 1_790_000_042.0  # just after the harness' alerts start


def delivery(instance: str = "a", status: str = "firing") -> Delivery:
    return Delivery(10.0, instance, "VllmP99LatencyBreaker", status, 5.0, "f")


def test_the_running_hook_writes_off_the_event_loop_and_in_order(tmp_path) -> None:
    """A write that waits on the disk (fsync, here a sleep) leaves the loop free to answer the webhook."""
    store = Store(tmp_path / "state.db")

    async def main() -> tuple[int, list[str]]:
        slow = asyncio.ensure_future(store.run(time.sleep, 0.5))
        ticks = 0
        while not slow.done():
            ticks += 1
            await asyncio.sleep(0.01)
        await store.run(store.accept, [delivery("a")])
        await store.run(store.accept, [delivery("b")])
        return ticks, [d.vllm_instance for d in await store.run(store.pending)]

    ticks, pending = asyncio.run(main())
    store.close()
    assert ticks >= 10, f"the loop ran {ticks} times during a 0.5 s write: the write blocked it"
    assert pending == ["a", "b"]


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
    keep, skipped = deliveries(payload, now=NOW, instances={"a"}, alertnames={"VllmP99LatencyBreaker"})
    assert [(d.vllm_instance, d.status, d.received_at) for d in keep] == [
        ("a", "firing", NOW),
        ("a", "resolved", NOW),
    ]
    assert keep[0].starts_at == 1_790_000_000.0
    assert skipped == {"unknown_instance": 1, "missing_vllm_instance": 1, "other_alert": 1, "truncated": 3}


def test_with_a_cluster_set_only_that_clusters_alerts_are_acted_on() -> None:
    def in_cluster(name: str | None) -> dict:
        sent = alert("a")
        if name is not None:
            sent["labels"]["cluster"] = name
        return sent

    payload = WebhookPayload.model_validate(notification(in_cluster("east"), in_cluster("west"), in_cluster(None)))
    alertnames = {"VllmP99LatencyBreaker"}
    keep, skipped = deliveries(payload, now=NOW, instances={"a"}, alertnames=alertnames, cluster="east")
    assert len(keep) == 1 and skipped == {"other_cluster": 1, "missing_cluster": 1}
    keep, skipped = deliveries(payload, now=NOW, instances={"a"}, alertnames=alertnames)  # no cluster: all,
    assert len(keep) == 1 and skipped == {"duplicate": 2}  # and one delivery of the three copies


def test_an_alert_time_in_the_future_is_refused_and_counted() -> None:
    now = NOW
    payload = WebhookPayload.model_validate(
        notification(
            alert("a", "resolved", starts_at=253402297199.0),  # 9999-12-31: would mark every firing stale
            alert("b", starts_at=now + MAX_FUTURE_SECONDS + 1),
            alert("c", starts_at=now + MAX_FUTURE_SECONDS),  # clock skew within the bound: kept
        )
    )
    keep, skipped = deliveries(payload, now=now, instances={"a", "b", "c"}, alertnames={"VllmP99LatencyBreaker"})
    assert [d.vllm_instance for d in keep] == ["c"] and skipped == {"future_starts_at": 2}


def test_copies_in_one_notification_are_one_delivery_the_newest() -> None:
    copies = [alert("a", starts_at=1_790_000_000.0 + k) for k in range(999)]
    payload = WebhookPayload.model_validate(notification(*copies, alert("a", "resolved")))
    keep, skipped = deliveries(payload, now=1_790_001_000.0, instances={"a"}, alertnames={"VllmP99LatencyBreaker"})
    assert [(d.status, d.starts_at) for d in keep] == [("firing", 1_790_000_998.0), ("resolved", 1_790_000_000.0)]
    assert skipped == {"duplicate": 998}


def test_a_fingerprint_longer_than_alertmanagers_is_not_a_payload() -> None:
    sent = alert("a")
    sent["fingerprint"] = "f" * 65
    with pytest.raises(ValidationError, match="fingerprint"):
        WebhookPayload.model_validate(notification(sent))


def test_decided_deliveries_are_forgotten_after_a_week_and_pending_ones_never(tmp_path) -> None:
    store = Store(tmp_path / "s.sqlite")
    store.accept([delivery("old"), delivery("waits")])
    old, _ = store.pending()
    store.save("old", EngineState(), 11.0, done=old, outcome="halve")
    later = Delivery(11.0 + INBOX_KEEP_SECONDS + 1, "new", "VllmP99LatencyBreaker", "firing", 5.0, "f")
    store.accept([later])
    rows = store._db.execute("SELECT vllm_instance FROM inbox ORDER BY id").fetchall()
    assert rows == [("waits",), ("new",)]


def test_an_engine_with_its_fill_of_deliveries_waiting_takes_no_more_and_the_others_still_do(tmp_path) -> None:
    """A flood for an engine that cannot be reached stays pending: 3,000 notifications took 4.5 MB in 1.7 s. What
    does not fit is refused whole (the webhook's 503), never taken in part."""
    store = Store(tmp_path / "s.sqlite")
    store.accept([delivery("stuck") for _ in range(MAX_PENDING_PER_ENGINE - 1)])
    with pytest.raises(InboxFull, match="stuck has 256 deliveries waiting") as refused:
        store.accept([delivery("stuck"), delivery("stuck"), delivery("other")])
    assert refused.value.reason == "inbox_full"
    store.accept([delivery("stuck"), delivery("other")])
    waiting = [d.vllm_instance for d in store.pending()]
    assert waiting.count("stuck") == MAX_PENDING_PER_ENGINE and waiting.count("other") == 1


def test_a_namespace_with_its_share_waiting_takes_no_more_and_another_namespace_still_does(tmp_path) -> None:
    store = Store(tmp_path / "s.sqlite")
    pods = {f"flood/pod-{k}": "flood" for k in range(8)} | {"quiet/pod": "quiet"}
    for k in range(MAX_PENDING_PER_NAMESPACE // MAX_PENDING_PER_ENGINE):  # four pods' fill: the namespace's share
        store.accept([delivery(f"flood/pod-{k}") for _ in range(MAX_PENDING_PER_ENGINE)], pods)
    with pytest.raises(InboxFull, match="namespace flood has its share"):
        store.accept([delivery("flood/pod-7")], pods)  # an engine with room, in a namespace without
    store.accept([delivery("quiet/pod")], pods)
    assert [d.vllm_instance for d in store.pending()].count("quiet/pod") == 1


def test_the_store_stays_within_its_byte_budget_forgetting_the_oldest_decided_deliveries(tmp_path) -> None:
    store = Store(tmp_path / "s.sqlite", max_bytes=4 * 2**20)
    batches, size = 300, 200
    for batch in range(batches):
        store.accept([delivery(f"engine-{k % 50}") for k in range(size)])
        # Decided at once, as a hook that keeps up decides them (one statement: a mark_done each is an fsync each)
        store._db.execute("UPDATE inbox SET done_at = 11.0, outcome = 'halve' WHERE done_at IS NULL")
        store.log_action({"action": "halve", "batch": batch, "pad": "x" * 2000})
        assert store.bytes_on_disk() <= store.budget.total, f"batch {batch}: {store.bytes_on_disk()} bytes"
    ids = [row[0] for row in store._db.execute("SELECT id FROM inbox ORDER BY id")]
    assert ids[0] > 1 and ids == list(range(ids[0], batches * size + 1)), "not the oldest that went"
    assert len(ids) > 0.5 * (batches * size - ids[0]), f"{len(ids)} kept: it forgets far more than it must"


def test_with_the_budget_full_of_waiting_deliveries_a_notification_is_refused_and_nothing_waiting_is_lost(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr("batchlens.remediation.store.MAX_PENDING_PER_ENGINE", 10**6)
    monkeypatch.setattr("batchlens.remediation.store.MAX_PENDING_PER_NAMESPACE", 10**6)
    store = Store(tmp_path / "s.sqlite", max_bytes=4 * 2**20)
    with pytest.raises(InboxFull, match="byte budget") as full:
        for _ in range(1000):
            store.accept([delivery("e") for _ in range(500)])
    assert full.value.reason == "store_full"
    waiting = len(store.pending())
    assert waiting > 10_000 and store.bytes_on_disk() <= store.budget.total


def test_the_action_log_moves_aside_at_its_size_bound(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("batchlens.remediation.store.ACTION_LOG_MAX_BYTES", 100)
    store = Store(tmp_path / "s.sqlite")
    for k in range(5):
        store.log_action({"action": "halve", "n": k, "pad": "x" * 40})
    current = [json.loads(line)["n"] for line in store.action_log.read_text().splitlines()]
    previous = [json.loads(line)["n"] for line in (tmp_path / "s.sqlite.actions.jsonl.1").read_text().splitlines()]
    assert previous == [2, 3] and current == [4], (previous, current)  # nothing lost but the oldest generation


def test_an_engine_in_a_namespace_takes_alerts_of_that_namespace_from_a_token_good_for_it() -> None:
    def labelled(instance: str, namespace: str | None) -> dict:
        sent = alert(instance)
        if namespace is not None:
            sent["labels"]["namespace"] = namespace
        return sent

    engines = {"a/vllm": "a", "b/vllm": "b", "static": ""}
    payload = WebhookPayload.model_validate(
        notification(labelled("a/vllm", "a"), labelled("b/vllm", "a"), labelled("static", None))
    )

    def kept(scope) -> tuple[list[str], dict]:
        keep, skipped = deliveries(payload, now=NOW, instances=engines, alertnames={"VllmP99LatencyBreaker"},
                                   namespace_of=engines, scope=scope)  # fmt: skip
        return [d.vllm_instance for d in keep], dict(skipped)

    assert kept(None) == (["a/vllm", "static"], {"namespace_mismatch": 1})  # the service's token
    assert kept(frozenset({"a"})) == (["a/vllm"], {"other_namespace": 2})  # a's token: a's engines only
    assert kept(frozenset({"a", "b"})) == (["a/vllm"], {"namespace_mismatch": 1, "other_namespace": 1})  # shared


def test_a_count_past_what_metrics_can_render_or_a_time_without_its_zone_is_no_payload() -> None:
    """A 400-digit truncatedAlerts broke /metrics for good (a counter is a float there); a time without its zone
    would be read in this host's, hours off."""
    with pytest.raises(ValidationError, match="truncatedAlerts"):
        WebhookPayload.model_validate(notification(alert("a"), truncated=10**400))
    naive = alert("a")
    naive["startsAt"] = "2026-12-06T00:00:00"
    with pytest.raises(ValidationError, match="timezone"):
        WebhookPayload.model_validate(notification(naive))


def test_a_delivery_for_an_engine_that_left_is_dropped_and_the_rest_are_decided(tmp_path) -> None:
    """A tenant fires on its own pod, then deletes it: its pending delivery raised KeyError on every pass, ahead
    of every other tenant's (the inbox is read oldest first). Engines on ports nobody listens on."""
    config = Config.model_validate({"engines": [{"name": "static", "url": f"http://127.0.0.1:{free_port()}"}]})
    store = Store(tmp_path / "state.db")
    pod = Engine(name="ns-a/pod", url=f"http://127.0.0.1:{free_port()}", labels={"namespace": "ns-a"})

    async def run() -> dict:
        async with aiohttp.ClientSession() as session:
            hook = Remediator(config, store, session, {})
            await hook.engines_found([pod])
            fired = alert("ns-a/pod")
            fired["labels"]["namespace"] = "ns-a"
            await hook.accept(WebhookPayload.model_validate(notification(fired)), frozenset({"ns-a"}))
            await hook.engines_found([])  # the pod is gone before the worker decides
            await hook.accept(WebhookPayload.model_validate(notification(alert("static", "resolved"))))
            await hook.step()
            await hook.settle()  # the engines' passes, each a task of its own
            return dict(hook.deliveries)

    decided = asyncio.run(run())
    assert store.pending() == [] and decided["unknown_instance"] == 1, decided


def test_an_engine_whose_admin_token_variable_is_not_set_is_said_at_start(tmp_path, caplog) -> None:
    """Otherwise every call's 401 says only that the token does not match, and the operator hunts a wrong one."""
    engines = [{"name": "a", "url": f"http://127.0.0.1:{free_port()}", "admin_token_env": "A_TOKEN"},
               {"name": "b", "url": f"http://127.0.0.1:{free_port()}", "admin_token_env": "B_TOKEN"}]  # fmt: skip

    # A discovered pod whose namespace's Secret could not be read: discovery warns of that, and reads it again.
    pod = Engine(name="ns-a/pod", url=f"http://127.0.0.1:{free_port()}").with_admin_token(None, "the Secret ns-a/t")

    async def start() -> None:
        async with aiohttp.ClientSession() as session:
            hook = Remediator(Config.model_validate({"engines": engines}), Store(tmp_path / "state.db"), session,
                              {"B_TOKEN": "set"})  # fmt: skip
            await hook.engines_found([pod])

    with caplog.at_level(logging.ERROR, "batchlens.remediate"):
        asyncio.run(start())
    assert "a: the variable A_TOKEN is not set" in caplog.text and "B_TOKEN" not in caplog.text
    assert "ns-a/pod" not in caplog.text, "a restart is no cure for a Secret discovery reads again"


def test_the_webhook_token_from_a_secret_file_is_read_without_its_newline(tmp_path) -> None:
    config = Config.model_validate({"remediate": {"state_path": str(tmp_path / "state.db")}})
    assert RemediationServer(config, {"BATCHLENS_WEBHOOK_TOKEN": "tok\n"}).token == "tok"


def test_a_pass_that_ends_while_a_step_reads_the_inbox_is_not_given_its_delivery_again(tmp_path) -> None:
    """The step read the inbox, then dropped a departed pod's leftovers (a store write each); the engine's pass
    ended meanwhile, and the step started a new one with the delivery it had just decided: two GETs, and with
    cooldown_seconds 0 two halvings for one alert."""
    config = Config.model_validate({"engines": [{"name": "a", "url": "http://127.0.0.1:9"}],
                                    "breaker": {"cooldown_seconds": 0}})  # fmt: skip
    store = Store(tmp_path / "state.db")
    now = time.time()
    leftovers = [Delivery(now, "ns/gone", "VllmP99LatencyBreaker", "firing", now - 60, f"g{i}") for i in range(20)]

    async def run() -> tuple[int, Counter]:
        async with aiohttp.ClientSession() as session:
            hook = Remediator(config, store, session, {})
            admin = hook.admins["a"] = GatedAdmin()
            admin.gate.clear()
            await hook.accept(WebhookPayload.model_validate(notification(alert("a", starts_at=now - 30))))
            await hook.step()  # the pass for "a" starts; its GET waits at the gate
            await asyncio.sleep(0.05)
            await store.run(store.accept, leftovers)
            second = asyncio.create_task(hook.step())  # reads the inbox while the delivery is not yet done
            await asyncio.sleep(0)
            admin.gate.set()  # the first pass decides while the step drops the leftovers
            await second
            await asyncio.sleep(0.1)
            await hook.settle()
            return admin.gets, hook.deliveries

    gets, decided = asyncio.run(run())
    assert (gets, decided["halve"]) == (2, 1), (gets, decided)  # the delivery's GET and the PUT's answer


def test_a_page_decided_just_before_shutdown_is_posted_whatever_the_backoff(tmp_path) -> None:
    """A pass queued its cold-start page after the step had posted pages, and Alertmanager had refused a post (a
    restart): the stop ended the worker, the saved state said the page was sent, and on-call never heard.
    Alertmanager's client is the fake boundary: it refuses the first two posts."""
    config = Config.model_validate({"engines": [{"name": "a", "url": "http://127.0.0.1:9"}]})
    store = Store(tmp_path / "state.db")
    now = time.time()
    store.save("a", EngineState(mode="tripped", strikes=2, original_limit=64, target_limit=32, applied_limit=32,
                                capacity=64, last_action_at=now - 600, firing_seen_at=now - 100), now)  # fmt: skip

    async def run() -> list:
        async with aiohttp.ClientSession() as session:
            hook = Remediator(config, store, session, {}, alertmanager=(am := Alertmanager(refuse=2)))
            hook.admins["a"] = GatedAdmin(limit=32)
            stop = asyncio.Event()
            worker = asyncio.create_task(hook.run(stop))
            await asyncio.sleep(0.1)
            await hook.accept(WebhookPayload.model_validate(notification(alert("a", starts_at=now - 30))))
            while am.calls < 2:
                await asyncio.sleep(0.001)  # the page's posts refused twice: stop inside the 2 s backoff
            stop.set()
            await worker
            return am.posted

    posted = asyncio.run(run())
    assert store.states()["a"].paged == ("cold_start",)
    assert [a.labels["reason"] for a in posted] == ["cold_start"]


def test_a_decision_whose_save_fails_pages_nobody(tmp_path) -> None:
    """The page was queued before the save; a full disk then made every pass decide the delivery again, and each
    decision paged on-call "cold start at 1" while nothing changed. Alertmanager's client is the fake boundary."""
    config = Config.model_validate({"engines": [{"name": "a", "url": "http://127.0.0.1:9"}]})
    store = Store(tmp_path / "state.db")
    now = time.time()
    store.save("a", EngineState(mode="tripped", strikes=2, original_limit=64, target_limit=32, applied_limit=32,
                                capacity=64, last_action_at=now - 600, firing_seen_at=now - 100), now)  # fmt: skip

    def full(*_args, **_kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    async def run() -> list:
        async with aiohttp.ClientSession() as session:
            hook = Remediator(config, store, session, {}, alertmanager=(am := Alertmanager()))
            hook.admins["a"] = GatedAdmin(limit=32)
            await hook.accept(WebhookPayload.model_validate(notification(alert("a", starts_at=now - 30))))
            store.save = full
            for _ in range(3):
                await hook.step()
                await hook.settle()
            await hook.step()
            return am.posted

    assert asyncio.run(run()) == []


def test_a_pod_recreated_under_its_name_keeps_its_waiting_delivery(tmp_path) -> None:
    """Discovery took the moved pod out, read the store, then let it join again at its new IP; a step between saw
    an unknown engine and dropped its firing as unknown_instance, never to be decided."""
    store = Store(tmp_path / "state.db")
    old, new = (Engine(name="ns/a", url=f"http://10.0.0.{i}:8000", labels={"namespace": "ns"}) for i in (1, 2))
    fired = alert("ns/a", starts_at=time.time() - 30)
    fired["labels"]["namespace"] = "ns"

    async def run() -> list:
        async with aiohttp.ClientSession() as session:
            hook = Remediator(Config.model_validate({}), store, session, {})
            await hook.engines_found([old])
            await hook.accept(WebhookPayload.model_validate(notification(fired)))
            step = asyncio.create_task(hook.step())
            await asyncio.sleep(0)  # the step has sent its inbox read
            await hook.engines_found([new])
            await step
            await hook.settle(cancel=True)
            return store.pending()

    assert [d.vllm_instance for d in asyncio.run(run())] == ["ns/a"]


def test_the_breakers_silence_counts_from_when_its_engine_joined(tmp_path) -> None:
    """A pod gone for longer than firing_silence_seconds came back under its name, and its first pass took the
    episode for over: its firings were not heard while it was gone. Its admin client is the fake boundary."""
    t0 = 1_790_000_000.0
    tripped = EngineState(mode="tripped", strikes=1, original_limit=64, target_limit=32, applied_limit=32,
                          capacity=64, last_action_at=t0 - 2000, firing_seen_at=t0 - 2000)  # fmt: skip
    store = Store(tmp_path / "state.db")
    store.save("ns/b", tripped, t0)
    clock = [t0]

    async def run() -> str:
        async with aiohttp.ClientSession() as session:
            hook = Remediator(Config.model_validate({}), store, session, {}, clock=lambda: clock[0])
            clock[0] = t0 + 1800  # the hook has run 30 minutes when the pod comes back
            await hook.engines_found([Engine(name="ns/b", url="http://10.0.0.9:8000", labels={"namespace": "ns"})])
            hook.admins["ns/b"] = GatedAdmin(limit=32)
            await hook.step()
            await hook.settle()
            return hook.states["ns/b"].mode

    assert asyncio.run(run()) == "tripped"
