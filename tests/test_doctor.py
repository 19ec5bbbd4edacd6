"""`batchlens doctor`: every check's outcomes, from readings; the real run on this machine.

Boundaries: the GPU is the fake driver of harness/fake_pynvml.py (this machine
has none). Kernel settings are read from a folder shaped like / where a test
needs a setting this machine does not have; one test reads the real /proc and
/sys and checks the outcomes against what the files say.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pynvml as real
import pytest

from batchlens.doctor import checks, probe
from batchlens.doctor.checks import FAIL, PASS, SKIP, WARN, HostReadings, NvmlReadings, VllmProcess
from harness.fake_pynvml import GPM_DRAM, FakeNvml, a100_80gb, h100_sxm, t4

BATCHLENS = str(Path(sys.executable).with_name("batchlens"))


def host_tree(root: Path, **files: str) -> Path:
    """A folder shaped like / holding only the given files: thp, defrag, numa_balancing, zone_reclaim, nodeN."""
    paths = {
        "thp": "sys/kernel/mm/transparent_hugepage/enabled",
        "defrag": "sys/kernel/mm/transparent_hugepage/defrag",
        "numa_balancing": "proc/sys/kernel/numa_balancing",
        "zone_reclaim": "proc/sys/vm/zone_reclaim_mode",
    }
    for key, text in files.items():
        path = root / (paths.get(key) or f"sys/devices/system/node/{key}/cpulist")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def nvml_of(fake: FakeNvml, **kwargs) -> NvmlReadings:
    return probe.read_nvml(
        fake.module(), sample_seconds=kwargs.pop("sample_seconds", 0.4), sleep=fake.advance, **kwargs
    )


TWO_NODES = {"node0": "0-3", "node1": "4-7"}


# -- host settings ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "check", "status"),
    [
        ({"thp": "always madvise [never]", "defrag": "always defer [madvise] never"}, "thp", WARN),
        ({"thp": "[always] madvise never", "defrag": "[always] defer madvise never"}, "thp", WARN),
        ({"thp": "[always] madvise never", "defrag": "always defer+madvise [madvise] never"}, "thp", PASS),
        ({"thp": "always [madvise] never", "defrag": "always [defer+madvise] madvise never"}, "thp", PASS),
        ({}, "thp", SKIP),
        ({"numa_balancing": "1", **TWO_NODES}, "numa", WARN),
        ({"numa_balancing": "1", "node0": "0-7"}, "numa", PASS),
        ({"numa_balancing": "0", **TWO_NODES}, "numa", PASS),
        ({}, "numa", SKIP),
        ({"zone_reclaim": "1"}, "zone", WARN),
        ({"zone_reclaim": "0"}, "zone", PASS),
        ({}, "zone", SKIP),
    ],
)
def test_host_setting_outcomes(tmp_path, files, check, status):
    host = probe.read_host(host_tree(tmp_path, **files))
    judge = {"thp": checks.transparent_hugepages, "numa": checks.numa_balancing, "zone": checks.zone_reclaim}[check]
    outcome = judge(host)
    assert outcome.status == status, outcome
    if status in (WARN, FAIL):
        assert outcome.why and outcome.fix


def test_numa_balancing_warning_corrects_the_article(tmp_path):
    outcome = checks.numa_balancing(probe.read_host(host_tree(tmp_path, numa_balancing="1", **TWO_NODES)))
    assert "kernel.numa_balancing=0" in outcome.fix and "zone_reclaim_mode" in outcome.fix


def test_cpulist_round_trip():
    assert checks.cpulist("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert checks.format_cpus(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    assert checks.selected("always [madvise] never") == "madvise"


# -- GPU checks, on the fake driver ---------------------------------------------------


@pytest.mark.parametrize(("cuda", "status"), [(11080, FAIL), (12040, WARN), (12080, PASS), (13000, PASS)])
def test_driver_outcomes(cuda, status):
    outcome = checks.driver(nvml_of(FakeNvml([a100_80gb()], cuda_version=cuda)))
    assert outcome.status == status, outcome
    assert f"CUDA {cuda // 1000}.{cuda % 1000 // 10}" in outcome.found


@pytest.mark.parametrize(
    ("gpu", "status", "words"),
    [
        (dict(pcie_width=8), FAIL, "x8 of x16"),
        (dict(pcie_gen=1), WARN, "gen1 of gen4"),
        (dict(pcie_gen=4, pcie_gen_max=4, pcie_gen_gpu_max=5), WARN, "gen4 slot for a gen5 GPU"),
        ({}, PASS, "gen4/4 x16/16"),
    ],
)
def test_pcie_outcomes(gpu, status, words):
    outcome = checks.pcie(nvml_of(FakeNvml([t4(0), t4(1, **gpu)])))
    assert outcome.status == status, outcome
    assert words in outcome.found


def test_pcie_without_link_state_skips():
    links = {"nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth"}
    outcome = checks.pcie(nvml_of(FakeNvml([t4(0, unsupported=links)])))
    assert outcome.status == SKIP


@pytest.mark.parametrize(
    ("gpus", "topology", "status"),
    [
        ([a100_80gb(0)], {}, PASS),
        ([a100_80gb(0), a100_80gb(1)], {}, PASS),
        ([a100_80gb(0), a100_80gb(1, nvlinks=[False] * 12)], {}, FAIL),
        ([t4(0), t4(1)], {(0, 1): real.NVML_TOPOLOGY_SYSTEM}, WARN),
        ([t4(0), t4(1)], {(0, 1): real.NVML_TOPOLOGY_HOSTBRIDGE}, PASS),
    ],
)
def test_topology_outcomes(gpus, topology, status):
    outcome = checks.topology(nvml_of(FakeNvml(gpus, topology=topology)))
    assert outcome.status == status, outcome


def test_topology_counts_active_links():
    readings = nvml_of(FakeNvml([a100_80gb(0, nvlinks=[True] * 8 + [False] * 4), a100_80gb(1)]))
    assert [g.nvlinks_active for g in readings.gpus] == [8, 12]
    assert readings.pairs == {(0, 1): real.NVML_TOPOLOGY_NODE}


def test_memory_bandwidth_outcomes():
    assert checks.memory_bandwidth(nvml_of(FakeNvml([t4(util_mem=85)])), 0.7).status == WARN
    assert checks.memory_bandwidth(nvml_of(FakeNvml([t4(util_mem=20)])), 0.7).status == PASS
    # On Hopper the GPM bandwidth ratio decides: memory busy 50%, DRAM bandwidth 75%.
    hopper = h100_sxm(util_mem=50)
    hopper.gpm[GPM_DRAM] = 75.0
    readings = nvml_of(FakeNvml([hopper]), sample_seconds=1.0)
    assert readings.gpus[0].dram_bandwidth == pytest.approx(0.75)
    assert len(readings.gpus[0].memory_busy) == 5
    outcome = checks.memory_bandwidth(readings, 0.7)
    assert outcome.status == WARN and "DRAM bandwidth 75%" in outcome.found


def test_without_driver_every_gpu_check_skips_with_the_reason():
    readings = probe.read_nvml(FakeNvml([], library=False).module(), sample_seconds=0)
    outcomes = checks.run_all(HostReadings(), readings, [], warn_bandwidth=0.7)
    gpu = [o for o in outcomes if o.check.startswith("gpu.")]
    assert len(gpu) == 4 and all(o.status == SKIP and "no NVIDIA driver" in o.found for o in gpu)
    assert checks.exit_code(outcomes) == 0


def test_an_nvml_that_refuses_to_start_says_why():
    refused = probe.read_nvml(FakeNvml([t4()], errors={"nvmlInit_v2": real.NVML_ERROR_NO_PERMISSION}).module())
    assert refused.unavailable == "NVML cannot start: Insufficient Permissions"
    assert checks.driver(refused).status == SKIP
    unloaded = probe.read_nvml(FakeNvml([t4()], errors={"nvmlInit_v2": real.NVML_ERROR_DRIVER_NOT_LOADED}).module())
    assert "no NVIDIA driver" in unloaded.unavailable


def test_a_gpu_lost_mid_read_is_reported_not_raised():
    lost = t4(1, errors={"nvmlDeviceGetCurrPcieLinkWidth": real.NVML_ERROR_GPU_IS_LOST})
    readings = nvml_of(FakeNvml([t4(0), lost]))
    assert readings.unavailable and "GPU" in readings.unavailable
    assert checks.pcie(readings).status == SKIP


def test_numa_node_falls_back_to_sysfs(tmp_path):
    (tmp_path / "sys/bus/pci/devices/0000:3b:00.0").mkdir(parents=True)
    (tmp_path / "sys/bus/pci/devices/0000:3b:00.0/numa_node").write_text("1\n")
    readings = nvml_of(FakeNvml([t4(numa_node=None)]), root=tmp_path)
    assert readings.gpus[0].numa_node == 1


# -- CPU affinity -------------------------------------------------------------------


def two_node_host() -> HostReadings:
    return HostReadings(numa_nodes={0: frozenset(range(4)), 1: frozenset(range(4, 8))})


@pytest.mark.parametrize(
    ("cpus", "status"),
    [(range(4, 8), PASS), (range(5, 7), PASS), (range(8), WARN), (range(4), FAIL)],
)
def test_cpu_affinity_outcomes(cpus, status):
    nvml = NvmlReadings(gpus=(checks.GpuReadings(0, "gpu", numa_node=1),))
    process = VllmProcess(4242, "VLLM::EngineCore", frozenset(cpus), (0,))
    outcome = checks.cpu_affinity(two_node_host(), nvml, [process])
    assert outcome.status == status, outcome
    if status != PASS:
        assert "4-7" in outcome.fix  # the GPU's node's CPUs, not the article's fixed 0-7


def test_cpu_affinity_skips():
    nvml = NvmlReadings(gpus=(checks.GpuReadings(0, "gpu", numa_node=1),))
    assert checks.cpu_affinity(two_node_host(), nvml, []).status == SKIP
    process = VllmProcess(1, "vllm", frozenset(range(8)), ())
    assert checks.cpu_affinity(two_node_host(), NvmlReadings(unavailable="no driver"), [process]).status == SKIP
    one_node = HostReadings(numa_nodes={0: frozenset(range(8))})
    assert checks.cpu_affinity(one_node, NvmlReadings(unavailable="no driver"), [process]).status == PASS


def test_vllm_processes_are_found_with_their_real_affinity():
    """A real process whose command line is vLLM's API server, pinned to CPU 0."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import os, time; os.sched_setaffinity(0, {0}); time.sleep(60)",
         "-m", "vllm.entrypoints.openai.api_server"],
    )  # fmt: skip
    try:
        for _ in range(50):
            found = {p.pid: p for p in probe.vllm_processes({child.pid: (0,)})}
            if child.pid in found and found[child.pid].affinity == {0}:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert found[child.pid].affinity == frozenset({0})
        assert found[child.pid].gpus == (0,)
        assert os.getpid() not in found  # pytest itself is not vLLM
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    ("name", "cmdline", "expected"),
    [
        ("VLLM::EngineCore", [], True),
        ("python", ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], True),
        ("vllm", ["/usr/bin/vllm", "serve", "deepseek"], True),
        ("python", ["python", "-m", "pytest", "tests/test_vllm_plugin.py"], False),
        ("timeout", ["timeout", "600", "pytest", "-m", "not vllm"], False),
        ("python3", ["/usr/bin/python3", "/opt/venv/bin/vllm", "serve", "m"], True),
        ("batchlens", ["batchlens", "exporter", "--engine", "vllm-a=http://x"], False),
    ],
)
def test_is_vllm(name, cmdline, expected):
    assert probe.is_vllm(name, cmdline) is expected


