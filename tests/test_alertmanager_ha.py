"""The breaker behind Alertmanager in HA, as kube-prometheus-stack runs it: three real replicas gossiping on
loopback, each sent every alert by a real Prometheus, each delivering to the hook.

The breach is real in Prometheus' own data: it scrapes a switch (harness/upstreams.py, the fake boundary: a
metric set by the test instead of a loaded GPU) that a rule of the breaker's name fires on, and the hook confirms
every delivery against that Prometheus. The replicas wait no peer timeout (``--cluster.peer-timeout=0s``), so
each delivers its own copy, the worst case gossip can give: one breach is acted on once, the copies and a
replica killed mid-episode change nothing, and the hook counts the copies.
"""

from __future__ import annotations

import json
import signal

import pytest
import yaml

from harness.admin import AdminClient
from harness.alertmanager import AlertmanagerServer, local_config
from harness.exporter import pick
from harness.procs import free_port, wait_until
from harness.prometheus import PrometheusServer
from harness.remediate import WEBHOOK_TOKEN, RemediateProcess
from harness.simulator import SimulatorProcess

pytestmark = pytest.mark.e2e
CAPACITY = 32
REPLICAS = 3


def test_one_breach_through_three_alertmanager_replicas_is_acted_on_once(tmp_path, upstreams) -> None:
    upstreams.add("switch", text='breach_switch{vllm_instance="sim"} 0\n')
    switch = upstreams.engines["switch"]
    rules = tmp_path / "breaker.yml"
    rules.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "breaker",
                        "interval": "1s",
                        "rules": [
                            {
                                "alert": "VllmP99LatencyBreaker",
                                "expr": "breach_switch > 0",
                                "labels": {"severity": "critical"},
                            }
                        ],
                    }
                ]
            }
        )
    )
    sim = SimulatorProcess(tmp_path, args=("--max-num-seqs", str(CAPACITY)))
    procs: list = [sim]
    try:
        hook = RemediateProcess(tmp_path, {"engines": [{"name": "sim", "url": sim.url}],
                                           "breaker": {"cooldown_seconds": 120, "recovery_interval_seconds": 1}},
                                env={"BATCHLENS_ADMIN_TOKEN": sim.token}, defer=True)  # fmt: skip
        routing = local_config(tmp_path / "alertmanager.yml", hook.url, WEBHOOK_TOKEN,
                               {"group_wait": "0s", "group_interval": "1s", "repeat_interval": "8s"})  # fmt: skip
        gossip = [free_port() for _ in range(REPLICAS)]
        replicas = [AlertmanagerServer(tmp_path / f"am{i}", routing, peer_timeout="0s",
                                       cluster=(gossip[i], [p for p in gossip if p != gossip[i]]))
                    for i in range(REPLICAS)]  # fmt: skip
        procs += replicas
        scrape = {"job_name": "switch", "metrics_path": "/switch/metrics",
                  "static_configs": [{"targets": [f"127.0.0.1:{upstreams.port}"]}]}  # fmt: skip
        prometheus = PrometheusServer(tmp_path / "prom", [scrape], rule_files=(str(rules),),
                                      alertmanager=[f"127.0.0.1:{am.port}" for am in replicas])  # fmt: skip
        procs.append(prometheus)
        hook.config["remediate"] |= {"alertmanager_url": replicas[0].url, "prometheus_url": prometheus.url}
        hook.start()
        procs.append(hook)
        wait_until(lambda: all(len(am.status()["cluster"]["peers"]) == REPLICAS for am in replicas), 30,
                   "the three replicas to see each other")  # fmt: skip
        admin = AdminClient(sim.url, sim.token)

        def decided(outcome: str) -> float:
            return sum(pick(hook.samples(), "batchlens_remediation_deliveries_total", outcome=outcome).values())

        def halvings() -> list[dict]:
            return [a for a in hook.actions() if a["action"] == "halve"]

        switch.text = 'breach_switch{vllm_instance="sim"} 1\n'  # the breach, in Prometheus' own data
        wait_until(lambda: admin.state().max_num_active_seqs == CAPACITY // 2, 30, "the halving")
        # Each replica's copy of the first notification: one acts, the others are recorded inside the cooldown.
        wait_until(lambda: decided("cooldown") >= REPLICAS - 1, 6, "the other replicas' copies")
        copies = decided("cooldown")
        replicas[2].process.stop(signal.SIGKILL)  # mid-episode
        wait_until(lambda: decided("cooldown") >= copies + 2, 30, "the surviving replicas' repeats")
        assert len(halvings()) == 1 and admin.state().max_num_active_seqs == CAPACITY // 2, halvings()
        assert hook.health()["engines"]["sim"]["strikes"] == 1

        switch.text = 'breach_switch{vllm_instance="sim"} 0\n'  # the breach ends: the replicas send it resolved
        wait_until(lambda: admin.state().max_num_active_seqs == CAPACITY, 60, "recovery to the capacity")
        actions = [a["action"] for a in hook.actions() if a["action"] not in ("set_limit", "raise")]
        assert actions == ["halve", "resolved", "recovered"], actions
        assert decided("unconfirmed") == decided("unconfirmable") == 0
        samples = hook.samples()
        print("deliveries:", json.dumps({dict(k)["outcome"]: v for k, v in
                                         pick(samples, "batchlens_remediation_deliveries_total").items()}))  # fmt: skip
    finally:
        for proc in reversed(procs):
            proc.stop()
