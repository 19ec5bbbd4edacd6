"""Engine discovery on Kubernetes: the vLLM pods on the exporter's node become engines.

Fake boundary: the Kubernetes API server (tests/harness/kube_api.py), which answers over
real HTTP with the real JSON shapes, and whose pods are real HTTP servers on loopback IPs
serving a real vLLM 0.32 exposition. The exporter is the real process; lightkube is the
real client.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest
from lightkube.resources.core_v1 import Pod
from pydantic import ValidationError

from batchlens.config import Kubernetes
from batchlens.discovery.pods import engines_of
from harness.exporter import BATCHLENS, ExporterProcess, one, pick
from harness.kube_api import FakeKubernetes, pod
from harness.procs import free_port, wait_until
from harness.remediate import WEBHOOK_TOKEN, RemediateProcess, alert, notification

WEBHOOK_ENV = "BATCHLENS_WEBHOOK_TOKEN"


def test_running_pods_with_an_ip_are_engines_and_the_rest_is_counted() -> None:
    terminating = pod("vllm-9", "10.1.0.9")
    terminating["metadata"]["deletionTimestamp"] = "2026-12-01T11:00:00Z"
    other_key = pod("vllm-5", "10.1.0.5", token_secret={"name": "batchlens-admin-token", "key": "other"})
    pods = [
        pod("vllm-1", "10.1.0.8"), pod("vllm-0", "fd00::7"), pod("vllm-2", None), terminating,
        pod("impostor", "10.1.0.6", token_secret=None),  # wears the label, holds no admin token
        pod("its-own", "10.1.0.7", token_secret={"name": "my-secret", "key": "token"}),  # another Secret
        other_key,
        pod("not-vllm", "10.9.0.1", namespace="tenant-evil"),  # a namespace the config does not list
    ]  # fmt: skip
    settings = Kubernetes(port=8001, namespaces=["serving", "team-b"])
    engines, skipped = engines_of([Pod.from_dict(p) for p in pods], settings)
    assert [(e.name, e.url, e.labels) for e in engines] == [
        ("serving/vllm-0", "http://[fd00::7]:8001", {"namespace": "serving", "pod": "vllm-0"}),
        ("serving/vllm-1", "http://10.1.0.8:8001", {"namespace": "serving", "pod": "vllm-1"}),
    ]
    assert skipped == {"no_ip": 1, "terminating": 1, "no_admin_token_secret": 3, "namespace_not_listed": 1}
    assert all(e.admin_token({"BATCHLENS_ADMIN_TOKEN": "shared"}) == "shared" for e in engines)  # no pod token yet


def test_discovery_is_scoped_to_listed_namespaces_and_holds_no_shared_token() -> None:
    with pytest.raises(ValidationError, match="discover needs namespaces"):
        Kubernetes(discover=True)
    with pytest.raises(ValidationError, match="must name namespaces"):
        Kubernetes(discover=True, namespaces=["*"])
    with pytest.raises(ValidationError, match="admin_token_env is gone"):
        Kubernetes(discover=True, namespaces=["serving"], admin_token_env="BATCHLENS_ADMIN_TOKEN")


def test_a_discovered_engine_carries_its_pods_token_and_never_shows_it() -> None:
    [engine], _ = engines_of([Pod.from_dict(pod("vllm-0", "10.1.0.8"))], Kubernetes(namespaces=["serving"]))
    mine = engine.with_admin_token("s3cret-of-serving", "the Secret serving/batchlens-admin-token")
    assert mine.admin_token({"BATCHLENS_ADMIN_TOKEN": "shared"}) == "s3cret-of-serving"
    assert engine.with_admin_token(None, "the Secret serving/x").admin_token({"BATCHLENS_ADMIN_TOKEN": "s"}) is None
    assert "s3cret" not in repr(mine) + mine.model_dump_json() + mine.admin_token_source
    assert mine != engine and mine != engine.with_admin_token("rotated", "the Secret serving/batchlens-admin-token")


def test_a_discovered_engines_admin_api_is_on_the_pods_ip_at_the_admin_port_where_one_is_set() -> None:
    found = [Pod.from_dict(pod("vllm-0", "10.1.0.8"))]
    [engine], _ = engines_of(found, Kubernetes(namespaces=["serving"], admin_port=8001))
    assert (engine.url, engine.admin_url) == ("http://10.1.0.8:8000", "http://10.1.0.8:8001")
    assert engines_of(found, Kubernetes(namespaces=["serving"]))[0][0].admin_url == "http://10.1.0.8:8000"


def test_discovered_engines_sign_their_calls_unless_the_config_asks_for_bearer() -> None:
    found = [Pod.from_dict(pod("vllm-0", "10.1.0.8"))]
    assert engines_of(found, Kubernetes(namespaces=["serving"]))[0][0].admin_auth == "signed"
    assert engines_of(found, Kubernetes(namespaces=["serving"]))[0][0].pod == "serving/vllm-0"  # what a call names
    assert engines_of(found, Kubernetes(namespaces=["serving"], admin_auth="bearer"))[0][0].admin_auth == "bearer"
    with pytest.raises(ValueError, match="admin_auth"):
        Kubernetes(namespaces=["serving"], admin_auth="basic")


@pytest.fixture
def api():
    """The fake API server, with two pods' servers on 127.0.0.2 and 127.0.0.3; tests say what it lists."""
    server = FakeKubernetes(free_port())
    for ip in ("127.0.0.2", "127.0.0.3"):
        server.serve_pod(ip)
    yield server
    server.close()


