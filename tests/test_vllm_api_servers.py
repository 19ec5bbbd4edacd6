"""The door on every API server, the ranks of a deployment over two nodes, and the controller steering: a real
vLLM 0.32 on the CPU started with ``vllm serve`` as users start it, in two layouts that run several API server
processes on one socket:

- ``--data-parallel-size 2``: vLLM's default of one API server per DP rank, two engine cores;
- vLLM's multi-node recipe on loopback: a head (``--data-parallel-size 2 --data-parallel-size-local 1
  --api-server-count 2``, with BATCHLENS_ADMIN_PORT: API server 0 serves the admin API on its own port) and a
  ``--headless --data-parallel-start-rank 1`` process holding rank 1 with no API server;
- and, in `make vllm-matrix` only (marker ``matrix``: a third server would cost make test a minute and a half of
  its 15), ``--api-server-count 2`` with BATCHLENS_ADMIN_PORT and one engine core.

Each new connection lands on either API server. The plugin's caps must hold in both, count the whole server, and
/metrics must count every refusal whichever process answers (batchlens.vllm_plugin.siblings). The controller's
scenario is tests/harness/control_vllm.py's: how good its goodput is against the best static limit is a figure,
printed by benchmarks/control_vllm.py in make bench. No fakes but the headless node's GPU (the fake NVML).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import pytest

from batchlens.admin_api import ADMISSION_PATH, BATCH_PATH, INFO_PATH, TOKEN_ENV
from batchlens.exporter.nvml_source import NvmlSource
from batchlens.vllm_plugin.admin_port import PORT_ENV
from harness.admin import AdminClient, check_concurrent_puts, check_contract, set_caps
from harness.control_vllm import bursty_trace, steer
from harness.exporter import one, parse_samples
from harness.fake_pynvml import GIB, FakeNvml, FakeProcess, h100_sxm
from harness.procs import Process, free_port, http_get, wait_until
from harness.vllm import ADMIN_TOKEN, DP_SLOTS, VllmServer, door_counts, launch_vllm, start_vllm

pytestmark = pytest.mark.vllm

SLOTS = DP_SLOTS  # --max-num-seqs


@dataclass(frozen=True)
class Served:
    """A server of two API servers and two engine cores, and where its admin API answers: vLLM's port, or its
    own; ``headless``: the process of the rank on the other "node", where there is one."""

    server: VllmServer
    admin: AdminClient
    headless: Process | None = None
    engines: int = 2


@pytest.fixture(scope="module", params=["dp2", "head_and_headless", pytest.param("api2", marks=pytest.mark.matrix)])
def served(request, tmp_path_factory: pytest.TempPathFactory, vllm_plugin_env: dict[str, str]) -> Iterator[Served]:
    env, workdir = {**vllm_plugin_env, TOKEN_ENV: ADMIN_TOKEN}, tmp_path_factory.mktemp(f"vllm-{request.param}")
    port = free_port()
    if request.param != "head_and_headless":
        one_node = {"dp2": ("--data-parallel-size", "2"), "api2": ("--api-server-count", "2")}[request.param]
        own_port = {PORT_ENV: str(port)} if request.param == "api2" else {}
        server = start_vllm(workdir, env={**env, **own_port}, serve=True, max_num_seqs=SLOTS, memory_fraction=0.1,
                            extra_args=one_node)  # fmt: skip
        try:
            admin = AdminClient(f"http://127.0.0.1:{port}" if own_port else server.url, server.admin_token)
            server.process.wait_http(admin.url + INFO_PATH, timeout=60)  # API server 0 may open its port last
            yield Served(server, admin, engines=1 if own_port else 2)
        finally:
            server.process.stop()
        return
    rpc = free_port()
    dp = ("--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
          "--data-parallel-rpc-port", str(rpc))  # fmt: skip
    headless, _, _ = launch_vllm(workdir / "node-2", env=env, max_num_seqs=SLOTS, memory_fraction=0.1,
                                 extra_args=(*dp, "--data-parallel-start-rank", "1"), headless=True)  # fmt: skip
    try:
        server = start_vllm(workdir / "head", env={**env, PORT_ENV: str(port)}, serve=True, max_num_seqs=SLOTS,
                            memory_fraction=0.1, extra_args=(*dp, "--api-server-count", "2"))  # fmt: skip
        try:
            admin = AdminClient(f"http://127.0.0.1:{port}", server.admin_token)
            # vLLM's /health can answer (from API server 1) before API server 0 has opened the admin port.
            server.process.wait_http(admin.url + INFO_PATH, timeout=60)
            yield Served(server, admin, headless)
        finally:
            server.process.stop()
    finally:
        headless.stop()


def test_one_put_sets_both_caps_in_every_api_server(served: Served) -> None:
    """And the batch limit reaches every engine core, the headless node's too (the contract, through either API
    server where vLLM's port serves the admin API; through API server 0 alone where its own port does, and
    vLLM's port then has none)."""
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
        said = "API server 1 of 2: the admin API's own port is API server 0's"
        wait_until(lambda: said in server.process.log_path.read_text(errors="replace"), timeout=60, what=said)
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


