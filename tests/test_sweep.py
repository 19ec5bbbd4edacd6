"""`batchlens sweep`: the knee rule (pure), the outputs, and real sweeps of the simulator and of vLLM.

The simulator stands in for vLLM on a GPU. Its knee is worked out here from the simulator's engine
model directly (simulated time, no HTTP, closed-loop clients as the sweep runs them); the sweep over
HTTP must find it within one step. The `vllm` test sweeps the real CPU server.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import time

import pytest

from batchlens.sweep.knee import Point, find_knee, gain_per_doubling
from batchlens.sweep.output import table, write_csv, write_png
from batchlens.sweep.run import StepResult
from harness.admin import AdminClient
from harness.exporter import BATCHLENS, ExporterProcess, parse_samples, pick
from harness.simulator import SimulatorProcess
from harness.vllm import ADMIN_TOKEN


def token_env(token: str) -> dict[str, str]:
    return {**os.environ, "BATCHLENS_ADMIN_TOKEN": token}


CURVE = [Point(1, 81, 0.1), Point(2, 155, 0.1), Point(4, 278, 0.1), Point(8, 434, 0.2), Point(16, 524, 0.3),
         Point(32, 448, 0.8)]  # fmt: skip


# -- the knee, pure ------------------------------------------------------------------------


def test_the_knee_is_where_a_doubling_stops_paying():
    knee = find_knee(CURVE, slo=1.0)
    assert knee.limit == 16 and "x0.85" in knee.reason
    assert knee.gains[2] == pytest.approx(155 / 81)
    assert find_knee(CURVE, slo=1.0, min_gain=1.3).limit == 8  # 8 -> 16 gains x1.21
    assert find_knee(list(reversed(CURVE)), slo=1.0).limit == 16  # order does not matter


def test_the_slo_stops_the_walk_and_can_refuse_every_limit():
    assert find_knee(CURVE, slo=0.25).limit == 8
    none = find_knee(CURVE, slo=0.05)
    assert none.limit is None and "smallest limit 1" in none.reason


def test_a_small_limit_over_the_slo_from_its_queue_alone_does_not_hide_a_larger_one_within_it():
    # advise's history: at 1 and 4 the queue made P99 huge; at 16 the batch kept up.
    seen = [Point(1, 1616, 19.9), Point(4, 5408, 4.975), Point(16, 8228, 0.2475)]
    knee = find_knee(seen, slo=0.5)
    assert knee.limit == 16, knee.reason


def test_gain_is_per_doubling_whatever_the_step():
    assert gain_per_doubling(Point(4, 100, 0), Point(16, 400, 0)) == pytest.approx(2.0)  # x4 over two doublings
    assert gain_per_doubling(Point(1, 0, 0), Point(2, 10, 0)) == math.inf
    assert gain_per_doubling(Point(1, 0, 0), Point(2, 0, 0)) == 1.0  # nothing to nothing: no gain, no loss
    assert gain_per_doubling(Point(1, 0.5, 0), Point(2, 1, 0)) == 2.0  # under one token a second is still a rate
    assert gain_per_doubling(Point(2, 100, 0), Point(16, 800, 0)) == pytest.approx(2.0)  # x8 over three: a root


def test_the_knee_walk_at_its_bounds() -> None:
    # P99 exactly at the SLO is within it; a gain exactly at min_gain still pays
    at = find_knee([Point(1, 100, 0.5), Point(2, 150, 0.5), Point(4, 225, 0.5)], slo=0.5, min_gain=1.5)
    assert at.limit == 4 and at.reason == "the largest limit measured (4)"
    alone = find_knee([Point(8, 100, 0.1)], slo=0.5)
    assert alone.limit == 8 and alone.reason == "the largest limit measured (8)"
    over = find_knee([Point(1, 100, 0.1), Point(2, 190, 0.1), Point(4, 380, 0.9)], slo=0.5)
    assert over.limit == 2 and over.reason == "at 4 P99 is 0.9s, over the 0.5s SLO"
    refused = find_knee([Point(1, 100, 0.9), Point(2, 190, 1.0)], slo=0.5)
    assert refused.limit is None and refused.gains == {2: pytest.approx(1.9)}
    with pytest.raises(ValueError, match="no operating points"):
        find_knee([], slo=0.5)


def test_outputs_table_csv_and_png(tmp_path):
    steps = [StepResult(p.limit, p.limit, 10, 0, p.throughput, p.p99, p.p99 * 3, p.limit / 64, itl_p99=p.p99 / 9)
             for p in CURVE]  # fmt: skip
    knee = find_knee(CURVE, slo=1.0)
    text = table(steps, knee)
    assert text.splitlines()[5].endswith("<- knee") and "knee: batch limit 16" in text
    write_csv(steps, knee, tmp_path / "sweep.csv")
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [int(r["limit"]) for r in rows] == [1, 2, 4, 8, 16, 32]
    assert [r["knee"] for r in rows] == ["0", "0", "0", "0", "1", "0"] and rows[0]["gpu_memory_busy"] == ""
    assert [float(r["itl_p99"]) for r in rows] == [p.p99 / 9 for p in CURVE] and "P99 ITL s" in text
    write_png(steps, knee, tmp_path / "sweep.png", slo=1.0, latency="TTFT", title="test")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the simulator's own knee -------------------------------------------------------------------

# The SLO is loose on purpose (0.5 s of wall clock): the knee comes from the gain rule, which a busy machine does
# not move, and not from a TTFT that the scheduler of two loaded cores can push over a tight bound.
PROMPT, OUTPUT, SPEED, SLO = 512, 128, 5, 2.5
LIMITS = (1, 2, 4, 8, 16, 32, 64)
#: The knee of the default profile (A100 80 GB, dense-7b) with 512-token prompts and 128-token answers, written
#: down once from the engine model's closed-loop curve (tokens/s 83, 159, 295, 495, 678, 687, 512 at these
#: limits): each doubling pays x1.37 or more up to 16, and 16 -> 32 gains x1.01, under the sweep's x1.15. A
#: change of the profile or of the knee rule must change this number on purpose.
KNEE = 16


def watched_simulator(tmp_path, *, capacity: int, limit: int) -> tuple[SimulatorProcess, ExporterProcess, AdminClient]:
    """A simulator named "sim" at ``limit`` of ``capacity``, with an exporter watching its simulated GPU."""
    sim = SimulatorProcess(tmp_path, speed=SPEED, args=("--max-num-seqs", str(capacity)))
    config = tmp_path / "batchlens.yaml"
    config.write_text(json.dumps({"engines": [{"name": "sim", "url": sim.url, "simulated_gpu": True}]}))
    exporter = ExporterProcess(tmp_path, [], extra_args=("--config", str(config)))
    admin = AdminClient(sim.url, sim.token)
    admin.set_limit(limit)
    return sim, exporter, admin


def test_the_sweep_finds_the_simulators_knee(tmp_path):
    sim, exporter, admin = watched_simulator(tmp_path, capacity=64, limit=48)
    try:
        done = subprocess.run(
            [BATCHLENS, "sweep", "--engine", sim.url, "--limits", ",".join(map(str, LIMITS)), "--settle", "2",
             "--measure", "6", "--prompt-tokens", str(PROMPT), "--output-tokens", str(OUTPUT),
             "--slo", str(SLO / SPEED), "--latency", "ttft",  # wall-clock seconds: the simulator runs 5x faster
             "--exporter", exporter.url, "--vllm-instance", "sim", "--out", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=240, env=token_env(sim.token),
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert admin.state().max_num_active_seqs == 48, "the sweep must restore the limit it found"
    finally:
        exporter.stop()
        sim.stop()
    print(done.stdout)
    rows = list(csv.DictReader((tmp_path / "out/sweep.csv").open()))
    found = next(int(r["limit"]) for r in rows if r["knee"] == "1")
    assert found == KNEE, (found, [(r["limit"], r["throughput"]) for r in rows])
    assert f"knee: batch limit {found} (going to 32 gains only x" in done.stdout, done.stdout
    assert "sweeping 7 limits" in done.stderr  # the progress bar
    throughput = [float(r["throughput"]) for r in rows]
    assert throughput[3] > 4 * throughput[0], "batching must pay at small limits"
    kv = [float(r["kv_usage"]) for r in rows]
    assert kv == sorted(kv) and kv[-1] > kv[0]
    assert all(0 < float(r["gpu_memory_busy"]) <= 1 for r in rows), "GPU memory busy from the exporter"
    assert all(int(r["requests"]) > 0 and int(r["errors"]) == 0 for r in rows)
    assert (tmp_path / "out/sweep.png").stat().st_size > 10_000


def test_sweep_refuses_limits_above_capacity_and_a_wrong_token(tmp_path):
    sim = SimulatorProcess(tmp_path, speed=SPEED, args=("--max-num-seqs", "8"))
    try:
        base = [BATCHLENS, "sweep", "--engine", sim.url, "--out", str(tmp_path / "out"), "--measure", "1"]
        too_big = subprocess.run([*base, "--limits", "4,16"], capture_output=True, text=True, timeout=60,
                                 env=token_env(sim.token))  # fmt: skip
        assert too_big.returncode == 1 and "limits [16] exceed the engine's max_num_seqs 8" in too_big.stderr
        wrong = subprocess.run([*base, "--limits", "1"], capture_output=True, text=True, timeout=60,
                               env=token_env("nope"))  # fmt: skip
        assert wrong.returncode == 1 and "401" in wrong.stderr and "nope" not in wrong.stderr
    finally:
        sim.stop()


def test_an_engine_that_dies_mid_sweep_ends_it_with_a_clear_error(tmp_path):
    sim = SimulatorProcess(tmp_path, speed=SPEED, args=("--max-num-seqs", "8"))
    sweep = subprocess.Popen(
        [BATCHLENS, "sweep", "--engine", sim.url, "--limits", "1,2,4", "--settle", "1", "--measure", "6",
         "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=token_env(sim.token),
    )  # fmt: skip
    time.sleep(4)
    sim.process.stop(signal.SIGKILL)
    _, err = sweep.communicate(timeout=60)
    assert sweep.returncode == 1
    assert f"cannot read {sim.url}/metrics" in err and "could not put the batch limit back to 8" in err
    assert "Traceback" not in err and not (tmp_path / "out/sweep.csv").exists()


def test_a_sweep_stopped_by_any_signal_puts_the_limit_back(tmp_path):
    """SIGTERM (timeout, systemd, Kubernetes, a cancelled CI job), SIGINT (Ctrl-C), SIGHUP (a closed terminal)."""
    sim = SimulatorProcess(tmp_path, speed=SPEED, args=("--max-num-seqs", "64"))
    admin = AdminClient(sim.url, sim.token)
    admin.set_limit(48)
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            sweep = subprocess.Popen(
                [BATCHLENS, "sweep", "--engine", sim.url, "--limits", "1,2,4,8", "--settle", "1", "--measure", "3",
                 "--out", str(tmp_path / "out")],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=token_env(sim.token),
            )  # fmt: skip
            deadline = time.monotonic() + 30
            while admin.state().max_num_active_seqs == 48:  # the sweep has changed the engine
                assert time.monotonic() < deadline and sweep.poll() is None, sweep.stderr.read()
                time.sleep(0.1)
            sweep.send_signal(sig)
            _, err = sweep.communicate(timeout=30)
            assert sweep.returncode == 128 + sig, (sig.name, sweep.returncode, err)
            assert admin.state().max_num_active_seqs == 48, f"{sig.name} left the engine throttled"
            assert f"stopped by {sig.name}" in err and "put back to 48" in err and "Traceback" not in err, err
    finally:
        sim.stop()


def test_sweep_checks_its_output_and_the_exporters_engine_before_it_changes_anything(tmp_path):
    sim, exporter, admin = watched_simulator(tmp_path, capacity=8, limit=6)
    (tmp_path / "file").write_text("")
    base = [BATCHLENS, "sweep", "--engine", sim.url, "--limits", "1,2", "--measure", "1"]
    try:
        unwritable = subprocess.run([*base, "--out", str(tmp_path / "file" / "out")], capture_output=True,
                                    text=True, timeout=60, env=token_env(sim.token))  # fmt: skip
        assert unwritable.returncode == 2 and "--out" in unwritable.stderr and "cannot write" in unwritable.stderr
        unknown = subprocess.run([*base, "--out", str(tmp_path / "out"), "--exporter", exporter.url,
                                  "--vllm-instance", "simm"], capture_output=True, text=True, timeout=60,
                                 env=token_env(sim.token))  # fmt: skip
        assert unknown.returncode == 1 and "knows no vllm_instance 'simm' (it knows: sim)" in unknown.stderr
        assert admin.state().max_num_active_seqs == 6, "a refused sweep changed the engine"
    finally:
        exporter.stop()
        sim.stop()


# -- a real vLLM on the CPU -----------------------------------------------------------------------


@pytest.mark.vllm
def test_sweep_of_a_real_vllm_writes_its_table_csv_and_png(tmp_path, vllm_server):
    out = tmp_path / "out"
    done = subprocess.run(
        [BATCHLENS, "sweep", "--engine", vllm_server.url, "--limits", "1,2,4,8", "--settle", "2", "--measure", "5",
         "--prompt-tokens", "32", "--output-tokens", "32", "--slo", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=token_env(ADMIN_TOKEN),
    )  # fmt: skip
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [int(r["limit"]) for r in rows] == [1, 2, 4, 8]
    assert all(float(r["throughput"]) > 0 and int(r["requests"]) > 0 for r in rows)
    assert all(float(r["ttft_p99"]) > 0 and float(r["e2e_p99"]) >= float(r["ttft_p99"]) for r in rows)
    assert sum(r["knee"] == "1" for r in rows) == 1
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The plugin's arrival series, seen by the middleware inside the real API server.
    samples = parse_samples(vllm_server.metrics_text())
    assert sum(pick(samples, "batchlens_requests_total", stream="true").values()) >= sum(
        int(r["requests"]) for r in rows
    )
    assert sum(pick(samples, "batchlens_request_interarrival_seconds_count").values()) > 0
