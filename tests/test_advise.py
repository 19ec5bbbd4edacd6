"""`batchlens advise`: the decision table from evidence (pure), the arrival series, and the real thing.

The e2e test feeds two stacks (the simulator standing in for vLLM on a GPU -> the exporter -> a real
Prometheus with the committed rules) with `batchlens load`: one bursty, streamed and long, one steady,
unstreamed and short. advise must call the first continuous and the second static, with its evidence.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from batchlens.advise.decide import decide, peak_to_trough
from batchlens.advise.evidence import Evidence, LimitSeen
from batchlens.advise.text import format_advice
from batchlens.arrivals import ArrivalMetrics
from batchlens.queued_caps import refusal_body
from batchlens.vllm_plugin.arrival_middleware import ArrivalMiddleware
from harness.exporter import BATCHLENS, ExporterProcess
from harness.procs import Process
from harness.prometheus import PrometheusServer, require_binary
from harness.simulator import SimulatorProcess

ROOT = Path(__file__).resolve().parent.parent

BURSTY = Evidence(
    "bursty", 3600, requests=5000, interarrival_mean=0.25, interarrival_cv=2.4, interarrival_p50=0.05,
    interarrival_p90=0.2, interarrival_p99=3.9, qps_mean=4, qps_peak=12, qps_trough=0, mean_tokens=2600,
    prompt_p90=4096, long_share=0.5, stream_share=0.6, p99_observed=0.2,
)  # fmt: skip
STEADY = Evidence(
    "steady", 3600, requests=5000, interarrival_mean=0.25, interarrival_cv=0.05, interarrival_p50=0.24,
    interarrival_p90=0.25, interarrival_p99=0.26, qps_mean=4, qps_peak=4.3, qps_trough=3.8, mean_tokens=300,
    prompt_p90=256, long_share=0.0, stream_share=0.0, p99_observed=0.05,
)  # fmt: skip


def recommendation(advice, setting: str):
    return next(r for r in advice.recommendations if r.setting == setting)


# -- the decision table, pure ---------------------------------------------------------


def test_bursty_traffic_calls_for_continuous_batching_with_its_evidence():
    advice = decide(BURSTY, requirement=0.5, latency="ttft")
    assert advice.continuous is True
    assert {c.name: c.met for c in advice.criteria} == {
        "inter-arrival CV": True, "peak/trough QPS": True, "mean tokens per request": True,
        "streaming share": True, "P99 requirement (s)": False,
    }  # fmt: skip
    assert "4 of 5 criteria" in recommendation(advice, "serving mode").evidence
    assert recommendation(advice, "max_num_batched_tokens").value == "2048"
    assert recommendation(advice, "long-context instance").value.startswith("yes")
    assert recommendation(advice, "cold-path threshold (s)").value == "0.2"


def test_steady_traffic_suits_static_batching():
    advice = decide(STEADY, requirement=0.5, latency="ttft")
    assert advice.continuous is False and not any(c.met for c in advice.criteria)
    assert recommendation(advice, "serving mode").value.startswith("static batching")
    assert recommendation(advice, "max_num_batched_tokens").value == "8192"
    assert recommendation(advice, "long-context instance").value == "no"


def test_each_criterion_alone_tips_the_verdict():
    for change in (dict(interarrival_cv=0.8), dict(qps_trough=0.5), dict(mean_tokens=3000), dict(stream_share=0.4)):
        assert decide(Evidence(**{**vars(STEADY), **change}), requirement=0.5, latency="ttft").continuous is True
    assert decide(STEADY, requirement=0.2, latency="ttft").continuous is True  # a 200 ms requirement


def test_unknown_criteria_decide_nothing():
    advice = decide(Evidence("quiet", 60), requirement=0.5, latency="ttft")
    assert advice.continuous is None and all(c.met is None for c in advice.criteria[:4])
    json.dumps(advice.to_dict(), allow_nan=False)  # NaN becomes null
    no_plugin = Evidence(**{**vars(STEADY), "stream_share": math.nan})
    assert decide(no_plugin, requirement=0.5, latency="ttft").criteria[3].met is None


def test_peak_to_trough_with_idle_spells_is_unbounded():
    assert peak_to_trough(BURSTY) == math.inf
    assert (
        json.loads(json.dumps(decide(BURSTY, requirement=0.5, latency="ttft").to_dict()))["criteria"][1]["value"]
        == "inf"
    )


def test_batch_limit_is_the_knee_of_the_operating_points_seen():
    points = [LimitSeen(4, 278, 0.1, requests=500), LimitSeen(8, 434, 0.2, requests=500),
              LimitSeen(16, 524, 0.3, requests=500), LimitSeen(32, 448, 0.9, requests=500)]  # fmt: skip
    advice = decide(Evidence(**{**vars(BURSTY), "limits": points}), requirement=0.5, latency="ttft")
    assert recommendation(advice, "batch limit").value == "16 (the knee)"
    assert recommendation(advice, "max_num_seqs").value == "32"
    tight = decide(Evidence(**{**vars(BURSTY), "limits": points}), requirement=0.25, latency="ttft")
    assert recommendation(tight, "batch limit").value == "8 (the knee)"
    overloaded = decide(Evidence(**{**vars(BURSTY), "limits": points}), requirement=0.05, latency="ttft")
    assert recommendation(overloaded, "batch limit").value == "16 (none meets the SLO)"
    assert "add capacity" in recommendation(overloaded, "batch limit").evidence
    one = decide(Evidence(**{**vars(BURSTY), "limits": [LimitSeen(32, 448, 0.9, requests=500)]}), requirement=0.5,
                 latency="ttft")  # fmt: skip
    assert recommendation(one, "batch limit").value == "16 (halve)"
    assert "batchlens sweep" in recommendation(one, "batch limit").evidence


def test_a_verdict_needs_enough_requests_and_every_limit_seen_is_listed():
    few = [LimitSeen(4, 278, 0.1, requests=500), LimitSeen(8, 434, 0.2, requests=40)]
    advice = decide(Evidence(**{**vars(BURSTY), "limits": few}), requirement=0.5, latency="ttft")
    limit = recommendation(advice, "batch limit")
    assert limit.value == "4 (keep)" and "8: 434 tok/s, P99 0.2s over 40 requests" in limit.evidence
    none = decide(Evidence(**{**vars(BURSTY), "limits": few[1:]}), requirement=0.5, latency="ttft")
    assert recommendation(none, "batch limit").value == "no recommendation (too little evidence)"
    assert not [r for r in none.recommendations if r.setting == "max_num_seqs"]
    quiet = decide(Evidence(**{**vars(BURSTY), "requests": 60}), requirement=0.5, latency="ttft")
    assert quiet.continuous is None and "at least 100" in recommendation(quiet, "serving mode").evidence


def test_text_shows_the_table_and_the_reasons():
    text = format_advice(decide(BURSTY, requirement=0.5, latency="ttft"))
    assert "bursty: 5000 requests over 3600s of data -> continuous batching" in text
    assert "inf (idle spells)" in text and "60%" in text and text.count("because") >= 5


# -- the arrival series ----------------------------------------------------------------------


def test_arrival_sums_give_the_exact_coefficient_of_variation():
    registry = CollectorRegistry()
    arrivals = ArrivalMetrics(registry)
    times = [0.0, 0.1, 0.15, 1.0, 1.05, 4.0, 4.2]
    for t in times:
        arrivals.arrived(t)
    value = registry.get_sample_value
    n = value("batchlens_request_interarrival_seconds_count")
    mean = value("batchlens_request_interarrival_seconds_sum") / n
    variance = value("batchlens_request_interarrival_seconds_squared_total") / n - mean**2
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert n == len(gaps)
    assert math.sqrt(variance) / mean == pytest.approx(statistics.pstdev(gaps) / statistics.fmean(gaps))


def test_the_arrival_series_pass_promtool_lint():
    registry = CollectorRegistry()
    arrivals = ArrivalMetrics(registry)
    arrivals.arrived(0.0)
    arrivals.arrived(0.5)
    arrivals.answered(True)
    promtool = require_binary("promtool", "prometheus")
    done = subprocess.run([promtool, "check", "metrics"], input=generate_latest(registry), capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_plugin_middleware_counts_generation_requests_and_streams():
    registry = CollectorRegistry()
    sent = []

    async def app(scope, receive, send):
        content_type = b"text/event-stream" if scope["path"] == "/v1/chat/completions" else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})

    async def send(message):
        sent.append(message)

    door = Door()
    middleware = ArrivalMiddleware(app, ArrivalMetrics(registry), door=lambda: door)
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                         ("POST", "/batchlens/v1/batch")]:  # fmt: skip
        asyncio.run(middleware({"type": "http", "method": method, "path": path}, None, send))
    value = registry.get_sample_value
    assert value("batchlens_requests_total", {"stream": "true"}) == 1
    assert value("batchlens_requests_total", {"stream": "false"}) == 1
    assert value("batchlens_request_interarrival_seconds_count") == 1  # two arrivals, one gap
    assert len(sent) == 4  # every answer still goes out
    # The plugin's door refuses a generation request before the app sees it: vLLM's 503, with its Retry-After.
    # The door gets the request's priority from its header, and the refusal is counted in the header's class.
    door.reason, sent[:] = "max_num_queued_tokens", []
    header = (b"x-batchlens-priority", b"-2")
    sheddable = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [header]}
    asyncio.run(middleware(sheddable, None, send))
    start, body = sent
    assert start["status"] == 503 and (b"retry-after", b"7") in start["headers"], start
    assert json.loads(body["body"])["error"]["message"].startswith("The engine has reached its prefill token")
    assert value("batchlens_requests_total", {"stream": "false"}) == 1  # refused: never answered by the app
    assert door.priorities == [0, 0, -2]  # no header: standard
    assert value("batchlens_door_requests_total", {"priority_class": "standard"}) == 2
    assert value("batchlens_door_refusals_total", {"priority_class": "sheddable"}) == 1
    assert value("batchlens_door_refusals_total", {"priority_class": "standard"}) == 0
    asyncio.run(middleware({"type": "http", "method": "GET", "path": "/metrics"}, None, send))
    assert sent[-1]["status"] == 200  # nothing but generation requests goes through the door
    # A header sent twice (a gateway appending its copy) is read at its lowest: no copy claims critical.
    door.reason = None
    asyncio.run(middleware({**sheddable, "headers": [(b"x-batchlens-priority", b"-5"), header]}, None, send))
    assert door.priorities[-1] == -5

    def answering(status: int, body: bytes):  # vLLM's own 503s, as its serving code sends them
        async def vllm(scope, receive, send):
            await send({"type": "http.response.start", "status": status, "headers": [(b"retry-after", b"3")]})
            await send({"type": "http.response.body", "body": body})

        return ArrivalMiddleware(vllm, middleware.arrivals, door=lambda: door)

    refused_before, sent[:] = value("batchlens_door_refusals_total", {"priority_class": "standard"}), []
    standard = {"type": "http", "method": "POST", "path": "/v1/completions"}
    asyncio.run(answering(503, json.dumps(refusal_body("max_num_queued_reqs")).encode())(standard, None, send))
    assert sent[0]["headers"] == [(b"retry-after", b"7")] and sent[1]["type"] == "http.response.body"
    asyncio.run(answering(503, b'{"error": {"message": "shutting down"}}')(standard, None, send))
    assert sent[2]["headers"] == [(b"retry-after", b"3")], "another 503 keeps its own headers"
    refused = value("batchlens_door_refusals_total", {"priority_class": "standard"}) - refused_before
    assert refused == 1, "only the cap's 503 is the door's refusal"


class Door:
    """The admission door as the middleware asks it (the plugin's AdminService in vLLM): a verdict per request."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.priorities: list[int] = []  # each request's door priority, as the middleware read it

    def refusal(self, priority: int) -> str | None:
        self.priorities.append(priority)
        return self.reason

    def retry_after(self) -> int:
        return 7

    def predicts(self) -> bool:  # the per-request door off: the body is never read
        return False

    def predicted(self, prompt_tokens: int | None) -> tuple[None, None]:
        return None, None


# -- the real thing: two Prometheus servers, two kinds of traffic --------------------------------

LOADS = {
    "sim-bursty": ["--rate", "4", "--arrival", "bursty", "--prompt-tokens", "1024,4096", "--output-tokens", "64",
                   "--stream-share", "0.6"],
    "sim-steady": ["--rate", "5", "--arrival", "steady", "--prompt-tokens", "256", "--output-tokens", "32",
                   "--stream-share", "0"],
}  # fmt: skip
RANGE_SECONDS = 40
# The bursty load repeats every 6 s (2 s of burst, 4 s quiet). Windows of 2 s, evaluated every 2 s, cut each
# period into three, so one window is always quiet and one holds burst, whatever the phase. (With 3 s
# windows a phase exists where both halves of the period hold half a burst, and peak = trough.)
RESOLUTION = "2s"


@pytest.mark.e2e
def test_bursty_and_steady_traffic_get_opposite_advice(tmp_path):
    stacks, loads = [], []
    try:
        for name, args in LOADS.items():
            sim = SimulatorProcess(tmp_path, speed=10, args=("--max-num-seqs", "64"))
            config = tmp_path / f"{name}.yaml"
            config.write_text(json.dumps({"engines": [{"name": name, "url": sim.url, "simulated_gpu": True}]}))
            exporter = ExporterProcess(tmp_path, [], extra_args=("--config", str(config)))
            prometheus = PrometheusServer(
                tmp_path / f"prom-{name}",
                [{"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
                rule_files=tuple(str(p) for p in sorted((ROOT / "alerts").glob("*.yml"))),
            )
            stacks.append((name, sim, exporter, prometheus))
            argv = [BATCHLENS, "load", "--url", sim.url, "--duration", str(RANGE_SECONDS + 40), *args]
            loads.append(Process(f"load-{name}", argv, tmp_path / f"load-{name}.log"))
        time.sleep(RANGE_SECONDS + 10)  # advise on live traffic: the whole range inside the load
        advice = {}
        for name, _, _, prometheus in stacks:
            done = subprocess.run(
                [BATCHLENS, "advise", "--prometheus", prometheus.url, "--range", f"{RANGE_SECONDS}s",
                 "--resolution", RESOLUTION, "--json"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            (advice[name],) = json.loads(done.stdout)
            text = subprocess.run(
                [BATCHLENS, "advise", "--prometheus", prometheus.url, "--range", f"{RANGE_SECONDS}s",
                 "--resolution", RESOLUTION],
                capture_output=True, text=True, timeout=60,
            ).stdout  # fmt: skip
            print(text)  # the evidence, in the test log
            assert f"{name}: " in text and "because" in text
    finally:
        for load in loads:
            load.stop()
        for _, sim, exporter, prometheus in stacks:
            prometheus.stop()
            exporter.stop()
            sim.stop()

    bursty, steady = advice["sim-bursty"], advice["sim-steady"]
    assert bursty["continuous"] is True and steady["continuous"] is False
    b = {c["name"]: c for c in bursty["criteria"]}
    s = {c["name"]: c for c in steady["criteria"]}
    assert b["inter-arrival CV"]["value"] > 1.0 and s["inter-arrival CV"]["value"] < 0.3
    assert b["peak/trough QPS"]["met"] and not s["peak/trough QPS"]["met"]
    assert b["mean tokens per request"]["value"] > 2048 > 1000 > s["mean tokens per request"]["value"]
    assert 0.4 < b["streaming share"]["value"] < 0.8 and s["streaming share"]["value"] == 0
    recommended = {r["setting"]: r for r in steady["recommendations"]}
    # Evenly spaced at 5/s: every gap is 0.2 s, so the P90 lies in the (0.1, 0.25] bucket.
    assert 0.1 < float(recommended["cold-path threshold (s)"]["value"]) <= 0.25
    assert recommended["long-context instance"]["value"] == "no"
    assert {r["setting"]: r for r in bursty["recommendations"]}["long-context instance"]["value"].startswith("yes")
    assert bursty["requests"] > 100 and steady["requests"] > 150


def test_advise_explains_an_unreachable_prometheus():
    done = subprocess.run(
        [BATCHLENS, "advise", "--prometheus", "http://127.0.0.1:9", "--range", "1h"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "cannot read http://127.0.0.1:9" in done.stderr
    bad = subprocess.run([BATCHLENS, "advise", "--prometheus", "http://x", "--range", "soon"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--range" in bad.stderr