def pod_alert(instance: str, namespace: str | None = None) -> dict:
    """The breaker alert of a discovered engine "<namespace>/<pod>", labelled as the rules label it: with the
    namespace of its series (or another one, to forge it)."""
    sent = alert(instance)
    sent["labels"]["namespace"] = namespace or instance.split("/")[0]
    return sent


def discovery(api: FakeKubernetes, namespaces=("serving",)) -> dict:
    return {
        "discover": True, "api_url": api.url, "port": api.pod_port, "interval_seconds": 0.5,
        "namespaces": list(namespaces),
    }  # fmt: skip


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
        lists = [r for r in api.requests if "/pods" in r]
        assert lists and all("fieldSelector=spec.nodeName" in r for r in lists), lists[:3]

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
        hook = RemediateProcess(tmp_path, {"kubernetes": discovery(api)})  # the token: the pods' own Secret
        status, body = hook.post(notification(pod_alert("serving/vllm-1"), pod_alert("serving/vllm-9")))
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


@pytest.mark.slow
def test_a_pod_that_only_wears_the_label_never_gets_a_token(tmp_path) -> None:
    """The attack from issue 30: a tenant's pod with the vLLM label collected the one admin token.

    Now each namespace's token goes only to the pods of that namespace that hold it already, and a pod
    recreated under its name is followed to its new IP, never reached at its old one.
    """
    api = FakeKubernetes(free_port())
    for ip, namespace in [("127.0.0.2", "serving"), ("127.0.0.3", "serving"), ("127.0.0.4", "tenant-evil"),
                          ("127.0.0.5", "team-b"), ("127.0.0.6", "serving")]:  # fmt: skip
        api.serve_pod(ip, namespace)
    api.tokens.update({"team-b": "team-b-token", "tenant-evil": "evil-token"})
    hook = exporter = None
    try:
        api.pods = [
            pod("vllm-0", "127.0.0.2"),
            pod("impostor", "127.0.0.3", token_secret=None),  # the label, no admin token of its own
            pod("not-vllm", "127.0.0.4", namespace="tenant-evil"),  # the label, in a namespace nobody listed
            pod("vllm-b", "127.0.0.5", namespace="team-b"),
        ]
        k8s = discovery(api, namespaces=("serving", "team-b"))
        env = {"BATCHLENS_ADMIN_TOKEN": "a-shared-token-nobody-should-see"}
        hook = RemediateProcess(tmp_path, {"kubernetes": k8s}, env=env)
        sent = ("serving/vllm-0", "team-b/vllm-b", "serving/impostor", "tenant-evil/not-vllm")
        status, body = hook.post(notification(*map(pod_alert, sent)))
        assert status == 200 and body["accepted"] == 2 and body["unknown_instance"] == 2, body
        wait_until(lambda: api.batch["127.0.0.2"]["max_num_active_seqs"] == 32, what="serving/vllm-0 halved")
        wait_until(lambda: api.batch["127.0.0.5"]["max_num_active_seqs"] == 32, what="team-b/vllm-b halved")
        assert set(api.signers["127.0.0.2"]) == {"pod-admin-token"}  # serving's own token signed every call
        assert set(api.signers["127.0.0.5"]) == {"team-b-token"}  # team-b's, not serving's
        assert all(",p=serving/vllm-0," in a for a in api.authorizations["127.0.0.2"])  # each names its pod
        assert all(",p=team-b/vllm-b," in a for a in api.authorizations["127.0.0.5"])

        config = tmp_path / "exporter.yaml"
        config.write_text(json.dumps({"kubernetes": k8s, "exporter": {"nvml": False}}))
        hook.stop()  # from here on, every call the API server and the pods get is the exporter's
        api.requests.clear()
        hooks_calls = len(api.signers["127.0.0.2"])
        exporter = ExporterProcess(
            tmp_path, [], extra_args=("--config", str(config)), env={"NODE_NAME": "gpu-node-a", **env}
        )
        samples = exporter.wait_for(
            lambda s: (
                pick(s, "batchlens_batch_limit", vllm_instance="serving/vllm-0")
                and pick(s, "batchlens_batch_limit", vllm_instance="team-b/vllm-b")
            ),
            what="both engines' batch limits, read without a token",
        )
        assert pick(samples, "batchlens_source_errors_total", source="kubernetes", reason="pod_no_admin_token_secret")
        assert api.authorizations["127.0.0.3"] == [] and api.authorizations["127.0.0.4"] == []  # never reached
        # Issue 57: the exporter only reads, and holds no token: it asks for no Secret, and signs nothing.
        assert api.requests and not [r for r in api.requests if "/secrets/" in r], api.requests
        assert set(api.signers["127.0.0.2"][hooks_calls:]) == {None}

        # vllm-0 is recreated at a new IP, and its old IP now belongs to a pod that holds no token.
        api.pods = [pod("vllm-0", "127.0.0.6"), pod("impostor", "127.0.0.2", token_secret=None)]
        wait_until(lambda: len(api.authorizations["127.0.0.6"]) >= 2, what="the exporter at vllm-0's new IP")
        before = len(api.authorizations["127.0.0.2"])
        wait_until(lambda: len(api.authorizations["127.0.0.6"]) >= 8, what="more samples at the new IP")
        assert len(api.authorizations["127.0.0.2"]) == before, "the exporter still read vllm-0's old IP"
        # No token ever went on the wire, only signatures: an address that is not the engine learns none.
        seen = str(api.authorizations)
        assert all(t not in seen for t in ("a-shared-token-nobody-should-see", "pod-admin-token", "team-b-token"))
        hook_log = hook.process.log_tail(400)
        assert "pod-admin-token" not in hook_log and "team-b-token" not in hook_log + exporter.process.log_tail(400)
    finally:
        for proc in (exporter, hook):
            if proc is not None:
                proc.stop()
        api.close()


