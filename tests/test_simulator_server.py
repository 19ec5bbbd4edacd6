"""``batchlens simulate`` over real HTTP: the OpenAI API, hostile input, the admin API contract, /metrics.

The simulator is the fake here, by design: it stands in for vLLM on a GPU.
Its admin API goes through the same contract checks as the vLLM plugin's
(tests/harness/admin.py).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import yaml

from batchlens.admin_api import ADMISSION_PATH, INFO_PATH
from batchlens.queued_caps import CLASSES, PRIORITY_HEADER
from harness.admin import (
    AdminClient,
    check_admission_contract,
    check_concurrent_puts,
    check_contract,
    check_disabled_without_token,
    set_caps,
)
from harness.exporter import BATCHLENS, ExporterProcess, one, parse_samples, pick
from harness.procs import http_get, wait_until
from harness.simulator import SimulatorProcess

pytestmark = pytest.mark.slow
MODEL = "deepseek-sim"


@pytest.fixture
def sim(tmp_path) -> Iterator[SimulatorProcess]:
    simulator = SimulatorProcess(tmp_path, args=("--max-num-seqs", "32", "--max-model-len", "4096"))
    yield simulator
    assert simulator.stop() == 0


def gauges(sim: SimulatorProcess) -> dict:
    return parse_samples(http_get(sim.url + "/metrics")[1].decode())


def test_completions_and_chat_answer_like_vllm(sim: SimulatorProcess) -> None:
    status, reply = sim.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 7})
    assert status == 200 and reply["object"] == "text_completion"
    assert reply["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    assert reply["choices"][0]["finish_reason"] == "length" and reply["choices"][0]["text"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, reply = sim.post("/v1/chat/completions", chat)
    assert status == 200 and reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] == 3
    models = json.loads(http_get(sim.url + "/v1/models")[1])
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 4096
    assert json.loads(http_get(sim.url + "/version")[1])["version"] == "0.32.0"
    samples = gauges(sim)
    assert one(samples, "vllm:request_success_total", finished_reason="length") == 2
    assert one(samples, "vllm:generation_tokens_total") == 10


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_sends_one_event_per_token_then_usage_and_done(sim: SimulatorProcess, chat: bool) -> None:
    payload = {"model": MODEL, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    payload.update({"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"})
    conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
    conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(payload))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = [line[6:] for line in resp.read().decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert len(tokens) == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    ("payload", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        ({"model": "gpt-9", "prompt": "a"}, 404, "The model `gpt-9` does not exist."),
        ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens must be at least 1, got 0."),
        ({"model": MODEL, "prompt": "a", "max_tokens": -5}, 400, "at least 1"),
        ({"model": MODEL, "prompt": "a", "max_tokens": "many"}, 400, "must be an integer"),
        ({"model": MODEL, "prompt": list(range(5000)), "max_tokens": 10}, 400, "maximum context length is 4096"),
        ({"model": MODEL, "prompt": []}, 400, "prompt must be"),
        (b'{"model": "deepseek-sim", "prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}', 413, "larger than"),
    ],
    # short ids: pytest puts the id in PYTEST_CURRENT_TEST, and 17 MiB of it in the environment would not exec
    ids=[
        "not-json",
        "not-an-object",
        "unknown-model",
        "zero-tokens",
        "negative-tokens",
        "string-tokens",
        "too-long",
        "empty-prompt",
        "17MiB",
    ],
)
def test_hostile_requests_get_openai_errors_and_the_server_keeps_serving(sim, payload, status, says) -> None:
    got, reply = sim.post("/v1/completions", payload)
    assert got == status and says in reply["error"]["message"], reply
    assert reply["error"]["code"] == status
    assert sim.post("/v1/completions", {"model": MODEL, "prompt": "still here", "max_tokens": 2})[0] == 200


def test_the_admin_api_keeps_the_contract(sim: SimulatorProcess) -> None:
    admin = AdminClient(sim.url, sim.token)
    check_contract(admin, 32)
    check_concurrent_puts(admin, 32)
    check_admission_contract(admin)


def post_with_headers(url: str, payload: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def three_in_flight(admin: AdminClient) -> None:
    wait_until(lambda: admin.request("GET", ADMISSION_PATH)[1]["num_unfinished_reqs"] == 3, timeout=10,
               what="three requests in flight")  # fmt: skip


@contextmanager
def holding_three(tmp_path, *args: str) -> Iterator[tuple[SimulatorProcess, AdminClient]]:
    """A simulator at speed 1 with three long requests held in flight (minutes of simulated decode)."""
    sim = SimulatorProcess(tmp_path, speed=1, args=("--max-num-seqs", "32", *args))
    admin = AdminClient(sim.url, sim.token)
    pool = ThreadPoolExecutor(3)
    try:
        for _ in range(3):
            pool.submit(sim.post, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2000}, 300)
        three_in_flight(admin)
        # Each past its first token: a door that starts watching then sees none of theirs come.
        firsts = lambda: sum(pick(gauges(sim), "vllm:time_to_first_token_seconds_count").values())  # noqa: E731
        wait_until(lambda: firsts() == 3, timeout=10, what="the three past their first token")
        yield sim, admin
    finally:
        sim.stop()  # the three held requests end with it
        pool.shutdown(wait=True)


def test_a_queued_cap_refuses_at_once_with_vllms_503_and_counts_it_as_vllm_does(tmp_path) -> None:
    with holding_three(tmp_path) as (sim, admin):
        set_caps(admin, max_num_queued_reqs=3)
        started = time.monotonic()
        status, headers, reply = post_with_headers(sim.url, {"model": MODEL, "prompt": "y", "max_tokens": 2})
        assert status == 503 and "busy" in reply["error"]["message"] and time.monotonic() - started < 1, reply
        assert reply["error"]["type"] == "Service Unavailable"  # vLLM 0.32 types it by the status's phrase
        assert headers["Retry-After"] == "1"  # nothing in prefill: the backlog is gone at once
        counted = pick(gauges(sim), "vllm:admission_rejections_total", reason="max_num_queued_reqs")
        assert list(counted.values()) == [1.0]
        set_caps(admin, max_num_queued_reqs=None)
        assert sim.post("/v1/completions", {"model": MODEL, "prompt": "y", "max_tokens": 2})[0] == 200


def test_the_per_request_door_refuses_a_predicted_miss_and_tells_the_admitted_their_prediction(tmp_path) -> None:
    """The plugin's per-request door, as the simulator answers it: once it has seen enough first tokens it tells
    each admitted request its predicted TTFT; a bound no request can meet refuses with vLLM's 503 and counts reason
    predicted_ttft, a critical request too (it would miss too), and the door's second look refuses so the requests
    admitted before it that still wait for a slot, a streamed one too; lifted, requests pass."""
    short = {"model": MODEL, "prompt": "y " * 200, "max_tokens": 2}
    with holding_three(tmp_path) as (sim, admin), ThreadPoolExecutor(2) as pool:
        set_caps(admin, max_predicted_ttft_seconds=3600)
        said = [post_with_headers(sim.url, short)[1].get("x-batchlens-predicted-ttft") for _ in range(10)]
        assert said[:7] == [None] * 7 and float(said[-1]) > 0, said  # MIN_PREFILLS first tokens, then predictions
        assert admin.request("GET", ADMISSION_PATH)[1]["learned_prefill_tokens_per_second"] > 0
        admin.set_limit(3)  # the three held requests hold every slot: two more wait for one
        queued = [pool.submit(post_with_headers, sim.url, {**short, "stream": stream}) for stream in (False, True)]
        wait_until(lambda: admin.request("GET", ADMISSION_PATH)[1]["num_unfinished_reqs"] == 5, timeout=10,
                   what="two requests waiting for a slot")  # fmt: skip
        set_caps(admin, max_predicted_ttft_seconds=0.001)
        refused = [post_with_headers(sim.url, short, {PRIORITY_HEADER: p}) for p in ("0", "1")]
        refused += [future.result(timeout=30) for future in queued]
        assert [status for status, _, _ in refused] == [503] * 4, refused
        for _, headers, reply in refused:
            assert "miss its time to first token" in reply["error"]["message"] and int(headers["Retry-After"]) >= 1
        counted = pick(gauges(sim), "vllm:admission_rejections_total", reason="predicted_ttft")
        assert list(counted.values()) == [4.0]
        assert admin.request("GET", ADMISSION_PATH)[1]["num_unfinished_reqs"] == 3  # the two aborted, not left
        admin.set_limit(32)
        set_caps(admin, max_predicted_ttft_seconds=None)
        assert post_with_headers(sim.url, short)[0] == 200


@pytest.mark.parametrize(
    ("version", "critical", "counted_by_vllm"),
    [("0.32.0", 503, "standard and critical"), ("0.10.2", 200, "standard and sheddable")],
)
def test_the_door_refuses_sheddable_requests_first_and_critical_ones_only_where_vllm_keeps_it(
    tmp_path, version, critical, counted_by_vllm
) -> None:
    """Three requests held in flight. Under a cap of 5 unfinished a sheddable request (x-batchlens-priority < 0)
    meets half of it and is refused, a standard one passes. Under a cap of 3 the standard one is refused, and a
    critical one too where vLLM's own caps keep the door (0.29+: they cannot tell requests apart), never where
    the plugin's door does. vLLM's counter counts what vLLM refused; the door's counts each class."""
    short = {"model": MODEL, "prompt": "y", "max_tokens": 2}

    def post(sim: SimulatorProcess, priority: int) -> int:
        return post_with_headers(sim.url, short, {PRIORITY_HEADER: str(priority)})[0]

    with holding_three(tmp_path, "--vllm-version", version) as (sim, admin):
        set_caps(admin, max_num_queued_reqs=5)
        assert (post(sim, -1), post(sim, 0)) == (503, 200)
        three_in_flight(admin)  # the short request done
        set_caps(admin, max_num_queued_reqs=3)
        assert (post(sim, 0), post(sim, 1)) == (503, critical)
        samples = gauges(sim)
        assert list(pick(samples, "vllm:admission_rejections_total", reason="max_num_queued_reqs").values()) == [2.0]
        refused = {c: pick(samples, "batchlens_door_refusals_total", priority_class=c) for c in CLASSES}
        assert {c: sum(v.values()) for c, v in refused.items()} == {
            "critical": float(critical == 503), "standard": 1.0, "sheddable": 1.0}, counted_by_vllm  # fmt: skip
        arrived = {c: sum(pick(samples, "batchlens_door_requests_total", priority_class=c).values()) for c in CLASSES}
        assert arrived == {"critical": 1.0, "standard": 5.0, "sheddable": 1.0}  # the three long ones are standard


