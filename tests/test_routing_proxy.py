"""The routing plugin inside a real LiteLLM proxy (make litellm-env), in front of three simulator engines.

Real: the LiteLLM proxy (1.106.12) with the config batchlens generates, the plugin from the built wheel,
the batchlens exporter it reads its signals from, Prometheus with the committed rules, and HTTP between all
of them. Fake: the engines are batchlens simulators (no GPU here); each counts the requests it served
(vllm:request_success_total), which is how the test sees where LiteLLM sent each one. Grafana is the other
fake boundary (harness/grafana.py runs the routing row's queries as it would).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from batchlens.config import load_config
from batchlens.queued_caps import CLASSES
from batchlens.routing.proxy_config import litellm_config
from harness.exporter import ExporterProcess, one, parse_samples, pick, scraped_sum
from harness.grafana import panel_results, walk_panels
from harness.litellm import MASTER_KEY, LitellmProxy
from harness.procs import free_port, wait_until
from harness.prometheus import PrometheusServer
from harness.simulator import SIM_TOKEN, SimulatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.litellm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent
VARIABLES = {"cluster": ".*", "__rate_interval": "15s", "__range": "60s", "__interval": "5s"}
LONG = " hello" * 3000  # over 2048 tokens by any tokenizer (LiteLLM counts text with tiktoken's cl100k here)


def served(engine: SimulatorProcess) -> float:
    return scraped_sum(engine.url, "vllm:request_success_total")


def decisions(proxy: LitellmProxy) -> dict[tuple[str, str, str, str], float]:
    found = pick(parse_samples(proxy.metrics()), "batchlens_routing_decisions_total")
    return {tuple(dict(k)[n] for n in ("wanted", "reason", "role", "fallback")): v for k, v in found.items() if v}


def answered(proxy: LitellmProxy) -> dict[str, float]:
    """Requests LiteLLM reported answered, by the role they wanted (the count of the plugin's TTFT histogram)."""
    found = pick(parse_samples(proxy.metrics()), "batchlens_routing_time_to_first_token_seconds_count")
    return {dict(k)["wanted"]: v for k, v in found.items() if v}


@pytest.fixture
def stack(tmp_path, litellm_env):
    engines = {name: SimulatorProcess(tmp_path, speed=20) for name in ("main", "fast", "long")}
    roles = {"main": "main", "fast": ["interactive", "cold"], "long": "long"}
    listed = [{"name": n, "url": e.url, "role": roles[n], **({"max_model_len": 8192} if n == "long" else {})}
              for n, e in engines.items()]  # fmt: skip
    proxy_port = free_port()
    watching = tmp_path / "exporter.yaml"  # the exporter watches the engines and the proxy in front of them
    watching.write_text(yaml.safe_dump({"engines": listed, "routing": {"proxy_url": f"http://127.0.0.1:{proxy_port}"}}))
    exporter = ExporterProcess(tmp_path, [], interval=0.25, extra_args=("--config", str(watching)),
                               env={"BATCHLENS_ADMIN_TOKEN": SIM_TOKEN})  # fmt: skip
    path = tmp_path / "batchlens.yaml"
    routing = {"model": "deepseek-sim", "exporter_url": exporter.url, "signals_ttl_seconds": 0.2, "cold_gap": 3.0}
    path.write_text(yaml.safe_dump({"engines": listed, "routing": routing}))
    proxy = LitellmProxy(tmp_path, litellm_config(load_config(path, environ={})), path, litellm_env, port=proxy_port)
    # Prometheus scrapes the proxy as users would (LiteLLM's /metrics/ asks for its key) and the exporter, with
    # the committed rules: the workload dashboard's routing row is checked against what it records.
    prometheus = PrometheusServer(
        tmp_path / "prom",
        [
            {"job_name": "litellm", "metrics_path": "/metrics/", "authorization": {"credentials": MASTER_KEY},
             "static_configs": [{"targets": [f"127.0.0.1:{proxy_port}"]}]},
            {"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]},
        ],
        rule_files=tuple(str(p) for p in sorted((ROOT / "alerts").glob("*.yml"))),
    )  # fmt: skip
    try:
        # Traffic before Prometheus' first scrape of the proxy would show in no rate.
        prometheus.wait_for('up{job="litellm"} == 1 and on () up{job="batchlens"} == 1')
        yield engines, exporter, proxy, prometheus
    finally:
        prometheus.stop()
        proxy.stop()
        exporter.stop()
        for engine in engines.values():
            engine.stop()


def test_each_class_reaches_its_engine_and_a_killed_engine_falls_back(stack) -> None:
    engines, exporter, proxy, prometheus = stack
    proxy.complete("hello")  # the first arrival: no gap yet
    for _ in range(3):
        proxy.complete("hello")  # main
    proxy.complete("hello", headers={"x-batchlens-latency-class": "interactive"})
    proxy.complete("hello", tags=["interactive"])
    proxy.complete("hello", headers={"x-batchlens-latency-class": "batch"}, tags=["interactive"])  # header wins: main
    proxy.complete(LONG)
    time.sleep(3.5)
    proxy.complete("hello")  # after a quiet spell: cold, which the fast engine serves
    assert {n: served(e) for n, e in engines.items()} == {"main": 5, "fast": 3, "long": 1}
    assert decisions(proxy) == {
        ("main", "default", "main", ""): 5,
        ("interactive", "latency_header", "interactive", ""): 1,
        ("interactive", "latency_tag", "interactive", ""): 1,
        ("long", "long_prompt", "long", ""): 1,
        ("cold", "cold_gap", "cold", ""): 1,
    }
    assert answered(proxy) == {"main": 5, "interactive": 2, "long": 1, "cold": 1}
    # Each role's door priority (routing.door_priority) reached its engine as x-batchlens-priority, through
    # LiteLLM: the long prompt is sheddable there, the rest standard.
    door = {n: {c: scraped_sum(e.url, "batchlens_door_requests_total", priority_class=c) for c in CLASSES}
            for n, e in engines.items()}  # fmt: skip
    assert door["long"] == {"critical": 0, "standard": 0, "sheddable": 1}, door
    assert door["main"] == {"critical": 0, "standard": 5, "sheddable": 0}, door

    # The exporter hangs (SIGSTOP) and the fast engine dies: the plugin has either the last signals (the engine
    # up) or, once a read timed out, none (unknown); either way the role stands. LiteLLM finds the engine dead
    # and its fallback group (every engine) serves the request. Nothing is lost.
    os.kill(exporter.process.pid, signal.SIGSTOP)
    try:
        engines["fast"].stop()
        time.sleep(0.3)  # past the plugin's signal cache
        proxy.complete("hello", headers={"x-batchlens-latency-class": "interactive"})
        # The plugin reads in the background (a request never waits on it): its read times out and is counted.
        wait_until(lambda: pick(parse_samples(proxy.metrics()), "batchlens_routing_signal_errors_total",
                                reason="timeout"), timeout=5, what="the plugin to count a timed-out read")  # fmt: skip
    finally:
        os.kill(exporter.process.pid, signal.SIGCONT)
    assert decisions(proxy)[("interactive", "latency_header", "interactive", "")] == 2
    # Once the exporter says the engine is down, interactive requests fall back to main, and say so.
    wait_until(lambda: one(exporter.samples(), "batchlens_source_up", vllm_instance="fast") == 0, timeout=10,
               what="the exporter to see the fast engine down")  # fmt: skip
    time.sleep(0.3)
    for _ in range(3):
        proxy.complete("hello", headers={"x-batchlens-latency-class": "interactive"})
    assert served(engines["main"]) + served(engines["long"]) == 5 + 1 + 1 + 3
    assert decisions(proxy)[("interactive", "latency_header", "main", "down")] == 3
    final = parse_samples(proxy.metrics())
    assert one(final, "batchlens_routing_signals_up") == 1
    assert answered(proxy)["interactive"] == 2 + 1 + 3
    assert sum(pick(final, "batchlens_routing_failures_total").values()) == 0

    # The workload dashboard's routing row, as Grafana would query it (harness/grafana.py): every panel has data.
    board = json.loads((ROOT / "dashboards" / "batchlens-workload.json").read_text())
    row = [p for p in walk_panels(board) if p["title"].startswith("Routing:")]
    assert len(row) == 3
    wait_until(lambda: all(any(panel_results(prometheus.url, p, VARIABLES)[0].values()) for p in row), timeout=30,
               what="every routing panel to have data")  # fmt: skip

    # Over the last 5 minutes of the recorded series (the one cold request leaves the 1m window on a slow run),
    # once a scrape and a rule evaluation have followed that request: in a clean clone's run the query came first.
    def with_p99() -> set[str]:
        p99 = prometheus.query("max_over_time(wanted:batchlens_routing_time_to_first_token_seconds:p99_1m[5m])")
        return {r["metric"]["wanted"] for r in p99 if r["value"][1] != "NaN"}

    wait_until(lambda: with_p99() == {"main", "interactive", "long", "cold"}, timeout=30,
               what="a recorded P99 TTFT for every class")  # fmt: skip

    # The exporter labels each engine's roles, and says whether the proxy in front of them answers.
    samples = exporter.samples()
    roles = {(dict(k)["vllm_instance"], dict(k)["role"]) for k in pick(samples, "batchlens_engine_role")}
    assert roles == {("main", "main"), ("fast", "interactive"), ("fast", "cold"), ("long", "long")}
    assert one(samples, "batchlens_source_up", source="litellm") == 1
    proxy.stop()
    wait_until(lambda: one(exporter.samples(), "batchlens_source_up", source="litellm") == 0, timeout=10,
               what="the exporter to see the proxy down")  # fmt: skip


def test_a_tenants_key_cannot_claim_the_interactive_engine_pin_one_or_set_a_priority(tmp_path, litellm_env) -> None:
    """Keys with a record (alias, admin-set tags) through harness/litellm_keys.py: LiteLLM's key store is the fake."""
    engines = {name: SimulatorProcess(tmp_path, speed=20) for name in ("main", "fast")}
    listed = [{"name": "main", "url": engines["main"].url, "role": "main"},
              {"name": "fast", "url": engines["fast"].url, "role": "interactive"}]  # fmt: skip
    path = tmp_path / "batchlens.yaml"
    routing = {"model": "deepseek-sim", "exporter_url": "http://127.0.0.1:9", "trusted_keys": ["ops-console"]}
    path.write_text(yaml.safe_dump({"engines": listed, "routing": routing}))
    proxy_config = litellm_config(load_config(path, environ={}))
    proxy_config["general_settings"]["custom_auth"] = "litellm_keys.user_api_key_auth"
    proxy = LitellmProxy(tmp_path, proxy_config, path, litellm_env)
    interactive = {"x-batchlens-latency-class": "interactive"}
    try:
        proxy.complete("hello", key="sk-tenant-a", headers=interactive)
        proxy.complete("hello", key="sk-tenant-a", tags=["interactive"])
        proxy.complete("hello", key="sk-tenant-a", headers={"x-litellm-tags": "batchlens-engine:fast"})
        proxy.complete("hello", key="sk-tenant-a", metadata={"tags": ["batchlens-role:interactive"]},
                       extra_body={"priority": -100})  # fmt: skip
        assert {n: served(e) for n, e in engines.items()} == {"main": 4, "fast": 0}
        proxy.complete("hello", key="sk-ops-console", headers=interactive)  # trusted by routing.trusted_keys
        proxy.complete("hello", key="sk-kiosk")  # the admin tagged the key itself: a config rule
        assert {n: served(e) for n, e in engines.items()} == {"main": 4, "fast": 2}
        # a team key its team's admin renamed to the trusted alias and tagged: the tenant's claim, not trust
        proxy.complete("hello", key="sk-team-a-renamed", headers=interactive)
        assert {n: served(e) for n, e in engines.items()} == {"main": 5, "fast": 2}
        ignored = pick(parse_samples(proxy.metrics()), "batchlens_routing_untrusted_claims_total")
        assert {dict(k)["claim"]: v for k, v in ignored.items()} == {
            "latency_header": 2, "latency_tag": 2, "engine_tag": 2, "priority": 1}  # fmt: skip
        assert "ignored a latency_header claim from key tenant-a" in proxy.process.log_path.read_text()
    finally:
        proxy.stop()
        for engine in engines.values():
            engine.stop()


COUNTING = """
import json, logging, pathlib, sys
import tiktoken
from batchlens.routing.litellm_proxy import count_cl100k

warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger().addHandler(Catch(logging.WARNING))
logging.getLogger("LiteLLM").addHandler(Catch(logging.WARNING))
root = pathlib.Path(sys.argv[1])
texts = [(root / p).read_text() for p in ("README.md", "docs/routing.md", "src/batchlens/routing/router.py")]
names = ["meta-llama/Llama-3.1-8B-Instruct", "llama-2-7b-chat", "deepseek-sim", ""]
counts = {n: [count_cl100k(model=n, text=t) for t in texts] for n in names}
messages = [{"role": "user", "content": texts[0]}]
counts_msgs = {n: count_cl100k(model=n, messages=messages) for n in names}
encodings = {e: [len(tiktoken.get_encoding(e).encode(t)) for t in texts] for e in ("cl100k_base", "o200k_base")}
print(json.dumps({"counts": counts, "messages": counts_msgs, "encodings": encodings, "warnings": warnings}))
"""


def test_a_text_prompt_counts_the_same_whatever_the_served_name_within_a_stated_bound(litellm_env) -> None:
    """LiteLLM's own counter picks a tokenizer by the model's name: "llama-3" in it made it try Hugging Face, then
    fall back to tiktoken with a warning, so the long-prompt bound rested on a name. The plugin's count is
    cl100k_base for every name, and on English prose and code within 2% of a 200k-vocabulary tokenizer
    (o200k_base), the error docs/routing.md states."""
    from harness.litellm import OFFLINE, litellm_venv

    ran = subprocess.run([str(litellm_venv() / "bin" / "python"), "-c", COUNTING, str(ROOT)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **litellm_env, **OFFLINE})  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout)
    assert not [w for w in got["warnings"] if "tiktoken" in w or "okenizer" in w], got["warnings"]
    by_name = list(got["counts"].values())
    assert all(c == by_name[0] for c in by_name), got["counts"]
    # LiteLLM's text count runs a little over a plain encode (its own handling of special tokens): under 1%.
    assert all(abs(a / b - 1) < 0.01 for a, b in zip(by_name[0], got["encodings"]["cl100k_base"], strict=True)), got
    assert len(set(got["messages"].values())) == 1, got["messages"]
    for cl100k, o200k in zip(got["encodings"]["cl100k_base"], got["encodings"]["o200k_base"], strict=True):
        assert abs(cl100k / o200k - 1) <= 0.02, (cl100k, o200k)


HOOK = """
import asyncio, json, sys
from batchlens.routing.litellm_proxy import BatchlensRouting
from batchlens.routing.router import Router
from batchlens.config import load_config
from prometheus_client import CollectorRegistry

def broken(**prompt):
    raise ValueError("a content part LiteLLM cannot count (video_url)")

hook = BatchlensRouting(Router(load_config(sys.argv[1]), registry=CollectorRegistry()), count_text=broken)
claims = {"X-Batchlens-Priority": "100", "x-batchlens-priority": "100", "x-other": "kept"}
out = {}
for call in ("aresponses", "acompletion"):  # not routed at all; routed, and the counting fails
    data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "extra_headers": dict(claims)}
    out[call] = asyncio.run(hook.async_pre_call_hook(None, None, data, call))["extra_headers"]
passed = {"query": "q"}  # a pass-through's body goes upstream as it stands: nothing added to it
out["pass_through_endpoint"] = asyncio.run(hook.async_pre_call_hook(None, None, dict(passed), "pass_through_endpoint"))
print(json.dumps(out))
"""


def test_no_request_leaves_the_proxy_with_a_clients_door_priority(tmp_path, litellm_env) -> None:
    """A tenant's own x-batchlens-priority (in any letter case) never reaches vLLM: not on a call the plugin does
    not route (LiteLLM's /v1/responses), nor when routing fails for the request; it goes as standard (0)."""
    from harness.litellm import OFFLINE, litellm_venv

    config = tmp_path / "batchlens.yaml"
    config.write_text(yaml.safe_dump({"engines": [{"name": "e", "url": "http://127.0.0.1:9"}]}))
    ran = subprocess.run([str(litellm_venv() / "bin" / "python"), "-c", HOOK, str(config)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **litellm_env, **OFFLINE})  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    sent = json.loads(ran.stdout.strip().splitlines()[-1])
    assert sent["aresponses"] == sent["acompletion"] == {"x-other": "kept", "x-batchlens-priority": "0"}, sent
    assert sent["pass_through_endpoint"] == {"query": "q"}


TRUST = """
import asyncio, json, sys
from litellm.proxy._types import UserAPIKeyAuth
from batchlens.routing.litellm_proxy import BatchlensRouting
from batchlens.routing.router import Router
from batchlens.config import load_config
from prometheus_client import CollectorRegistry

callers = {  # LiteLLM's own auth records: it hashes the key into ``token``
    "kiosk": UserAPIKeyAuth(api_key="sk-kiosk", key_alias="kiosk", metadata={"tags": ["interactive"]}),
    "team": UserAPIKeyAuth(api_key="sk-team-b", key_alias="ops-console", team_id="team-b"),
}
out = {}
for path in sys.argv[1:]:
    hook = BatchlensRouting(Router(load_config(path), registry=CollectorRegistry()))
    for who, auth in callers.items():
        data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": {"tags": ["interactive"]},
                "proxy_server_request": {"headers": {"x-batchlens-latency-class": "interactive"}}}
        tags = asyncio.run(hook.async_pre_call_hook(auth, None, data, "acompletion"))["metadata"]["tags"]
        out[f"{path} {who}"] = [t for t in tags if t.startswith("batchlens-wanted:")]
print(json.dumps(out))
"""


def test_trust_from_litellms_own_auth_record_key_hashes_and_metadata_tags(tmp_path, litellm_env) -> None:
    """A personal key's own tags count unless routing.trust_metadata_tags is false (a team's admin can detach a
    team key and tag it); a team key renamed to a trusted alias counts for nothing, but a key listed by its hash
    in routing.trusted_key_hashes does, team key or not. The plugin in LiteLLM's environment, with LiteLLM's own
    UserAPIKeyAuth, which hashes the key itself."""
    from harness.litellm import OFFLINE, litellm_venv

    configs = {"default": {"trusted_keys": ["ops-console"]}, "no tags": {"trust_metadata_tags": False},
               "by hash": {"trusted_key_hashes": [hashlib.sha256(b"sk-team-b").hexdigest().upper()]}}  # fmt: skip
    paths = {}
    for name, routing in configs.items():
        path = paths[name] = tmp_path / f"{name.replace(' ', '-')}.yaml"
        path.write_text(yaml.safe_dump({"engines": [{"name": "e", "url": "http://127.0.0.1:9"}],
                                        "routing": {"model": "m", **routing}}))  # fmt: skip
    env = {**os.environ, **litellm_env, **OFFLINE}
    ran = subprocess.run([str(litellm_venv() / "bin" / "python"), "-c", TRUST, *map(str, paths.values())],
                         capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    wanted = json.loads(ran.stdout.strip().splitlines()[-1])
    got = {(name, who): wanted[f"{paths[name]} {who}"] for name in configs for who in ("kiosk", "team")}
    interactive, main = ["batchlens-wanted:interactive"], ["batchlens-wanted:main"]
    assert got == {("default", "kiosk"): interactive, ("default", "team"): main,
                   ("no tags", "kiosk"): main, ("no tags", "team"): main,
                   ("by hash", "kiosk"): interactive, ("by hash", "team"): interactive}, got  # fmt: skip