@pytest.mark.slow
def test_a_tenants_webhook_token_acts_on_its_own_namespace_only(tmp_path) -> None:
    """The attack from issue 30: an alert labelled namespace=ns-a with vllm_instance=ns-b/vllm-0 halved ns-b's
    engine, sent with the one webhook token that every tenant's namespace held a copy of.

    Now each namespace's Secret holds its own webhook token, good for its engines only, and an alert acts only
    on an engine of the namespace it is labelled with, whichever token sent it."""
    api = FakeKubernetes(free_port())
    api.serve_pod("127.0.0.2", "ns-a")
    api.serve_pod("127.0.0.3", "ns-b")
    api.tokens = {"ns-a": "a-admin", "ns-b": "b-admin"}
    api.webhook_tokens = {"ns-a": "a-webhook", "ns-b": "b-webhook"}
    hook = None
    try:
        api.pods = [pod("vllm-0", "127.0.0.2", namespace="ns-a"), pod("vllm-0", "127.0.0.3", namespace="ns-b")]
        k8s = discovery(api, namespaces=("ns-a", "ns-b"))
        hook = RemediateProcess(tmp_path, {"kubernetes": k8s})  # and the service's own token, WEBHOOK_TOKEN
        attacks = [
            ("a-webhook", pod_alert("ns-b/vllm-0", "ns-a"), "other_namespace"),  # the attack as found
            ("a-webhook", pod_alert("ns-b/vllm-0", "ns-b"), "other_namespace"),  # with the label forged too
            (WEBHOOK_TOKEN, pod_alert("ns-b/vllm-0", "ns-a"), "namespace_mismatch"),  # mislabelled, any token
        ]
        for token, sent, reason in attacks:
            status, body = hook.post(notification(sent), token=token)
            assert status == 200 and body == {"status": "accepted", "accepted": 0, reason: 1}, body
        assert hook.post(notification(pod_alert("ns-b/vllm-0", "ns-b")), token="a-admin")[0] == 401
        status, body = hook.post(notification(pod_alert("ns-b/vllm-0", "ns-b")), token="b-webhook")  # its own
        assert status == 200 and body["accepted"] == 1, body
        wait_until(lambda: api.batch["127.0.0.3"]["max_num_active_seqs"] == 32, what="ns-b/vllm-0 halved")
        assert api.batch["127.0.0.2"]["max_num_active_seqs"] == 64
        assert pick(hook.samples(), "batchlens_remediation_deliveries_total", outcome="other_namespace")
        assert "a-webhook" not in hook.process.log_tail(400) and "b-webhook" not in hook.process.log_tail(400)
    finally:
        if hook is not None:
            hook.stop()
        api.close()


