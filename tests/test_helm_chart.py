"""The Helm chart (deploy/helm/batchlens), proved offline with real tools, layer by layer.

No API server, helm binary or Prometheus Operator can run here. What runs:
- Helm's own Go library (helm-python-sdk) renders and strictly lints the chart with each ci/ values file;
- kubernetes-validate --strict checks every built-in kind against Kubernetes 1.30 and the newest it ships;
- the operator's CRD schemas (npm @kubernetes-models/prometheus-operator) and TypeScript's excess-property
  check cover the operator's kinds, so a misspelt field fails; KEDA's (npm @kubernetes-models/keda) its
  ScaledObject;
- promtool checks the rules taken out of the rendered PrometheusRule and runs alerts/tests on them;
- amtool tests the routing of the Alertmanager configuration the operator would build (harness/helm.py).
"""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from batchlens.admin_auth import POD_NAME_ENV, POD_NAMESPACE_ENV
from batchlens.artifacts import chart_files, rule_groups
from batchlens.config import Config, ConfigError, load_config
from harness.helm import (
    CHART,
    MONITORING,
    NAMESPACE,
    RELEASE,
    ROOT,
    VALUES,
    check_operator_kinds,
    helm,
    objects,
    of_kind,
    operator_alertmanager_config,
    render,
)
from harness.pod_security import restricted_violations
from harness.prometheus import require_binary

OPERATOR_KINDS = {"PrometheusRule", "ServiceMonitor", "PodMonitor", "AlertmanagerConfig", "ScaledObject"}  # CRDs
KUBERNETES = ("1.30.0", "1.37.0")  # the oldest we support here, and the newest kubernetes-validate ships
KPS = {"monitoringNamespace": MONITORING}  # where kube-prometheus-stack runs: a value every install gives


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: objects(values) for name, values in VALUES.items()}


def test_the_ci_values_files_are_the_three_the_docs_name() -> None:
    assert set(VALUES) == {"default-values", "all-enabled-values", "production-stack-values"}


def test_the_chart_version_follows_batchlens() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["apiVersion"] == "v2" and chart["version"] == version and chart["appVersion"] == version


@pytest.mark.parametrize("name", sorted(VALUES))
def test_helm_lints_the_chart_strictly(name: str) -> None:
    for kube in KUBERNETES:
        report = helm().lint(CHART, VALUES[name], strict=True, namespace=NAMESPACE, kube_version=f"v{kube}")
        serious = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
        assert not serious and not report["errors"], (kube, serious, report["errors"])


def test_the_values_schema_refuses_a_misspelt_key_and_a_relative_link() -> None:
    for values, complaint in (
        ({"exporter": {"nodeSelecter": {}}}, "'nodeSelecter' not allowed"),
        ({"links": {"grafanaUrl": "grafana:3000"}}, "/links/grafanaUrl"),
    ):
        with pytest.raises(helm().HelmValuesError, match=complaint):
            render(values)


