"""The hook acting on a real vLLM 0.32 (CPU) with the batchlens plugin: the PUT lands, the limit holds."""

from __future__ import annotations

import time

import pytest

from harness.admin import AdminClient
from harness.exporter import parse_samples, pick
from harness.remediate import RemediateProcess, alert, notification
from harness.vllm import ADMIN_TOKEN, VllmServer

pytestmark = pytest.mark.vllm
CAPACITY = 32  # the session server's --max-num-seqs


def running(server: VllmServer) -> float:
    return sum(pick(parse_samples(server.metrics_text()), "vllm:num_requests_running").values())


def test_the_breaker_halves_a_real_vllm_and_the_scheduler_holds_the_new_limit(tmp_path, vllm_server) -> None:
    admin = AdminClient(vllm_server.url, ADMIN_TOKEN)
    admin.set_limit(CAPACITY)
    hook = RemediateProcess(
        tmp_path,
        {"engines": [{"name": "cpu", "url": vllm_server.url}], "breaker": {"cooldown_seconds": 1}},
        env={"BATCHLENS_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    try:
        assert hook.post(notification(alert("cpu")))[0] == 200
        deadline = time.monotonic() + 30
        while admin.state().max_num_active_seqs != CAPACITY // 2:
            assert time.monotonic() < deadline, f"no halving: {admin.state()}\n{hook.process.log_tail()}"
            time.sleep(0.2)
        time.sleep(1.1)
        hook.post(notification(alert("cpu")))  # strike 2: 16 -> 8
        while admin.state().max_num_active_seqs != CAPACITY // 4:
            assert time.monotonic() < deadline, f"no second halving: {admin.state()}"
            time.sleep(0.2)
        with vllm_server.steady_load(20, max_tokens=128):
            time.sleep(3)
            seen = []
            for _ in range(15):
                seen.append(running(vllm_server))
                time.sleep(0.2)
        assert max(seen) <= CAPACITY // 4 and max(seen) > 0, seen
        assert hook.health()["engines"]["cpu"] | {"strikes": 2, "applied_limit": 8} == hook.health()["engines"]["cpu"]
    finally:
        hook.stop()
        admin.set_limit(CAPACITY)