# -- the real command on this machine ---------------------------------------------------


def expected_host_statuses() -> dict[str, str]:
    """What this machine's files say, judged here by hand, apart from the code under test."""

    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    thp, defrag = (
        read("/sys/kernel/mm/transparent_hugepage/enabled"),
        read("/sys/kernel/mm/transparent_hugepage/defrag"),
    )
    if thp is None:
        thp_status = SKIP
    elif "[never]" in thp or (defrag and "[always]" in defrag):
        thp_status = WARN
    else:
        thp_status = PASS
    numa, zone = read("/proc/sys/kernel/numa_balancing"), read("/proc/sys/vm/zone_reclaim_mode")
    return {
        "host.transparent_hugepage": thp_status,
        "host.numa_balancing": SKIP if numa is None else PASS if numa == "0" or nodes <= 1 else WARN,
        "host.zone_reclaim_mode": SKIP if zone is None else PASS if zone == "0" else WARN,
    }


def test_doctor_on_this_machine():
    done = subprocess.run(
        [BATCHLENS, "doctor", "--json", "--sample-seconds", "0.2"], capture_output=True, text=True, timeout=60
    )
    outcomes = {o["check"]: o for o in json.loads(done.stdout)}
    assert set(outcomes) == {
        "gpu.driver", "gpu.topology", "gpu.pcie_link", "gpu.memory_bandwidth", "host.transparent_hugepage",
        "host.numa_balancing", "host.zone_reclaim_mode", "host.cpu_affinity",
    }  # fmt: skip
    expected = expected_host_statuses()
    for check, status in expected.items():
        assert outcomes[check]["status"] == status, outcomes[check]
    gpu_checks = ("gpu.driver", "gpu.topology", "gpu.pcie_link", "gpu.memory_bandwidth")
    if Path("/proc/driver/nvidia/version").exists():  # a GPU host (a lent device machine): the checks ran
        assert outcomes["gpu.driver"]["status"] in (PASS, WARN), outcomes["gpu.driver"]
        assert all(outcomes[c]["status"] != SKIP or "NVML" not in outcomes[c]["found"] for c in gpu_checks)
    else:  # no NVIDIA driver: the GPU checks skip and say why, and decide nothing
        for check in gpu_checks:
            assert outcomes[check]["status"] == SKIP and "NVML" in outcomes[check]["found"]
            expected[check] = SKIP
        # No GPU, so no GPU's NUMA node to hold vLLM's CPUs to: it skips, unless a vLLM runs here (another test's,
        # on another worker) on a machine of one NUMA node, where every CPU is local.
        cpu = outcomes["host.cpu_affinity"]
        one_node = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) <= 1
        assert cpu["status"] == SKIP or (one_node and cpu["status"] == PASS and "one NUMA node" in cpu["found"]), cpu
        expected["host.cpu_affinity"] = cpu["status"]
        # The exit code from what this machine is, judged above by hand: not from what the command printed.
        statuses = set(expected.values())
        assert done.returncode == (1 if FAIL in statuses else 3 if WARN in statuses else 0), done.stderr