def test_without_a_token_the_admin_api_is_closed(tmp_path) -> None:
    sim = SimulatorProcess(tmp_path, token=None)
    try:
        check_disabled_without_token(AdminClient(sim.url, None))
    finally:
        sim.stop()


def test_an_older_releases_dialect_is_served_and_an_unsupported_release_refused(tmp_path) -> None:
    sim = SimulatorProcess(tmp_path, args=("--vllm-version", "0.10.2"))
    try:
        status, body = http_get(sim.url + "/metrics")
        assert status == 200
        names = {name for name, _ in parse_samples(body.decode())}
        assert {"vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total"} <= names
        assert "vllm:time_per_output_token_seconds_count" in names
        assert json.loads(http_get(sim.url + "/version")[1])["version"] == "0.10.2"
        assert AdminClient(sim.url, sim.token).request("GET", INFO_PATH)[1]["vllm_version"] == "0.10.2"
        # No queued caps in vLLM 0.10: the simulator answers as the plugin's door does there, under vLLM's series.
        check_admission_contract(AdminClient(sim.url, sim.token), door="plugin")
        assert "vllm:admission_rejections_total" in names
    finally:
        sim.stop()
    refused = subprocess.run([BATCHLENS, "simulate", "--vllm-version", "0.9.2"], capture_output=True, text=True)
    assert refused.returncode == 1 and "vLLM 0.9.2 is outside the releases batchlens supports" in refused.stderr


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused_at_start_as_vllm_does() -> None:
    """A 7B model on a T4 leaves room for 1712 tokens: an 8192-token request would wait forever. (Asked with
    --model, the old name of --model-profile: it still works for a release, and says so.)"""
    refused = subprocess.run([BATCHLENS, "simulate", "--gpu", "t4", "--model", "dense-7b"], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 1, refused.stderr
    assert "--model is now --model-profile; --model will be removed in the next release" in refused.stderr
    assert "--max-model-len 8192 is larger than the 1712 tokens the KV cache of dense-7b on t4 holds" in refused.stderr


def test_a_lowered_limit_holds_the_running_batch(sim: SimulatorProcess) -> None:
    admin = AdminClient(sim.url, sim.token)
    admin.set_limit(2)
    request = {"model": MODEL, "prompt": [1] * 64, "max_tokens": 400}
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(sim.post, "/v1/completions", request) for _ in range(8)]
        seen = []
        deadline = time.monotonic() + 30
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            samples = gauges(sim)
            seen.append((one(samples, "vllm:num_requests_running"), one(samples, "vllm:num_requests_waiting")))
            time.sleep(0.05)
        assert all(f.result()[0] == 200 for f in futures)
    assert max(running for running, _ in seen) <= 2, seen
    assert any(waiting > 0 for _, waiting in seen), seen