@pytest.mark.parametrize("kube", KUBERNETES)
def test_every_builtin_kind_is_valid_kubernetes_strictly(rendered, kube: str, tmp_path) -> None:
    files = []
    for name, docs in rendered.items():
        for i, doc in enumerate(d for d in docs if d["kind"] not in OPERATOR_KINDS):
            files.append(tmp_path / f"{name}-{i}-{doc['kind']}.yaml")
            files[-1].write_text(yaml.safe_dump(doc))
    examples = ROOT / "deploy" / "examples" / "vllm-with-batchlens.yaml"  # how a user runs vLLM with the plugin
    for i, doc in enumerate(yaml.safe_load_all(examples.read_text())):
        files.append(tmp_path / f"example-{i}-{doc['kind']}.yaml")
        files[-1].write_text(yaml.safe_dump(doc))
    kinds = {path.stem.rsplit("-", 1)[1] for path in files}
    assert {"DaemonSet", "Deployment", "Service", "ConfigMap", "Secret", "PersistentVolumeClaim"} <= kinds
    assert {"NetworkPolicy", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    misspelt = yaml.safe_load(files[0].read_text())
    misspelt["metdata"] = misspelt.pop("metadata")
    (tmp_path / "misspelt.yaml").write_text(yaml.safe_dump(misspelt))
    done = kubernetes_validate(kube, *files)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(" passed for resource ") == len(files), done.stdout[-3000:]
    done = kubernetes_validate(kube, tmp_path / "misspelt.yaml")  # the check can fail
    assert done.returncode != 0 and "metdata" in done.stdout + done.stderr, done.stdout + done.stderr


def kubernetes_validate(kube: str, *files: Path) -> subprocess.CompletedProcess:
    tool = Path(sys.executable).parent / "kubernetes-validate"
    argv = [str(tool), "--strict", "-k", kube, *map(str, files)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_the_operator_kinds_match_the_operators_schemas(rendered, tmp_path) -> None:
    docs = [d for name in rendered for d in rendered[name] if d["kind"] in OPERATOR_KINDS]
    assert {d["kind"] for d in docs} == OPERATOR_KINDS
    done = check_operator_kinds(docs, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(docs)} objects, 0 problems" in done.stdout


def test_the_operator_kinds_check_fails_on_a_misspelt_field(rendered, tmp_path) -> None:
    docs = copy.deepcopy(rendered["default-values"])  # the fixture is shared
    [monitor] = of_kind(docs, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = monitor["spec"]["endpoints"][0].pop("interval")
    [rule] = of_kind(docs, "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["recrod"] = "x"
    [scaler] = copy.deepcopy(of_kind(rendered["all-enabled-values"], "ScaledObject"))
    scaler["spec"]["minReplicas"] = scaler["spec"].pop("minReplicaCount")
    done = check_operator_kinds([monitor, rule, scaler], tmp_path)
    assert done.returncode == 1, done.stdout
    assert "intervall" in done.stdout and "recrod" in done.stdout and "minReplicas" in done.stdout, done.stdout
    scaler["spec"]["minReplicaCount"] = scaler["spec"].pop("minReplicas")
    scaler["spec"]["triggers"][0].pop("type")  # KEDA's CRD schema requires it
    done = check_operator_kinds([scaler], tmp_path)
    assert done.returncode == 1 and "type" in done.stdout, done.stdout


def test_the_keda_scaledobject_is_off_by_default_and_scales_the_workload_to_the_desired_replicas(
    rendered, tmp_path
) -> None:
    """docs/scaling.md: KEDA's Prometheus scaler, AverageValue with threshold 1, sets the replicas to the value."""
    assert not of_kind(rendered["default-values"], "ScaledObject")
    assert not of_kind(rendered["production-stack-values"], "ScaledObject")
    [scaler] = of_kind(rendered["all-enabled-values"], "ScaledObject")
    assert scaler["metadata"]["namespace"] == "serving"  # the workload's: KEDA scales in its own namespace
    assert scaler["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm"}
    assert (scaler["spec"]["minReplicaCount"], scaler["spec"]["maxReplicaCount"]) == (1, 8)
    [trigger] = scaler["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == f"http://prometheus-operated.{MONITORING}.svc:9090"
    assert (meta["threshold"], meta["ignoreNullValues"]) == ("1", "false")
    # The query picks the deployment's one series (of this cluster) out of every level of the rule: promtool says so.
    promtool = require_binary("promtool", "prometheus")
    series = [
        ('batchlens:desired_replicas{cluster="gpu-east-1",model_name="m",vllm_instance="serving/vllm"}', "3"),
        ('batchlens:desired_replicas{cluster="gpu-west-1",model_name="m",vllm_instance="serving/vllm"}', "7"),
        ('batchlens:desired_replicas{cluster="gpu-east-1",role="main"}', "5"),
    ]
    suite = {
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": value} for name, value in series],
                "promql_expr_test": [
                    {"expr": meta["query"], "eval_time": "0m", "exp_samples": [{"labels": "{}", "value": 3}]}
                ],
            }
        ]
    }
    (tmp_path / "query.test.yml").write_text(yaml.safe_dump(suite))
    done = subprocess.run([promtool, "test", "rules", str(tmp_path / "query.test.yml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_keda_scaledobject_needs_its_workload_and_one_signal() -> None:
    keda = {"enabled": True, "scaleTargetRef": {"name": "vllm"}, "vllmInstance": "serving/vllm"}
    base = {**KPS, "discovery": {"enabled": False}}
    [scaler] = of_kind(objects({**base, "autoscaling": {"keda": {**keda, "role": "", "serverAddress": "http://p:9090"}}}),
                       "ScaledObject")  # fmt: skip
    assert scaler["metadata"]["namespace"] == NAMESPACE
    assert (
        scaler["spec"]["triggers"][0]["metadata"]["query"]
        == 'max(batchlens:desired_replicas{vllm_instance="serving/vllm"})'
    )
    for broken, complaint in (
        ({"scaleTargetRef": {"name": ""}}, "scaleTargetRef.name"),
        ({"vllmInstance": ""}, "set one of vllmInstance"),
        ({"role": "interactive"}, "set one of vllmInstance"),
    ):
        with pytest.raises(Exception, match=complaint):
            render({**base, "autoscaling": {"keda": {**keda, **broken}}})


def test_the_prometheusrule_holds_exactly_the_generated_groups(rendered) -> None:
    for name, docs in rendered.items():
        [rule] = of_kind(docs, "PrometheusRule")
        links = {
            "grafana_url": VALUES[name].get("links", {}).get("grafanaUrl", ""),
            "runbook_url": VALUES[name].get("links", {}).get("runbookUrl", ""),
        }
        expected = list(rule_groups(load_config(None, {"links": links}, {})).values())
        assert rule["spec"]["groups"] == expected, name
    [rule] = of_kind(rendered["all-enabled-values"], "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_promtool_checks_and_unit_tests_the_rendered_rules(rendered, tmp_path) -> None:
    promtool = require_binary("promtool", "prometheus")
    [rule] = of_kind(rendered["default-values"], "PrometheusRule")
    extracted = tmp_path / "rules" / "prometheusrule.yml"
    extracted.parent.mkdir()
    extracted.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    done = subprocess.run([promtool, "check", "rules", "--lint=all", str(extracted)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    suites = tmp_path / "tests"
    suites.mkdir()
    for path in sorted((ROOT / "alerts" / "tests").glob("*.yml")):
        suite = yaml.safe_load(path.read_text())
        suite["rule_files"] = ["../rules/prometheusrule.yml"]
        suite["group_eval_order"] = [group["name"] for group in rule["spec"]["groups"]]
        (suites / path.name).write_text(yaml.safe_dump(suite, sort_keys=False))
    done = subprocess.run(
        [promtool, "test", "rules", *map(str, sorted(suites.glob("*.yml")))], capture_output=True, text=True
    )
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout + done.stderr


def test_one_dashboard_configmap_per_dashboard_with_the_sidecar_label(rendered) -> None:
    committed = {path.name: path.read_text() for path in sorted((ROOT / "dashboards").glob("*.json"))}
    maps = [
        m for m in of_kind(rendered["default-values"], "ConfigMap") if "grafana_dashboard" in m["metadata"]["labels"]
    ]
    assert len(maps) == len(committed)
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "batchlens"
        [(file, text)] = cm["data"].items()
        assert json.loads(text) == json.loads(committed[file]), file
        assert len(text.encode()) < 1_000_000  # a ConfigMap holds 1 MiB at most


def test_the_chart_payloads_are_what_batchlens_build_writes() -> None:
    for path, text in chart_files(load_config(None, {}, {})).items():
        assert (ROOT / path).read_text() == text, f"{path} is stale: run `batchlens build`"


def test_the_generated_config_is_a_valid_batchlens_config(rendered) -> None:
    for name, docs in rendered.items():
        [config_map] = [m for m in of_kind(docs, "ConfigMap") if m["metadata"]["name"].endswith("-config")]
        data = yaml.safe_load(config_map["data"]["config.yaml"])
        config = load_config(None, data, {})
        assert config.exporter.listen == "0.0.0.0:9400" and config.remediate.listen == "0.0.0.0:9401"
        assert config.remediate.cluster == VALUES[name].get("cluster", "")
        assert config.kubernetes.discover and config.kubernetes.node_name_env == "NODE_NAME"
        selector = VALUES[name].get("discovery", {}).get("selector") or {"app.kubernetes.io/name": "vllm"}
        assert config.kubernetes.selector == selector  # a user's selector replaces the default, not merged
        # the socket the DaemonSet mounts read-only (tests/test_pod_resources.py reads one)
        assert config.exporter.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
        assert [e.name for e in config.engines] == [e["name"] for e in VALUES[name].get("engines", [])]
        assert config.kubernetes.admin_port == VALUES[name]["discovery"].get("adminPort")
        if name == "all-enabled-values":
            assert config.thresholds.kv_blocks_ratio == 0.85 and config.control.enabled


def test_the_exporter_runs_on_gpu_nodes_with_the_kubelet_socket_read_only(rendered) -> None:
    [daemonset] = of_kind(rendered["all-enabled-values"], "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and pod["runtimeClassName"] == "nvidia"
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "BATCHLENS_ADMIN_TOKEN" not in env  # it only reads: no token (test_the_exporter_has_its_own_...)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert (
        mounts["pod-resources"]["readOnly"] and mounts["pod-resources"]["mountPath"] == "/var/lib/kubelet/pod-resources"
    )
    assert container["securityContext"]["readOnlyRootFilesystem"]
    assert container["resources"]["limits"]["memory"]


def test_two_hooks_by_default_one_acting_on_a_lease_their_state_in_a_config_map(rendered) -> None:
    docs = rendered["default-values"]
    [deployment] = of_kind(docs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 2 and spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }
    pod = spec["template"]["spec"]
    assert pod["affinity"]["podAntiAffinity"], "the standby on another node"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["BATCHLENS_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert {v["name"]: v for v in pod["volumes"]}["state"] == {"name": "state", "emptyDir": {}}
    assert not of_kind(docs, "PersistentVolumeClaim")
    election = chart_config(docs).remediate.leader_election
    lease = f"{RELEASE}-batchlens-remediate"
    assert election.enabled and (election.lease_name, election.state_config_map) == (lease, f"{lease}-state")
    [role] = [r for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader")]
    assert role["metadata"]["namespace"] == NAMESPACE
    named = {(r["resources"][0], v) for r in role["rules"] if "resourceNames" in r for v in r["verbs"]}
    assert named == {("leases", "get"), ("leases", "update"), ("configmaps", "get"), ("configmaps", "update")}
    assert [r["resourceNames"] for r in role["rules"] if "resourceNames" in r] == [[lease], [f"{lease}-state"]]


def test_without_leader_election_one_recreated_replica_with_its_state_on_a_claim(rendered) -> None:
    docs = rendered["production-stack-values"]
    [deployment] = of_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    [claim] = of_kind(docs, "PersistentVolumeClaim")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert not chart_config(docs).remediate.leader_election.enabled
    assert not [r for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader")]


def test_discovery_needs_the_engines_namespaces() -> None:
    with pytest.raises(Exception, match=r"discovery.namespaces: list the namespaces whose vLLM pods are engines"):
        render(KPS)
    assert render({**KPS, "discovery": {"enabled": False}})  # no discovery, nothing to scope


def test_each_engine_namespace_has_its_own_token_and_a_role_that_reads_only_it(rendered) -> None:
    """Issue 30: one token for every engine, and a ClusterRole on every pod, let any labelled pod take it."""
    for name, docs in rendered.items():
        values = VALUES[name]
        namespaces = values["discovery"]["namespaces"]
        secret = values.get("adminToken", {}).get("existingSecret") or f"{RELEASE}-batchlens-admin-token"
        assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding"), name
        roles = [r for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-engines")]
        assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(namespaces), name
        for role in roles:
            assert role["rules"] == [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
                {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [secret], "verbs": ["get"]},
            ], name
        bindings = [b for b in of_kind(docs, "RoleBinding") if b["metadata"]["name"].endswith("-engines")]
        assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(namespaces), name
        assert all(b["subjects"][0]["namespace"] == NAMESPACE for b in bindings)
        k8s = chart_config(docs).kubernetes
        assert (k8s.namespaces, k8s.admin_token_secret, k8s.admin_token_key) == (namespaces, secret, "token")
        made = [s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == secret]
        if values.get("adminToken", {}).get("existingSecret"):
            assert not made, name  # the user's own, in each namespace
        else:  # one per engine namespace, each its own random token
            assert sorted(s["metadata"]["namespace"] for s in made) == sorted(namespaces), name
        for workload in of_kind(docs, "DaemonSet") + of_kind(docs, "Deployment"):
            env = {e["name"] for c in workload["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
            # the environment's token is the service's, for static engines only: the exporter holds none
            wanted = bool(values.get("engines")) and workload["kind"] == "Deployment"
            assert ("BATCHLENS_ADMIN_TOKEN" in env) == wanted, (name, workload["kind"])
    # Rendered with no cluster, each namespace's Secret is left for the service to fill, each with its own token
    # (test_discovery.py::test_the_hook_fills_the_secrets_the_chart_rendered_empty_once_and_restarts_to_read_them).
    two = objects({**KPS, "discovery": {"namespaces": ["team-a", "team-b"]}})
    assert fills(two) == {("team-a", f"{RELEASE}-batchlens-admin-token"): ["token", "webhook-token"],
                          ("team-b", f"{RELEASE}-batchlens-admin-token"): ["token", "webhook-token"],
                          (NAMESPACE, f"{RELEASE}-batchlens-webhook-token"): ["token"]}  # fmt: skip


def test_the_exporter_has_its_own_service_account_with_no_right_to_any_secret(rendered) -> None:
    """Issue 57, item 3: the exporter (root, on every GPU node) ran as the remediation service's ServiceAccount,
    with get on every admin token Secret and get+patch on the webhook token's: a node's compromise was every
    engine's. Now it may list the engine namespaces' pods and nothing else, and mounts no token of any kind."""
    for name, docs in rendered.items():
        [daemonset] = of_kind(docs, "DaemonSet")
        [deployment] = of_kind(docs, "Deployment")
        pod = daemonset["spec"]["template"]["spec"]
        account = pod["serviceAccountName"]
        assert account != deployment["spec"]["template"]["spec"]["serviceAccountName"], name
        [sa] = [a for a in of_kind(docs, "ServiceAccount") if a["metadata"]["name"] == account]
        assert sa["automountServiceAccountToken"] is True, name  # discovery lists pods
        roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in of_kind(docs, "Role")}
        bound = [roles[(b["metadata"]["namespace"], b["roleRef"]["name"])] for b in of_kind(docs, "RoleBinding")
                 if any(s["name"] == account for s in b["subjects"])]  # fmt: skip
        assert sorted(r["metadata"]["namespace"] for r in bound) == sorted(VALUES[name]["discovery"]["namespaces"])
        for role in bound:
            assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}], (name, role)
        secrets = [e for c in pod["containers"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
        volumes = [v for v in pod.get("volumes", []) if "secret" in v or "projected" in v]
        assert not secrets and not volumes, (name, secrets, volumes)
    notes = render(VALUES["default-values"])[f"{CHART.name}/templates/NOTES.txt"]
    assert f"the exporter's ServiceAccount\n{RELEASE}-batchlens-exporter may list pods and nothing else" in notes
    assert f"{RELEASE}-batchlens may list pods and get the Secret {RELEASE}-batchlens-admin-token" in notes
    # Without discovery the exporter asks the API server nothing: its ServiceAccount mounts no API token.
    docs = objects({**KPS, "discovery": {"enabled": False}})
    [sa] = [a for a in of_kind(docs, "ServiceAccount") if a["metadata"]["name"].endswith("-exporter")]
    assert sa["automountServiceAccountToken"] is False
    assert not [b for b in of_kind(docs, "RoleBinding") if b["subjects"][0]["name"] == sa["metadata"]["name"]]


def chart_config(docs: list[dict]) -> Config:
    """The batchlens config the chart's ConfigMap holds, as both pods load it."""
    [config_map] = [m for m in of_kind(docs, "ConfigMap") if m["metadata"]["name"].endswith("-config")]
    return load_config(None, yaml.safe_load(config_map["data"]["config.yaml"]), {})


def fills(docs: list[dict]) -> dict[tuple[str, str], list[str]]:
    """What the service's config says to fill: (namespace, Secret) -> keys."""
    k8s = chart_config(docs).kubernetes
    return {(f.namespace, f.name): f.keys for f in k8s.fill_secrets}


def test_a_render_without_a_cluster_is_the_same_every_time_and_leaves_the_tokens_to_the_service() -> None:
    """Issue 30: the lookup-kept token was new on every `helm template` (and so every GitOps render). Rendered
    with no cluster, the Secrets carry no token and the fill mark, the service may get and patch those Secrets
    alone, and its pod starts without them (it writes them, then restarts to read them)."""
    values = {**KPS, "discovery": {"namespaces": ["serving"]}}
    assert render(values) == render(values)
    docs = objects(values)
    for secret in of_kind(docs, "Secret"):
        assert "data" not in secret and secret["metadata"]["annotations"] == {"batchlens.io/fill-tokens": "true"}
    filled = fills(docs)
    assert {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in of_kind(docs, "Secret")} == set(filled)
    fill_roles = {(r["metadata"]["namespace"], tuple(r["rules"][0]["resourceNames"])): r["rules"]
                  for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-fill")}  # fmt: skip
    assert set(fill_roles) == {(ns, (name,)) for ns, name in filled}
    assert all(rules == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": list(names),
                          "verbs": ["get", "patch"]}] for (_, names), rules in fill_roles.items())  # fmt: skip
    [service] = of_kind(docs, "Deployment")
    refs = [e["valueFrom"]["secretKeyRef"] for e in service["spec"]["template"]["spec"]["containers"][0]["env"]
            if "secretKeyRef" in e.get("valueFrom", {})]  # fmt: skip
    assert refs and all(ref.get("optional") is True for ref in refs)
    # given values (or existing Secrets), nothing is left to fill and nothing may be patched
    given = objects({**values, "adminToken": {"value": "a" * 40}, "remediate": {"webhookToken": {"value": "w" * 40}}})
    assert fills(given) == {("serving", f"{RELEASE}-batchlens-admin-token"): ["webhook-token"]}
    assert fills(objects(VALUES["all-enabled-values"])) == {}


def test_tokens_are_kept_secret_and_stable_across_renders(rendered) -> None:
    secrets = of_kind(rendered["all-enabled-values"], "Secret")
    # The service's webhook token stays in the release's namespace (no copy in a tenant's); the admin token is
    # the user's existing Secret, so the chart makes none.
    assert sorted(s["metadata"]["namespace"] for s in secrets) == [NAMESPACE]
    assert all("value" not in json.dumps(s["metadata"]) for s in secrets)
    for path, text in render(VALUES["all-enabled-values"]).items():
        if not path.endswith("secrets.yaml"):
            assert "not-a-real-token-only-for-rendering" not in text, path


def test_the_notes_warn_about_the_missing_release_label() -> None:
    scoped = {**KPS, "discovery": {"namespaces": ["serving"]}}
    notes = render(scoped)[f"{CHART.name}/templates/NOTES.txt"]
    assert "prometheusRule.additionalLabels has no `release` label" in notes and "ignored" in notes
    labelled = {**scoped, "prometheusRule": {"additionalLabels": {"release": "kps"}},
                "serviceMonitor": {"additionalLabels": {"release": "kps"}},
                "networkPolicy": {"apiServer": {"cidrs": ["10.0.0.10/32"]}}}  # fmt: skip
    assert "WARNING" not in render(labelled)[f"{CHART.name}/templates/NOTES.txt"]


def test_amtool_routes_the_breaker_to_the_hook_only_from_the_objects_namespaces(rendered, tmp_path) -> None:
    amtool = require_binary("amtool", "prometheus-alertmanager")
    configs = of_kind(rendered["all-enabled-values"], "AlertmanagerConfig")
    # the engine namespaces', and the release's for the static engines (their series carry the exporter's)
    assert sorted(c["metadata"]["namespace"] for c in configs) == [NAMESPACE, "serving", "serving-canary"]
    token = tmp_path / "token"
    token.write_text("x")
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(operator_alertmanager_config(configs, token)))
    done = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    hook = f"serving/{RELEASE}-batchlens/batchlens-remediate"
    for labels, receiver in (
        (["alertname=VllmP99LatencyBreaker", "namespace=serving", "vllm_instance=serving/vllm-0"], hook),
        (["alertname=VllmP99LatencyBreaker", "namespace=elsewhere"], "default"),
        (["alertname=VllmKvCacheBlocksHigh", "namespace=serving"], "default"),
    ):
        done = subprocess.run(
            [amtool, "config", "routes", "test", f"--config.file={config}", f"--verify.receivers={receiver}", *labels],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, (labels, done.stdout + done.stderr)
    for config in configs:
        [hook_config] = config["spec"]["receivers"][0]["webhookConfigs"]
        assert hook_config["url"] == f"http://{RELEASE}-batchlens-remediate.{NAMESPACE}.svc:9401/alertmanager"
        # each tenant's object sends its own namespace's webhook token: good for its own engines only
        credentials = hook_config["httpConfig"]["authorization"]["credentials"]
        own = {"name": f"{RELEASE}-batchlens-webhook-token", "key": "token"}  # the release's: the service's
        expected = own if config["metadata"]["namespace"] == NAMESPACE else {"name": "vllm-admin-token",
                                                                              "key": "webhook-token"}  # fmt: skip
        assert credentials == expected, config["metadata"]


def test_each_engine_namespace_gets_a_webhook_token_of_its_own_and_the_config_names_its_key() -> None:
    docs = objects(
        {
            **KPS,
            "discovery": {"namespaces": ["team-a", "team-b"]},
            "engines": [{"name": "edge", "url": "http://10.0.0.9:8000"}],
        }
    )
    webhook = [s for s in of_kind(docs, "Secret") if "webhook" in s["metadata"]["name"]]
    assert [s["metadata"]["namespace"] for s in webhook] == [NAMESPACE], "the service's token: one copy, its own"
    # each namespace's webhook token is a key of its own Secret, filled apart from the service's
    admin = f"{RELEASE}-batchlens-admin-token"
    assert {key for (ns, name), keys in fills(docs).items() if name == admin for key in keys} == {"webhook-token",
                                                                                                 "token"}  # fmt: skip
    assert {ns for ns, name in fills(docs) if name == admin} == {"team-a", "team-b", NAMESPACE}
    by_namespace = {c["metadata"]["namespace"]: c for c in of_kind(docs, "AlertmanagerConfig")}
    assert set(by_namespace) == {"team-a", "team-b", NAMESPACE}  # the release's: the static engine's alerts
    sent = {ns: c["spec"]["receivers"][0]["webhookConfigs"][0]["httpConfig"]["authorization"]["credentials"]
            for ns, c in by_namespace.items()}  # fmt: skip
    assert sent["team-a"] == {"name": f"{RELEASE}-batchlens-admin-token", "key": "webhook-token"}
    assert sent[NAMESPACE] == {"name": f"{RELEASE}-batchlens-webhook-token", "key": "token"}
    [configmap] = [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-config")]
    config = yaml.safe_load(next(iter(configmap["data"].values())))
    assert config["kubernetes"]["webhook_token_key"] == "webhook-token"


def test_the_vllm_examples_switch_the_plugin_on_with_the_token_the_chart_reads() -> None:
    examples = ROOT / "deploy" / "examples"
    statefulset = next(yaml.safe_load_all((examples / "vllm-with-batchlens.yaml").read_text()))
    stack = yaml.safe_load((examples / "production-stack-values.yaml").read_text())
    envs = [statefulset["spec"]["template"]["spec"]["containers"][0]["env"]]
    envs += [model["env"] for model in stack["servingEngineSpec"]["modelSpec"]]
    secrets = [VALUES["all-enabled-values"]["adminToken"]["existingSecret"],
               VALUES["production-stack-values"]["adminToken"]["existingSecret"]]  # fmt: skip
    for env, secret in zip(envs, secrets, strict=True):
        named = {e["name"]: e for e in env}
        assert named["VLLM_PLUGINS"]["value"] == "batchlens"
        assert named["BATCHLENS_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == secret
        assert named[POD_NAME_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # what a signature names
        assert named[POD_NAMESPACE_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_the_pods_meet_pod_security_restricted_but_for_the_exporters_one_documented_exception(rendered) -> None:
    """The remediation service always; the exporter without the kubelet's pod-resources socket. With it (the
    default), exactly the two things that socket needs fail, and docs/security.md says so."""
    for name, docs in rendered.items():
        [remediate] = [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-remediate")]
        assert restricted_violations(remediate["spec"]["template"]["spec"]) == [], name
    without = objects(
        {**KPS, "discovery": {"namespaces": ["serving"]}, "exporter": {"podResources": {"enabled": False}}}
    )
    [exporter] = of_kind(without, "DaemonSet")
    assert restricted_violations(exporter["spec"]["template"]["spec"]) == []
    [exporter] = of_kind(rendered["default-values"], "DaemonSet")
    assert restricted_violations(exporter["spec"]["template"]["spec"]) == [
        "volume types: pod-resources is hostPath",
        "running as non-root: exporter must set runAsNonRoot: true",
        "running as non-root user: exporter runs as UID 0",
    ]
    security = (ROOT / "docs" / "security.md").read_text()
    assert "pod-resources" in security and "restricted" in security


def test_the_restricted_check_catches_what_the_standard_forbids() -> None:
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}]}  # fmt: skip
    assert restricted_violations(good) == []
    no_seccomp = {**good, "securityContext": {"runAsNonRoot": True}}
    [missing] = restricted_violations(no_seccomp)
    assert missing == "seccomp: c needs seccompProfile RuntimeDefault or Localhost, has None"
    host = {**good, "hostPID": True, "volumes": [{"name": "proc", "hostPath": {"path": "/proc"}}]}
    assert restricted_violations(host) == ["host namespaces: hostPID", "volume types: proc is hostPath"]


def peer(namespace: str, **labels: str) -> dict:
    """A NetworkPolicy peer: pods with these labels in the namespace of this name (a label nobody can set)."""
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "podSelector": {"matchLabels": labels}}  # fmt: skip


def tcp(*ports: int) -> list[dict]:
    return [{"port": p, "protocol": "TCP"} for p in ports]


DNS = {"to": [peer("kube-system", **{"k8s-app": "kube-dns"})], "ports": [{"port": 53, "protocol": "UDP"}, *tcp(53)]}


def test_the_network_policies_allow_exactly_what_the_docs_say(rendered) -> None:
    """Issue 30: ingress from any namespace by a label anyone sets, egress to any pod on 8000, DNS anywhere, and
    no policy for the exporter. Each rule here is stated by hand, as docs/kubernetes.md states it."""
    vllm = {"app.kubernetes.io/name": "vllm"}
    monitoring = MONITORING  # kube-prometheus-stack's, never the release's
    policies = {p["metadata"]["name"].rsplit("-", 1)[1]: p["spec"] for p in of_kind(rendered["default-values"],
                                                                                     "NetworkPolicy")}  # fmt: skip
    engines = {"to": [peer("serving", **vllm)], "ports": tcp(8000)}
    api = {"ports": tcp(443, 6443)}  # no cidrs given: open by port, and the NOTES say so
    assert policies["remediate"]["ingress"] == [{
        "from": [peer(monitoring, **{"app.kubernetes.io/name": "alertmanager"}),
                 peer(monitoring, **{"app.kubernetes.io/name": "prometheus"})],
        "ports": tcp(9401)}]  # fmt: skip
    assert policies["remediate"]["egress"] == [
        engines,
        {"to": [peer(monitoring, **{"app.kubernetes.io/name": "alertmanager"})], "ports": tcp(9093)},
        {"to": [peer(monitoring, **{"app.kubernetes.io/name": "prometheus"})], "ports": tcp(9090)},  # to confirm
        api,
        DNS,
    ]
    assert policies["exporter"]["ingress"] == [
        {"from": [peer(monitoring, **{"app.kubernetes.io/name": "prometheus"})], "ports": tcp(9400)}
    ]
    assert policies["exporter"]["egress"] == [engines, api, DNS]
    assert all(set(p["policyTypes"]) == {"Ingress", "Egress"} for p in policies.values())
    notes = render(VALUES["default-values"])[f"{CHART.name}/templates/NOTES.txt"]
    assert "WARNING: networkPolicy.apiServer.cidrs is empty" in notes and "ports 443/6443\non ANY address" in notes
    assert "kubectl get endpoints kubernetes -n default" in notes
    # ... and both pods say it at start: the config tells them the policy's addresses ([]: any)
    assert chart_config(rendered["default-values"]).kubernetes.api_server_cidrs == []

    # every engine namespace by name, the selector and port discovery uses, the API server by address
    full = {p["metadata"]["name"].rsplit("-", 1)[1]: p["spec"] for p in of_kind(rendered["all-enabled-values"],
                                                                                 "NetworkPolicy")}  # fmt: skip
    [engine_rule, _am, _prometheus, api_rule, _dns, extra] = full["remediate"]["egress"]
    assert engine_rule == {"to": [peer("serving", **vllm), peer("serving-canary", **vllm)], "ports": tcp(8000, 8001)}
    assert api_rule == {"ports": tcp(443, 6443), "to": [{"ipBlock": {"cidr": "10.96.0.1/32"}}]}
    assert extra["to"] == [{"ipBlock": {"cidr": "203.0.113.0/24"}}]
    assert full["exporter"]["ingress"][0]["from"] == [peer("monitoring", **{"app.kubernetes.io/name": "prometheus"})]
    stack = {p["metadata"]["name"].rsplit("-", 1)[1]: p["spec"] for p in of_kind(rendered["production-stack-values"],
                                                                                  "NetworkPolicy")}  # fmt: skip
    assert stack["exporter"]["egress"][0] == {"to": [peer("serving", **{"helm-release-name": "vllm"})],
                                              "ports": tcp(8000)}  # fmt: skip


def test_as_installed_the_breaker_can_act_and_page(rendered) -> None:
    """Issue 30, "the chart works as installed": with its defaults and the engines' namespace, the token reaches
    both sides (the vLLM pods' Secret, the service's config naming it), pages go to the operator's Alertmanager
    and the policy lets them, and the config the pods read is one batchlens accepts."""
    docs = rendered["default-values"]
    [configmap] = [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-config")]
    config = yaml.safe_load(next(iter(configmap["data"].values())))
    assert (
        load_config(None, config, {}).remediate.alertmanager_url
        == f"http://alertmanager-operated.{MONITORING}.svc:9093"
    )
    secret = config["kubernetes"]["admin_token_secret"]
    made = [s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == secret]
    assert [s["metadata"]["namespace"] for s in made] == ["serving"]
    assert fills(docs)[("serving", secret)] == ["token", "webhook-token"]  # the service writes both at start
    policy = next(p["spec"] for p in of_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-remediate"))
    assert {"to": [peer(MONITORING, **{"app.kubernetes.io/name": "alertmanager"})], "ports": tcp(9093)} in policy[
        "egress"
    ]
    other = objects({"discovery": {"namespaces": ["serving"]}, "monitoringNamespace": "kps",
                     "remediate": {"alertmanagerUrl": "http://am.example:9093"}})  # fmt: skip
    [configmap] = [c for c in of_kind(other, "ConfigMap") if c["metadata"]["name"].endswith("-config")]
    assert yaml.safe_load(next(iter(configmap["data"].values())))["remediate"]["alertmanager_url"] == (
        "http://am.example:9093"
    )


def test_a_misspelt_config_section_fails_the_render_and_a_misspelt_key_names_itself_when_the_pod_starts() -> None:
    scoped = {**KPS, "discovery": {"namespaces": ["serving"]}}
    with pytest.raises(Exception, match=r"config.contol is not a batchlens setting: config takes .*control"):
        render({**scoped, "config": {"contol": {"enabled": True}}})
    docs = objects({**scoped, "config": {"control": {"enabld": True}}})
    [configmap] = [c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-config")]
    with pytest.raises(ConfigError, match=r"control\.enabld"):  # what the pods log, and exit on
        load_config(None, yaml.safe_load(next(iter(configmap["data"].values()))), {})


def documented_install() -> tuple[str, str, dict, dict[tuple[str, str], set[str]], dict[str, str]]:
    """docs/kubernetes.md's install, as a user types it: (release, namespace, the --set values, each Secret its
    kubectl lines create: (namespace, name) -> keys, and the labels it puts on namespaces: namespace -> label)."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    block = text.split("## Install beside kube-prometheus-stack", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    secrets: dict[tuple[str, str], set[str]] = {}
    labels: dict[str, str] = {}
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:3] == ["kubectl", "label", "namespace"]:
            labels[words[3]] = words[4]
        elif words[:1] == ["kubectl"] and "secret" in words:
            namespace, name = words[words.index("-n") + 1], words[words.index("generic") + 1]
            secrets[(namespace, name)] = {w.removeprefix("--from-literal=").split("=", 1)[0] for w in words
                                          if w.startswith("--from-literal=")}  # fmt: skip
        elif words[:2] == ["helm", "install"]:
            release, namespace, values = words[2], words[words.index("-n") + 1], {}
            for k, word in enumerate(words):
                if word == "--set":
                    key, value = words[k + 1].split("=", 1)
                    *parents, leaf = key.split(".")
                    node = values
                    for part in parents:
                        node = node.setdefault(part, {})
                    node[leaf] = value[1:-1].split(",") if value.startswith("{") else value
    return release, namespace, values, secrets, labels


def test_the_documented_install_of_the_common_layout_renders_a_chart_that_works() -> None:
    """Issue 58, item 1: docs/kubernetes.md installed into `-n batchlens` with kube-prometheus-stack in
    `monitoring`; the policies admitted Prometheus and Alertmanager from `batchlens` only, the hook paged
    alertmanager-operated.batchlens, and the doc's Secret lacked the key the AlertmanagerConfig reads, so the
    operator rejected it. Rendered here exactly as the doc's lines say, in a namespace of its own."""
    release, namespace, values, secrets, labels = documented_install()
    assert namespace != values["monitoringNamespace"] == "monitoring", "the layout the doc teaches"
    # The exporter's one exception to Pod Security "restricted" (the kubelet's socket): its namespace says so.
    assert labels == {namespace: "pod-security.kubernetes.io/enforce=privileged"}
    docs = [d for path, text in render(values, name=release, namespace=namespace).items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]  # fmt: skip
    monitoring = values["monitoringNamespace"]
    # 1. Only kube-prometheus-stack's pods, where they run, reach batchlens, and batchlens reaches them there.
    for policy in of_kind(docs, "NetworkPolicy"):
        rules = policy["spec"]["ingress"] + policy["spec"]["egress"]
        peers = [
            p
            for r in rules
            for p in r.get("from", []) + r.get("to", [])
            if "app.kubernetes.io/name" in p.get("podSelector", {}).get("matchLabels", {})
            and p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] in ("prometheus", "alertmanager")
        ]
        assert peers and {p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for p in peers} == {
            monitoring}, policy["metadata"]["name"]  # fmt: skip
    # 2. The hook pages that Alertmanager, and asks that Prometheus.
    remediate = chart_config(docs).remediate
    assert remediate.alertmanager_url == f"http://alertmanager-operated.{monitoring}.svc:9093"
    assert remediate.prometheus_url == f"http://prometheus-operated.{monitoring}.svc:9090"
    # 3. Every key the chart reads from the doc's Secret is one the doc's kubectl line creates.
    name = values["adminToken"]["existingSecret"]
    for config in of_kind(docs, "AlertmanagerConfig"):
        for receiver in config["spec"]["receivers"]:
            for hook in receiver.get("webhookConfigs", []):
                ref = hook["httpConfig"]["authorization"]["credentials"]
                if config["metadata"]["namespace"] != namespace:  # an engine namespace's: the doc's Secret
                    assert ref["name"] == name and ref["key"] in secrets[(config["metadata"]["namespace"], name)]
    k8s = chart_config(docs).kubernetes
    for engine_namespace in values["discovery"]["namespaces"]:
        assert {k8s.admin_token_key, k8s.webhook_token_key} <= secrets[(engine_namespace, name)]
    # ... and what the chart cannot know offline, it refuses to guess
    without = {k: v for k, v in values.items() if k != "monitoringNamespace"}
    with pytest.raises(Exception, match=r"monitoringNamespace: set it to the namespace kube-prometheus-stack"):
        render(without, name=release, namespace=namespace)
