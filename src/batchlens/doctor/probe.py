"""What the doctor reads: kernel settings under /proc and /sys, NVML, `nvidia-smi topo -m`, vLLM processes.

Every reader returns the raw material for :mod:`batchlens.doctor.checks` and
never raises for a missing file, a missing driver or an NVML error: those
become absent readings, which the checks turn into SKIPs with the reason.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil

from batchlens.admin_api import ADMISSION_PATH, INFO_PATH
from batchlens.doctor.checks import GpuReadings, HostReadings, NvmlReadings, PluginReadings, VllmProcess, cpulist
from batchlens.exporter.nvml_source import GpmPair, NvmlCalls, error_reason
from batchlens.masking import mask_url

log = logging.getLogger("batchlens.doctor")

# vLLM v1 names its processes VLLM::EngineCore, VLLM::Worker...; the API server is a Python command line.
VLLM_TITLE = re.compile(r"^VLLM::")
SAMPLES_PER_SECOND = 5


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def read_host(root: Path = Path("/")) -> HostReadings:
    """The kernel's settings under ``root`` (``/``; a test passes a folder shaped like it)."""
    nodes: dict[int, frozenset[int]] = {}
    for node in sorted((root / "sys/devices/system/node").glob("node[0-9]*")):
        if (text := _text(node / "cpulist")) is not None:
            nodes[int(node.name[4:])] = cpulist(text)
    thp = root / "sys/kernel/mm/transparent_hugepage"
    return HostReadings(
        thp_enabled=_text(thp / "enabled"),
        thp_defrag=_text(thp / "defrag"),
        numa_balancing=_text(root / "proc/sys/kernel/numa_balancing"),
        zone_reclaim_mode=_text(root / "proc/sys/vm/zone_reclaim_mode"),
        numa_nodes=nodes,
    )


def _bus_id(info: Any) -> str | None:
    """NVML's ``00000000:3B:00.0`` as sysfs spells it: ``0000:3b:00.0``."""
    raw = getattr(info, "busId", b"")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    match = re.fullmatch(r"0*([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])", text.strip())
    return match.group(1).lower() if match else None


def _numa_node(calls: NvmlCalls, scope: str, handle: Any, root: Path) -> int | None:
    n = calls.nvml
    node = calls.get(scope, n.nvmlDeviceGetNumaNodeId, handle)
    if node is None and (info := calls.get(scope, n.nvmlDeviceGetPciInfo, handle)) is not None:
        bus = _bus_id(info)
        text = _text(root / f"sys/bus/pci/devices/{bus}/numa_node") if bus else None
        node = int(text) if text and text.strip().lstrip("-").isdigit() else None
    return node if node is not None and node >= 0 else None  # -1: the platform does not say


def _nvlinks(calls: NvmlCalls, scope: str, handle: Any) -> int | None:
    """How many NVLinks are active; None where the GPU has none."""
    n = calls.nvml
    active, any_link = 0, False
    for link in range(n.NVML_NVLINK_MAX_LINKS):
        try:
            state = n.nvmlDeviceGetNvLinkState(handle, link)
        except (n.NVMLError_NotSupported, n.NVMLError_InvalidArgument, n.NVMLError_NotFound):
            break  # past the last link, or no NVLink at all
        except n.NVMLError as exc:
            calls.soft[error_reason(exc)] = f"{scope}: nvmlDeviceGetNvLinkState({link}) failed: {exc}"
            break
        any_link = True
        active += bool(state)
    return active if any_link else None


