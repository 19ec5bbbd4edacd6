"""The door on every API server: a real vLLM 0.32 on the CPU started with ``vllm serve``, as users start it.

``vllm serve --data-parallel-size 2`` runs two API server processes on one socket (vLLM's default: one per DP
rank), and two engine cores; ``--api-server-count 2`` runs two API servers before one engine. Each new
connection lands on either. The plugin's caps must hold in both, count the whole server, and /metrics must
count every refusal whichever process answers (batchlens.vllm_plugin.siblings). No fakes.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from batchlens.admin_api import ADMISSION_PATH, BATCH_PATH, INFO_PATH, TOKEN_ENV
from batchlens.vllm_plugin.admin_port import PORT_ENV
from harness.admin import AdminClient, check_concurrent_puts, check_contract, set_caps
from harness.exporter import one, parse_samples
from harness.procs import free_port, http_get
from harness.vllm import ADMIN_TOKEN, DP_SLOTS, VllmServer, start_vllm

pytestmark = pytest.mark.vllm

SLOTS = DP_SLOTS  # --max-num-seqs


def start(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str], *args: str) -> VllmServer:
    return start_vllm(tmp_path_factory.mktemp("vllm-serve"), env={**env, TOKEN_ENV: ADMIN_TOKEN}, serve=True,
                      max_num_seqs=SLOTS, memory_fraction=0.1, extra_args=args)  # fmt: skip


def completion(server: VllmServer, prompt_tokens: int, max_tokens: int) -> int:
    """One completion on a fresh connection: its HTTP status."""
    body = {"model": server.model, "prompt": [3] * prompt_tokens, "max_tokens": max_tokens, "ignore_eos": True}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def counted(server: VllmServer) -> list[tuple[float, float, float]]:
    """Six scrapes of /metrics, each on a fresh connection (so from either API server): vLLM's refusals, the
    door's refusals and its arrivals, as each scrape reads them."""
    scrapes = []
    for _ in range(6):
        samples = parse_samples(server.metrics_text())
        scrapes.append((
            sum(v for k, v in samples.items() if k[0] == "vllm:admission_rejections_total"),
            one(samples, "batchlens_door_refusals_total", priority_class="standard"),
            one(samples, "batchlens_door_requests_total", priority_class="standard"),
        ))  # fmt: skip
    return scrapes


def test_one_put_sets_both_caps_in_every_api_server(vllm_dp_server: VllmServer) -> None:
    """And the batch limit reaches both engine cores (the contract, through vLLM's port: either API server)."""
    admin = AdminClient(vllm_dp_server.url, vllm_dp_server.admin_token)
    check_contract(admin, SLOTS)
    state = admin.set_limit(3)
    assert [(e.engine, e.max_num_active_seqs) for e in state.engines] == [(0, 3), (1, 3)]
    check_concurrent_puts(admin, SLOTS)  # through both API servers: one order for both engine cores
    admin.set_limit(SLOTS)
    reply = set_caps(admin, max_num_queued_tokens=4096, max_num_queued_reqs=64)
    assert (reply["api_servers"], reply["api_servers_behind"]) == (2, []), reply
    seen = [json.loads(http_get(vllm_dp_server.url + ADMISSION_PATH)[1]) for _ in range(12)]  # fresh connections
    assert {(s["max_num_queued_tokens"], s["max_num_queued_reqs"], s["api_servers"]) for s in seen} == {(4096, 64, 2)}
    log = vllm_dp_server.process.log_path.read_text(errors="replace")
    for index in (0, 1):
        assert f"API server {index} of 2: the queued caps and counts are shared" in log
    set_caps(admin, max_num_queued_tokens=None, max_num_queued_reqs=None)


def test_a_request_cap_holds_over_every_api_server_and_each_scrape_counts_it(
    vllm_dp_server: VllmServer,
) -> None:
    admin = AdminClient(vllm_dp_server.url, vllm_dp_server.admin_token)
    before = counted(vllm_dp_server)[0]
    set_caps(admin, max_num_queued_reqs=2)
    try:
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda _: completion(vllm_dp_server, 32, 300), range(16)))
    finally:
        set_caps(admin, max_num_queued_reqs=None)
    admitted, refused = statuses.count(200), statuses.count(503)
    assert admitted + refused == 16 and 1 <= admitted <= 4, statuses  # per process it would be up to 2 each
    for vllm_refusals, door_refusals, arrivals in counted(vllm_dp_server):
        assert (vllm_refusals - before[0], door_refusals - before[1], arrivals - before[2]) == (refused, refused, 16)