def test_doctor_text_output_explains_warnings(tmp_path):
    root = host_tree(tmp_path, thp="always [madvise] never", zone_reclaim="1", numa_balancing="0", **TWO_NODES)
    done = subprocess.run(
        [BATCHLENS, "doctor", "--host-root", str(root), "--sample-seconds", "0"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    warn = next(i for i, line in enumerate(lines) if line.startswith("WARN  host.zone_reclaim_mode"))
    assert "why:" in lines[warn + 1] and "fix: sysctl -w vm.zone_reclaim_mode=0" in lines[warn + 2]
    assert lines[-1] == "2 PASS, 1 WARN, 0 FAIL, 5 SKIP"


INFO = json.dumps({"batchlens_version": "1.0", "vllm_version": "0.32.0", "engines": 2}).encode()
NOT_FOUND = b'{"detail":"Not Found"}'  # FastAPI's, as vLLM's Python API server answers a route it lacks


@pytest.mark.parametrize(
    ("answers", "admission", "status", "said"),
    [
        ([(200, INFO)] * 8, {"api_servers": 2, "api_servers_behind": []}, PASS, "2 API server(s)"),
        ([(200, INFO), (404, NOT_FOUND)] * 4, None, FAIL, "answered on 4 of 8 connections"),
        ([(200, INFO)] * 8, {"api_servers": 4, "api_servers_behind": [3]}, FAIL, "API server(s) [3] do not have"),
        ([(404, NOT_FOUND)] * 8, None, FAIL, "VLLM_PLUGINS=batchlens"),
        ([(404, b"")] * 8, None, FAIL, "VLLM_USE_RUST_FRONTEND"),
        ([(501, b'{"error": "vLLM 0.9: no scheduler"}')] * 8, None, FAIL, "no scheduler"),
        ([(0, b"Connection refused")] * 8, None, WARN, "Connection refused"),
    ],
)
def test_the_plugin_check_says_what_each_server_lacks(answers, admission, status, said) -> None:
    outcome = checks.plugin(checks.PluginReadings("dp8", "http://vllm:8000", tuple(answers), admission))
    assert outcome.status == status, outcome
    assert said in outcome.found + outcome.why, outcome


def test_doctor_names_the_rust_frontend_on_a_server_that_answers_like_it(tmp_path: Path) -> None:
    """A stand-in for `VLLM_USE_RUST_FRONTEND=1 vllm serve` (the CPU wheel ships no vllm-rs binary): it serves
    the OpenAI routes and answers every other path an empty 404, as the Rust frontend does."""
    import http.server
    import threading

    class RustFrontendLike(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"data": [{"id": "deepseek"}]}' if self.path == "/v1/models" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RustFrontendLike)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = tmp_path / "batchlens.yaml"
    config.write_text(f"engines:\n  - name: dp8\n    url: http://127.0.0.1:{server.server_address[1]}\n")
    try:
        done = subprocess.run([BATCHLENS, "doctor", "--config", str(config), "--sample-seconds", "0"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        server.shutdown()
    line = next(line for line in done.stdout.splitlines() if "vllm.plugin[dp8]" in line)
    assert line.startswith("FAIL") and "answered 404" in line, done.stdout
    assert "VLLM_USE_RUST_FRONTEND" in done.stdout and "Traceback" not in done.stdout + done.stderr
    assert done.returncode == 1