def test_the_hook_fills_the_secrets_the_chart_rendered_empty_once_and_restarts_to_read_them(api, tmp_path) -> None:
    """Issue 30: `helm template` made a new random token on every render. The chart now renders the Secrets
    empty and marked, and `batchlens remediate` writes each missing token once, then exits 75 so that the
    pod starts again with it in its environment. A Secret without the mark is never written."""
    api.tokens = {"serving": "", "team-b": ""}
    api.fill_marked = {"serving"}
    fill = [{"namespace": ns, "name": "batchlens-admin-token", "keys": ["token", "webhook-token"]}
            for ns in ("serving", "team-b")]  # fmt: skip
    config = {"kubernetes": {**discovery(api, ("serving", "team-b")), "fill_secrets": fill}}
    (tmp_path / "hook.yaml").write_text(json.dumps({**config, "remediate": {"listen": f"127.0.0.1:{free_port()}",
                                                    "state_path": str(tmp_path / "s.sqlite")}}))  # fmt: skip
    argv = [BATCHLENS, "remediate", "--config", str(tmp_path / "hook.yaml")]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, WEBHOOK_ENV: ""})
    assert first.returncode == 75, first.stderr[-2000:]
    assert "exiting so that Kubernetes restarts it with the tokens just written" in first.stderr
    assert "team-b/batchlens-admin-token has no token, webhook-token, and no batchlens.io/fill-tokens" in first.stderr
    written = (api.tokens["serving"], api.webhook_tokens["serving"])
    assert all(len(t) >= 32 for t in written) and written[0] != written[1] and api.tokens["team-b"] == ""
    assert not any(t in first.stderr for t in written)  # a token is never logged
    assert [ns for ns, _ in api.patches] == ["serving"]

    # The restarted pod has its token: nothing more is written, and the hook serves.
    hook = RemediateProcess(tmp_path, config, env={WEBHOOK_ENV: WEBHOOK_TOKEN})
    try:
        assert hook.health() and len(api.patches) == 1 and api.tokens["serving"] == written[0]
    finally:
        hook.stop()


