"""The Helm chart, rendered offline, and what the Prometheus Operator would make of its objects.

No API server, helm binary or operator runs here. The boundary: Helm's own Go library
(helm-python-sdk) renders and lints the chart exactly as `helm template` / `helm lint`
would; :func:`operator_alertmanager_config` stands in for the operator's translation of
AlertmanagerConfig objects into Alertmanager's configuration, following its documented
rules (receivers named <namespace>/<object>/<receiver>, a namespace matcher on each route,
continue: true), so that the real amtool can test the routing.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
CHART = ROOT / "deploy" / "helm" / "batchlens"
VALUES = {path.stem: yaml.safe_load(path.read_text()) or {} for path in sorted((CHART / "ci").glob("*-values.yaml"))}
OPERATOR_KINDS = ROOT / "tests" / "harness" / "operator_kinds"
# The common layout (docs/kubernetes.md): batchlens in a namespace of its own, kube-prometheus-stack in
# "monitoring" (the ci/ values' monitoringNamespace), vLLM in a third. Rendered into "monitoring" itself, a chart
# that took the release's namespace for the monitoring one passed every test, and failed every real install.
RELEASE, NAMESPACE, MONITORING = "bl", "batchlens", "monitoring"


def helm():
    try:
        import helm_python
    except ImportError:  # pragma: no cover - the test extra installs it
        raise AssertionError("helm-python-sdk is missing: pip install -e '.[test]'") from None
    return helm_python


def render(values: dict, *, name: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    """template path -> rendered text, as `helm template` writes it."""
    with helm().Chart.load(CHART) as chart:
        return chart.render(values, name=name, namespace=namespace)


def objects(values: dict) -> list[dict]:
    """Every Kubernetes object the chart renders with ``values``."""
    docs = []
    for path, text in render(values).items():
        if path.endswith(".yaml"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def check_operator_kinds(docs: list[dict], tmp: Path) -> subprocess.CompletedProcess:
    """tests/harness/operator_kinds/check.mjs: the operator's CRD schemas, and no unknown field."""
    if not (OPERATOR_KINDS / "node_modules").is_dir():
        raise AssertionError("the operator's schemas are not installed: run `make operator-kinds` (npm)")
    import json

    listing = tmp / "operator-objects.json"
    listing.write_text(json.dumps(docs))
    return subprocess.run(
        ["node", str(OPERATOR_KINDS / "check.mjs"), str(listing)], capture_output=True, text=True, timeout=180
    )


def operator_alertmanager_config(configs: list[dict], token_file: Path) -> dict:
    """The Alertmanager configuration the operator builds from AlertmanagerConfig objects (v1alpha1)."""
    routes, receivers = [], [{"name": "default"}]
    for config in configs:
        prefix = f"{config['metadata']['namespace']}/{config['metadata']['name']}/"
        route = config["spec"]["route"]
        matchers = [f'{m["name"]}{m.get("matchType", "=")}"{m["value"]}"' for m in route.get("matchers", [])]
        matchers.append(f'namespace="{config["metadata"]["namespace"]}"')  # the operator's namespace matcher
        routes.append(
            {
                "receiver": prefix + route["receiver"],
                "matchers": matchers,
                "group_by": route.get("groupBy", []),
                "group_wait": route.get("groupWait", "30s"),
                "group_interval": route.get("groupInterval", "5m"),
                "repeat_interval": route.get("repeatInterval", "4h"),
                "continue": True,
            }
        )
        for receiver in config["spec"]["receivers"]:
            hooks = [
                {
                    "url": hook["url"],
                    "send_resolved": hook.get("sendResolved", True),
                    "http_config": {
                        "authorization": {
                            "type": hook["httpConfig"]["authorization"]["type"],
                            "credentials_file": str(token_file),  # the operator mounts the Secret's key
                        }
                    },
                }
                for hook in receiver.get("webhookConfigs", [])
            ]
            receivers.append({"name": prefix + receiver["name"], "webhook_configs": hooks})
    return {"route": {"receiver": "default", "routes": routes}, "receivers": receivers}
