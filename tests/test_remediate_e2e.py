"""The breaker end to end, time-compressed: load -> simulator -> exporter -> Prometheus (generated rules)
-> Alertmanager (the provisioned routing) -> the hook, which confirms the alert with Prometheus -> the simulator's
admin API. Before the load, the forged-alert attack (tests/attacks/forged_alert.py) runs against the same
Alertmanager, while Prometheus has seen no breach: it must move nothing.

Time is compressed, not faked: the rules come from `batchlens build` with a 15 s breaker window, the
breaker route repeats every 5 s, the hook's cooldown is 4 s and its recovery interval 3 s. The simulator
stands in for vLLM on a GPU; everything else is the real thing.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from attacks.forged_alert import forged, post
from harness.admin import AdminClient
from harness.alertmanager import AlertmanagerServer, local_config
from harness.exporter import BATCHLENS, ExporterProcess, pick
from harness.procs import wait_until
from harness.prometheus import PrometheusServer
from harness.remediate import WEBHOOK_TOKEN, RemediateProcess
from harness.simulator import SimulatorProcess

pytestmark = pytest.mark.e2e
CAPACITY = 32
WINDOW = "15s"


def test_a_breach_is_halved_to_cold_start_paged_and_recovers_when_the_load_drops(tmp_path) -> None:
    sim = SimulatorProcess(tmp_path, speed=20, args=("--max-num-seqs", str(CAPACITY)))
    config = {
        "engines": [{"name": "sim", "url": sim.url, "simulated_gpu": True}],
        "thresholds": {"p99_window": WINDOW},
        "breaker": {"cooldown_seconds": 4, "recovery_interval_seconds": 3},
    }
    config_path = tmp_path / "batchlens.json"
    config_path.write_text(json.dumps(config))
    built = subprocess.run([BATCHLENS, "build", "--config", str(config_path), "--root", str(tmp_path)],
                           capture_output=True, text=True)  # fmt: skip
    assert built.returncode == 0, built.stderr
    hook = None
    procs = [sim]
    try:
        am_port_config = tmp_path / "alertmanager.yml"
        # The hook's port is known only once it starts; Alertmanager needs it first: reserve it.
        hook = RemediateProcess(tmp_path, config, env={"BATCHLENS_ADMIN_TOKEN": sim.token}, defer=True)
        local_config(am_port_config, hook.url, WEBHOOK_TOKEN,
                     {"group_wait": "0s", "group_interval": "2s", "repeat_interval": "5s"})  # fmt: skip
        am = AlertmanagerServer(tmp_path / "am", am_port_config)
        procs.append(am)
        exporter = ExporterProcess(tmp_path, [], interval=0.5, extra_args=("--config", str(config_path)),
                                   env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
        procs.append(exporter)
        prometheus = PrometheusServer(
            tmp_path / "prom",
            [{"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
            rule_files=tuple(str(p) for p in sorted((tmp_path / "alerts").glob("*.yml"))),
            alertmanager=f"127.0.0.1:{am.port}",
        )
        procs.append(prometheus)
        hook.config["remediate"] |= {"alertmanager_url": am.url, "prometheus_url": prometheus.url}
        hook.start()
        procs.append(hook)
        admin = AdminClient(sim.url, sim.token)
        # The attack: Prometheus has seen no breach, and Alertmanager forwards the forged alert with the token.
        prometheus.wait_for('up{job="batchlens"} == 1')
        assert post(am.url, [forged("sim")]) == 200
        wait_until(lambda: pick(hook.samples(), "batchlens_remediation_deliveries_total", outcome="unconfirmed"), 30,
                   "the forged alert reaching the hook")  # fmt: skip
        assert admin.state().max_num_active_seqs == CAPACITY, "a forged alert moved the limit"
        assert hook.health()["engines"]["sim"]["strikes"] == 0
        assert "Prometheus shows none for this engine" in hook.process.log_path.read_text()

        def paged() -> list[str]:
            return [a["labels"]["vllm_instance"] for a in am.alerts() if a["labels"].get("reason") == "unconfirmed"]

        wait_until(lambda: paged() == ["sim"], 10, "the unconfirmed alert's page to on-call")
        assert post(am.url, [forged("sim", resolve=True)]) == 200  # the attacker's alert ends; the real one comes
        slow = f"vllm_instance_model_name_engine:vllm_time_to_first_token_seconds:slow_ratio{WINDOW}"
        request = {"model": "deepseek-sim", "prompt": [1] * 2048, "max_tokens": 256}
        limits, started = [], time.time()
        with sim.clients(CAPACITY, lambda i: request):  # a full batch of long prompts: P99 TTFT over 0.5 s
            deadline = time.monotonic() + 120
            while admin.state().max_num_active_seqs != 1:
                assert time.monotonic() < deadline, f"no cold start; limits seen {limits}\n{hook.process.log_tail()}"
                limit = admin.state().max_num_active_seqs
                if not limits or limits[-1] != limit:
                    limits.append(limit)
                time.sleep(0.25)
            limits.append(1)
        assert limits == [32, 16, 8, 1], limits  # two halvings, then cold start on the third strike
        # From the breach (the first evaluation of the breaker's slow ratio over 1%, in Prometheus' own
        # data) to the first limit change the admin API confirmed (the hook's action log).
        [ratio] = prometheus.query(f"{slow}[{int(time.time() - started) + 5}s]")  # raw evaluations, not steps
        breach_at = min(float(ts) for ts, v in ratio["values"] if float(v) > 0.01)
        first_action_at = min(a["at"] for a in hook.actions() if a["action"] == "set_limit" and a["result"] == "ok")
        print(f"breach to first action: {first_action_at - breach_at:.2f} s")
        assert 0 <= first_action_at - breach_at < 20
        pages = [a for a in am.alerts() if a["labels"]["alertname"] == "VllmBreakerEscalation"]
        assert sorted(p["labels"]["reason"] for p in pages) == ["cold_start", "unconfirmed"]
        # The load is gone: the breaker resolves, and the limit climbs back by 3 every 3 s.
        deadline = time.monotonic() + 120
        seen = set()
        while admin.state().max_num_active_seqs != CAPACITY:
            seen.add(admin.state().max_num_active_seqs)
            assert time.monotonic() < deadline, f"no recovery: {sorted(seen)}\n{hook.process.log_tail()}"
            time.sleep(0.25)
        assert {4, 7, 10} <= seen, sorted(seen)
        assert hook.health()["engines"]["sim"] | {"mode": "closed", "strikes": 0} == hook.health()["engines"]["sim"]
    finally:
        for proc in reversed(procs):
            proc.stop()