def test_a_client_that_goes_away_is_aborted(sim: SimulatorProcess) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 3000, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(payload))
    resp = conn.getresponse()
    resp.fp.readline()  # the first event: it is running
    conn.close()
    deadline = time.monotonic() + 20
    while one(gauges(sim), "vllm:request_success_total", finished_reason="abort") < 1:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.1)
    assert one(gauges(sim), "vllm:num_requests_running") == 0


def test_clients_that_leave_mid_stream_leave_the_engine_serving(sim: SimulatorProcess) -> None:
    """Ten streams dropped while their tokens are being produced; the next request must still be answered."""
    aborted = one(gauges(sim), "vllm:request_success_total", finished_reason="abort")
    conns = []
    for _ in range(10):
        conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=30)
        payload = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(payload))
        resp = conn.getresponse()
        resp.fp.readline()
        conns.append(conn)
    for conn in conns:
        conn.close()
    status, reply = sim.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 20}, timeout=20)
    assert status == 200 and reply["usage"]["completion_tokens"] == 20
    assert one(gauges(sim), "vllm:request_success_total", finished_reason="abort") > aborted
    assert "Traceback" not in sim.process.log_tail(200)


def test_a_client_that_leaves_mid_body_is_logged_not_a_traceback(sim: SimulatorProcess) -> None:
    """A proxy stopped while it sends a request: half a body, then the connection closes."""
    import socket

    with socket.create_connection(("127.0.0.1", sim.port), timeout=10) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n" + b'{"model": "' + MODEL.encode())  # fmt: skip
        time.sleep(0.3)  # the handler is reading the body
    deadline = time.monotonic() + 10
    while "closed its connection before its request arrived whole" not in sim.process.log_tail(50):
        assert time.monotonic() < deadline, sim.process.log_tail(50)
        time.sleep(0.1)
    status, reply = sim.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=20)
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    assert "Traceback" not in sim.process.log_tail(200)


