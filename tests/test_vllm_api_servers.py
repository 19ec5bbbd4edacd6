"""The door on every API server, and the controller steering: a real vLLM 0.32 on the CPU started with
``vllm serve`` as users start it, in two layouts that run several API server processes on one socket:
``--data-parallel-size 2`` (vLLM's default: one API server per DP rank, and two engine cores), and one engine
core with ``--api-server-count 2`` and BATCHLENS_ADMIN_PORT (API server 0 serves the admin API on its own port).
Each new connection lands on either API server. The plugin's caps must hold in both, count the whole server,
and /metrics must count every refusal whichever process answers (batchlens.vllm_plugin.siblings). The
controller's scenario is tests/harness/control_vllm.py's: how good its goodput is against the best static limit
is a figure, printed by benchmarks/control_vllm.py in make bench. No fakes. The multi-node recipe (a head and a
``--headless`` rank) is tests/test_vllm_headless.py's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from batchlens.admin_api import ADMISSION_PATH, BATCH_PATH, INFO_PATH, TOKEN_ENV
from batchlens.vllm_plugin.admin_port import PORT_ENV
from harness.admin import AdminClient, check_concurrent_puts, check_contract, set_caps
from harness.control_vllm import bursty_trace, steer
from harness.exporter import one, parse_samples
from harness.procs import free_port, http_get
from harness.vllm import ADMIN_TOKEN, DP_SLOTS, VllmServer, door_counts, start_vllm

pytestmark = pytest.mark.vllm

SLOTS = DP_SLOTS  # --max-num-seqs
LAYOUTS = {"dp2": ("--data-parallel-size", "2"), "api2": ("--api-server-count", "2")}


@dataclass(frozen=True)
class Served:
    """A server of two API servers, and where its admin API answers: vLLM's port, or its own."""

    server: VllmServer
    admin: AdminClient
    engines: int


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, tmp_path_factory: pytest.TempPathFactory, vllm_plugin_env: dict[str, str]) -> Iterator[Served]:
    env = {**vllm_plugin_env, TOKEN_ENV: ADMIN_TOKEN}
    admin_port = free_port() if request.param == "api2" else None
    if admin_port:
        env[PORT_ENV] = str(admin_port)
    server = start_vllm(tmp_path_factory.mktemp(f"vllm-{request.param}"), env=env, serve=True, max_num_seqs=SLOTS,
                        memory_fraction=0.1, extra_args=LAYOUTS[request.param])  # fmt: skip
    try:
        admin = AdminClient(server.url, server.admin_token)
        if admin_port:
            admin = AdminClient(f"http://127.0.0.1:{admin_port}", server.admin_token)
            # vLLM's /health can answer (from API server 1) before API server 0 has opened the admin port.
            server.process.wait_http(admin.url + INFO_PATH, timeout=60)
        yield Served(server, admin, engines=2 if request.param == "dp2" else 1)
    finally:
        server.process.stop()


def test_one_put_sets_both_caps_in_every_api_server(served: Served) -> None:
    """And the batch limit reaches every engine core (the contract, through either API server where vLLM's port
    serves the admin API; through API server 0 alone where its own port does, and vLLM's port then has none)."""
    admin, server = served.admin, served.server
    check_contract(admin, SLOTS)
    state = admin.set_limit(3)
    assert [(e.engine, e.max_num_active_seqs) for e in state.engines] == [(n, 3) for n in range(served.engines)]
    check_concurrent_puts(admin, SLOTS)  # one order for every engine core
    admin.set_limit(SLOTS)
    reply = set_caps(admin, max_num_queued_tokens=4096, max_num_queued_reqs=64)
    assert (reply["api_servers"], reply["api_servers_behind"]) == (2, []), reply
    seen = [json.loads(http_get(admin.url + ADMISSION_PATH)[1]) for _ in range(12)]  # fresh connections
    assert {(s["max_num_queued_tokens"], s["max_num_queued_reqs"], s["api_servers"]) for s in seen} == {(4096, 64, 2)}
    log = server.process.log_path.read_text(errors="replace")
    for index in (0, 1):
        assert f"API server {index} of 2: the queued caps and counts are shared" in log
    if admin.url != server.url:
        assert http_get(server.url + BATCH_PATH)[0] == 404  # vLLM's port, on either process
        assert "API server 1 of 2: the admin API's own port is API server 0's" in log
        assert log.count("batchlens: admin API on its own port") == 1
    set_caps(admin, max_num_queued_tokens=None, max_num_queued_reqs=None)