def read_nvml(
    nvml: ModuleType | None = None,
    *,
    sample_seconds: float = 2.0,
    root: Path = Path("/"),
    sleep: Callable[[float], None] = time.sleep,
) -> NvmlReadings:
    """Driver, GPUs, links and topology, and ``sample_seconds`` of memory busy (5 samples a second).

    GPM bandwidth is the rate between a sample before and one after that time.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:  # nvidia-ml-py is a dependency; this is a broken install
            return NvmlReadings(unavailable=f"cannot import pynvml ({exc}): pip install nvidia-ml-py")
    try:
        nvml.nvmlInit()
    except (nvml.NVMLError_LibraryNotFound, nvml.NVMLError_DriverNotLoaded) as exc:
        return NvmlReadings(unavailable=f"NVML cannot start ({exc}): no NVIDIA driver on this machine")
    except nvml.NVMLError as exc:  # NoPermission, a driver/library mismatch...
        return NvmlReadings(unavailable=f"NVML cannot start: {exc}")
    calls = NvmlCalls(nvml)
    try:
        return _read_gpus(calls, sample_seconds, root, sleep)
    except Exception as exc:  # GpuLost, or a driver that breaks mid-way: report, never crash the doctor
        log.warning("nvml: reading the GPUs failed: %s", exc)
        return NvmlReadings(unavailable=f"NVML failed while reading the GPUs: {exc}")
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def _read_gpus(calls: NvmlCalls, sample_seconds: float, root: Path, sleep: Callable[[float], None]) -> NvmlReadings:
    n = calls.nvml
    count = calls.get("system", n.nvmlDeviceGetCount) or 0
    handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpm = {}
    for i, h in enumerate(handles):
        support = calls.get(f"gpu{i}", n.nvmlGpmQueryDeviceSupport, h)
        if support is not None and support.isSupportedDevice:
            scope = f"gpu{i}"
            pair = GpmPair(calls, scope, lambda s, h=h, scope=scope: calls.get(scope, n.nvmlGpmSampleGet, h, s))
            if pair.usable:
                pair.tick()
                gpm[i] = pair
    samples: list[list[float]] = [[] for _ in handles]
    count_samples = max(1, round(sample_seconds * SAMPLES_PER_SECOND))
    for k in range(count_samples):
        if k:
            sleep(sample_seconds / count_samples)
        for i, h in enumerate(handles):
            if (util := calls.get(f"gpu{i}", n.nvmlDeviceGetUtilizationRates, h)) is not None:
                samples[i].append(util.memory / 100)
    dram = {i: pair.tick().get("batchlens_gpu_dram_bandwidth_ratio") for i, pair in gpm.items()}
    for pair in gpm.values():
        pair.free()
    gpus = []
    for i, h in enumerate(handles):
        scope = f"gpu{i}"
        name = calls.get(scope, n.nvmlDeviceGetName, h)
        gpus.append(
            GpuReadings(
                index=i,
                name=name.decode() if isinstance(name, bytes) else str(name),
                pcie_gen=calls.get(scope, n.nvmlDeviceGetCurrPcieLinkGeneration, h),
                pcie_gen_max=calls.get(scope, n.nvmlDeviceGetMaxPcieLinkGeneration, h),
                pcie_gen_gpu_max=calls.get(scope, n.nvmlDeviceGetGpuMaxPcieLinkGeneration, h),
                pcie_width=calls.get(scope, n.nvmlDeviceGetCurrPcieLinkWidth, h),
                pcie_width_max=calls.get(scope, n.nvmlDeviceGetMaxPcieLinkWidth, h),
                nvlinks_active=_nvlinks(calls, scope, h),
                numa_node=_numa_node(calls, scope, h, root),
                memory_busy=tuple(samples[i]),
                dram_bandwidth=dram.get(i),
            )
        )
    processes: dict[int, list[int]] = {}
    for i, h in enumerate(handles):
        listed = calls.first(
            f"gpu{i}",
            (n.nvmlDeviceGetComputeRunningProcesses_v3, (h,), None),
            (n.nvmlDeviceGetComputeRunningProcesses_v2, (h,), None),
        )
        for p in listed or []:
            processes.setdefault(p.pid, []).append(i)
    pairs = {}
    for i in range(count):
        for j in range(i + 1, count):
            level = calls.get(f"gpu{i}", n.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
            if level is not None:
                pairs[(i, j)] = level
    for reason, message in calls.soft.items():
        log.warning("nvml: %s (%s)", message, reason)
    driver = calls.get("system", n.nvmlSystemGetDriverVersion)
    return NvmlReadings(
        driver=driver.decode() if isinstance(driver, bytes) else driver,
        cuda=calls.get("system", n.nvmlSystemGetCudaDriverVersion),
        gpus=tuple(gpus),
        pairs=pairs,
        gpu_pids={pid: tuple(gpus) for pid, gpus in processes.items()},
        smi_topo=nvidia_smi_topo(),
    )


def nvidia_smi_topo() -> str | None:
    """`nvidia-smi topo -m`, the matrix the article asks to read, when nvidia-smi is installed."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`nvidia-smi topo -m` failed: {exc}"
    return done.stdout if done.returncode == 0 else f"`nvidia-smi topo -m` exited {done.returncode}: {done.stderr}"


def is_vllm(name: str, cmdline: list[str]) -> bool:
    """``VLLM::*`` titles, ``vllm serve`` (or ``python .../vllm serve``) and ``python -m vllm.entrypoints...``.

    Only the command itself counts: ``pytest -m "not vllm"`` mentions vllm but is not it.
    """
    if VLLM_TITLE.match(name):
        return True
    return "vllm" in (Path(arg).name for arg in cmdline[:2]) or any(a.startswith("vllm.entrypoints") for a in cmdline)


def vllm_processes(gpu_pids: dict[int, tuple[int, ...]]) -> list[VllmProcess]:
    """The vLLM processes here, with their CPU affinity and the GPUs ``gpu_pids`` (pid -> GPU indexes) puts them on."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            name, cmdline = proc.info["name"] or "", proc.info["cmdline"] or []
            if not is_vllm(name, cmdline):
                continue
            affinity = frozenset(proc.cpu_affinity())
        except (psutil.Error, OSError):
            continue
        label = name if VLLM_TITLE.match(name) else " ".join(cmdline)[:80]
        found.append(VllmProcess(proc.pid, label, affinity, gpu_pids.get(proc.pid, ())))
    return found


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    """One GET on a fresh connection: (status, at most 64 KiB of body), or (0, why none came)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read(65536)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(65536)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(exc, http.client.HTTPException):  # a gRPC port, or something else than HTTP/1.1
            reason = f"not an HTTP/1.1 answer ({exc.__class__.__name__}): a gRPC port?"
        return 0, str(reason).encode()


def read_plugins(engines: Sequence[Any], connections: int = 8, timeout: float = 5.0) -> list[PluginReadings]:
    """Each engine's admin API, read (no token: reads need none) on ``connections`` fresh connections, so that
    the answers come from as many of its API server processes as there are, up to that many."""
    found = []
    for engine in engines:
        base = engine.admin_url
        answers = tuple(_get(base + INFO_PATH, timeout) for _ in range(connections))
        status, body = _get(base + ADMISSION_PATH, timeout) if any(s == 200 for s, _ in answers) else (0, b"")
        admission = None
        if status == 200:
            with contextlib.suppress(ValueError):
                admission = json.loads(body)
        found.append(
            PluginReadings(engine.name, mask_url(base), answers, admission if isinstance(admission, dict) else None)
        )
    return found