def test_the_exporter_reads_the_simulator_like_a_vllm_with_its_gpu(tmp_path, sim: SimulatorProcess) -> None:
    config = tmp_path / "batchlens.yaml"
    config.write_text(yaml.safe_dump({"engines": [{"name": "sim", "url": sim.url, "simulated_gpu": True}]}))
    exporter = ExporterProcess(
        tmp_path, [], interval=0.3, extra_args=("--config", str(config)), env={"BATCHLENS_ADMIN_TOKEN": sim.token}
    )
    gpu = {"vllm_instance": "sim", "model_name": MODEL, "gpu": "0"}
    request = {"model": MODEL, "prompt": [1] * 512, "max_tokens": 2000}
    try:
        with ThreadPoolExecutor(8) as pool:
            load = [pool.submit(sim.post, "/v1/completions", request) for _ in range(8)]
            busy = exporter.wait_for(
                lambda s: sum(pick(s, "batchlens_gpu_memory_busy_ratio", **gpu).values()) > 0,
                what="a busy simulated GPU labelled with its engine and model",
            )
            assert all(f.result()[0] == 200 for f in load)
    finally:
        exporter.stop()
    info = json.loads(http_get(sim.url + "/batchlens/v1/info", headers={"Authorization": f"Bearer {sim.token}"})[1])
    assert one(busy, "batchlens_kv_blocks_total", vllm_instance="sim") == info["num_gpu_blocks"]
    assert one(busy, "batchlens_batch_limit", vllm_instance="sim", model_name=MODEL, engine="0") == 32
    # The source's own up, and its GPU's (which names the engine too).
    ups = pick(busy, "batchlens_source_up", source="simulated_gpu")
    assert sorted((dict(k).get("gpu", ""), dict(k)["vllm_instance"], v) for k, v in ups.items()) == [
        ("", "sim", 1), ("0", "sim", 1)], ups  # fmt: skip
    assert 0 < one(busy, "batchlens_gpu_dram_bandwidth_ratio", **gpu) <= 1
    assert one(busy, "batchlens_gpu_memory_bandwidth_peak_bytes_per_second", **gpu) == 2.039e12


