"""Leader election on a Lease (remediation/leader.py): the rules pure, then two electors against one Lease.

Fake boundary: the Kubernetes API server (tests/harness/kube_api.py), which keeps the Lease and the state's
ConfigMap with the real one's resourceVersion semantics (409 on a stale replace or a second create). The
clocks are the test's: a lease's duration passes without waiting for it.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from batchlens.config import Kubernetes, LeaderElection
from batchlens.remediation.leader import Holding, LeaseElector, StateMirror, claim
from harness.exporter import one, pick
from harness.kube_api import FakeKubernetes
from harness.procs import free_port
from harness.remediate import RemediateProcess, alert, notification
from test_remediate import CAPACITY, eventually, hook_config, limit_of, sim, wait_limit  # noqa: F401 (sim: a fixture)

SETTINGS = LeaderElection(enabled=True, namespace="batchlens")


def test_the_claim_follows_client_gos_rules() -> None:
    held = Holding("hook-a", 15.0, 3, "17")
    assert claim(None, "hook-b", 0.0) == ("create", 0)
    assert claim(held, "hook-a", 99.0) == ("renew", 3), "its own: renewed, whatever the clock"
    assert claim(held, "hook-b", 14.9) is None, "another's, changed within its duration: left alone"
    assert claim(held, "hook-b", 15.0) == ("take", 4), "unchanged for its duration, by our own clock: taken"
    assert claim(Holding("", 15.0, 3, "18"), "hook-b", 0.0) == ("take", 4), "released: taken at once"


@pytest.fixture(scope="module")
def kube():
    api = FakeKubernetes(free_port())
    yield api
    api.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_leads_the_other_waits_takes_over_once_the_lease_stands_still_and_the_deposed_acts_on_nothing(
    kube,
) -> None:
    kube.objects.clear()
    settings = SETTINGS.model_copy(update={"lease_name": "failover"})
    where = Kubernetes(api_url=kube.url)

    async def main() -> None:
        clock = Clock()
        a, b = (LeaseElector(settings, where, name, "batchlens", clock) for name in ("hook-a", "hook-b"))
        try:
            assert await a.round() and not await b.round(), "the first creates the Lease, the second waits"
            assert await a.holds() and not await b.holds() and b.holder == "hook-a"
            for _ in range(10):  # a renews every round; b, watching the version change, never takes over
                clock.now += 2.0
                assert await a.round() and not await b.round()
            lease = kube.objects[("Lease", "batchlens", "failover")]
            assert lease["spec"]["holderIdentity"] == "hook-a" and lease["spec"]["leaseTransitions"] == 0
            # a stops (a killed pod): the version stands still; b takes over one duration after it first saw it
            clock.now += 14.0
            assert not await b.round(), "not before the Lease's duration"
            assert not a.leading, "a, past its renew deadline, stops acting before anyone may take over"
            clock.now += 1.0
            assert await b.round() and await b.holds()
            lease = kube.objects[("Lease", "batchlens", "failover")]
            assert lease["spec"]["holderIdentity"] == "hook-b" and lease["spec"]["leaseTransitions"] == 1
            assert not await a.holds(), "fenced: the Lease names another"
            assert not await a.round() and a.holder == "hook-b", "and a, back, stands by"
            await b.release()
            assert await a.round(), "a released Lease is taken at the next round"
        finally:
            await a.aclose()
            await b.aclose()

    asyncio.run(main())


def test_of_two_writers_in_one_round_one_wins_on_the_resource_version(kube) -> None:
    kube.objects.clear()
    settings = SETTINGS.model_copy(update={"lease_name": "race"})
    where = Kubernetes(api_url=kube.url)

    async def main() -> list[bool]:
        electors = [LeaseElector(settings, where, f"hook-{i}", "batchlens", Clock()) for i in range(4)]
        try:
            await electors[0].round()
            electors[0]._clock.now = 100.0
            for e in electors[1:]:
                e._clock.now = 0.0
                await e.round()  # each sees the version now
                e._clock.now = 20.0
            return list(await asyncio.gather(*(e.round() for e in electors[1:])))
        finally:
            await asyncio.gather(*(e.aclose() for e in electors))

    won = asyncio.run(main())
    assert won.count(True) == 1, won
    assert kube.objects[("Lease", "batchlens", "race")]["spec"]["leaseTransitions"] == 1


def test_the_state_mirror_keeps_each_section_for_the_next_leader(kube) -> None:
    kube.objects.clear()
    where = Kubernetes(api_url=kube.url)

    async def main() -> dict:
        mirror = StateMirror(SETTINGS, where, "batchlens")
        try:
            assert await mirror.load() == {}
            await mirror.save("engines", {"ns/a": {"strikes": 2}})
            await mirror.save("controllers", {"ns/a": {"limit": 24}})
            await mirror.save("engines", {"ns/a": {"strikes": 3}})
            return await StateMirror(SETTINGS, where, "batchlens").load()
        finally:
            await mirror.aclose()

    assert asyncio.run(main()) == {"engines": {"ns/a": {"strikes": 3}}, "controllers": {"ns/a": {"limit": 24}}}


def test_two_hooks_one_lease_the_standby_takes_over_a_killed_leaders_episode_and_nothing_acts_twice(
    kube,
    sim,  # noqa: F811 (the fixture, imported above)
    tmp_path,
) -> None:
    """Two `batchlens remediate` processes against one Lease and one real simulated engine: the standby refuses
    deliveries (503: Alertmanager retries, and reaches the leader), takes over within the Lease's duration and a
    round of the leader's kill -9, goes on from the episode's strikes, and halves nothing twice."""
    kube.objects.clear()
    election = {"enabled": True, "namespace": "batchlens", "lease_duration_seconds": 3, "renew_deadline_seconds": 2,
                "retry_period_seconds": 0.5}  # fmt: skip
    config = hook_config(("sim", sim.url), cooldown_seconds=4)
    config |= {"remediate": {"leader_election": election}, "kubernetes": {"api_url": kube.url}}
    hooks = {}
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            env = {"BATCHLENS_ADMIN_TOKEN": sim.token, "BATCHLENS_POD_NAME": f"hook-{name}"}
            hooks[name] = RemediateProcess(tmp_path / name, config, env=env)
            if name == "a":
                eventually(lambda: hooks["a"].health()["leader"]["leading"], "the first hook leading")
        a, b = hooks["a"], hooks["b"]
        eventually(lambda: b.health()["leader"]["holder"] == "hook-a", "the second watching the first")
        assert not b.health()["leader"]["leading"]
        standby = b.samples()
        assert one(standby, "batchlens_remediation_leader") == 0
        assert one(a.samples(), "batchlens_remediation_leader") == 1
        assert not pick(standby, "batchlens_breaker_state"), "a standby's states are no engine's: not exported"
        status, body = b.post(notification(alert("sim")))
        assert status == 503 and "hook-a leads" in body["error"], body
        assert a.post(notification(alert("sim")))[0] == 200
        wait_limit(sim, CAPACITY // 2)
        halved = time.monotonic()
        kept = json.loads(kube.objects[("ConfigMap", "batchlens", "batchlens-remediate-state")]["data"]["engines"])
        assert kept["sim"]["strikes"] == 1, "kept for the next leader before the act"
        a.kill9()
        killed = time.monotonic()
        eventually(lambda: b.health()["leader"]["leading"], "the standby taking over", timeout=10)
        took = time.monotonic() - killed
        assert took <= 3 + 0.5 + 1.5, f"failover in {took:.1f} s: the bound is the Lease's 3 s and a 0.5 s round"
        assert b.health()["engines"]["sim"]["strikes"] == 1, "the episode's strike carried over"
        assert b.post(notification(alert("sim")))[0] == 200  # Alertmanager's retry, now taken: inside the cooldown
        eventually(lambda: b.health()["engines"]["sim"]["strikes"] == 1 and limit_of(sim) == CAPACITY // 2,
                   "the retry decided")  # fmt: skip
        time.sleep(max(0.0, halved + 4.2 - time.monotonic()))  # the cooldown passes
        assert b.post(notification(alert("sim")))[0] == 200
        wait_limit(sim, CAPACITY // 4)
        assert b.health()["engines"]["sim"]["strikes"] == 2, "strike 2 of the same episode, not a new one"
        halvings = [x for hook in (a, b) for x in hook.actions() if x["action"] == "halve"]
        assert len(halvings) == 2, halvings
        lease = kube.objects[("Lease", "batchlens", "batchlens-remediate")]["spec"]
        assert lease["holderIdentity"] == "hook-b" and lease["leaseTransitions"] == 1
    finally:
        for hook in hooks.values():
            hook.stop()
