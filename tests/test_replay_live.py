"""`batchlens replay --url`: a trace replayed in real time against a running server, measured at the client.

The simulator stands in for vLLM on a GPU; the HTTP, the streaming and the engine dying are real.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from harness.exporter import scraped_sum
from harness.misbehaving import RefusingServer
from harness.replay import replay, write_trace
from harness.simulator import SimulatorProcess

pytestmark = pytest.mark.slow


def test_a_replay_against_the_simulator_measures_every_request_at_the_client(tmp_path) -> None:
    """Every request accounted for, by the engine's own counters: the long prompts the server turned away
    (HTTP 400 past --max-model-len) are failed, the rest answered, and nothing is lost between the two."""
    trace = tmp_path / "trace.jsonl"
    count = write_trace(trace, seconds=4, rate=10, prompts=(128, 256, 4096))
    longs = trace.read_text().count('"prompt_tokens": 4096')
    sim = SimulatorProcess(tmp_path, speed=4, args=("--max-model-len", "2048"))
    try:
        done = replay(trace, sim.url + "/v1", "--out", str(tmp_path / "out"))
        served = scraped_sum(sim.url, "vllm:request_success_total")
    finally:
        sim.stop()
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    [live] = result["policies"]
    assert result["sent"] == result["requests"] == live["requests"] == count and result["stopped"] is None
    assert 0 < longs < count
    assert result["accounting"]["total"] == {"sent": count, "answered": count - longs, "refused": {},
                                             "failed": {"http_400": longs}}, result["accounting"]  # fmt: skip
    assert served == count - longs  # the engine's own count of what it answered
    assert 0 < live["good"] <= count - longs and live["goodput_rps"] > 0 and live["p99_ttft_s"] > 0, live
    assert live["throughput_tokens_s"] > 0
    assert (tmp_path / "out" / "replay.csv").exists() and (tmp_path / "out" / "replay.png").stat().st_size > 0


def test_an_engine_dying_mid_replay_ends_it_with_what_was_measured(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    count = write_trace(trace, seconds=20, rate=5)
    sim = SimulatorProcess(tmp_path, speed=4)
    killer = threading.Timer(3.0, sim.process.stop)
    killer.start()
    started = time.monotonic()
    try:
        done = replay(trace, sim.url)
    finally:
        killer.cancel()
        sim.stop()
    assert done.returncode == 1, done.stderr
    assert "the engine stopped answering" in done.stderr and "Traceback" not in done.stderr
    result = json.loads(done.stdout)
    assert 5 <= result["sent"] < count and result["stopped"].startswith("stopped ")
    [live] = result["policies"]
    assert live["requests"] == result["sent"] and live["good"] > 0, "what was measured before the death is kept"
    total = result["accounting"]["total"]
    assert total["sent"] == result["sent"] == total["answered"] + sum(total["failed"].values())
    assert total["failed"].get("connect", 0) >= 5, total  # the deaths that ended it, each counted by reason
    assert time.monotonic() - started < 15, "it stops at the death, not at the end of the trace"


def test_requests_refused_at_the_door_are_counted_apart_by_status(tmp_path) -> None:
    """Issue 29 finding 2: a live run's `refused` was always 0. A server that answers 503 and 429 in turn (an
    admission cap, a rate limit): every request is refused, none failed, none answered, and none is good."""
    trace = tmp_path / "trace.jsonl"
    count = write_trace(trace, seconds=2, rate=10)
    server = RefusingServer()
    try:
        done = replay(trace, server.url + "/v1", "--served-model-name", "m")
    finally:
        server.close()
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    refused = {"http_503": (count + 1) // 2, "http_429": count // 2}
    assert result["accounting"]["total"] == {"sent": count, "answered": 0, "refused": refused, "failed": {}}
    assert result["policies"][0]["good"] == 0
