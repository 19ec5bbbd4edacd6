"""``batchlens load``: the plan (pure), then real runs against the simulator and against a real vLLM.

The simulator is the stand-in for vLLM on a GPU; the `vllm` test uses the real CPU server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import time

import aiohttp
import pytest
from aiohttp import web

from batchlens.load.client import connector
from batchlens.load.plan import LoadSpec, Planned, Result, Tally, plan, report, schedule
from batchlens.quantiles import percentile
from harness.exporter import BATCHLENS, parse_samples, pick
from harness.procs import http_get
from harness.simulator import SimulatorProcess
from harness.vllm import VllmServer


def test_poisson_arrivals_average_the_rate_and_repeat_with_the_seed() -> None:
    spec = LoadSpec(rate=50, duration=20, prompt_tokens=(256, 2048), output_tokens=(64,), stream_share=0.25)
    planned = plan(spec)
    assert abs(len(planned) - 1000) < 4 * 1000**0.5  # four standard deviations of a Poisson count
    assert planned == plan(spec) and planned != plan(LoadSpec(rate=50, duration=20, seed=2))
    assert all(0 <= a.at < b.at < 20 for a, b in itertools.pairwise(planned))
    assert {p.prompt_tokens for p in planned} == {256, 2048} and {p.max_tokens for p in planned} == {64}
    assert 0.2 < sum(p.stream for p in planned) / len(planned) < 0.3


def test_bursty_arrivals_come_in_bursts_with_the_same_mean() -> None:
    spec = LoadSpec(rate=20, duration=60, arrival="bursty", burst_seconds=2, burst_factor=3)
    planned = plan(spec)
    assert all(p.at % 6 < 2 for p in planned), "nothing arrives in the quiet 4 s of each 6 s period"
    assert abs(len(planned) - 1200) < 4 * 1200**0.5


def test_steady_arrivals_are_evenly_spaced() -> None:
    planned = plan(LoadSpec(rate=4, duration=10, arrival="steady"))
    assert [p.at for p in planned] == pytest.approx([0.25 * k for k in range(1, 40)])


@pytest.mark.parametrize("arrival", ["poisson", "bursty", "steady"])
def test_an_overload_phase_adds_factor_minus_one_times_the_rate_in_each_periods_last_seconds(arrival: str) -> None:
    base = LoadSpec(rate=20, duration=200, arrival=arrival)
    phased = LoadSpec(rate=20, duration=200, arrival=arrival, overload_every=50, overload_seconds=10,
                      overload_factor=3)  # fmt: skip
    calm, loaded = plan(base), plan(phased)
    extra = [p for p in loaded if p not in calm]
    assert [p for p in loaded if p in calm] == calm, "the base schedule of the seed is kept, in order"
    assert all(a.at <= b.at for a, b in itertools.pairwise(loaded))
    assert extra and all(p.at % 50 >= 40 for p in extra), "the extra arrivals fall in the last 10 s of each 50 s"
    expected = 20 * (3 - 1) * 10 * 4  # 40 extra requests/s, 10 s a phase, 4 phases
    assert abs(len(extra) - expected) < 4 * expected**0.5
    assert plan(phased) == loaded  # the same seed, the same phases


@pytest.mark.parametrize(
    "overload",
    [dict(overload_seconds=0), dict(overload_seconds=60, overload_every=30), dict(overload_factor=1.0)],
)
def test_an_overload_phase_that_cannot_be_is_refused(overload: dict) -> None:
    with pytest.raises(ValueError, match="overload phase"):
        plan(LoadSpec(rate=1, duration=10, **{"overload_every": 30, **overload}))


def test_a_share_of_the_load_is_sent_in_the_interactive_class_and_the_schedule_stays() -> None:
    spec = LoadSpec(rate=50, duration=20)
    classed = plan(LoadSpec(rate=50, duration=20, interactive_share=0.2))
    assert 0.15 < sum(p.latency_class == "interactive" for p in classed) / len(classed) < 0.25
    assert {p.latency_class for p in plan(spec)} == {""}
    # Without classes, no draw is spent on them: a seed's schedule is what it was before classes existed.
    assert [p.at for p in plan(spec)][:5] == pytest.approx([0.0029, 0.0315, 0.0335, 0.0622, 0.0946], abs=1e-4)


def test_the_plan_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        plan(LoadSpec(rate=0, duration=1))
    with pytest.raises(ValueError):
        plan(LoadSpec(rate=1, duration=1, arrival="sine"))


def test_percentiles_are_nearest_rank_and_errors_are_counted() -> None:
    assert percentile([5, 1, 4, 2, 3], 50) == 3 and percentile([5, 1, 4, 2, 3], 99) == 5
    assert percentile(list(range(1, 101)), 90) == 90 and percentile([], 50) is None
    p = Planned(0, 10, 10, True)
    results = [Result(p, True, e2e=1.0, ttft=0.1, itl=(0.01, 0.03), output_tokens=10), Result(p, False, "timeout"),
               Result(p, False, "http_503", reason="queue full")]  # fmt: skip
    rep = report(results, 2.0)
    assert rep["succeeded"] == 1 and rep["errors"] == {"timeout": 1} and rep["output_tokens_per_second"] == 5
    # A refusal at the door is the server working as set: counted apart, and not an error (the exit code's).
    assert rep["refused"] == {"http_503": 1} and rep["error_reasons"] == {"http_503": "queue full"}
    assert rep["itl_seconds"]["p50"] == 0.01 and rep["ttft_seconds"]["p99"] == 0.1


def load(url: str, *args: str) -> dict:
    done = subprocess.run(
        [BATCHLENS, "load", "--url", url, "--json", *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return json.loads(done.stdout)


def successes(text: str) -> float:
    return sum(pick(parse_samples(text), "vllm:request_success_total").values())


@pytest.mark.slow
def test_a_run_against_the_simulator_counts_what_the_server_counts(tmp_path) -> None:
    sim = SimulatorProcess(tmp_path, speed=10)
    try:  # the OpenAI base URL (.../v1) is what users copy from their client config
        rep = load(sim.url + "/v1", "--rate", "20", "--duration", "3", "--output-tokens", "32,64",
                   "--stream-share", "0.5")  # fmt: skip
        served = successes(http_get(sim.url + "/metrics")[1].decode())
        refused = subprocess.run([BATCHLENS, "load", "--url", sim.url, "--rate", "4", "--duration", "1",
                                  "--prompt-tokens", "9000"], capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        sim.stop()
    assert rep["requests"] == rep["succeeded"] == served > 30
    # A refused request says why, as the server put it: not just its status.
    assert refused.returncode == 1 and "http_400: This model's maximum context length is" in refused.stdout
    assert rep["ttft_seconds"]["p50"] is not None and rep["itl_seconds"]["p99"] is not None
    assert rep["e2e_seconds"]["p50"] <= rep["e2e_seconds"]["p99"]


@pytest.mark.vllm
def test_a_run_against_real_vllm_counts_what_vllm_counts(vllm_server: VllmServer) -> None:
    before = successes(vllm_server.metrics_text())
    rep = load(vllm_server.url, "--rate", "4", "--duration", "4", "--prompt-tokens", "16,64", "--output-tokens", "16")
    after = successes(vllm_server.metrics_text())
    assert rep["model"] == vllm_server.model
    assert rep["requests"] == rep["succeeded"] == after - before > 0
    assert rep["ttft_seconds"]["p50"] is not None


def test_an_idle_connection_is_dropped_before_the_server_would_close_it() -> None:
    """The lost request of issue 32: uvicorn (vLLM's API server, the LiteLLM proxy) closes a connection idle for
    5 s, and a client that keeps it longer can send a request into the closing socket, where it vanishes. The load's
    and replay's pool keeps one idle for 4 s: a request after 4.5 s opens a new connection; one after 0.2 s reuses.
    Real sockets and a real aiohttp server with uvicorn's keep-alive."""

    async def scenario() -> list[int]:
        peers: list[int] = []

        async def answer(request: web.Request) -> web.Response:
            peers.append(request.transport.get_extra_info("peername")[1])
            return web.json_response({})

        app = web.Application()
        app.router.add_post("/", answer)
        runner = web.AppRunner(app, keepalive_timeout=5.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"
        try:
            async with aiohttp.ClientSession(connector=connector(4)) as session:
                for pause in (0.0, 0.2, 4.5):
                    await asyncio.sleep(pause)
                    async with session.post(url, json={}) as reply:
                        await reply.read()
        finally:
            await runner.cleanup()
        return peers

    first, soon, late = asyncio.run(scenario())
    assert first == soon  # kept alive: the pool works
    assert late != soon  # dropped at 4 s, before the server's 5 s: a fresh connection, never a closing one


def test_the_schedule_comes_one_request_at_a_time_and_is_the_plan() -> None:
    spec = LoadSpec(rate=5, duration=120, arrival="bursty", overload_every=60, overload_seconds=20)
    lazy = schedule(spec)
    assert not isinstance(lazy, list) and list(lazy) == plan(spec)
    day = schedule(LoadSpec(rate=2.5, duration=86400))  # the demo's: nothing drawn until asked for
    assert next(day).at < 5


def test_a_long_runs_latencies_are_a_bounded_uniform_sample_and_a_short_runs_all() -> None:
    tally = Tally(sample_size=1000)
    for i in range(100_000):
        tally.add(Result(Planned(0, 1, 1, True), True, e2e=i / 100_000, ttft=0.1, itl=(0.01,), output_tokens=1))
    assert len(tally.e2e.values) == 1000 and tally.e2e.seen == 100_000 and tally.requests == 100_000
    assert 0.45 < percentile(tally.e2e.values, 50) < 0.55 and 0.97 < percentile(tally.e2e.values, 99) <= 1
    short = Tally(sample_size=1000)
    for i in range(10):
        short.add(Result(Planned(0, 1, 1, False), True, e2e=float(i)))
    assert sorted(short.e2e.values) == [float(i) for i in range(10)]


@pytest.mark.slow
def test_ctrl_c_stops_the_load_and_prints_what_finished(tmp_path) -> None:
    """Issue 58, item 9: the demo's load.log was empty after Ctrl-C: the summary of a run cut short was lost."""
    sim = SimulatorProcess(tmp_path, speed=10)
    try:
        argv = [BATCHLENS, "load", "--url", sim.url, "--rate", "10", "--duration", "3600", "--output-tokens", "16"]
        load = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        load.send_signal(signal.SIGINT)
        out, err = load.communicate(timeout=30)
    finally:
        sim.stop()
    assert load.returncode == 0, err
    assert "(stopped by SIGINT: what finished, before)" in out and "Traceback" not in err
    succeeded = int(out.split("succeeded ")[1].split(",")[0])
    assert 10 <= succeeded <= 40, out  # three seconds at 10/s
