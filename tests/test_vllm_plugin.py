"""The batchlens plugin inside a real vLLM 0.32 on the CPU. No fakes.

The session's server (tests/conftest.py) loads the plugin as a user would: the
wheel built from this checkout, pip-installed, ``VLLM_PLUGINS=batchlens``,
``BATCHLENS_ADMIN_TOKEN`` set. Data parallelism, several API servers and the
admin API on a port of its own run under ``vllm serve`` in
tests/test_vllm_api_servers.py. The plugin's entry points in other shapes (no token, other
scheduler shapes, ``--middleware``, the plugin's door) run in the real vLLM
environment's FastAPI with the engine client faked.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from batchlens.admin_api import ADMISSION_PATH, BATCH_PATH, CACHE_RESET_PATH, INFO_PATH, TOKEN_ENV
from batchlens.queued_caps import MESSAGES, PREDICTED_TTFT, PRIORITY_HEADER
from batchlens.vllm_plugin.admin_port import HOST_ENV, PORT_ENV, AdminListen, admin_listen
from batchlens.vllm_plugin.second_look import TOKEN_PREFIX, SecondLook, judged_again, request_id_header
from harness.admin import (
    AdminClient,
    check_admission_contract,
    check_concurrent_puts,
    check_contract,
    set_caps,
)
from harness.exporter import one, parse_samples, pick
from harness.procs import free_port
from harness.vllm import VLLM_VERSION, VllmServer, vllm_python
from harness.wheel import Distributions

pytestmark = pytest.mark.vllm

CAPACITY = 32  # the session server's --max-num-seqs


def admin(server: VllmServer) -> AdminClient:
    return AdminClient(server.url, server.admin_token)


def batch_gauges(server: VllmServer) -> tuple[float, float]:
    """vLLM's own view: (requests running, requests waiting), over every engine."""
    samples = parse_samples(server.metrics_text())
    running = sum(pick(samples, "vllm:num_requests_running").values())
    waiting = sum(pick(samples, "vllm:num_requests_waiting").values())
    return running, waiting


def wait_for(server: VllmServer, predicate, what: str, timeout: float = 120) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        gauges = batch_gauges(server)
        if predicate(*gauges):
            return gauges
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached within {timeout:.0f}s (running, waiting = {gauges})")
        time.sleep(0.2)


@pytest.fixture
def session_admin(vllm_server: VllmServer) -> Iterator[AdminClient]:
    """The session server's admin API; the limit is back at the capacity afterwards, for the other tests."""
    client = admin(vllm_server)
    yield client
    client.set_limit(CAPACITY)


def test_the_admin_api_keeps_its_contract(session_admin: AdminClient) -> None:
    check_contract(session_admin, CAPACITY)
    check_admission_contract(session_admin)
    # The signature covers the body, so it is read before the token is checked: no further than the contract's.
    status, reply = session_admin.request("PUT", BATCH_PATH, b" " * 5000, auth={})
    assert status == 400 and "larger" in reply["error"], (status, reply)


def completion_status(server: VllmServer, bodies: list[bytes], priority: int = 0) -> int:
    """One completion's HTTP status, at a door priority; a refusal's body is kept in ``bodies``."""
    payload = {"model": server.model, "prompt": [3] * 16, "max_tokens": 48, "ignore_eos": True}
    headers = {"Content-Type": "application/json", PRIORITY_HEADER: str(priority)}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(payload).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as exc:
        bodies.append(exc.headers.get("Retry-After", "none").encode() + b" " + exc.read())
        return exc.code


def admission_rejections(server: VllmServer) -> float:
    samples = parse_samples(server.metrics_text())
    return sum(pick(samples, "vllm:admission_rejections_total", reason="max_num_queued_reqs").values())