def test_two_writers_racing_to_fill_a_secret_keep_the_first_ones_tokens(api) -> None:
    """The write names the version it read: the second writer gets 409 and writes nothing."""
    from batchlens.config import SecretToFill
    from batchlens.discovery.kubernetes import PodLister

    api.tokens, api.fill_marked = {"serving": ""}, {"serving"}
    wanted = SecretToFill(namespace="serving", name="batchlens-admin-token", keys=["token"])

    async def race() -> tuple[list[str], list[str]]:
        first, second = PodLister(Kubernetes(**discovery(api))), PodLister(Kubernetes(**discovery(api)))
        real_patch = second._client.patch

        async def patch_after_the_first(*args, **kwargs):
            await first.fill(wanted)  # the first writer lands between the second's read and its write
            return await real_patch(*args, **kwargs)

        second._client.patch = patch_after_the_first
        try:
            return await second.fill(wanted), await first.fill(wanted)
        finally:
            await first.aclose()
            await second.aclose()

    assert asyncio.run(race()) == ([], []) and len(api.patches) == 1 and api.tokens["serving"]


def test_a_network_policy_open_to_any_address_for_the_api_server_is_said_at_start(caplog) -> None:
    """Issue 57, item 3: with networkPolicy.apiServer.cidrs empty, the chart's policy lets both pods reach 443 and
    6443 anywhere; the chart tells the config so ([]), and each pod's discovery warns when it starts."""
    from batchlens.discovery.kubernetes import PodLister

    said = {}
    for cidrs in ([], ["10.0.0.10/32"], None):
        settings = Kubernetes(discover=True, namespaces=["serving"], api_url=f"http://127.0.0.1:{free_port()}",
                              api_server_cidrs=cidrs)  # fmt: skip
        caplog.clear()
        with caplog.at_level("WARNING", "batchlens.discovery"):
            asyncio.run(PodLister(settings).aclose())
        said[str(cidrs)] = caplog.text
    assert "reach the API server's ports on ANY address" in said["[]"] and "kubectl get endpoints" in said["[]"]
    assert said["['10.0.0.10/32']"] == said["None"] == ""
    with pytest.raises(ValidationError, match=r"10\.0\.0\.300/32"):
        Kubernetes(api_server_cidrs=["10.0.0.300/32"])


def test_the_pods_of_one_leaderworkerset_group_are_the_servers_of_one_engine() -> None:
    """llm-d's wide EP: one vLLM per rank, a LeaderWorkerSet per deployment; each replica (group) an engine."""
    lws = {"app.kubernetes.io/name": "vllm", "leaderworkerset.sigs.k8s.io/name": "deepseek"}
    pods = [
        pod("deepseek-0", "10.1.0.10", labels={**lws, "leaderworkerset.sigs.k8s.io/group-index": "0"}),
        pod("deepseek-0-1", "10.1.0.11", labels={**lws, "leaderworkerset.sigs.k8s.io/group-index": "0"}),
        pod("deepseek-1", "10.1.0.12", labels={**lws, "leaderworkerset.sigs.k8s.io/group-index": "1"}),
        pod("solo", "10.1.0.13"),
    ]
    engines, _ = engines_of([Pod.from_dict(p) for p in pods], Kubernetes(namespaces=["serving"]))
    assert [(e.name, e.series_labels) for e in engines] == [
        ("serving/deepseek-0", {"vllm_instance": "serving/deepseek-0", "server": "serving/deepseek-0"}),
        ("serving/deepseek-0-1", {"vllm_instance": "serving/deepseek-0", "server": "serving/deepseek-0-1"}),
        ("serving/deepseek-1", {"vllm_instance": "serving/deepseek-1", "server": "serving/deepseek-1"}),
        ("serving/solo", {"vllm_instance": "serving/solo"}),
    ]
    off, _ = engines_of([Pod.from_dict(p) for p in pods], Kubernetes(namespaces=["serving"], deployment_label=""))
    assert {e.instance for e in off} == {e.name for e in off}
