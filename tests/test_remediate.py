"""`batchlens remediate` as a real process, over real HTTP: the webhook, the breaker acting on the
simulator's admin API, persistence across kill -9, faults, paging through a real Alertmanager.

Fakes: the simulator stands in for vLLM on a GPU; `Upstreams` (harness/upstreams.py) plays an admin API
that answers 401 or hangs. A real vLLM is in test_remediate_vllm.py.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchlens.admin_api import BATCH_PATH
from batchlens.remediation.store import MAX_PENDING_PER_NAMESPACE
from harness.admin import AdminClient
from harness.alertmanager import AlertmanagerServer
from harness.exporter import ExporterProcess, pick
from harness.procs import free_port, http_get
from harness.prometheus import require_binary
from harness.remediate import WEBHOOK_TOKEN, RemediateProcess, alert, notification
from harness.simulator import SimulatorProcess

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
CAPACITY = 32
T0 = 1_790_000_000.0  # the alerts' startsAt: in the past, as a real one is


def eventually(check: Callable[[], object], what: str, timeout: float = 15) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)


@pytest.fixture
def sim(tmp_path) -> Iterator[SimulatorProcess]:
    s = SimulatorProcess(tmp_path, speed=20, args=("--max-num-seqs", str(CAPACITY)))
    yield s
    s.stop()


def hook_config(*engines: tuple[str, str], **breaker) -> dict:
    return {
        "engines": [{"name": name, "url": url} for name, url in engines],
        "breaker": {"cooldown_seconds": 30, "recovery_interval_seconds": 1, **breaker},
    }


@pytest.fixture
def start_hook(tmp_path, sim) -> Iterator[Callable[..., RemediateProcess]]:
    hooks = []

    def start(config: dict | None = None, **kwargs) -> RemediateProcess:
        hook = RemediateProcess(tmp_path, config or hook_config(("sim", sim.url)),
                                env={"BATCHLENS_ADMIN_TOKEN": sim.token}, **kwargs)  # fmt: skip
        hooks.append(hook)
        return hook

    yield start
    for hook in hooks:
        hook.stop()


def limit_of(sim: SimulatorProcess) -> int:
    return AdminClient(sim.url, sim.token).state().max_num_active_seqs


def decided(hook: RemediateProcess, outcome: str | None = None) -> float:
    """Deliveries the hook has decided (of one outcome): what a wait watches instead of the clock."""
    labels = {"outcome": outcome} if outcome else {}
    return sum(pick(hook.samples(), "batchlens_remediation_deliveries_total", **labels).values())


def wait_decided(hook: RemediateProcess, n: int, outcome: str | None = None) -> None:
    eventually(lambda: decided(hook, outcome) >= n, f"{n} deliveries decided ({outcome or 'any'})")


def wait_limit(sim: SimulatorProcess, value: int, timeout: float = 15) -> None:
    eventually(lambda: limit_of(sim) == value, f"the limit becoming {value} (it is {limit_of(sim)})", timeout)


def test_a_firing_alert_halves_once_and_deliveries_inside_the_cooldown_only_count(sim, start_hook) -> None:
    hook = start_hook()
    status, body = hook.post(notification(alert("sim")))
    assert (status, body["accepted"]) == (200, 1)
    wait_limit(sim, 16)
    for _ in range(3):  # a retry, an HA twin, a repeat: all inside the 30 s cooldown
        assert hook.post(notification(alert("sim")))[0] == 200
    wait_decided(hook, 3, "cooldown")
    assert limit_of(sim) == 16
    engine = hook.health()["engines"]["sim"]
    assert engine | {"strikes": 1, "mode": "tripped"} == engine
    samples = hook.samples()
    assert pick(samples, "batchlens_remediation_deliveries_total", outcome="cooldown") == {
        frozenset({("outcome", "cooldown")}): 3.0
    }
    assert [a["action"] for a in hook.actions() if a["action"] != "set_limit"] == ["halve"]


def test_three_strikes_cold_start_then_the_limit_recovers_step_by_step(sim, start_hook) -> None:
    hook = start_hook(hook_config(("sim", sim.url), cooldown_seconds=1))
    for expected in (16, 8, 1):  # the third strike is cold start, at 1
        hook.post(notification(alert("sim")))
        wait_limit(sim, expected)
        time.sleep(1.1)  # past the cooldown: the next delivery is a new strike
    assert hook.health()["engines"]["sim"]["mode"] == "cold_start"
    hook.post(notification(alert("sim", "resolved")))
    seen = set()
    eventually(lambda: seen.add(limit_of(sim)) or limit_of(sim) == CAPACITY, "recovery to 32", timeout=30)
    assert {4, 7} <= seen, f"recovery steps by max(1, 10% of 32) = 3: saw {sorted(seen)}"
    # The engine answers the PUT before the hook records it as applied: wait for the hook's own record.
    eventually(lambda: hook.health()["engines"]["sim"]["applied_limit"] == CAPACITY, "the hook recording 32")
    engine = hook.health()["engines"]["sim"]
    assert engine | {"mode": "closed", "strikes": 0} == engine
    state = pick(hook.samples(), "batchlens_breaker_state", vllm_instance="sim")
    assert {dict(k)["state"]: v for k, v in state.items()} == {
        "closed": 1, "recovering": 0, "tripped": 0, "cold_start": 0}  # fmt: skip


def test_one_notification_mixing_engines_and_bad_alerts_handles_each_on_its_own(tmp_path, sim, start_hook) -> None:
    other = SimulatorProcess(tmp_path, speed=20, args=("--max-num-seqs", str(CAPACITY)))
    try:
        hook = start_hook(hook_config(("sim", sim.url), ("other", other.url)))
        no_instance = alert("sim")
        del no_instance["labels"]["vllm_instance"]
        status, body = hook.post(notification(
            alert("sim"), alert("other", "resolved"), alert("ghost"), no_instance,
            alert("sim", name="VllmKvCacheBlocksHigh"),
        ))  # fmt: skip
        assert status == 200
        assert body == {"status": "accepted", "accepted": 2, "unknown_instance": 1, "missing_vllm_instance": 1,
                        "other_alert": 1}  # fmt: skip
        wait_limit(sim, 16)
        time.sleep(1)
        assert limit_of(other) == CAPACITY
    finally:
        other.stop()


@pytest.mark.parametrize(
    ("body", "token", "status"),
    [
        (notification(alert("sim")), None, 401),
        (notification(alert("sim")), "wrong-token", 401),
        (notification(alert("sim")), "\xff\xfe", 401),  # bytes that are not UTF-8: it answered 500, a traceback
        (b"{not json", WEBHOOK_TOKEN, 400),
        ({**notification(alert("sim")), "version": "3"}, WEBHOOK_TOKEN, 400),
        ({**notification(alert("sim")), "alerts": "sim"}, WEBHOOK_TOKEN, 400),
        ({**notification(), "alerts": [{"status": "firing", "labels": {}}]}, WEBHOOK_TOKEN, 400),  # no startsAt
        (b'{"version": "4", "pad": "' + b"x" * (10 * 1024 * 1024) + b'"}', WEBHOOK_TOKEN, 413),
    ],
    ids=[
        "no-token",
        "wrong-token",
        "non-utf8-token",
        "malformed-json",
        "version-3",
        "alerts-not-a-list",
        "alert-without-times",
        "10MB",
    ],
)
def test_bad_requests_get_a_clear_status_and_change_nothing(sim, start_hook, body, token, status) -> None:
    hook = start_hook()
    got, reply = hook.post(body, token=token)
    assert got == status, reply
    time.sleep(0.5)
    assert limit_of(sim) == CAPACITY
    assert hook.health()["engines"]["sim"]["strikes"] == 0
    assert pick(hook.samples(), "batchlens_webhook_requests_total", code=str(status))


def test_truncated_alerts_are_counted(sim, start_hook) -> None:
    hook = start_hook()
    status, body = hook.post(notification(alert("sim"), truncated=7))
    assert status == 200 and body["truncated"] == 7
    wait_limit(sim, 16)
    assert pick(hook.samples(), "batchlens_remediation_deliveries_total", outcome="truncated")


def test_without_a_webhook_token_the_hook_answers_503_and_says_why(sim, start_hook) -> None:
    hook = start_hook(token="")
    status, body = hook.post(notification(alert("sim")))
    assert status == 503 and "BATCHLENS_WEBHOOK_TOKEN" in body["error"]


def test_an_out_of_order_firing_after_its_resolution_never_acts(sim, start_hook) -> None:
    hook = start_hook()
    hook.post(notification(alert("sim", "resolved", starts_at=T0)))
    hook.post(notification(alert("sim", "firing", starts_at=T0)))  # delivered late
    hook.post(notification(alert("sim", "firing", starts_at=T0 - 60)))  # older still
    wait_decided(hook, 2, "stale")
    assert limit_of(sim) == CAPACITY
    assert pick(hook.samples(), "batchlens_remediation_deliveries_total", outcome="stale")


def test_after_kill_9_no_strike_is_lost_and_nothing_is_halved_twice(sim, start_hook) -> None:
    hook = start_hook(hook_config(("sim", sim.url), cooldown_seconds=4))
    hook.post(notification(alert("sim")))
    wait_limit(sim, 16)
    halved = time.monotonic()
    hook.kill9()
    hook.start()
    assert hook.health()["engines"]["sim"]["strikes"] == 1
    hook.post(notification(alert("sim")))  # a replay inside the cooldown, after the restart
    wait_decided(hook, 1, "cooldown")
    assert limit_of(sim) == 16
    time.sleep(max(0.0, halved + 4.2 - time.monotonic()))  # the 4 s cooldown passes
    hook.post(notification(alert("sim")))  # past the cooldown: strike 2 continues the episode
    wait_limit(sim, 8)
    assert hook.health()["engines"]["sim"]["strikes"] == 2


def test_a_delivery_accepted_before_kill_9_is_decided_once_after_the_restart(tmp_path) -> None:
    port = free_port()  # nothing listens yet: the engine cannot be observed, so the delivery waits
    hook = RemediateProcess(tmp_path, hook_config(("sim", f"http://127.0.0.1:{port}")),
                            env={"BATCHLENS_ADMIN_TOKEN": "sim-admin-token"})  # fmt: skip
    sim = None
    try:
        assert hook.post(notification(alert("sim")))[0] == 200
        eventually(lambda: pick(hook.samples(), "batchlens_remediation_actions_total", action="observe",
                                result="unreachable"), "the engine found unreachable")  # fmt: skip
        assert hook.health()["engines"]["sim"]["strikes"] == 0 and decided(hook) == 0  # it waits, undecided
        hook.kill9()
        sim = SimulatorProcess(tmp_path, speed=20, args=("--max-num-seqs", str(CAPACITY)), port=port)
        hook.start()
        wait_limit(sim, 16)
        wait_decided(hook, 1, "halve")
        assert limit_of(sim) == 16 and hook.health()["engines"]["sim"]["strikes"] == 1 and decided(hook) == 1
        assert [a["action"] for a in hook.actions() if a["action"] != "set_limit"] == ["halve"]
    finally:
        hook.stop()
        if sim is not None:
            sim.stop()


def test_an_admin_api_that_answers_401_is_recorded_and_retried_with_backoff(tmp_path, upstreams) -> None:
    url = upstreams.add("engine", admin={"max_num_seqs": 32, "max_num_active_seqs": 32, "num_running": 0,
                                         "num_waiting": 0}, admin_token="the-right-token")  # fmt: skip
    hook = RemediateProcess(tmp_path, hook_config(("e", url)), env={"BATCHLENS_ADMIN_TOKEN": "a-wrong-token"})
    try:
        hook.post(notification(alert("e")))
        calls = upstreams.engines["engine"].admin_calls_at
        eventually(lambda: len(calls) >= 5, "four tries", timeout=20)
        gaps = [b - a for a, b in itertools.pairwise(calls[1:5])]  # the delivery's tries (the first: the startup read)
        # The backoff doubles (1, 2, 4 s): no wait short, and the last far longer than the first. Not each longer
        # than the one before: on a loaded machine the worker's passes come late, and 1 s and 2 s both became 2.
        assert min(gaps) > 0.8 and gaps[2] > 1.6 * gaps[0], gaps
        assert pick(hook.samples(), "batchlens_remediation_actions_total", action="observe", result="http_401")
        assert hook.health()["engines"]["e"]["strikes"] == 0  # nothing decided on a blind guess
        log = hook.process.log_path.read_text()
        assert "a-wrong-token" not in log  # the token is never logged
        assert ": 401 'unauthorized' (does the engine's admin token" in log, "the server's own reason is logged"
    finally:
        hook.stop()


def test_a_hanging_admin_api_does_not_slow_the_webhook(tmp_path, upstreams) -> None:
    url = upstreams.add("engine", behavior="hang", admin={"max_num_seqs": 32})
    hook = RemediateProcess(tmp_path, hook_config(("e", url)), env={"BATCHLENS_ADMIN_TOKEN": "t"})
    try:
        hook.post(notification(alert("e")))
        time.sleep(0.5)  # the worker is now waiting on the hanging GET
        t0 = time.monotonic()
        assert hook.post(notification(alert("e", "resolved")))[0] == 200
        assert time.monotonic() - t0 < 1.0
        eventually(lambda: pick(hook.samples(), "batchlens_remediation_actions_total", result="timeout"),
                   "the GET timing out (5 s) and being counted")  # fmt: skip
    finally:
        hook.stop()


def test_an_engine_that_hangs_delays_no_other_engines_breaker(tmp_path, sim, upstreams) -> None:
    """On a shared cluster one tenant's wedged engine must not hold up another's remediation: the hook once
    decided every delivery in one line, and each waited out the hanging engine's 5 s admin timeout first."""
    stuck = upstreams.add("stuck", behavior="hang", admin={"max_num_seqs": 32})
    config = hook_config(("stuck", stuck), ("sim", sim.url))
    config["engines"][0]["admin_token_env"] = "STUCK_TOKEN"  # each engine its own token
    hook = RemediateProcess(tmp_path, config, env={"BATCHLENS_ADMIN_TOKEN": sim.token, "STUCK_TOKEN": "t"})
    try:
        eventually(lambda: "startup: stuck: cannot read" in hook.process.log_path.read_text(), "the startup read")
        hook.post(notification(alert("stuck"), alert("sim")))  # the stuck engine's delivery first in the inbox
        wait_limit(sim, CAPACITY // 2)

        def stuck_reads() -> dict:
            return pick(hook.samples(), "batchlens_remediation_actions_total", vllm_instance="stuck", action="observe")

        # ... while the stuck engine's GET for its own delivery has not yet timed out
        assert not stuck_reads(), "the stuck engine's GET ended before the other engine was halved"
        eventually(stuck_reads, "the stuck engine's own GET timing out, counted")
    finally:
        hook.stop()


def test_a_put_that_fails_is_retried_until_it_lands(tmp_path) -> None:
    sim = SimulatorProcess(tmp_path, speed=20, args=("--max-num-seqs", str(CAPACITY)))
    port = sim.port
    hook = RemediateProcess(tmp_path, hook_config(("sim", sim.url), cooldown_seconds=1),
                            env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
    try:
        hook.post(notification(alert("sim")))
        wait_limit(sim, 16)
        sim.stop()  # the engine goes away; the hook decides on the last limit it knows, 16 -> 8
        time.sleep(1.1)
        hook.post(notification(alert("sim")))
        eventually(lambda: pick(hook.samples(), "batchlens_remediation_actions_total", action="set_limit",
                                result="unreachable"), "a failed PUT counted")  # fmt: skip
        sim = SimulatorProcess(tmp_path, speed=20, args=("--max-num-seqs", str(CAPACITY)), port=port)
        wait_limit(sim, 8, timeout=30)  # the retry lands on the engine that came back
        # and the hook records it once the PUT's answer is back: the engine can show the limit a moment before
        eventually(lambda: hook.health()["engines"]["sim"]["applied_limit"] == 8, "the hook's record of the limit")
    finally:
        hook.stop()
        sim.stop()


def test_kv_pressure_resets_the_prefix_cache_once_per_cooldown_when_enabled(tmp_path, upstreams) -> None:
    url = upstreams.add("engine", admin={"max_num_seqs": 32, "max_num_active_seqs": 32, "num_running": 0,
                                         "num_waiting": 0}, admin_token="t")  # fmt: skip
    hook = RemediateProcess(tmp_path, hook_config(("e", url), reset_prefix_cache=True),
                            env={"BATCHLENS_ADMIN_TOKEN": "t"})  # fmt: skip
    try:
        kv = alert("e", name="VllmKvCacheBlocksHigh")
        assert hook.post(notification(kv))[1]["accepted"] == 1
        eventually(lambda: upstreams.engines["engine"].prefix_cache_resets == 1, "one POST /reset_prefix_cache")
        hook.post(notification(kv))  # inside the cooldown
        wait_decided(hook, 1, "cooldown")
        assert upstreams.engines["engine"].prefix_cache_resets == 1
        assert upstreams.engines["engine"].admin["max_num_active_seqs"] == 32  # KV pressure never halves
        assert pick(hook.samples(), "batchlens_remediation_actions_total", action="reset_prefix_cache", result="ok")
    finally:
        hook.stop()


def test_with_alertmanager_down_the_hook_keeps_working(sim, start_hook) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    hook = start_hook({**hook_config(("sim", sim.url), strikes=1), "remediate": {"alertmanager_url": dead}})
    hook.post(notification(alert("sim")))
    wait_limit(sim, 1)  # strike 1 of 1: cold start
    eventually(lambda: pick(hook.samples(), "batchlens_remediation_pages_total", reason="cold_start", result="error"),
               "the failed page counted")  # fmt: skip
    assert hook.post(notification(alert("sim", "resolved")))[0] == 200
    wait_limit(sim, 4)  # recovery goes on
    assert hook.health()["status"] == "ok"


def test_cold_start_pages_on_call_once_through_a_real_alertmanager(tmp_path, sim, start_hook) -> None:
    am = AlertmanagerServer(tmp_path / "am", ROOT / "provisioning" / "alertmanager" / "alertmanager.yml")
    try:
        hook = start_hook({**hook_config(("sim", sim.url), strikes=1, cooldown_seconds=1),
                           "remediate": {"alertmanager_url": am.url}})  # fmt: skip
        hook.post(notification(alert("sim")))
        wait_limit(sim, 1)
        pages = eventually(lambda: [a for a in am.alerts() if a["labels"]["alertname"] == "VllmBreakerEscalation"],
                           "the page in Alertmanager")  # fmt: skip
        assert (
            pages[0]["labels"] | {"vllm_instance": "sim", "reason": "cold_start", "severity": "critical"}
            == (pages[0]["labels"])
        )
        assert {r["name"] for r in pages[0]["receivers"]} == {"page"}
        time.sleep(1.1)
        hook.post(notification(alert("sim")))  # still breaching, past the cooldown: cold start holds
        wait_decided(hook, 2)
        sent = pick(hook.samples(), "batchlens_remediation_pages_total", reason="cold_start", result="sent")
        assert list(sent.values()) == [1.0], sent
    finally:
        am.stop()


def test_overload_holds_the_limit_and_escalates_capacity(sim, start_hook) -> None:
    AdminClient(sim.url, sim.token).set_limit(2)
    request = {"model": "deepseek-sim", "prompt": [1] * 2048, "max_tokens": 2000}
    with sim.clients(20, lambda i: request):  # 18 waiting behind a batch of 2: a queue 9 batches long
        eventually(lambda: AdminClient(sim.url, sim.token).state().num_waiting >= 12, "a long queue")
        hook = start_hook()
        hook.post(notification(alert("sim")))
        eventually(lambda: pick(hook.samples(), "batchlens_remediation_pages_total", reason="capacity"),
                   "the capacity escalation")  # fmt: skip
        assert limit_of(sim) == 2 and hook.health()["engines"]["sim"]["strikes"] == 0
        assert [a["action"] for a in hook.actions()] == ["hold_overload"]


def test_the_metrics_pass_promtool(sim, start_hook) -> None:
    hook = start_hook()
    hook.post(notification(alert("sim")))
    wait_limit(sim, 16)
    promtool = require_binary("promtool", "prometheus")
    from harness.procs import http_get

    text = http_get(hook.url + "/metrics")[1]
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    for family in ("batchlens_breaker_state", "batchlens_breaker_strikes", "batchlens_batch_limit_target",
                   "batchlens_remediation_actions_total", "batchlens_webhook_requests_total"):  # fmt: skip
        assert family.encode() in text, family


def test_with_the_admin_api_on_its_own_port_the_hook_and_the_exporter_use_that_port_alone(tmp_path) -> None:
    """vLLM's BATCHLENS_ADMIN_PORT, as the simulator's --admin-port: the API port no longer serves the admin API,
    and an engine's ``admin_port`` sends the hook's PUT and the exporter's GET (with the token) to that port."""
    admin_port = free_port()
    sim = SimulatorProcess(tmp_path, args=("--max-num-seqs", str(CAPACITY), "--admin-port", str(admin_port)))
    engines = [{"name": "sim", "url": sim.url, "admin_port": admin_port}]
    (tmp_path / "exporter.yaml").write_text(json.dumps({"engines": engines, "exporter": {"nvml": False}}))
    hook = RemediateProcess(tmp_path, {**hook_config(), "engines": engines}, env={"BATCHLENS_ADMIN_TOKEN": sim.token})
    exporter = ExporterProcess(tmp_path, (), extra_args=("--config", str(tmp_path / "exporter.yaml")),
                               env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
    try:
        assert http_get(sim.url + BATCH_PATH, headers={"Authorization": f"Bearer {sim.token}"})[0] == 404
        admin = AdminClient(f"http://127.0.0.1:{admin_port}", sim.token)
        assert hook.post(notification(alert("sim")))[0] == 200
        eventually(lambda: admin.state().max_num_active_seqs == 16, "the hook halving through the admin port")
        exporter.wait_for(lambda s: list(pick(s, "batchlens_batch_limit", vllm_instance="sim").values()) == [16.0],
                          what="the limit, read there")  # fmt: skip
    finally:
        for process in (exporter, hook, sim):
            process.stop()


def namespaced(fired: dict) -> dict:
    """The alert as a namespace's Prometheus rule labels it: with the namespace of its vllm_instance."""
    fired["labels"]["namespace"] = fired["labels"]["vllm_instance"].partition("/")[0]
    return fired


def test_a_namespace_that_floods_fills_its_own_share_gets_503s_and_another_namespaces_alert_is_acted_on(
    tmp_path, sim, upstreams
) -> None:
    """Issue 57, item 2: a tenant floods the webhook for its five engines, whose admin APIs hang (so every
    delivery waits); the inbox took what fit and answered 200 to the rest (`inbox_full`), and Alertmanager never
    retried them. Now what does not fit gets a 503, and another namespace's genuine alert, sent mid-flood, acts."""
    flooded = [f"flood/pod-{k}" for k in range(5)]
    engines = [{"name": n, "url": upstreams.add(n.replace("/", "-"), behavior="hang", admin={"max_num_seqs": 32}),
                "labels": {"namespace": "flood"}} for n in flooded]  # fmt: skip
    engines.append({"name": "quiet/pod", "url": sim.url, "labels": {"namespace": "quiet"}})
    config = {"engines": engines, "breaker": {"cooldown_seconds": 30}, "remediate": {"store_max_bytes": 4 * 2**20}}
    hook = RemediateProcess(tmp_path, config, env={"BATCHLENS_ADMIN_TOKEN": sim.token})
    try:
        statuses: Counter[int] = Counter()

        def flood(first: int) -> None:  # each notification one alert per engine: five deliveries
            for i in range(first, first + 150):
                status, _ = hook.post(notification(*(namespaced(alert(name, starts_at=T0 + i)) for name in flooded)))
                statuses[status] += 1

        threads = [threading.Thread(target=flood, args=(k * 1000,)) for k in range(2)]
        for thread in threads:
            thread.start()
        eventually(lambda: statuses[503], "the first 503")
        assert hook.post(notification(namespaced(alert("quiet/pod"))))[0] == 200  # mid-flood, another namespace
        for thread in threads:
            thread.join()
        wait_limit(sim, CAPACITY // 2)
        # The namespace's share, 1024 deliveries, took 204 notifications; no engine's own 256 was reached.
        assert set(statuses) == {200, 503} and statuses[200] == MAX_PENDING_PER_NAMESPACE // 5, statuses
        samples = hook.samples()
        assert pick(samples, "batchlens_webhook_requests_total", code="503") == {
            frozenset({("code", "503")}): statuses[503]}  # fmt: skip
        refused = pick(samples, "batchlens_remediation_deliveries_total", outcome="inbox_full")
        assert sum(refused.values()) == 5 * statuses[503]
        with sqlite3.connect(f"file:{hook.state_path}?mode=ro", uri=True) as db:  # what it answered 200 for, kept
            kept = db.execute("SELECT COUNT(*) FROM inbox WHERE vllm_instance LIKE 'flood/%'").fetchone()[0]
        assert kept == 5 * statuses[200]
        [used] = pick(samples, "batchlens_remediation_store_bytes").values()
        [budget] = pick(samples, "batchlens_remediation_store_budget_bytes").values()
        assert 0 < used <= budget == 4 * 2**20
        assert "refused with 503, for Alertmanager to retry" in hook.process.log_path.read_text()
    finally:
        hook.stop()


def test_the_servers_of_one_deployment_are_one_engine_to_the_breaker_and_the_controller(tmp_path, sim) -> None:
    """vLLM's external balancer (one server per DP rank), here two simulators of deployment ``ds``: one alert of
    ``ds`` halves both servers, the controller decides once a tick for ``ds``, and the exporter labels both
    servers' series ``vllm_instance="ds"``, apart by ``server``."""
    second = SimulatorProcess(tmp_path, speed=20, args=("--max-num-seqs", str(CAPACITY)))
    servers = [{"name": "rank-0", "url": sim.url, "deployment": "ds"},
               {"name": "rank-1", "url": second.url, "deployment": "ds"}]  # fmt: skip
    config = {"engines": servers, "breaker": {"cooldown_seconds": 30},
              "control": {"enabled": True, "interval_seconds": 0.5}}  # fmt: skip
    hook = RemediateProcess(tmp_path, config, env={"BATCHLENS_ADMIN_TOKEN": sim.token})
    exporter_config = tmp_path / "exporter.json"
    exporter_config.write_text(json.dumps({"engines": servers}))
    exporter = ExporterProcess(tmp_path, [], extra_args=("--config", str(exporter_config)),
                               env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
    try:
        assert set(hook.health()["engines"]) == {"ds"}
        assert hook.post(notification(alert("ds")))[0] == 200
        wait_limit(sim, 16)
        wait_limit(second, 16)

        def decisions() -> dict[str, float]:
            found: dict[str, float] = {}
            for key, n in pick(hook.samples(), "batchlens_controller_decisions_total").items():
                found[dict(key)["vllm_instance"]] = found.get(dict(key)["vllm_instance"], 0) + n
            return found

        eventually(lambda: decisions().get("ds", 0) >= 4, "the controller deciding for the deployment")
        assert set(decisions()) == {"ds"}
        limits = eventually(lambda: pick(exporter.samples(), "batchlens_batch_limit") or None, "the exporter's limits")
        assert {(dict(k)["vllm_instance"], dict(k)["server"]) for k in limits} == {("ds", "rank-0"), ("ds", "rank-1")}
    finally:
        exporter.stop()
        hook.stop()
        second.stop()
