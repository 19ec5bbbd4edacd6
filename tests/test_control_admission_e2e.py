"""The second knob end to end: `batchlens load` past capacity -> the simulator <- `batchlens remediate` setting its
queued-token cap from the prefill rate it measures, over real HTTP.

The simulator stands in for vLLM on a GPU (at 4x speed); it serves the same admission route and refuses with vLLM's
rules and answers (test_vllm_plugin.py checks those on the real vLLM). The law itself is tested pure in
test_control_admission.py.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from batchlens.admin_api import ADMISSION_PATH
from harness.admin import AdminClient, set_caps
from harness.exporter import BATCHLENS, one, pick, scraped_sum
from harness.remediate import RemediateProcess, alert, notification
from harness.simulator import SimulatorProcess
from test_remediate import eventually

pytestmark = pytest.mark.e2e
SPEED = 4
# The controller's windows are wall seconds, and the simulator runs SPEED times faster: a TTFT of 1 simulated
# second is 1/SPEED of a wall second to it (the law is otherwise free of units).
TTFT = 1.0 / SPEED


def test_past_capacity_the_controller_caps_the_queue_sheds_the_rest_the_breaker_holds_and_the_door_opens_after(
    tmp_path,
) -> None:
    sim = SimulatorProcess(tmp_path, speed=SPEED, args=("--max-num-seqs", "16"))
    admin = AdminClient(sim.url, sim.token)
    control = {"enabled": True, "admission": True, "interval_seconds": 1 / SPEED, "timeout_seconds": 1,
               "admission_stale_seconds": 3, "start_limit": 16}  # fmt: skip
    hook = RemediateProcess(tmp_path, {"engines": [{"name": "sim", "url": sim.url}], "control": control,
                                       "slo": {"ttft_seconds": TTFT, "tpot_seconds": 1.0},
                                       "breaker": {"cooldown_seconds": 0.5}},
                            env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
    # 30 s of load: the cap, the first refusals and three firings must all come while it runs, and on a busy machine
    # (the full suite) the first cap has taken 13 s and the first refusal 19 s. At 6 requests/s the queue passed
    # the cap only in the load's bursts, and once none came within 20 s: 10 keeps it past capacity throughout.
    argv = [BATCHLENS, "load", "--url", sim.url, "--rate", str(10 * SPEED), "--duration", "30", "--arrival", "poisson",
            "--prompt-tokens", "1024,2048", "--output-tokens", "32,64", "--json"]  # fmt: skip
    load = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        capped = eventually(lambda: admin.request("GET", ADMISSION_PATH)[1]["max_num_queued_tokens"], timeout=30,
                            what="the controller setting a queued-token cap on the overloaded engine")  # fmt: skip
        samples = hook.samples()
        rate = one(samples, "batchlens_admission_prefill_tokens_per_second", vllm_instance="sim")
        assert one(samples, "batchlens_admission_cap_tokens", vllm_instance="sim") == capped
        # At least what drains within a TTFT on average, widened by the randomness of the finishes.
        assert rate > 0 and int(TTFT * rate) <= capped <= 4 * TTFT * rate
        eventually(lambda: scraped_sum(sim.url, "vllm:admission_rejections_total", reason="max_num_queued_tokens"),
                   timeout=20, what="the engine refusing requests past the cap")  # fmt: skip
        # P99 breaks on the queue while the door sheds: three firings past the cooldown would be two halvings
        # and a cold start; each is a hold and one capacity page, with the door's figures in it.
        for _ in range(3):
            assert hook.post(notification(alert("sim")))[0] == 200
            time.sleep(1.0)
        eventually(lambda: len(breaker_acts(hook)) == 3, timeout=10, what="three breaker decisions")
        assert breaker_acts(hook) == ["hold_overload"] * 3, hook.process.log_tail()
        assert admin.state().max_num_active_seqs == 16
        paged = [line for line in hook.process.log_path.read_text().splitlines() if "PAGE capacity" in line]
        assert len(paged) == 1 and "the door caps the queue at " in paged[0] and "refuses " in paged[0], paged
        out, err = load.communicate(timeout=120)
        ran = json.loads(out)
        shed = ran["refused"].get("http_503", 0)
        assert shed > 0 and ran["succeeded"] > 0 and shed + ran["succeeded"] == ran["requests"], ran
        assert load.returncode == 0, err  # refusals are the door at work, not failures of the load
        # The load is over: no window with requests waiting for admission_stale_seconds, so the door opens.
        eventually(lambda: admin.request("GET", ADMISSION_PATH)[1]["max_num_queued_tokens"] is None, timeout=20,
                   what="the cap lifted once its estimate went stale")  # fmt: skip
        reasons = decisions(hook)
        opened = reasons.get("admission_stale", 0) + reasons.get("admission_too_few_windows", 0)
        assert reasons.get("admission_estimated", 0) > 0 and opened > 0, reasons  # the door failed open
        assert "queued-token cap none -> " in hook.process.log_path.read_text()
    finally:
        load.kill()
        hook.stop()
        sim.stop()


def test_a_cap_set_by_hand_stands_for_the_hold_and_through_a_restart_after_kill_9(
    tmp_path,
) -> None:
    sim = SimulatorProcess(tmp_path, speed=SPEED, args=("--max-num-seqs", "16"))
    admin = AdminClient(sim.url, sim.token)
    control = {"enabled": True, "admission": True, "interval_seconds": 0.2, "timeout_seconds": 1,
               "manual_hold_seconds": 600}  # fmt: skip
    config = {"engines": [{"name": "sim", "url": sim.url}], "control": control}
    hook = RemediateProcess(tmp_path, config, env={"BATCHLENS_ADMIN_TOKEN": sim.token})
    try:
        eventually(lambda: decisions(hook).get("admission_no_signal"), what="the controller looking at the cap")
        set_caps(admin, max_num_queued_tokens=5000)  # by hand, while nothing runs: no estimate to set one from
        eventually(lambda: decisions(hook).get("admission_manual_hold", 0) >= 5, what="the controller holding off")
        assert admin.request("GET", ADMISSION_PATH)[1]["max_num_queued_tokens"] == 5000
        assert "set by hand (or the engine restarted, or a second hook" in hook.process.log_path.read_text()
        hook.kill9()
        assert admin.request("GET", ADMISSION_PATH)[1]["max_num_queued_tokens"] == 5000  # the engine keeps it
        hook = RemediateProcess(tmp_path, config, env={"BATCHLENS_ADMIN_TOKEN": sim.token})
        # A new process goes on from what the store kept: the hand's hold still stands, and it says so.
        eventually(lambda: decisions(hook).get("admission_manual_hold", 0) >= 5, what="the hold kept over a restart")
        assert admin.request("GET", ADMISSION_PATH)[1]["max_num_queued_tokens"] == 5000
        log = hook.process.log_path.read_text()
        assert "a queued-token cap set by hand still holds the door's control off" in log, log
        health = hook.health()["control"]["engines"]["sim"]
        assert health["cap_manual_hold"] and health["cap_in_force"] == health["cap_target"] == 5000, health
        assert "queued-token cap 5000 ->" not in log
    finally:
        hook.stop()
        sim.stop()


def breaker_acts(hook: RemediateProcess) -> list[str]:
    return [a["action"] for a in hook.actions() if a["action"] != "set_limit"]


def decisions(hook: RemediateProcess) -> dict[str, float]:
    found = pick(hook.samples(), "batchlens_controller_decisions_total", vllm_instance="sim")
    return {dict(k)["reason"]: v for k, v in found.items()}