def test_the_token_cap_counts_the_whole_servers_queued_prompt_tokens(vllm_dp_server: VllmServer) -> None:
    """One running request per engine core holds the batch (limit 1); then 100-token prompts one at a time: with
    a cap of 250 queued prompt tokens, the server takes 3 (0, 100, 200 queued before each) and refuses the rest,
    whichever API server each lands on. Counted per process, as vLLM counts, it would take 3 per process."""
    admin = AdminClient(vllm_dp_server.url, vllm_dp_server.admin_token)
    admin.set_limit(1)
    pool = ThreadPoolExecutor(10)
    try:
        blockers = []
        for running in (1, 2):  # one at a time, so that vLLM's balancer gives each engine core one
            blockers.append(pool.submit(completion, vllm_dp_server, 16, 1200))
            until(lambda n=running: sorted(e.num_running for e in admin.state().engines) == [n - 1, 1], admin)
            time.sleep(0.5)  # the DP coordinator's counts reach both API servers' balancers
        until(lambda: state(admin)["num_queued_tokens"] == 0, admin)  # both past their prefill
        set_caps(admin, max_num_queued_tokens=250)
        statuses = []
        for sent in range(1, 9):
            waiter = pool.submit(completion, vllm_dp_server, 100, 1)
            taken = 2 + statuses.count(200) + 1  # the blockers, those admitted, and this one
            until(lambda w=waiter, n=taken: w.done() or state(admin)["num_unfinished_reqs"] == n, admin)
            statuses.append(waiter.result() if waiter.done() else 200)
            assert len(statuses) == sent
        queued = state(admin)
    finally:
        set_caps(admin, max_num_queued_tokens=None)
        admin.set_limit(SLOTS)
        pool.shutdown(wait=True)
    assert statuses == [200, 200, 200, 503, 503, 503, 503, 503], statuses
    assert queued["num_queued_tokens"] == 300, queued
    assert [b.result() for b in blockers] == [200, 200]
    # The gaps between arrivals are the server's: one fewer than its arrivals, whichever process took each.
    samples = parse_samples(vllm_dp_server.metrics_text())
    arrivals = sum(v for k, v in samples.items() if k[0] == "batchlens_door_requests_total")
    assert one(samples, "batchlens_request_interarrival_seconds_count") == arrivals - 1


def state(admin: AdminClient) -> dict:
    status, reply = admin.request("GET", ADMISSION_PATH)
    assert status == 200, reply
    return reply


def until(predicate, admin: AdminClient, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {timeout:.0f}s: {state(admin)}")
        time.sleep(0.05)


def test_with_an_admin_port_one_api_server_serves_it_and_its_caps_hold_in_all(
    tmp_path_factory: pytest.TempPathFactory, vllm_plugin_env: dict[str, str]
) -> None:
    """``--api-server-count 2`` and BATCHLENS_ADMIN_PORT: API server 0 binds the port (the other says so), and
    a request cap set there holds for the requests that land on either."""
    port = free_port()
    server = start(tmp_path_factory, {**vllm_plugin_env, PORT_ENV: str(port)}, "--api-server-count", "2")
    try:
        admin = AdminClient(f"http://127.0.0.1:{port}", server.admin_token)
        # vLLM's /health can answer (from API server 1) before API server 0 has opened the admin port.
        server.process.wait_http(admin.url + INFO_PATH, timeout=60)
        assert http_get(server.url + BATCH_PATH)[0] == 404  # vLLM's port, on either process
        reply = set_caps(admin, max_num_queued_reqs=2)
        assert (reply["api_servers"], reply["api_servers_behind"]) == (2, []), reply
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda _: completion(server, 32, 300), range(16)))
        assert 1 <= statuses.count(200) <= 4 and statuses.count(503) >= 12, statuses
        log = server.process.log_path.read_text(errors="replace")
        assert "API server 1 of 2: the admin API's own port is API server 0's" in log
        assert log.count("batchlens: admin API on its own port") == 1
    finally:
        server.process.stop()
