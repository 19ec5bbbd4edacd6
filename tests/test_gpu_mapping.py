"""Mapping GPUs to engines, as pure logic. No fakes: processes are plain values here.

tests/test_nvml_source.py maps through a real process tree.
"""

from __future__ import annotations

import logging

from batchlens.config import Engine
from batchlens.exporter.gpu_mapping import (
    assign_engines,
    device_ranks,
    dp_rank_of,
    engine_of,
    process_owners,
    static_mapping,
)
from batchlens.exporter.gpu_metrics import GpuDevice, GpuProcess

GPU0 = GpuDevice(0, "GPU-0", "NVIDIA H100 80GB HBM3")
GPU1 = GpuDevice(1, "GPU-1", "NVIDIA H100 80GB HBM3")
MIG1 = GpuDevice(1, "MIG-1-1", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "1", "GPU-1")
MIG2 = GpuDevice(1, "MIG-1-2", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "2", "GPU-1")


def test_engine_of_takes_the_nearest_server_among_the_ancestors() -> None:
    assert engine_of((30, 20, 10, 1), {10: "a", 20: "b"}) == "b"
    assert engine_of((30, 20, 1), {10: "a"}) is None
    assert engine_of((), {10: "a"}) is None


def test_a_gpu_goes_to_the_engine_whose_processes_run_on_it() -> None:
    procs = [GpuProcess(0, "", 100, 8e9), GpuProcess(1, "", 200, 9e9)]
    assert assign_engines([GPU0, GPU1], procs, {100: "a", 200: "b"}, {}) == {GPU0: "a", GPU1: "b"}


def test_a_shared_gpu_goes_to_the_engine_using_most_memory_then_by_name() -> None:
    procs = [GpuProcess(0, "", 100, 2e9), GpuProcess(0, "", 200, 9e9), GpuProcess(0, "", 300, None)]
    assert assign_engines([GPU0], procs, {100: "a", 200: "b", 300: "c"}, {}) == {GPU0: "b"}
    tied = [GpuProcess(0, "", 100, None), GpuProcess(0, "", 200, None)]
    assert assign_engines([GPU0], tied, {100: "zeta", 200: "alpha"}, {}) == {GPU0: "alpha"}


def test_processes_of_no_engine_leave_a_gpu_unmapped() -> None:
    assert assign_engines([GPU0], [GpuProcess(0, "", 100, 1e9)], {}, {}) == {}


def test_the_static_mapping_wins_and_covers_mig_instances_of_a_named_gpu() -> None:
    procs = [GpuProcess(0, "", 100, 8e9)]
    static = {"0": "pinned", "GPU-1": "whole", "MIG-1-2": "slice"}
    assigned = assign_engines([GPU0, MIG1, MIG2], procs, {100: "auto"}, static)
    assert assigned == {GPU0: "pinned", MIG1: "whole", MIG2: "slice"}


def test_mig_instances_are_mapped_by_their_own_processes() -> None:
    procs = [GpuProcess(1, "1", 100, 1e9), GpuProcess(1, "2", 200, 1e9)]
    assert assign_engines([MIG1, MIG2], procs, {100: "a", 200: "b"}, {}) == {MIG1: "a", MIG2: "b"}


def test_process_owners_fall_back_to_the_static_mapping_only() -> None:
    procs = [GpuProcess(0, "", 100, 1e9), GpuProcess(0, "", 101, 1e9), GpuProcess(1, "", 200, 1e9)]
    # 101 is not visible (another PID namespace): GPU 0 is pinned, so it belongs to that engine.
    # 200 runs on GPU 1, which no static entry names: it stays unowned.
    assert process_owners(procs, {100: "a"}, [GPU0, GPU1], {"0": "pinned"}) == {100: "a", 101: "pinned"}


def test_static_mapping_reads_indexes_and_uuids_and_warns_on_conflicts(caplog) -> None:
    engines = [
        Engine(name="a", url="http://127.0.0.1:8000", gpus=[0, "GPU-1"]),
        Engine(name="b", url="http://127.0.0.1:8001", gpus=["0"]),
    ]
    with caplog.at_level(logging.WARNING, "batchlens.exporter"):
        assert static_mapping(engines) == {"0": "a", "GPU-1": "a"}
    assert "GPU 0 is listed under engines a and b" in caplog.text


def test_the_dp_rank_comes_from_vllms_process_titles_nearest_first() -> None:
    assert dp_rank_of(["VLLM::Worker_DP12_TP3_EP99", "VLLM::EngineCore_DP12", "vllm serve"]) == "12"
    assert dp_rank_of(["python worker.py", "VLLM::EngineCore_DP3"]) == "3"  # an untitled child of a rank's core
    assert dp_rank_of(["VLLM::EngineCore", "VLLM::Worker_TP1"]) == ""  # no data parallelism
    assert dp_rank_of(["pytest -k VLLM::EngineCore_DP1", "VLLM::EngineCore_DP123456"]) == ""  # not a title; too long


def test_a_gpu_takes_the_rank_of_the_process_using_most_of_it() -> None:
    procs = [GpuProcess(0, "", 100, 70e9), GpuProcess(0, "", 200, 1e9), GpuProcess(1, "", 300, None)]
    assert device_ranks([GPU0, GPU1], procs, {100: "8", 200: "9", 300: "15"}) == {GPU0: "8", GPU1: "15"}
    assert device_ranks([GPU0], procs, {}) == {}