def test_a_queued_cap_set_at_runtime_makes_vllm_itself_refuse_the_overflow(
    vllm_server: VllmServer, session_admin: AdminClient
) -> None:
    """Twelve clients, past what the CPU server serves at once: a cap of 4 unfinished requests, set through the
    plugin while they run. vLLM answers the overflow 503 and counts it; the batch keeps running; lifted, all pass."""
    statuses: Counter[int] = Counter()
    bodies: list[bytes] = []
    lock, stop = threading.Lock(), threading.Event()

    def client() -> None:
        while not stop.is_set():
            status = completion_status(vllm_server, bodies)
            with lock:
                statuses[status] += 1
            if status == 503:
                time.sleep(0.05)  # as a client backing off: a refusal is instant, and a tight loop would be a DoS

    before = admission_rejections(vllm_server)
    pool = ThreadPoolExecutor(12)
    try:
        for _ in range(12):
            pool.submit(client)
        wait_for(vllm_server, lambda running, waiting: running + waiting >= 8, "the load in flight")
        assert set_caps(session_admin, max_num_queued_reqs=4)["max_num_queued_reqs"] == 4
        wait_for(vllm_server, lambda running, waiting: running + waiting <= 4, "the engine drained to the cap")
        deadline = time.monotonic() + 60
        while statuses[503] < 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        # Read first: the sheddable requests below take their time. Over 2 s, not once: the admitted requests
        # can all finish between two of the clients' next ones (a clean clone's suite read 0 running once).
        running = []
        for _ in range(10):
            running.append(batch_gauges(vllm_server)[0])
            time.sleep(0.2)
        kv = sum(pick(parse_samples(vllm_server.metrics_text()), "vllm:kv_cache_usage_perc").values())
        # A sheddable request meets half the cap, refused by the plugin before vLLM sees it: vLLM never counts it.
        shed = [completion_status(vllm_server, [], priority=-1) for _ in range(3)]
    finally:
        set_caps(session_admin, max_num_queued_reqs=None)
        stop.set()
        pool.shutdown(wait=True)
    assert statuses[503] >= 20 and statuses[200] > 0, statuses
    retry, _, body = bodies[0].partition(b" ")
    assert b"busy" in body and int(retry) >= 1, bodies[0][:300]  # vLLM's 503, with the plugin's Retry-After
    assert admission_rejections(vllm_server) - before == statuses[503]  # vLLM's own counter, one per refusal
    assert 503 in shed, shed
    door = parse_samples(vllm_server.metrics_text())
    assert one(door, "batchlens_door_refusals_total", priority_class="sheddable") == shed.count(503)
    assert one(door, "batchlens_door_refusals_total", priority_class="standard") >= statuses[503]
    assert 1 <= max(running) <= 4 and kv < 0.9, running  # the admitted ones keep running; nothing piles up in KV
    assert vllm_server.complete(max_tokens=4)["usage"]["completion_tokens"] == 4


