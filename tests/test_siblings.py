"""The table the API servers of one vLLM server share (batchlens.vllm_plugin.siblings): pure, over a buffer, and
over the real shared file from two real processes. The real ``vllm serve`` with two API servers is in
tests/test_vllm_api_servers.py."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchlens.admin_api import AdmissionState
from batchlens.queued_caps import refusal
from batchlens.vllm_plugin.siblings import (
    NONCES,
    STALE_NS,
    Caps,
    SiblingTable,
    open_table,
    private_table,
    size,
    table_path,
)

NONE = Caps(0, None, None, None)


def pair() -> tuple[SiblingTable, SiblingTable]:
    buffer = memoryview(bytearray(size(2)))
    return private_like(buffer, 0), private_like(buffer, 1)


def private_like(buffer: memoryview, index: int) -> SiblingTable:
    return SiblingTable(buffer, index, 2)


def test_a_cap_set_through_one_sibling_is_what_every_sibling_reads() -> None:
    first, second = pair()
    assert second.caps() == NONE  # a fresh table: no caps, each process keeps its command line's
    first.set_caps({"max_num_queued_reqs": 2}, Caps(0, 5000, None, None))
    assert second.caps() == Caps(1, 5000, 2, None)  # the writer's own token cap carried over, not lost
    second.set_caps({"max_num_queued_tokens": None, "prefill_tokens_per_second": 812.5}, Caps(0, 1, 1, None))
    assert first.caps() == Caps(2, None, 2, 812.5)  # once written, the table's caps are the base, not the writer's
    first.set_caps({"max_num_queued_reqs": 0}, NONE)
    assert second.caps().max_num_queued_reqs == 0  # 0 is a cap (vLLM's "refuse all"), not "none"
    second.set_caps({"max_predicted_ttft_seconds": 0.625}, NONE)  # the per-request door's bound, shared alike
    assert first.caps() == Caps(4, None, 0, 812.5, 0.625)
    first.set_caps({"max_predicted_ttft_seconds": None}, NONE)
    assert second.caps().max_predicted_ttft_seconds is None
    assert second.slots() is None  # no batch read yet: the door predicts no slot wait
    first.set_slots(64)  # a batch read through one sibling: every sibling's door counts against it
    assert second.slots() == 64 and second.caps() == first.caps()  # beside the caps, never over them


def test_the_totals_are_this_process_live_and_the_others_published_while_they_tick() -> None:
    first, second = pair()
    now = 10 * STALE_NS
    second.publish(700, 3, applied=0, now_ns=now)
    assert first.totals(100, 1, now) == (800, 4)
    assert second.totals(5, 0, now) == (5, 0)  # its own published values are never counted twice
    assert first.totals(100, 1, now + STALE_NS) == (100, 1)  # a sibling gone silent holds no requests


def test_behind_names_the_siblings_without_the_caps_in_force() -> None:
    first, second = pair()
    now = 10 * STALE_NS
    generation = first.set_caps({"max_num_queued_reqs": 2}, NONE).generation
    first.publish(0, 0, generation, now)
    assert first.behind(generation, now) == [1]  # never ticked: started without the plugin, or not yet
    second.publish(0, 0, generation - 1, now)
    assert first.behind(generation, now) == [1]
    second.publish(0, 0, generation, now)
    assert first.behind(generation, now) == []


def test_the_gap_is_measured_from_the_last_arrival_at_any_sibling() -> None:
    first, second = pair()
    assert first.swap_last_arrival(1_000) is None
    assert second.swap_last_arrival(1_500) == 1_000
    assert first.swap_last_arrival(1_700) == 1_500


def test_a_table_of_something_else_or_too_small_is_refused() -> None:
    buffer = bytearray(size(2))
    buffer[:8] = (12345).to_bytes(8, "little")
    with pytest.raises(ValueError, match="something else"):
        private_like(memoryview(buffer), 0)
    with pytest.raises(ValueError, match="needs"):
        SiblingTable(memoryview(bytearray(size(1))), 0, 2)
    with pytest.raises(ValueError, match=r"not in 0\.\.1"):
        private_like(memoryview(bytearray(size(2))), 2)


def _sibling(directory: str, parent: int, queue: multiprocessing.Queue) -> None:
    table = open_table(1, 2, parent_pid=parent, directory=directory)
    table.publish(42, 1, 0, 10 * STALE_NS)
    queue.put(table.caps().max_num_queued_tokens)


def test_two_processes_share_one_file_named_for_their_parent(tmp_path: Path) -> None:
    """A real second process (spawned, as vLLM spawns its API servers) maps the same file by the parent's PID."""
    first = open_table(0, 2, parent_pid=os.getpid(), directory=str(tmp_path))
    first.set_caps({"max_num_queued_tokens": 4096}, NONE)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_sibling, args=(str(tmp_path), os.getpid(), queue))
    child.start()
    child.join(60)
    assert queue.get(timeout=5) == 4096
    assert first.totals(0, 0, 10 * STALE_NS) == (42, 1)
    assert table_path(os.getpid(), str(tmp_path)).name.startswith(f"batchlens-siblings-{os.getpid()}-")
    assert private_table().count == 1


