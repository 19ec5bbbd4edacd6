"""The hook confirms an alert with Prometheus before it acts (issue 57): against a real Prometheus whose rules
fire the breaker's alert for some engines and not others.

The hook's worker runs in process, so that a test can decide each pass; its admin API and Alertmanager clients
are the fake boundary (harness/inprocess.py): what the test checks is what the hook asks Prometheus and what it
does with the answer. The whole path through a real Alertmanager is in test_remediate_e2e.py (the forged-alert
attack) and test_alertmanager_ha.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import pytest
import yaml

from batchlens.config import Config
from batchlens.remediation.breaker import EngineState
from batchlens.remediation.confirm import Confirmer, alert_series, fault_text, firing_here
from batchlens.remediation.service import Remediator
from batchlens.remediation.store import Store
from batchlens.remediation.webhook import WebhookPayload
from harness.inprocess import Alertmanager, GatedAdmin
from harness.procs import free_port
from harness.prometheus import PrometheusServer
from harness.remediate import alert, notification

pytestmark = pytest.mark.e2e
ODD = 'ns/a"b\\c'  # a name with PromQL's quote and escape in it: the query must still name it, and only it
FIRING = {"a": {}, ODD: {}, "elsewhere": {"cluster": "other"}, "g": {}}  # engines whose breaker fires, and labels
# Engine g's GPUs: GPU 3 lost a moment ago (its alert still pending: "for" is not over), GPU 5 holding its clocks
# down (firing); and a GPU lost in another cluster, of an engine named b there.
GPU_3 = {"gpu": "3", "uuid": "GPU-3", "instance": "node-a:9400"}
GPU_ALERTS = [("BatchlensGpuLost", "1h", {"vllm_instance": "g", **GPU_3}),
              ("BatchlensGpuThrottled", "0s", {"vllm_instance": "g", "gpu": "5", "uuid": "GPU-5",
                                               "instance": "node-a:9400", "reason": "hw_thermal_slowdown"}),
              ("BatchlensGpuLost", "0s", {"vllm_instance": "b", "cluster": "other", **GPU_3})]  # fmt: skip


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory) -> Iterator[PrometheusServer]:
    workdir = tmp_path_factory.mktemp("prom")
    rules = [{"alert": "VllmP99LatencyBreaker", "expr": "vector(1)",
              "labels": {"severity": "critical", "vllm_instance": name, **extra}}
             for name, extra in FIRING.items()]  # fmt: skip
    rules += [{"alert": name, "expr": "vector(1)", "for": duration, "labels": labels}
              for name, duration, labels in GPU_ALERTS]  # fmt: skip
    (workdir / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "b", "interval": "1s", "rules": rules}]}))
    server = PrometheusServer(workdir, [], rule_files=(str(workdir / "rules.yml"),))
    server.wait_for('count(ALERTS{alertstate="firing"}) == 6 and count(ALERTS{alertstate="pending"}) == 1')
    yield server
    server.stop()


def test_the_query_names_the_alert_and_the_engine_whatever_its_name_holds() -> None:
    assert alert_series("VllmP99LatencyBreaker", ODD) == (
        'ALERTS{alertname="VllmP99LatencyBreaker",alertstate="firing",vllm_instance="ns/a\\"b\\\\c"}'
    )


def test_a_series_confirms_for_this_cluster_only_when_it_is_this_clusters_own() -> None:
    assert firing_here([{}], "") and firing_here([{}], "here") and firing_here([{"cluster": "here"}], "here")
    assert not firing_here([{"cluster": "other"}], "here") and not firing_here([], "")
    assert firing_here([{"cluster": "other"}], "")  # no cluster set: any


def test_the_confirmer_asks_a_real_prometheus(prometheus) -> None:
    async def ask() -> dict[str, bool]:
        async with aiohttp.ClientSession() as session:
            confirmer = Confirmer(session, prometheus.url, cluster="here")
            names = ["a", ODD, "ns/a", "b", "elsewhere"]
            return {name: await confirmer.firing("VllmP99LatencyBreaker", name) for name in names}

    assert asyncio.run(ask()) == {"a": True, ODD: True, "ns/a": False, "b": False, "elsewhere": False}


def run_hook(tmp_path, prometheus_url: str, script, clock=time.time, engines=("a", "b"),
             **settings) -> tuple[Remediator, dict, Alertmanager]:  # fmt: skip
    """Run ``script(hook, admins)`` against a hook with ``engines`` (each its own in-process admin API)."""
    config = Config.model_validate({
        "engines": [{"name": n, "url": "http://127.0.0.1:9"} for n in engines],
        "breaker": {"cooldown_seconds": 60}, "remediate": {"prometheus_url": prometheus_url}, **settings,
    })  # fmt: skip
    store = Store(tmp_path / "state.db")
    am = Alertmanager()

    async def main():
        async with aiohttp.ClientSession() as session:
            hook = Remediator(config, store, session, {}, alertmanager=am, clock=clock)
            admins = {n: GatedAdmin(limit=64) for n in engines}
            hook.admins.update(admins)
            await script(hook, admins)
            return hook, admins

    hook, admins = asyncio.run(main())
    return hook, admins, am


async def deliver(hook: Remediator, *alerts: dict) -> None:
    """The alerts accepted, a pass of every engine decided, and the pages it queued posted, nothing left running."""
    if alerts:
        await hook.accept(WebhookPayload.model_validate(notification(*alerts)))
    for _ in range(2):  # the second step posts what the first's passes queued
        await hook.step()
        await hook.settle()
        await asyncio.sleep(0)  # the passes' done callbacks: their engines count as idle for the next step


def test_a_firing_prometheus_does_not_show_moves_nothing_and_pages_once_per_cooldown(tmp_path, prometheus) -> None:
    now = time.time()

    async def script(hook, admins) -> None:
        await deliver(hook, alert("b", starts_at=now - 30))  # forged: Prometheus shows none for b
        await deliver(hook, alert("b", starts_at=now - 20))  # and again, inside the cooldown
        await deliver(hook, alert("a", starts_at=now - 30))  # a real breach

    hook, admins, am = run_hook(tmp_path, prometheus.url, script)
    assert (admins["b"].limit, admins["a"].limit) == (64, 32)
    assert hook.deliveries["unconfirmed"] == 2 and hook.deliveries["halve"] == 1, hook.deliveries
    assert hook.states["b"].strikes == 0 and hook.states["b"].firing_seen_at is None  # no episode kept alive
    assert [(p.labels["vllm_instance"], p.labels["reason"]) for p in am.posted] == [("b", "unconfirmed")]
    assert "Prometheus shows none" in am.posted[0].annotations["description"]


def test_a_resolution_prometheus_still_shows_firing_starts_no_recovery(tmp_path, prometheus) -> None:
    now = time.time()

    async def script(hook, admins) -> None:
        await deliver(hook, alert("a", starts_at=now - 30))
        await deliver(hook, alert("a", "resolved", starts_at=now - 30))  # forged: a still fires

    hook, _admins, am = run_hook(tmp_path, prometheus.url, script)
    assert hook.states["a"].mode == "tripped" and hook.deliveries["unconfirmed"] == 1, hook.deliveries
    assert hook.states["a"].resolved_through is None
    assert am.posted == [], "a resolution not confirmed pages nobody: a flapping alert would"


def test_without_prometheus_a_firing_is_not_acted_on_and_a_resolution_waits_for_it(tmp_path, prometheus) -> None:
    """Prometheus cannot be reached (a port nobody listens on): a firing pages instead of halving; a resolution
    stays in the inbox, asked again after a backoff, and is decided once Prometheus answers."""
    now = [float(int(time.time()))]  # whole seconds: the alert times round-trip through ISO 8601 exactly
    down = f"http://127.0.0.1:{free_port()}"

    async def script(hook, admins) -> None:
        await deliver(hook, alert("a", starts_at=now[0] - 30))
        await hook.store.run(hook.store.save, "b", EngineState(mode="tripped", strikes=1, original_limit=64,
                             target_limit=32, applied_limit=32, capacity=64, last_action_at=now[0] - 90,
                             episode_starts_at=now[0] - 100, firing_seen_at=now[0] - 90), now[0])  # fmt: skip
        hook.states["b"] = (await hook.store.run(hook.store.states))["b"]
        await deliver(hook, alert("b", "resolved", starts_at=now[0] - 100))
        assert [d.status for d in await hook.store.run(hook.store.pending)] == ["resolved"]
        hook.confirmer.url = prometheus.url  # Prometheus is back, but the backoff holds the next question
        await deliver(hook)
        assert hook.states["b"].mode == "tripped"
        now[0] += 2  # past the backoff
        await deliver(hook)

    hook, admins, am = run_hook(tmp_path, down, script, clock=lambda: now[0])
    assert admins["a"].limit == 64 and hook.deliveries["unconfirmable"] == 1, hook.deliveries
    assert [p.labels["reason"] for p in am.posted] == ["unconfirmed"]
    assert "cannot confirm" in am.posted[0].annotations["description"]
    assert hook.states["b"].mode == "recovering", "a confirmed resolution starts the recovery"


def test_the_gpu_question_names_the_gpu_alerts_firing_or_pending_of_this_cluster_by_engine(prometheus) -> None:
    async def ask() -> tuple[dict, dict]:
        async with aiohttp.ClientSession() as session:
            confirmer = Confirmer(session, prometheus.url, cluster="here")
            return await confirmer.gpu_faults(), await confirmer.gpu_faults("b")

    every, b = asyncio.run(ask())
    assert b == {} and list(every) == ["g"]  # b's GPU alert is another cluster's
    assert fault_text(every["g"]) == ("GPU 3 (GPU-3) on node-a:9400: Lost; "
                                      "GPU 5 (GPU-5) on node-a:9400: Throttled hw_thermal_slowdown")  # fmt: skip


def test_a_breach_while_a_gpu_of_the_engine_fails_pages_its_state_and_halves_nothing(tmp_path, prometheus) -> None:
    """Engine g's breaker fires while its GPU 3 is lost (pending: within its "for") and GPU 5 throttles. A smaller
    batch mends neither: no halving, no strike; one page (per cooldown) that names both GPUs. Engine a, whose GPUs
    are well, is halved as before."""
    now = time.time()

    async def script(hook, admins) -> None:
        await deliver(hook, alert("g", starts_at=now - 30))
        await deliver(hook, alert("g", starts_at=now - 20))
        await deliver(hook, alert("a", starts_at=now - 30))

    hook, admins, am = run_hook(tmp_path, prometheus.url, script, engines=("a", "g"))
    assert (admins["g"].limit, admins["a"].limit) == (64, 32)
    assert hook.states["g"].strikes == 0 and hook.deliveries["gpu_fault"] == 2, hook.deliveries
    [page] = am.posted
    assert (page.labels["vllm_instance"], page.labels["reason"]) == ("g", "gpu_fault")
    assert "GPU 3 (GPU-3) on node-a:9400: Lost; GPU 5" in page.annotations["description"]
    assert "Not halved" in page.annotations["description"]


def test_the_controller_holds_an_engine_whose_gpu_fails_and_learns_nothing(tmp_path, prometheus) -> None:
    """The hook asks Prometheus once a control interval, for every engine; the controller's tick for g then holds
    (reason gpu_fault) whatever its window says."""

    async def script(hook, admins) -> None:
        for _ in range(3):
            await deliver(hook)
            await asyncio.sleep(0.2)
        assert hook.controller.gpu_faults == {"g": fault_text([{"alertname": "BatchlensGpuLost", **GPU_3},
            {"alertname": "BatchlensGpuThrottled", "gpu": "5", "uuid": "GPU-5", "instance": "node-a:9400",
             "reason": "hw_thermal_slowdown"}])}  # fmt: skip

    run_hook(tmp_path, prometheus.url, script, engines=("a", "g"), control={"enabled": True, "interval_seconds": 1})