def door_completion(
    server: VllmServer, prompt_tokens: int, max_tokens: int = 4, priority: int | None = None, seed: int = 0,
    stream: bool = False, prompts: int = 1, n: int = 1,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One completion of ``prompt_tokens`` token ids drawn from ``seed`` (so that no prefix cache makes its prefill
    free; ``prompts`` such prompts, ``n`` answers to each): its status, its headers (lower-cased names) and its
    body."""
    rng = random.Random(seed)
    ids = [rng.choices(range(3, 1000), k=prompt_tokens) for _ in range(prompts)]
    payload = {"model": server.model, "prompt": ids[0] if prompts == 1 else ids, "max_tokens": max_tokens,
               "ignore_eos": True, "stream": stream, "n": n}  # fmt: skip
    headers = {"Content-Type": "application/json", **({} if priority is None else {PRIORITY_HEADER: str(priority)})}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(payload).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def predicted_rejections(server: VllmServer) -> tuple[float, float]:
    """vLLM's own count of the per-request door's refusals, and the door's count of critical requests refused."""
    samples = parse_samples(server.metrics_text())
    vllms = sum(pick(samples, "vllm:admission_rejections_total", reason=PREDICTED_TTFT).values())
    return vllms, sum(pick(samples, "batchlens_door_refusals_total", priority_class="critical").values())


def learn_the_door(server: VllmServer, session_admin: AdminClient) -> None:
    """The door on at a bound nothing misses (an hour), and requests until it has learned the rates.

    Prompts of different lengths, alone and eight at once. One round at least: a rate learned from an earlier
    test's requests could age out of the door's horizon (30 s) midway, and a door with no rate admits (CI once
    saw one 200 so)."""
    assert set_caps(session_admin, max_predicted_ttft_seconds=3600)["max_predicted_ttft_seconds"] == 3600
    lengths, seed, deadline = (64, 1500, 256, 1024, 128, 768, 512, 384), 1, time.monotonic() + 60
    while True:
        for n in lengths[:3]:
            assert door_completion(server, n, seed=seed + n + 5000)[0] == 200
        with ThreadPoolExecutor(len(lengths)) as burst:
            replies = list(burst.map(lambda n, s=seed: door_completion(server, n, seed=s + n), lengths))
        seed += 10_000
        assert {status for status, _, _ in replies} == {200}, [r[:2] for r in replies]  # an hour: no miss
        state = session_admin.request("GET", ADMISSION_PATH)[1]
        if state["learned_prefill_tokens_per_second"] is not None:
            break
        assert time.monotonic() < deadline, f"the door learned no prefill rate within 60 s: {state}"
    assert state["max_predicted_ttft_seconds"] == 3600 and state["learned_prefill_tokens_per_second"] > 0, state


def test_the_per_request_door_predicts_each_requests_ttft_and_refuses_a_predicted_miss(
    vllm_server: VllmServer, session_admin: AdminClient
) -> None:
    """The door on at a bound nothing misses (an hour): it learns the prefill rate from the requests it sees served
    and tells each admitted one its predicted TTFT. Then, under eight clients, a bound every request misses (1 ms,
    what a 1,024-token prompt's own prefill takes longer than): each new request, a critical one too, gets vLLM's
    503 with the door's message and a Retry-After, and vLLM's counter counts each. Off again, a request passes."""
    header = "x-batchlens-predicted-ttft"  # what an admitted request's answer carries its prediction in
    statuses: Counter[int] = Counter()
    refused: list[tuple[dict[str, str], bytes]] = []
    after: list[int] = []  # the statuses of the requests sent once the 1 ms bound was in force
    lock, stop, strict = threading.Lock(), threading.Event(), threading.Event()
    pool = ThreadPoolExecutor(8)

    def client(seed: int) -> None:
        while not stop.is_set():
            judged = strict.is_set()
            status, headers, body = door_completion(vllm_server, 1024, max_tokens=32, seed=seed)
            seed += 1000
            with lock:
                statuses[status] += 1
                after.extend([status] if judged else [])
                refused.extend([(headers, body)] if status == 503 else [])
            if status == 503:
                time.sleep(0.05)  # as a client backing off: a refusal is instant

    session_admin.state()  # the batch route read: the door knows the limit it counts slots against
    before = predicted_rejections(vllm_server)
    try:
        learn_the_door(vllm_server, session_admin)
        status, headers, _ = door_completion(vllm_server, 700, seed=7)
        assert status == 200 and float(headers[header]) > 0, (status, headers)

        # A load, then a bound that every request misses.
        for i in range(8):
            pool.submit(client, 100 + i)
        wait_for(vllm_server, lambda running, waiting: running + waiting >= 4, "the load in flight")
        assert set_caps(session_admin, max_predicted_ttft_seconds=0.001)["max_predicted_ttft_seconds"] == 0.001
        strict.set()
        deadline = time.monotonic() + 30
        while len(after) < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        critical = door_completion(vllm_server, 1024, priority=1, seed=99)
    finally:
        stop.set()
        set_caps(session_admin, max_predicted_ttft_seconds=None)
        pool.shutdown(wait=True)
    assert len(after) >= 16 and set(after) == {503}, Counter(after)  # every request judged at 1 ms is refused
    assert critical[0] == 503, critical[:2]  # it would miss too: the door refuses by fate, not by class
    for headers, body in [*refused, critical[1:]]:
        assert json.loads(body)["error"]["message"] == MESSAGES[PREDICTED_TTFT], body[:300]
        assert int(headers["retry-after"]) >= 1 and header not in headers, headers
    vllms, criticals = predicted_rejections(vllm_server)
    assert vllms - before[0] == statuses[503] + 1, (vllms, before, statuses)  # one each, the critical one too
    assert criticals - before[1] == 1, (criticals, before)
    # Off: a request passes, and no prediction is made for it.
    assert session_admin.request("GET", ADMISSION_PATH)[1]["max_predicted_ttft_seconds"] is None
    status, headers, _ = door_completion(vllm_server, 1024, seed=98)
    assert status == 200 and header not in headers, (status, headers)


def test_the_doors_second_look_refuses_the_queued_requests_that_would_now_miss_and_no_other(
    vllm_server: VllmServer, session_admin: AdminClient
) -> None:
    """Admitted under an hour's bound, three requests wait for the one slot that a long one holds (limit 1): a
    streamed one, one of two prompts and one of n=2, five requests in vLLM. The bound falls to 1 ms: on its next
    tick the door judges them again and refuses all three while queued. Each client gets the door's 503 and
    Retry-After, not vLLM's answer; vLLM aborts all five (none waits) and counts each HTTP request's refusal once;
    the long one, past its first token, runs on to its end."""
    long_reply: list[tuple[int, dict[str, str], bytes]] = []
    queued: list[tuple[int, dict[str, str], bytes]] = []
    before = predicted_rejections(vllm_server)[0]
    pool = ThreadPoolExecutor(4)
    try:
        learn_the_door(vllm_server, session_admin)
        session_admin.set_limit(1)
        pool.submit(lambda: long_reply.append(door_completion(vllm_server, 64, max_tokens=1500, seed=11)))
        wait_for(vllm_server, lambda running, waiting: running == 1, "the long request running")
        # One streamed, one of two prompts, one of n=2 (the last two are two requests in vLLM each).
        shapes = ({"stream": True}, {"prompts": 2}, {"n": 2})
        waiting = [pool.submit(door_completion, vllm_server, 256, max_tokens=8, seed=20 + i, **shape)
                   for i, shape in enumerate(shapes)]  # fmt: skip
        wait_for(vllm_server, lambda running, waiting: waiting == 5, "five requests in vLLM waiting for the slot")
        set_caps(session_admin, max_predicted_ttft_seconds=0.001)
        queued = [future.result(timeout=60) for future in waiting]
        # The client has its 503 once vLLM's API server has aborted the request; its engine, a step later.
        gauges = wait_for(vllm_server, lambda running, waiting: waiting == 0, "the three aborted in vLLM", timeout=10)
    finally:
        set_caps(session_admin, max_predicted_ttft_seconds=None)
        pool.shutdown(wait=True)
    assert [status for status, _, _ in queued] == [503] * 3, [reply[:2] for reply in queued]
    for _, headers, body in queued:
        assert json.loads(body)["error"]["message"] == MESSAGES[PREDICTED_TTFT], body[:300]
        assert int(headers["retry-after"]) >= 1 and headers["content-type"] == "application/json", headers
    assert gauges[0] == 1, gauges  # the long one still running
    assert predicted_rejections(vllm_server)[0] - before == 3
    status, _, body = long_reply[0]
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 1500, (status, body[:300])


def test_the_second_look_names_a_request_by_a_token_of_its_own_and_judges_only_what_vllm_names_so() -> None:
    """The token goes after a client's X-Request-Id (a gateway such as Envoy sets one on every request), is found
    only where vLLM puts it (the end of the id, or before a prompt's index), and a request vLLM names otherwise, or
    that is several in vLLM for each token (beam search), is judged at arrival alone."""
    token = TOKEN_PREFIX + "ab" * 16
    assert request_id_header([(b"x-priority", b"1")], token) == [
        (b"x-priority", b"1"),
        (b"x-request-id", token.encode()),
    ]
    assert request_id_header([(b"X-Request-Id", b"envoy-7")], token) == [(b"x-request-id", f"envoy-7-{token}".encode())]
    look = SecondLook()
    ticket = look.track()
    for vllm_id in (f"chatcmpl-{ticket.token}", f"cmpl-{ticket.token}-1", f"chatcmpl-envoy-7-{ticket.token}"):
        assert look._ticket_of(vllm_id) is ticket, vllm_id
    for vllm_id in (f"chatcmpl-{ticket.token}x", f"cmpl-mine{ticket.token}-0", f"chatcmpl-{ticket.token}-beam-0"):
        assert look._ticket_of(vllm_id) is None, vllm_id
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    assert judged_again("/v1/completions", body) and judged_again("/v1/chat/completions", body)
    assert not judged_again("/v1/responses", body) and not judged_again("/v1/completions", None)
    for extra in ({"use_beam_search": True}, {"request_id": "mine"}):
        assert not judged_again("/v1/completions", json.dumps({"prompt": "hi", **extra}).encode()), extra
    assert judged_again("/v1/completions", json.dumps({"prompt": "hi", "use_beam_search": False}).encode())


def test_the_plugin_vllm_loaded_is_the_wheels(session_admin: AdminClient, distributions: Distributions) -> None:
    status, info = session_admin.request("GET", INFO_PATH)
    assert status == 200 and info["batchlens_version"] == distributions.version, info
    assert info["vllm_version"] == VLLM_VERSION, info


def test_a_lowered_limit_holds_under_load_and_a_raised_one_lets_the_batch_grow(
    vllm_server: VllmServer, session_admin: AdminClient
) -> None:
    limit, concurrency = 4, 16  # four times the limit in flight
    with vllm_server.steady_load(concurrency, max_tokens=256):
        wait_for(vllm_server, lambda running, _: running > limit, "the batch growing past the limit before the PUT")
        assert session_admin.set_limit(limit).max_num_active_seqs == limit
        # Requests already running finish; no new one is admitted past the limit.
        wait_for(vllm_server, lambda running, _: running <= limit, "the running batch draining to the limit")
        seen = []
        for _ in range(25):
            seen.append(batch_gauges(vllm_server))
            time.sleep(0.2)
        assert max(running for running, _ in seen) <= limit, seen
        # vLLM's gauges can dip for one sample between two scheduler steps; the queue must be there throughout.
        assert sum(waiting > 0 for _, waiting in seen) >= 15, f"the queue should hold the rest: {seen}"
        state = session_admin.state()
        assert state.max_num_active_seqs == limit and state.num_running <= limit and state.num_waiting > 0
        session_admin.set_limit(CAPACITY)
        wait_for(vllm_server, lambda running, _: running > limit, "the batch growing again after raising the limit")


def test_fifty_concurrent_puts_leave_one_state_that_the_scheduler_enforces(
    vllm_server: VllmServer, session_admin: AdminClient
) -> None:
    final = check_concurrent_puts(session_admin, CAPACITY, values=range(1, 7))
    with vllm_server.steady_load(3 * final.max_num_active_seqs + 2, max_tokens=128):
        wait_for(vllm_server, lambda _, waiting: waiting > 0, "a queue behind the limit")
        for _ in range(10):
            running, _ = batch_gauges(vllm_server)
            assert running <= final.max_num_active_seqs
            time.sleep(0.2)
        session_admin.set_limit(CAPACITY)


def test_vllm_is_unaffected_by_the_plugin(vllm_server: VllmServer) -> None:
    reply = vllm_server.complete(max_tokens=8)
    assert reply["usage"]["completion_tokens"] == 8
    assert "vllm:num_requests_running" in vllm_server.metrics_text()
    log = vllm_server.process.log_path.read_text(errors="replace")
    assert "Loaded endpoint plugin batchlens" in log
    assert "batchlens: admin API on /batchlens/v1/batch" in log
    bad = [line for line in log.splitlines() if ("batchlens" in line and ("ERROR" in line or "Failed" in line))]
    assert bad == []


TOKENLESS = textwrap.dedent(
    """
    import asyncio, json, logging, sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stdout)
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from batchlens.vllm_plugin import endpoint

    app = FastAPI()
    plugin = endpoint()
    plugin.attach_router(app)  # as vLLM's API server does, with BATCHLENS_ADMIN_TOKEN empty
    asyncio.run(plugin.init_state(None, app.state, None))  # no engine (render-only): what a read reaches
    client = TestClient(app)
    for method, path in [("GET", "/batchlens/v1/batch"), ("PUT", "/batchlens/v1/batch"), ("GET", "/batchlens/v1/info"),
                         ("POST", "/batchlens/v1/reset_prefix_cache"), ("GET", "/batchlens/v1/admission"),
                         ("PUT", "/batchlens/v1/admission")]:
        for token in (None, "any-token"):
            headers = {"Authorization": "Bearer " + token} if token else {}
            reply = client.request(method, path, headers=headers, content=b'{"max_num_active_seqs": 1}')
            print("ROUTE", json.dumps([method, path, token, reply.status_code, reply.json()["error"]]))
    """
)


def test_without_a_token_the_admin_api_is_closed_and_says_why(vllm_plugin_env) -> None:
    """Every change, and every read that carries a credential, answers 503 and names the variable, and the log
    says so once; a read with none is no change, and reaches the (stand-in) engine.

    The plugin's endpoint in the real vLLM environment's FastAPI, with BATCHLENS_ADMIN_TOKEN empty; the engine
    client is a stand-in that nothing reaches (the session server runs the same routes with a token, for real).
    """
    env = {**os.environ, **vllm_plugin_env, TOKEN_ENV: ""}
    done = subprocess.run([str(vllm_python()), "-c", TOKENLESS], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("ROUTE ")]
    assert len(answers) == 12, done.stdout[-2000:]
    for method, path, token, status, error in answers:
        if method == "GET" and token is None:  # through the token check, to an engine this server does not have
            assert status == 503 and "no engine" in error, (method, path, token, status, error)
        else:
            assert status == 503 and "BATCHLENS_ADMIN_TOKEN" in error, (method, path, token, status, error)
    said = [line for line in (done.stdout + done.stderr).splitlines() if "BATCHLENS_ADMIN_TOKEN is not set" in line]
    assert len(said) == 1 and "the admin API answers 503" in said[0], said


GUARD = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(message)s", stream=sys.stdout)
    import vllm.v1.core.sched.scheduler as sched
    from fastapi import FastAPI

    class Release010(sched.Scheduler):  # the shape of vLLM 0.10-0.31: no admission field
        def __init__(self):
            self.max_num_running_reqs = 1
        def schedule(self):
            return len(self.running) == self.max_num_running_reqs

    class Unknown(Release010):  # and a release where another method also reads the slot count
        def make_stats(self):
            return self.max_num_running_reqs

    sched.Scheduler = {"as-is": sched.Scheduler, "running-cap": Release010, "unknown": Unknown}[sys.argv[1]]
    from batchlens.vllm_plugin import endpoint, register
    from vllm.v1.engine.core import EngineCore
    register()
    app = FastAPI()
    plugin = endpoint()
    plugin.attach_router(app)
    routes = sorted(r.path for r in app.routes if "batchlens" in getattr(r, "path", ""))
    print("RESULT", hasattr(EngineCore, "batchlens_batch"), plugin.support.mechanism, routes)
    if plugin.support.refusal:  # refused: the routes say why, to anyone, and change nothing
        import asyncio
        from starlette.testclient import TestClient
        asyncio.run(plugin.init_state(None, app.state, None))
        reply = TestClient(app).put("/batchlens/v1/batch", json={"max_num_active_seqs": 4})
        print("REFUSED", reply.status_code, reply.json()["error"])
    """
)


@pytest.mark.parametrize(
    ("case", "mechanism", "said"),
    [
        ("as-is", "max_num_active_reqs", None),
        ("running-cap", "running_cap", None),
        (
            "unknown",
            None,
            "vLLM 0.32.0: Scheduler has no max_num_active_reqs, and max_num_running_reqs is also read by "
            "Scheduler.make_stats, so it cannot be lowered for admission alone.",
        ),
    ],
)
def test_the_plugin_picks_the_mechanism_the_scheduler_offers_or_refuses(vllm_plugin_env, case, mechanism, said) -> None:
    """The plugin's own entry points in the real vLLM environment, with the scheduler's shape changed."""
    env = {**os.environ, **vllm_plugin_env}
    done = subprocess.run([str(vllm_python()), "-c", GUARD, case], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    # Refused or not, the routes are there: refused, they answer 501 with the reason.
    routes = str(sorted([*[BATCH_PATH, ADMISSION_PATH] * 2, INFO_PATH, CACHE_RESET_PATH]))
    assert result == f"RESULT {mechanism is not None} {mechanism} {routes}"
    output = (done.stdout + done.stderr).splitlines()
    refusals = [line for line in output if "batchlens: admin API not installed" in line]
    if said:
        assert len(refusals) == 1 and said in refusals[0], output[-20:]
        answer = next(line for line in done.stdout.splitlines() if line.startswith("REFUSED"))
        assert answer.startswith("REFUSED 501 the batchlens plugin refused this vLLM: ") and said[:-1] in answer, answer
    else:
        assert refusals == []


MIDDLEWARE_APP = textwrap.dedent(
    """
    import asyncio, json, os, time, urllib.request
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from batchlens.vllm_plugin.middleware import AdminMiddleware

    class EngineCoreClient:  # the engine process: the only fake here (the matrix runs the real one)
        def __init__(self):
            self.limit, self.calls = 32, []
        async def call_utility_async(self, method, *args):
            self.calls.append((method, args))
            if args:
                self.limit = args[0]
            if method == "batchlens_info":
                return {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "block_size": 16,
                        "num_gpu_blocks": 100, "admission": "running_cap"}
            return {"engine": 0, "max_num_seqs": 32, "max_num_active_seqs": self.limit, "num_running": 3,
                    "num_waiting": 0}

    class EngineClient:
        engine_core = EngineCoreClient()

    app = FastAPI()  # vLLM's app: one route, and the engine client on its state after startup
    @app.post("/v1/completions")
    async def completions():
        return {"served": "by vLLM"}
    app.add_middleware(AdminMiddleware)  # what vLLM does with --middleware
    auth = {"Authorization": "Bearer " + os.environ["BATCHLENS_ADMIN_TOKEN"]}
    """
)
MIDDLEWARE = MIDDLEWARE_APP + textwrap.dedent(
    """
    client = TestClient(app)
    print("BEFORE", client.get("/batchlens/v1/batch", headers=auth).status_code)
    app.state.engine_client = EngineClient()
    print("NOAUTH", client.put("/batchlens/v1/batch", json={"max_num_active_seqs": 4}).status_code)
    print("PUT", client.put("/batchlens/v1/batch", headers=auth, json={"max_num_active_seqs": 4}).json())
    print("INFO", client.get("/batchlens/v1/info", headers=auth).json())
    print("VLLM", client.post("/v1/completions", json={}).json())
    print("CALLS", EngineClient.engine_core.calls)
    """
)
OWN_PORT = MIDDLEWARE_APP + textwrap.dedent(
    """
    app.state.engine_client = EngineClient()
    own = f"http://127.0.0.1:{os.environ['BATCHLENS_ADMIN_PORT']}/batchlens/v1/batch"
    with TestClient(app) as client:  # runs vLLM's lifespan: the port opens when its startup completes
        print("MAIN", client.get("/batchlens/v1/batch", headers=auth).status_code)
        for _ in range(100):
            try:
                reply = urllib.request.urlopen(urllib.request.Request(own, headers=auth), timeout=2)
                break
            except OSError:
                time.sleep(0.05)
        print("OWN", json.load(reply)["max_num_active_seqs"])
    """
)


def test_the_middleware_serves_the_admin_api_where_vllm_has_no_endpoint_plugins(vllm_plugin_env) -> None:
    """What vLLM 0.10-0.31 run through ``--middleware``, on this environment's FastAPI and Starlette.

    The engine core is faked: it is the same utility call as the endpoint plugin's, and the matrix runs both
    halves on real 0.10.2, 0.11.2 and 0.25.1 servers (docs/compatibility.md).
    """
    env = {**os.environ, **vllm_plugin_env, TOKEN_ENV: "tok"}
    done = subprocess.run([str(vllm_python()), "-c", MIDDLEWARE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert out["BEFORE"] == "503"  # no engine client before vLLM has started
    assert out["NOAUTH"] == "401"
    assert "'max_num_active_seqs': 4" in out["PUT"] and "'num_running': 3" in out["PUT"]
    assert "'api_route': '--middleware'" in out["INFO"] and "'admission': 'running_cap'" in out["INFO"]
    assert out["VLLM"] == "{'served': 'by vLLM'}"  # every other request is vLLM's
    assert out["CALLS"].count("batchlens_batch") == 2 and "('batchlens_batch', (4,))" in out["CALLS"]


PLUGIN_DOOR_APP = MIDDLEWARE_APP + textwrap.dedent(
    """
    from dataclasses import replace
    from types import SimpleNamespace
    from prometheus_client import generate_latest
    import batchlens.vllm_plugin.middleware as mw
    from batchlens.vllm_plugin.compat import PLUGIN_DOOR, plugin_door_refusal
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState

    print("SHAPE", plugin_door_refusal(OutputProcessor, RequestState))  # 0.32's own classes pass the check
    # What the per-request door reads of a request's output, where vLLM keeps it: its max_tokens and its stats.
    from batchlens.vllm_plugin.compat import SchedulerShape
    from batchlens.vllm_plugin.door import seen
    from vllm.v1.metrics.stats import RequestStateStats

    print("OUTPUT", "max_tokens_param" in frozenset().union(*SchedulerShape.of_class(RequestState).methods.values()))
    state = SimpleNamespace(prompt_len=10, is_prefilling=False, max_tokens_param=100, stats=RequestStateStats())
    state.stats.num_generation_tokens = 30
    print("SEEN", tuple(seen(state)), tuple(seen(SimpleNamespace(**{**vars(state), "stats": None}))))
    real = mw.check_installed_vllm  # a release without vLLM's caps: the one stand-in beside the engine client
    mw.check_installed_vllm = lambda: replace(real(), door=PLUGIN_DOOR, caps_refusal="(a release before 0.29)")
    # The API server's request states: 3 of 5 still in prefill, 100 prompt tokens each.
    states = {f"r{i}": SimpleNamespace(prompt_len=100, is_prefilling=i < 3) for i in range(5)}
    engine = EngineClient()
    engine.output_processor = SimpleNamespace(request_states=states)
    engine.model_config = SimpleNamespace(served_model_name=["tiny"])
    app.state.engine_client = engine
    client = TestClient(app)
    put = lambda caps: client.put("/batchlens/v1/admission", headers=auth, json=caps)
    print("OPEN", client.post("/v1/completions", json={}).status_code)
    print("CAP", put({"max_num_queued_tokens": 300, "prefill_tokens_per_second": 100.0}).json())
    refused = client.post("/v1/completions", json={})
    print("TOKENS", refused.status_code, refused.headers.get("retry-after"), json.dumps(refused.json()))
    put({"max_num_queued_tokens": 301, "max_num_queued_reqs": 5})
    refused = client.post("/v1/completions", json={})
    print("REQS", refused.status_code, json.dumps(refused.json()))
    print("PASS", put({"max_num_queued_reqs": 6}).status_code, client.post("/v1/completions", json={}).status_code)
    # Door classes: with 5 unfinished under a cap of 6, a sheddable request meets half of it; a critical one
    # passes a cap of 5 that refuses the standard one.
    priority = lambda value: {"x-batchlens-priority": value}
    print("SHEDDABLE", client.post("/v1/completions", json={}, headers=priority("-1")).status_code)
    put({"max_num_queued_reqs": 5})
    print("CRITICAL", client.post("/v1/completions", json={}, headers=priority("1")).status_code,
          client.post("/v1/completions", json={}, headers=priority("junk")).status_code)
    print("INFO", client.get("/batchlens/v1/info", headers=auth).json())
    lines = generate_latest().decode().splitlines()
    print("COUNTED", sorted(line for line in lines if line.startswith("vllm:admission_rejections_total")))
    print("CLASSES", sorted(line for line in lines if line.startswith("batchlens_door_")))
    # Two API servers of one `vllm serve` (--api-server-count 2): one with 3 prompts of 100 tokens in prefill, the
    # other with none. A cap set through the first holds in the second, and counts the first's tokens.
    import asyncio, os, tempfile
    from batchlens.vllm_plugin.endpoint import AdminService
    from batchlens.vllm_plugin.siblings import open_table

    folder = tempfile.mkdtemp()

    def sibling(index, states):
        client = EngineClient()
        client.output_processor = SimpleNamespace(request_states=states)
        client.model_config = SimpleNamespace(served_model_name=["tiny"])
        table = open_table(index, 2, parent_pid=os.getpid(), directory=folder)
        return AdminService(client, "tok", mw.check_installed_vllm(), None, table)

    async def siblings():
        busy = sibling(0, {f"s{i}": SimpleNamespace(prompt_len=100, is_prefilling=True) for i in range(3)})
        idle = sibling(1, {})
        ticks = [busy.start(), idle.start()]
        await asyncio.sleep(0.1)
        state = await busy.set_admission(b'{"max_num_queued_tokens": 250}', "test")
        print("SHARED", state.api_servers, state.api_servers_behind, state.num_queued_tokens)
        print("SIBLING", idle.refusal(0), idle.refusal(1))
        for tick in ticks:
            tick.cancel()

    asyncio.run(siblings())
    """
)


def test_where_vllm_has_no_queued_caps_the_plugins_door_refuses_by_the_same_rules(vllm_plugin_env) -> None:
    """The plugin's door, as it runs on 0.10-0.28 through ``--middleware``: it counts what vLLM's caps count from
    the API server's request states, answers vLLM's 503 before vLLM sees the request, and counts it in vLLM's
    series; and with two API servers, their shared caps and counts (siblings.py). Faked: the engine client and the
    release's lack of caps; real: this environment's FastAPI and Starlette, and 0.32's own output-processor
    classes for the shape check. The matrix runs it on 0.25.1."""
    env = {**os.environ, **vllm_plugin_env, TOKEN_ENV: "tok"}
    run = [str(vllm_python()), "-c", PLUGIN_DOOR_APP]
    done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert out["SHAPE"] == "None"
    assert out["OUTPUT"] == "True"  # and without stats (--disable-log-stats) the door knows no request's end
    assert out["SEEN"] == "(10, False, 30, 100) (10, False, 0, None)"
    assert out["OPEN"] == "200"  # no cap: the door is open
    assert "'num_queued_tokens': 300" in out["CAP"] and "'num_unfinished_reqs': 5" in out["CAP"], out["CAP"]
    status, retry, body = out["TOKENS"].split(" ", 2)
    assert (status, retry) == ("503", "3")  # 300 tokens in prefill at 100 tokens/s
    assert json.loads(body)["error"]["message"].startswith("The engine has reached its prefill token backlog limit")
    status, body = out["REQS"].split(" ", 1)
    assert status == "503" and "currently busy" in json.loads(body)["error"]["message"]  # 5 unfinished + 1 > 5
    assert out["PASS"] == "200 200"
    assert out["SHEDDABLE"] == "503" and out["CRITICAL"] == "200 503"  # "junk" is standard, never critical
    assert "'door': 'plugin'" in out["INFO"] and "'queued_caps': False" in out["INFO"], out["INFO"]
    counted = out["COUNTED"]
    assert 'model_name="tiny",reason="max_num_queued_tokens"} 1.0' in counted, counted
    assert 'model_name="tiny",reason="max_num_queued_reqs"} 3.0' in counted, counted  # reqs, sheddable, junk
    classes = out["CLASSES"]
    for line in (
        'requests_total{priority_class="standard"} 5.0',
        'requests_total{priority_class="sheddable"} 1.0',
        'requests_total{priority_class="critical"} 1.0',
        'refusals_total{priority_class="standard"} 3.0',
        'refusals_total{priority_class="sheddable"} 1.0',
        'refusals_total{priority_class="critical"} 0.0',
    ):
        assert f"batchlens_door_{line}" in classes, classes
    # Several API servers: the cap set through one is in force in the other, which counts the first's prompts.
    assert out["SHARED"] == "2 [] 300"
    assert out["SIBLING"] == "max_num_queued_tokens None"  # standard refused; critical passes, as on one server


def test_with_an_admin_port_the_middleware_serves_the_admin_api_there_alone(vllm_plugin_env) -> None:
    env = {**os.environ, **vllm_plugin_env, TOKEN_ENV: "tok", PORT_ENV: str(free_port())}
    done = subprocess.run([str(vllm_python()), "-c", OWN_PORT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert (out["MAIN"], out["OWN"]) == ("404", "32")


@pytest.mark.parametrize(
    ("environ", "listen"),
    [
        ({}, AdminListen()),
        ({PORT_ENV: "8001"}, AdminListen(port=8001)),
        ({PORT_ENV: " 8001 ", HOST_ENV: "0.0.0.0"}, AdminListen("0.0.0.0", 8001)),
        ({PORT_ENV: "80x"}, AdminListen(refusal="BATCHLENS_ADMIN_PORT='80x' is not a port (1-65535)")),
        ({PORT_ENV: "0"}, AdminListen(refusal="BATCHLENS_ADMIN_PORT='0' is not a port (1-65535)")),
    ],
)
def test_a_port_that_is_not_one_serves_the_admin_api_nowhere_never_on_vllms_port(environ, listen) -> None:
    assert admin_listen(environ) == listen
    assert admin_listen(environ).separate == bool(environ)