def test_a_change_waits_for_the_sibling_that_holds_the_lock_without_blocking_its_loop(tmp_path: Path) -> None:
    first = open_table(0, 2, parent_pid=os.getpid(), directory=str(tmp_path))
    second = open_table(1, 2, parent_pid=os.getpid(), directory=str(tmp_path))  # its own open file: a sibling's
    order = []

    async def change(table: SiblingTable, name: str, hold: float) -> None:
        async with table.exclusive():
            order.append(f"{name} in")
            await asyncio.sleep(hold)
            order.append(f"{name} out")

    async def both() -> None:
        await asyncio.gather(change(first, "first", 0.1), change(second, "second", 0))

    asyncio.run(both())
    assert order == ["first in", "first out", "second in", "second out"]


@pytest.mark.parametrize("servers", [1, 2, 4])
def test_the_token_cap_is_the_whole_servers_on_any_number_of_api_servers(servers: int) -> None:
    """100-token prompts, each landing on the next API server, against a cap of 250 queued prompt tokens by
    vLLM's rule: the server takes 3 however many API servers share it (counted per process: 3 on each)."""
    buffer = memoryview(bytearray(size(servers)))
    tables = [SiblingTable(buffer, index, servers) for index in range(servers)]
    own = [0] * servers
    admitted = 0
    for request in range(12):
        table = tables[request % servers]
        tokens, unfinished = table.totals(own[table.index], 0, STALE_NS)
        state = AdmissionState(max_num_queued_tokens=250, num_queued_tokens=tokens, num_unfinished_reqs=unfinished)
        if refusal(state) is None:
            own[table.index] += 100
            table.publish(own[table.index], 0, 0, STALE_NS)
            admitted += 1
    assert admitted == 3


def test_a_signed_call_taken_by_one_sibling_is_a_replay_to_every_other(tmp_path: Path) -> None:
    first = open_table(0, 2, parent_pid=os.getpid(), directory=str(tmp_path))
    second = open_table(1, 2, parent_pid=os.getpid(), directory=str(tmp_path))
    assert first.remember("ab" * 16, until=1_000, now=900.0) is None
    assert second.remember("ab" * 16, until=1_000, now=950.0) == "replay"
    assert second.remember("cd" * 16, until=1_000, now=950.0) is None
    assert first.remember("ab" * 16, until=2_000, now=1_001.0) is None  # its time past: forgotten, as it may be


def test_past_its_bound_the_shared_memory_of_signed_calls_refuses_rather_than_forgets() -> None:
    table = private_table(0, 2)
    for n in range(NONCES):
        assert table.remember(f"{n:032x}", until=10_000, now=1.0) is None
    assert table.remember("ff" * 16, until=10_000, now=1.0) == "full"
    assert table.remember(f"{0:032x}", until=10_000, now=1.0) == "replay"  # still remembered, never dropped


def test_api_server_0_removes_the_tables_that_killed_servers_left_behind(tmp_path: Path) -> None:
    """A server killed before its atexit ran leaves its table in /dev/shm; the next server's API server 0 removes
    it (its vllm serve process is gone, or its PID is another process's now), and no live server's."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"batchlens-siblings-{dead.pid}-12345"
    reused = tmp_path / f"batchlens-siblings-{os.getpid()}-1"  # this PID, another start time: another server
    live = table_path(os.getppid(), str(tmp_path))
    for path in (gone, reused, live):
        path.write_bytes(b"\0" * 64)
    (tmp_path / "unrelated").write_bytes(b"x")
    open_table(0, 2, parent_pid=os.getpid(), directory=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, "unrelated", table_path(os.getpid(), str(tmp_path)).name]
    )