def _mean(samples: dict, name: str) -> float:
    return one(samples, f"{name}_sum") / one(samples, f"{name}_count")


def test_the_simulated_latencies_do_not_depend_on_the_speed(tmp_path) -> None:
    """The same simulated load (3 req/s for 20 simulated seconds) at 4x and at 20x: the simulator's own
    latency histograms must agree, although at 20x the host has five times less time per step."""
    means = {}
    for speed in (4, 20):
        sim = SimulatorProcess(tmp_path, speed=speed)
        try:
            argv = [BATCHLENS, "load", "--url", sim.url, "--json", "--rate", str(3 * speed),
                    "--duration", str(20 / speed), "--output-tokens", "128", "--seed", "7"]  # fmt: skip
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            samples = gauges(sim)
        finally:
            sim.stop()
        means[speed] = {
            "requests": one(samples, "vllm:e2e_request_latency_seconds_count"),
            "e2e": _mean(samples, "vllm:e2e_request_latency_seconds"),
            "ttft": _mean(samples, "vllm:time_to_first_token_seconds"),
            "itl": _mean(samples, "vllm:inter_token_latency_seconds"),
        }
    slow, fast = means[4], means[20]
    print(f"\nsimulated means at 4x: {slow}\nsimulated means at 20x: {fast}")
    assert slow["requests"] == fast["requests"] > 40
    # TTFT is a few simulated steps (~50 ms): at 20x, one millisecond the loaded host takes to schedule the
    # simulator is 20 simulated ones, so its bound also allows 20 ms; the longer latencies are judged by ratio.
    for key, slack in (("e2e", 0), ("ttft", 0.02), ("itl", 0)):
        assert fast[key] == pytest.approx(slow[key], rel=0.15, abs=slack), (key, slow, fast)
