"""The host source on this machine's real /proc and /sys, and a real process tree. No fakes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psutil
import pytest

from batchlens.config import Engine
from batchlens.exporter.host_source import (
    NUMA_BALANCING,
    THP_ENABLED,
    ZONE_RECLAIM,
    HostSource,
    kernel_settings,
    selected_mode,
)
from batchlens.exporter.processes import ServerPids, listening_pid, process_tree
from harness.procs import free_port, start_server_with_child


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never", "always"),
        ("never", "never"),
        ("", "unavailable"),
    ],
)
def test_selected_mode(text: str, mode: str) -> None:
    assert selected_mode(text) == mode


def test_kernel_settings_read_each_file_and_say_when_one_is_missing(tmp_path) -> None:
    host = tmp_path / "host"
    for path, text in ((THP_ENABLED, "always [madvise] never\n"), (NUMA_BALANCING, "1\n"), (ZONE_RECLAIM, "0\n")):
        (host / path).parent.mkdir(parents=True, exist_ok=True)
        (host / path).write_text(text)
    assert kernel_settings(host) == {"transparent_hugepage": "madvise", "numa_balancing": "1", "zone_reclaim_mode": "0"}
    (host / NUMA_BALANCING).unlink()  # a kernel built without NUMA balancing has no such file
    assert kernel_settings(host)["numa_balancing"] == "unavailable"
    assert kernel_settings(tmp_path / "nothing") == dict.fromkeys(
        ("transparent_hugepage", "numa_balancing", "zone_reclaim_mode"), "unavailable"
    )
    # And on this host, what its own files say.
    assert kernel_settings()["zone_reclaim_mode"] == Path("/proc/sys/vm/zone_reclaim_mode").read_text().strip()


def test_the_host_source_reports_this_hosts_kernel_settings() -> None:
    by_name = {m.name: m for m in asyncio.run(HostSource([]).sample()).metrics}
    [sample] = by_name["batchlens_host_kernel_info"].samples
    assert sample.labels == kernel_settings() and sample.value == 1


def test_the_engine_process_is_found_by_its_port_with_its_children(server_with_child) -> None:
    port, proc = server_with_child
    assert listening_pid(port) == proc.pid
    tree = process_tree(proc.pid)
    assert tree is not None and tree.processes == 2
    expected_rss = sum(p.memory_info().rss for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children()])
    assert abs(tree.resident_bytes - expected_rss) < 4 * 1024 * 1024
    assert tree.threads >= 2 and tree.affinity_cpus == len(psutil.Process(proc.pid).cpu_affinity())


def test_host_source_reports_local_engines_only(server_with_child) -> None:
    port, proc = server_with_child
    engines = [Engine(name="here", url=f"http://127.0.0.1:{port}"), Engine(name="far", url="http://10.9.8.7:8000")]
    reading = asyncio.run(HostSource(engines).sample())
    by_name = {m.name: m for m in reading.metrics}
    info = by_name["batchlens_engine_process_info"].samples
    assert [(s.labels["vllm_instance"], s.labels["pid"]) for s in info] == [("here", str(proc.pid))]
    assert by_name["batchlens_engine_processes"].samples[0].value == 2
    assert 0 <= by_name["batchlens_host_cpu_utilization_ratio"].samples[0].value <= 1
    assert by_name["batchlens_host_memory_total_bytes"].samples[0].value == psutil.virtual_memory().total


def test_a_stopped_engine_process_disappears(server_with_child) -> None:
    port, proc = server_with_child
    source = HostSource([Engine(name="here", url=f"http://127.0.0.1:{port}")])
    assert "batchlens_engine_process_info" in {m.name for m in asyncio.run(source.sample()).metrics}
    proc.stop()
    assert "batchlens_engine_process_info" not in {m.name for m in asyncio.run(source.sample()).metrics}


def test_a_server_is_remembered_while_it_lives_and_a_missing_one_looked_for_again_later(tmp_path) -> None:
    port = free_port()
    now = [0.0]
    engines = [Engine(name="late", url=f"http://127.0.0.1:{port}")]
    servers = ServerPids(engines, "test", rescan_seconds=30, clock=lambda: now[0])
    assert servers.resolve() == {}
    proc = start_server_with_child(tmp_path, port)
    try:
        assert listening_pid(port) == proc.pid
        assert servers.resolve() == {}, "looked for again only after rescan_seconds"
        now[0] = 31
        assert servers.resolve() == {"late": proc.pid}
    finally:
        proc.stop()
    assert servers.resolve() == {}, "an exited server is noticed at once"
