"""vLLM's multi-node recipe on loopback, as users start it: a head and a ``--headless`` rank. A real vLLM 0.32 on
the CPU; the GPU of the headless node's exporter is the fake NVML (harness/fake_pynvml.py)."""

from __future__ import annotations

import psutil
import pytest

from batchlens.admin_api import BATCH_PATH, INFO_PATH, TOKEN_ENV
from batchlens.exporter.nvml_source import NvmlSource
from batchlens.vllm_plugin.admin_port import PORT_ENV
from harness.admin import AdminClient, set_caps
from harness.fake_pynvml import GIB, FakeNvml, FakeProcess, h100_sxm
from harness.procs import free_port, http_get, wait_until
from harness.vllm import ADMIN_TOKEN, DP_SLOTS, launch_vllm, start_vllm

pytestmark = pytest.mark.vllm


def test_a_head_and_a_headless_node_with_an_admin_port_are_one_engine(
    tmp_path_factory: pytest.TempPathFactory, vllm_plugin_env: dict[str, str]
) -> None:
    """vLLM's multi-node recipe on loopback: a head (``--data-parallel-size 2 --data-parallel-size-local 1``, with
    ``--api-server-count 2`` and BATCHLENS_ADMIN_PORT) and a ``--headless --data-parallel-start-rank 1`` process
    holding rank 1 with no API server. API server 0 binds the admin port (the other says so); a request cap set
    there is in force in both API servers; a limit set there reaches rank 1 in the other process; and the
    exporter on the headless "node" maps a GPU of that real engine core (by its title, ``VLLM::EngineCore_DP1``;
    the GPU is the fake NVML) to the engine and to rank 1."""
    workdir, port, rpc = tmp_path_factory.mktemp("vllm-hybrid"), free_port(), free_port()
    env = {**vllm_plugin_env, TOKEN_ENV: ADMIN_TOKEN}
    dp = ("--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
          "--data-parallel-rpc-port", str(rpc))  # fmt: skip
    headless, _, _ = launch_vllm(workdir / "node-2", env=env, max_num_seqs=DP_SLOTS, memory_fraction=0.1,
                                 extra_args=(*dp, "--data-parallel-start-rank", "1"), headless=True)  # fmt: skip
    try:
        server = start_vllm(workdir / "head", env={**env, PORT_ENV: str(port)}, serve=True, max_num_seqs=DP_SLOTS,
                            memory_fraction=0.1, extra_args=(*dp, "--api-server-count", "2"))  # fmt: skip
        try:
            admin = AdminClient(f"http://127.0.0.1:{port}", server.admin_token)
            # vLLM's /health can answer (from API server 1) before API server 0 has opened the admin port.
            server.process.wait_http(admin.url + INFO_PATH, timeout=60)
            assert http_get(server.url + BATCH_PATH)[0] == 404  # vLLM's port, on either process
            said = "API server 1 of 2: the admin API's own port is API server 0's"
            log_path = server.process.log_path  # API server 1 may still be starting once API server 0 answers
            wait_until(lambda: said in log_path.read_text(errors="replace"), timeout=60, what=said)
            assert log_path.read_text(errors="replace").count("batchlens: admin API on its own port") == 1
            state = admin.set_limit(3)
            assert [(e.engine, e.max_num_active_seqs) for e in state.engines] == [(0, 3), (1, 3)]
            admin.set_limit(DP_SLOTS)
            reply = set_caps(admin, max_num_queued_reqs=2)  # that a cap holds: test_vllm_api_servers.py
            assert (reply["api_servers"], reply["api_servers_behind"]) == (2, []), reply
            set_caps(admin, max_num_queued_reqs=None)
            rank_1 = next(p for p in psutil.Process(headless.proc.pid).children(recursive=True)
                          if p.cmdline()[:1] == ["VLLM::EngineCore_DP1"])  # fmt: skip
            assert headless_gpu_labels(rank_1.pid) == {"vllm_instance": "deepseek", "dp_rank": "1"}
        finally:
            server.process.stop()
    finally:
        headless.stop()


def headless_gpu_labels(pid: int) -> dict[str, str]:
    """The exporter's NVML source on a --headless node (exporter.headless_engine), the fake NVML reporting ``pid``
    on its GPU: that GPU's engine and rank."""
    gpu = h100_sxm(0, processes=[FakeProcess(pid, 70 * GIB)])
    source = NvmlSource([], nvml=FakeNvml([gpu]).module(), headless_engine="deepseek")
    reading = source.sample_now({})
    [sample] = next(m.samples for m in reading.metrics if m.name == "batchlens_gpu_info")
    return {k: sample.labels[k] for k in ("vllm_instance", "dp_rank") if k in sample.labels}
