"""Engine discovery on Kubernetes: the vLLM pods on the exporter's node become engines.

Fake boundary: the Kubernetes API server (tests/harness/kube_api.py), which answers over
real HTTP with the real JSON shapes, and whose pods are real HTTP servers on loopback IPs
serving a real vLLM 0.32 exposition. The exporter is the real process; lightkube is the
real client.
"""

from __future__ import annotations

import json

import pytest
from lightkube.resources.core_v1 import Pod

from batchlens.config import Kubernetes
from batchlens.discovery.pods import engines_of
from harness.exporter import ExporterProcess, one, pick
from harness.kube_api import FakeKubernetes, pod
from harness.procs import free_port, wait_until
from harness.remediate import RemediateProcess, alert, notification


def test_running_pods_with_an_ip_are_engines_and_the_rest_is_counted() -> None:
    terminating = pod("vllm-9", "10.1.0.9")
    terminating["metadata"]["deletionTimestamp"] = "2026-12-01T11:00:00Z"
    pods = [pod("vllm-1", "10.1.0.8"), pod("vllm-0", "fd00::7"), pod("vllm-2", None), terminating]
    engines, skipped = engines_of([Pod.from_dict(p) for p in pods], Kubernetes(port=8001))
    assert [(e.name, e.url, e.labels) for e in engines] == [
        ("serving/vllm-0", "http://[fd00::7]:8001", {"namespace": "serving", "pod": "vllm-0"}),
        ("serving/vllm-1", "http://10.1.0.8:8001", {"namespace": "serving", "pod": "vllm-1"}),
    ]
    assert skipped == {"no_ip": 1, "terminating": 1}


@pytest.fixture
def api():
    """The fake API server, with two pods' servers on 127.0.0.2 and 127.0.0.3; tests say what it lists."""
    server = FakeKubernetes(free_port())
    for ip in ("127.0.0.2", "127.0.0.3"):
        server.serve_pod(ip)
    yield server
    server.close()


def discovery(api: FakeKubernetes) -> dict:
    return {"discover": True, "api_url": api.url, "port": api.pod_port, "interval_seconds": 0.5}


@pytest.mark.slow
def test_the_exporter_follows_the_pods_on_its_node_and_survives_a_403(api, tmp_path) -> None:
    exporter = None
    try:
        api.pods = [
            pod("vllm-0", "127.0.0.2"),
            pod("vllm-1", "127.0.0.3"),
            pod("vllm-2", None),  # scheduled, no IP yet
            pod("vllm-3", "127.0.0.4", node="gpu-node-b"),  # another node's
            pod("router", "127.0.0.5", labels={"app.kubernetes.io/name": "router"}),  # not selected
        ]
        config = tmp_path / "batchlens.yaml"
        config.write_text(json.dumps({"kubernetes": discovery(api), "exporter": {"nvml": False}}))
        exporter = ExporterProcess(
            tmp_path, [], interval=0.5, extra_args=("--config", str(config)), env={"NODE_NAME": "gpu-node-a"}
        )

        def running(samples, name: str):
            return pick(samples, "vllm:num_requests_running", vllm_instance=name)

        samples = exporter.wait_for(
            lambda s: running(s, "serving/vllm-0") and running(s, "serving/vllm-1"), what="pods"
        )
        [labels] = [dict(k) for k in pick(samples, "vllm:num_requests_running", vllm_instance="serving/vllm-0")]
        assert labels["namespace"] == "serving" and labels["pod"] == "vllm-0"
        assert not pick(samples, "vllm:num_requests_running", pod="vllm-3")  # on gpu-node-b
        assert pick(samples, "batchlens_discovered_engines", namespace="serving") == {
            frozenset({("namespace", "serving")}): 2.0
        }
        assert pick(samples, "batchlens_source_errors_total", source="kubernetes", reason="pod_no_ip")
        assert all("fieldSelector=spec.nodeName" in r for r in api.requests), api.requests[:3]

        api.pods = [p for p in api.pods if p["metadata"]["name"] != "vllm-1"]  # the pod goes
        samples = exporter.wait_for(lambda s: not running(s, "serving/vllm-1"), what="vllm-1's series to go")
        assert not pick(samples, "batchlens_source_up", vllm_instance="serving/vllm-1")
        assert running(samples, "serving/vllm-0")

        api.forbidden = True  # RBAC revoked: counted, and the engines found so far are still sampled
        samples = exporter.wait_for(
            lambda s: (
                pick(s, "batchlens_source_up", source="kubernetes") == {frozenset({("source", "kubernetes")}): 0.0}
            ),
            what="discovery down",
        )
        assert pick(samples, "batchlens_source_errors_total", source="kubernetes", reason="forbidden")
        assert running(samples, "serving/vllm-0")
        assert "cannot list resource" in exporter.process.log_tail(200)
    finally:
        if exporter is not None:
            exporter.stop()


@pytest.mark.slow
def test_the_hook_resolves_an_alerts_pod_to_its_admin_api_and_keeps_its_state(api, tmp_path) -> None:
    hook = None
    try:
        api.pods = [pod("vllm-0", "127.0.0.2"), pod("vllm-1", "127.0.0.3", node="gpu-node-b")]  # every node
        env = {"BATCHLENS_ADMIN_TOKEN": api.admin_token}
        hook = RemediateProcess(tmp_path, {"kubernetes": discovery(api)}, env=env)
        status, body = hook.post(notification(alert("serving/vllm-1"), alert("serving/vllm-9")))
        assert status == 200 and body["accepted"] == 1 and body["unknown_instance"] == 1, body
        wait_until(lambda: api.batch["127.0.0.3"]["max_num_active_seqs"] == 32, what="vllm-1 halved")
        assert api.batch["127.0.0.2"]["max_num_active_seqs"] == 64  # the other pod is left alone
        states = pick(hook.samples(), "batchlens_breaker_state", vllm_instance="serving/vllm-1", state="tripped")
        assert list(states.values()) == [1.0]

        api.pods = api.pods[:1]  # vllm-1 goes: alerts for it are not acted on, its state stays saved
        wait_until(lambda: not pick(hook.samples(), "batchlens_breaker_state", vllm_instance="serving/vllm-1"))
        api.pods.append(pod("vllm-1", "127.0.0.3"))  # and comes back under its name
        wait_until(lambda: pick(hook.samples(), "batchlens_breaker_strikes", vllm_instance="serving/vllm-1"))
        assert one(hook.samples(), "batchlens_breaker_strikes", vllm_instance="serving/vllm-1") == 1

        api.forbidden = True
        wait_until(lambda: pick(hook.samples(), "batchlens_remediation_discovery_errors_total", reason="forbidden"))
        assert pick(hook.samples(), "batchlens_breaker_state", vllm_instance="serving/vllm-0")  # still known
    finally:
        if hook is not None:
            hook.stop()