def test_a_request_cap_holds_over_every_api_server_and_each_scrape_counts_it(served: Served) -> None:
    admin, server = served.admin, served.server
    before = door_counts(server)[0]
    set_caps(admin, max_num_queued_reqs=2)
    try:
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda _: server.status(32, 128), range(16)))
    finally:
        set_caps(admin, max_num_queued_reqs=None)
    admitted, refused = statuses.count(200), statuses.count(503)
    assert admitted + refused == 16 and 1 <= admitted <= 4, statuses  # per process it would be up to 2 each
    for vllm_refusals, door_refusals, arrivals in door_counts(server):
        assert (vllm_refusals - before[0], door_refusals - before[1], arrivals - before[2]) == (refused, refused, 16)


def test_the_token_cap_counts_the_whole_servers_queued_prompt_tokens(served: Served) -> None:
    """One running request per engine core holds the batch (limit 1); then 100-token prompts one at a time: with
    a cap of 250 queued prompt tokens, the server takes 3 (0, 100, 200 queued before each) and refuses the rest,
    whichever API server each lands on. Counted per process, as vLLM counts, it would take 3 per process."""
    admin, server, engines = served.admin, served.server, served.engines
    admin.set_limit(1)
    pool = ThreadPoolExecutor(10)
    try:
        blockers = []
        for running in range(1, engines + 1):  # one at a time, so that vLLM's balancer gives each engine core one
            blockers.append(pool.submit(server.status, 16, 800))
            busy = sorted([0] * (engines - running) + [1] * running)
            until(lambda b=busy: sorted(e.num_running for e in admin.state().engines) == b, admin)
            time.sleep(0.5)  # the DP coordinator's counts reach both API servers' balancers
        until(lambda: state(admin)["num_queued_tokens"] == 0, admin)  # all past their prefill
        set_caps(admin, max_num_queued_tokens=250)
        statuses = []
        for sent in range(1, 9):
            waiter = pool.submit(server.status, 100, 1)
            taken = engines + statuses.count(200) + 1  # the blockers, those admitted, and this one
            until(lambda w=waiter, n=taken: w.done() or state(admin)["num_unfinished_reqs"] == n, admin)
            statuses.append(waiter.result() if waiter.done() else 200)
            assert len(statuses) == sent
            time.sleep(0.1)  # its count reaches the other API server within a tick (25 ms): not the same instant
        queued = state(admin)
    finally:
        set_caps(admin, max_num_queued_tokens=None)
        admin.set_limit(SLOTS)
        pool.shutdown(wait=True)
    assert statuses == [200, 200, 200, 503, 503, 503, 503, 503], statuses
    assert queued["num_queued_tokens"] == 300, queued
    assert [b.result() for b in blockers] == [200] * engines
    # The gaps between arrivals are the server's: one fewer than its arrivals, whichever process took each.
    samples = parse_samples(server.metrics_text())
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


# The controller's scenario (tests/harness/control_vllm.py): the cold start shows in the first bursts, and 20 s
# of them (40 ticks) is enough to see the limit climb. TINY is below what any machine here serves at the
# scenario's SLO (from the benchmark's 12 a slower CI machine's controller rightly went down first: 12 -> 7 -> 11).
SECONDS, TINY = 20, 4


@pytest.mark.parametrize("served", ["dp2"], indirect=True)
def test_the_controller_steers_a_data_parallel_vllm_as_one_engine_limit_and_door(tmp_path, served: Served) -> None:
    """``vllm serve --data-parallel-size 2`` (two engine cores, two API servers): the controller makes one
    decision a tick for the server, for the limit and for the door; both engine cores hold the same limit at
    every scrape (harness.control_vllm.watch_limit), and it moves up from a small one."""
    trace, count = bursty_trace(tmp_path, seconds=SECONDS)
    steered = steer(tmp_path / "steered", served.server, trace, start=TINY, capacity=DP_SLOTS, admission=True)
    print(steered)
    seen = steered.limits_seen
    assert seen and seen[0] <= TINY < max(seen), f"the exporter never saw the controller move the limit up: {seen}"
    assert steered.moves > 0, "the controller never moved the limit"
    decided = {}
    for (name, labels), value in steered.decisions.items():
        if name == "batchlens_controller_decisions_total":
            labels = dict(labels)
            door = labels["reason"].startswith("admission_")
            decided[(labels["vllm_instance"], door)] = decided.get((labels["vllm_instance"], door), 0) + value
    assert set(decided) == {("cpu", False), ("cpu", True)}, decided  # one engine, whatever its ranks
    limit_ticks, door_ticks = decided[("cpu", False)], decided[("cpu", True)]
    assert limit_ticks > 10 and abs(limit_ticks - door_ticks) <= 2, decided  # one of each a tick
    accounting = steered.accounting
    assert accounting["sent"] == accounting["answered"] + sum(accounting["refused"].values()) == count, accounting
    assert not accounting["failed"], accounting
    assert served.server.complete(max_tokens=4)["usage"]["completion_tokens"] == 4
