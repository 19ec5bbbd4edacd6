"""The controller end to end: `batchlens load` -> the simulator <- `batchlens remediate` steering it, with the
exporter and a real Prometheus watching, and the control dashboard's queries run on what they saw.

The simulator stands in for vLLM on a GPU (at 4x speed); Grafana is the fake boundary (harness/grafana.py
runs the panels' queries as Grafana would). The load is `batchlens load`'s own plan, so the same arrival
process replayed in simulated time under every static limit gives the oracle to judge the controller's
limit against.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest

from batchlens.goodput import Slo
from batchlens.load.plan import LoadSpec, plan
from batchlens.replay.policies import Static
from batchlens.replay.simulated import oracle, replay
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine
from batchlens.simulator.profiles import GPUS, MODELS
from harness.exporter import BATCHLENS, ExporterProcess
from harness.grafana import panel_results, walk_panels
from harness.prometheus import PrometheusServer
from harness.remediate import RemediateProcess
from harness.simulator import SimulatorProcess

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
SPEED, CAPACITY = 4, 64
SIM_RATE, SECONDS = 2.5, 45  # simulated requests/s (bursty), wall seconds of load
SLO = Slo(0.5, 0.1)
LOAD = LoadSpec(rate=SIM_RATE * SPEED, duration=SECONDS, arrival="bursty", prompt_tokens=(256, 512, 1024, 2048),
                output_tokens=(64, 128, 256))  # fmt: skip
CONTROLLER_PANELS = ("SLO attainment", "Goodput", "Controller decisions", "Batch limit: in force")


def test_the_controller_steers_the_simulator_to_a_limit_near_the_oracles(tmp_path) -> None:
    sim = SimulatorProcess(tmp_path, speed=SPEED, args=("--max-num-seqs", str(CAPACITY)))
    engines = [{"name": "sim", "url": sim.url}]
    control = {"enabled": True, "interval_seconds": 2 / SPEED, "drain_seconds": 5 / SPEED, "timeout_seconds": 1}
    hook = RemediateProcess(tmp_path, {"engines": engines, "control": control},
                            env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
    config = tmp_path / "batchlens.json"
    config.write_text(json.dumps({"engines": engines}))
    exporter = ExporterProcess(tmp_path, [], interval=0.5, extra_args=("--config", str(config)),
                               env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
    prometheus = PrometheusServer(tmp_path / "prom", [
        {"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]},
        {"job_name": "batchlens-remediate", "static_configs": [{"targets": [f"127.0.0.1:{hook.port}"]}]},
    ])  # fmt: skip
    try:
        started = time.time()
        argv = [BATCHLENS, "load", "--url", sim.url, "--rate", str(LOAD.rate), "--duration", str(SECONDS),
                "--arrival", LOAD.arrival, "--prompt-tokens", "256,512,1024,2048", "--output-tokens", "64,128,256",
                "--json"]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SECONDS + 240)
        assert done.returncode == 0, done.stderr
        time.sleep(2)  # a last scrape of each
        limits = prometheus.query(f"batchlens_batch_limit[{int(time.time() - started)}s]")
        in_force = [int(float(v)) for _, v in limits[0]["values"]]
        targets = prometheus.query("batchlens_controller_target_limit")
        board = json.loads((ROOT / "dashboards" / "batchlens-breaker.json").read_text())
        variables = {
            "cluster": ".*",
            "vllm_instance": "sim",
            "__rate_interval": "5s",
            "__range": "60s",
            "__interval": "5s",
        }
        empty = [
            panel["title"]
            for panel in walk_panels(board)
            if panel["title"].startswith(CONTROLLER_PANELS) and not any(panel_results(prometheus.url, panel,
                                                                                      variables)[0].values())
        ]  # fmt: skip
    finally:
        for proc in (prometheus, exporter, hook, sim):
            proc.stop()
    settled = int(statistics.median(in_force[len(in_force) // 2 :]))
    print(f"limits in force (exporter): {sorted(set(in_force))}, settled at {settled}; load: {done.stdout[:400]}")
    # It starts from the limit in force (the capacity), and cuts within the first windows of load (before
    # Prometheus' first scrape on a quiet machine, a few seconds in on a loaded one): from then on it steers.
    taken = next((i for i, v in enumerate(in_force) if v < CAPACITY), None)
    assert taken is not None and max(in_force[taken:]) < CAPACITY and taken < len(in_force) // 4, (
        f"the controller took over from vLLM's default (the capacity) early in the load: {in_force}")  # fmt: skip
    assert int(float(targets[0]["value"][1])) == in_force[-1], "Prometheus sees the hook's target in force"
    assert empty == [], f"control dashboard panels with no data: {empty}"
    # The oracle of this load: the same arrival process over a longer sample (45 s of bursts is too few to
    # rank limits by), in simulated time, under every static limit.
    sample = replace(LOAD, duration=150, seed=2)
    trace = [TraceRequest(p.at * SPEED, p.prompt_tokens, p.max_tokens) for p in plan(sample)]

    def engine() -> Engine:
        return Engine(GPUS["a100-80g"], MODELS["dense-7b"], max_num_seqs=CAPACITY)

    best, _ = oracle(trace, engine, SLO)
    mine = replay(trace, engine(), Static(settled), SLO).judgement.goodput_rps
    print(f"oracle: {best.policy} {best.judgement.goodput_rps:.3f} rps; the controller's {settled}: {mine:.3f} rps")
    assert mine >= 0.9 * best.judgement.goodput_rps