def test_the_per_request_door_judges_on_every_api_server(served: Served) -> None:
    """One PUT of the door's bound reaches every API server; each learns its rates from its own requests (8 first
    tokens: 40 requests leave either with fewer one time in 10^5). Then every engine core's one slot is held and
    8 requests, spread over the API servers by their fresh connections, wait for one. At a bound no request can
    meet, each API server's second look refuses the waiting ones it took, and neither lets a new one through;
    each refusal is counted once, whichever process is scraped."""
    admin, server = served.admin, served.server
    before = door_counts(server)[0]
    set_caps(admin, max_predicted_ttft_seconds=3600)
    pool = ThreadPoolExecutor(12)
    try:
        assert set(pool.map(lambda _: server.status(32, 4), range(40))) == {200}
        admin.set_limit(1)
        blockers = hold_every_engine(served, pool)
        waiting = [pool.submit(server.status, 32, 4) for _ in range(8)]
        until(lambda: state(admin)["num_unfinished_reqs"] == served.engines + 8, admin)
        set_caps(admin, max_predicted_ttft_seconds=0.001)
        queued = [future.result(timeout=60) for future in waiting]
        statuses = [server.status(32, 4) for _ in range(16)]
    finally:
        set_caps(admin, max_predicted_ttft_seconds=None)
        admin.set_limit(SLOTS)
        pool.shutdown(wait=True)
    assert queued == [503] * 8 and statuses == [503] * 16, (queued, statuses)
    assert [b.result() for b in blockers] == [200] * served.engines  # running: not the door's to refuse
    arrived = 40 + served.engines + 8 + 16
    for vllm_refusals, door_refusals, arrivals in door_counts(server):
        assert (vllm_refusals - before[0], door_refusals - before[1], arrivals - before[2]) == (24, 24, arrived)


def test_the_token_cap_counts_the_whole_servers_queued_prompt_tokens(served: Served) -> None:
    """One running request per engine core holds the batch (limit 1); then 100-token prompts one at a time: with
    a cap of 250 queued prompt tokens, the server takes 3 (0, 100, 200 queued before each) and refuses the rest,
    whichever API server each lands on. Counted per process, as vLLM counts, it would take 3 per process."""
    admin, server, engines = served.admin, served.server, served.engines
    admin.set_limit(1)
    pool = ThreadPoolExecutor(10)
    try:
        blockers = hold_every_engine(served, pool)
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


def hold_every_engine(served: Served, pool: ThreadPoolExecutor) -> list:
    """One long request running on each engine core (the limit set to 1 first), past its prefill: the futures.
    Long: 800 output tokens ended within the token cap's test on a quiet two-core machine (1 run in 3)."""
    admin, engines = served.admin, served.engines
    blockers = []
    for running in range(1, engines + 1):  # one at a time, so that vLLM's balancer gives each engine core one
        blockers.append(pool.submit(served.server.status, 16, 2000))
        busy = sorted([0] * (engines - running) + [1] * running)
        until(lambda b=busy: sorted(e.num_running for e in admin.state().engines) == b, admin)
        time.sleep(0.5)  # the DP coordinator's counts reach both API servers' balancers
    until(lambda: state(admin)["num_queued_tokens"] == 0, admin)  # all past their prefill
    return blockers


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


@pytest.mark.parametrize("served", ["head_and_headless"], indirect=True)
def test_the_headless_nodes_exporter_maps_its_gpu_to_the_engine_and_rank(served: Served) -> None:
    """The exporter on the headless "node" (exporter.headless_engine) maps a GPU of that real engine core, found by
    its title ``VLLM::EngineCore_DP1``, to the engine and to rank 1 (the GPU is the fake NVML's)."""
    rank_1 = next(p for p in psutil.Process(served.headless.proc.pid).children(recursive=True)
                  if p.cmdline()[:1] == ["VLLM::EngineCore_DP1"])  # fmt: skip
    gpu = h100_sxm(0, processes=[FakeProcess(rank_1.pid, 70 * GIB)])
    source = NvmlSource([], nvml=FakeNvml([gpu]).module(), headless_engine="deepseek")
    try:
        reading = source.sample_now({})
    finally:
        source.close()
    [sample] = next(m.samples for m in reading.metrics if m.name == "batchlens_gpu_info")
    assert {k: sample.labels.get(k) for k in ("vllm_instance", "dp_rank")} == {"vllm_instance": "deepseek",
                                                                              "dp_rank": "1"}  # fmt: skip
