"""The doctor's checks: readings in, an outcome out. Pure: no files, no NVML, no processes.

Each check turns what :mod:`batchlens.doctor.probe` read into one
:class:`Outcome`: PASS, WARN, FAIL or SKIP, what was found, why it matters for
a vLLM server and what to do. Where the article's checklist is wrong, the
check says so (docs/article.md, "Where it is wrong").
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from batchlens.admin_api import missing_plugin

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
STATUSES = (PASS, WARN, FAIL, SKIP)

# vLLM's wheels are built with CUDA 12.8 and newer; a driver must support at least that to run them
# without relying on CUDA's minor-version compatibility.
CUDA_WANTED = (12, 8)
CUDA_MAJOR_REQUIRED = 12

# nvmlDeviceGetTopologyCommonAncestor levels, nearest first (pynvml NVML_TOPOLOGY_*).
TOPOLOGY = {
    0: "same board",
    10: "one PCIe switch",
    20: "several PCIe switches",
    30: "one host bridge",
    40: "one NUMA node",
    50: "across sockets (SMP interconnect)",
}
TOPOLOGY_ACROSS_SOCKETS = 50


@dataclass(frozen=True)
class Outcome:
    check: str
    status: str
    found: str
    why: str = ""
    fix: str = ""
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# -- what the probe reads ------------------------------------------------------


@dataclass(frozen=True)
class HostReadings:
    """Raw text of the kernel's settings (None: the file is absent) and the NUMA layout."""

    thp_enabled: str | None = None
    thp_defrag: str | None = None
    numa_balancing: str | None = None
    zone_reclaim_mode: str | None = None
    numa_nodes: dict[int, frozenset[int]] = field(default_factory=dict)  # node -> its CPUs


@dataclass(frozen=True)
class GpuReadings:
    index: int
    name: str
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None  # the most this GPU in this slot can do
    pcie_gen_gpu_max: int | None = None  # the most the GPU itself can do
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    nvlinks_active: int | None = None  # None: no NVLink on this GPU
    numa_node: int | None = None
    memory_busy: tuple[float, ...] = ()  # NVML utilization.memory samples, 0..1
    dram_bandwidth: float | None = None  # GPM DRAM bandwidth ratio over the sample (Hopper and newer)


@dataclass(frozen=True)
class NvmlReadings:
    unavailable: str | None = None  # why there is no GPU data (no driver, no GPU)
    driver: str | None = None
    cuda: int | None = None  # nvmlSystemGetCudaDriverVersion: 12040 is CUDA 12.4
    gpus: tuple[GpuReadings, ...] = ()
    pairs: dict[tuple[int, int], int] = field(default_factory=dict)  # (i, j) -> topology level
    gpu_pids: dict[int, tuple[int, ...]] = field(default_factory=dict)  # pid -> GPUs it has a context on
    smi_topo: str | None = None  # `nvidia-smi topo -m`, when nvidia-smi is installed


@dataclass(frozen=True)
class VllmProcess:
    pid: int
    name: str
    affinity: frozenset[int]
    gpus: tuple[int, ...] = ()  # GPU indexes NVML lists the process on


@dataclass(frozen=True)
class PluginReadings:
    """One configured engine's admin API, asked on several fresh connections (each may land on another of its
    API server processes): each answer's (status, body), status 0 where none came (the body says why), and
    the admission state where one answered."""

    engine: str
    url: str
    answers: tuple[tuple[int, bytes], ...]
    admission: dict | None = None


# -- helpers --------------------------------------------------------------------


def selected(text: str | None) -> str | None:
    """The bracketed choice of a sysfs selector: ``always [madvise] never`` -> ``madvise``."""
    if text is None:
        return None
    match = re.search(r"\[([^\]]+)\]", text)
    return match.group(1) if match else text.strip() or None


def cpulist(text: str) -> frozenset[int]:
    """A kernel CPU list (``0-3,8,10-11``) as a set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int]) -> str:
    """The inverse of :func:`cpulist`: ``{0, 1, 2, 5}`` -> ``0-2,5``."""
    runs: list[str] = []
    ordered = sorted(cpus)
    start = prev = None
    for cpu in [*ordered, None]:
        if start is not None and (cpu is None or cpu != prev + 1):
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = None
        if cpu is not None and start is None:
            start = cpu
        prev = cpu
    return ",".join(runs)


def _skip_without_gpu(check: str, nvml: NvmlReadings) -> Outcome | None:
    if nvml.unavailable is not None:
        return Outcome(check, SKIP, f"no GPU data: {nvml.unavailable}")
    if not nvml.gpus:
        return Outcome(check, SKIP, "NVML lists no GPU")
    return None


# -- GPU checks -----------------------------------------------------------------


def driver(nvml: NvmlReadings) -> Outcome:
    check = "gpu.driver"
    if nvml.unavailable is not None:
        return Outcome(check, SKIP, f"no GPU data: {nvml.unavailable}")
    if nvml.cuda is None:
        return Outcome(
            check,
            WARN,
            f"driver {nvml.driver}; the CUDA version it supports is unknown",
            why="NVML did not report the driver's CUDA version.",
            fix="Run nvidia-smi and read its header.",
        )
    cuda = divmod(nvml.cuda // 10, 100)
    found = f"driver {nvml.driver}, CUDA {cuda[0]}.{cuda[1]}"
    details = {"driver": nvml.driver, "cuda": f"{cuda[0]}.{cuda[1]}"}
    wanted = f"{CUDA_WANTED[0]}.{CUDA_WANTED[1]}"
    if cuda[0] < CUDA_MAJOR_REQUIRED:
        return Outcome(
            check,
            FAIL,
            found,
            details=details,
            why=f"vLLM's wheels need a CUDA {CUDA_MAJOR_REQUIRED} driver; this one cannot load them.",
            fix=f"Install a driver that supports CUDA {wanted} or newer (the 570 branch or later).",
        )
    if cuda < CUDA_WANTED:
        return Outcome(
            check,
            WARN,
            found,
            details=details,
            why=f"vLLM's wheels are built with CUDA {wanted} or newer; an older driver runs them only "
            "through CUDA's minor-version compatibility, where kernels that need PTX JIT fail.",
            fix=f"Upgrade to a driver that supports CUDA {wanted} (the 570 branch or later).",
        )
    return Outcome(check, PASS, found, details=details)


def pcie(nvml: NvmlReadings) -> Outcome:
    check = "gpu.pcie_link"
    if (skip := _skip_without_gpu(check, nvml)) is not None:
        return skip
    narrow, slow, capped, unknown = [], [], [], []
    links = {}
    for g in nvml.gpus:
        if None in (g.pcie_gen, g.pcie_gen_max, g.pcie_width, g.pcie_width_max):
            unknown.append(g.index)
            continue
        links[g.index] = f"gen{g.pcie_gen}/{g.pcie_gen_max} x{g.pcie_width}/{g.pcie_width_max}"
        if g.pcie_width < g.pcie_width_max:
            narrow.append(f"GPU {g.index} x{g.pcie_width} of x{g.pcie_width_max}")
        if g.pcie_gen < g.pcie_gen_max:
            slow.append(f"GPU {g.index} gen{g.pcie_gen} of gen{g.pcie_gen_max}")
        if g.pcie_gen_gpu_max is not None and g.pcie_gen_max < g.pcie_gen_gpu_max:
            capped.append(f"GPU {g.index} gen{g.pcie_gen_max} slot for a gen{g.pcie_gen_gpu_max} GPU")
    details = {"links": links, "unknown": unknown}
    if narrow:
        return Outcome(
            check,
            FAIL,
            "; ".join(narrow),
            details=details,
            why="A link trained narrower than it can be stays that way: every host-to-GPU copy "
            "(weights at start, swapped or offloaded KV, inputs) runs at a fraction of its speed.",
            fix="Reseat the GPU or its riser, check the slot's wiring and the BIOS bifurcation "
            "setting, then confirm with `lspci -vv` (LnkSta against LnkCap).",
        )
    if capped:
        return Outcome(
            check,
            WARN,
            "; ".join(capped),
            details=details,
            why="The slot or the platform caps the link below what the GPU supports.",
            fix="Move the GPU to a slot of its generation, or set the slot's PCIe generation to Auto in the BIOS.",
        )
    if slow:
        return Outcome(
            check,
            WARN,
            "; ".join(slow),
            details=details,
            why="GPUs lower the link generation when idle to save power, so this is normal at idle; "
            "under load a low generation halves host-to-GPU bandwidth per step down.",
            fix="Run doctor again while the GPU serves: if the generation stays low, check the BIOS "
            "PCIe settings (ASPM, generation).",
        )
    if unknown and not links:
        return Outcome(check, SKIP, "NVML reports no PCIe link state (a virtual GPU, or not PCIe)", details=details)
    return Outcome(check, PASS, ", ".join(f"GPU {i} {v}" for i, v in links.items()), details=details)


def topology(nvml: NvmlReadings) -> Outcome:
    check = "gpu.topology"
    if (skip := _skip_without_gpu(check, nvml)) is not None:
        return skip
    details = {
        "nvlinks_active": {g.index: g.nvlinks_active for g in nvml.gpus},
        "pairs": {f"{i}-{j}": TOPOLOGY.get(level, str(level)) for (i, j), level in sorted(nvml.pairs.items())},
        "nvidia_smi_topo": nvml.smi_topo,
    }
    if len(nvml.gpus) == 1:
        return Outcome(check, PASS, "one GPU: tensor parallelism has no peer to talk to", details=details)
    linked = {g.index for g in nvml.gpus if g.nvlinks_active}
    down = [g.index for g in nvml.gpus if g.nvlinks_active == 0]
    if down and linked:
        return Outcome(
            check,
            FAIL,
            f"GPUs {down} have NVLink with no active link, while GPUs {sorted(linked)} do",
            details=details,
            why="A GPU whose NVLinks are down falls back to PCIe, and every all-reduce of a tensor "
            "parallel group waits for the slowest link.",
            fix="Check `nvidia-smi nvlink -s` and `nvidia-smi topo -m`; on NVSwitch systems check "
            "that nvidia-fabricmanager runs.",
        )
    if len(linked) == len(nvml.gpus):
        return Outcome(check, PASS, f"{len(nvml.gpus)} GPUs, all with active NVLink", details=details)
    far = [f"{i}-{j}" for (i, j), level in sorted(nvml.pairs.items()) if level >= TOPOLOGY_ACROSS_SOCKETS]
    if far:
        return Outcome(
            check,
            WARN,
            f"no NVLink; GPU pairs {', '.join(far)} talk across sockets",
            details=details,
            why="Tensor parallelism all-reduces every layer; across sockets without NVLink that "
            "traffic crosses the CPUs' interconnect and stretches every decode step.",
            fix="Keep each tensor-parallel group on GPUs of one NUMA node (see `nvidia-smi topo -m`, "
            "set CUDA_VISIBLE_DEVICES), or use pipeline parallelism across sockets.",
        )
    return Outcome(check, PASS, "no NVLink; every GPU pair shares a NUMA node (PCIe peer to peer)", details=details)


def memory_bandwidth(nvml: NvmlReadings, warn_ratio: float) -> Outcome:
    check = "gpu.memory_bandwidth"
    if (skip := _skip_without_gpu(check, nvml)) is not None:
        return skip
    busy, details = [], {}
    for g in nvml.gpus:
        if not g.memory_busy:
            continue
        mean = sum(g.memory_busy) / len(g.memory_busy)
        details[g.index] = {
            "memory_busy_mean": mean,
            "memory_busy_max": max(g.memory_busy),
            "dram_bandwidth": g.dram_bandwidth,
            "samples": len(g.memory_busy),
        }
        figure = g.dram_bandwidth if g.dram_bandwidth is not None else mean
        busy.append((g.index, mean, g.dram_bandwidth, figure))
    if not busy:
        return Outcome(check, SKIP, "NVML gave no memory utilization samples", details=details)
    found = "; ".join(
        f"GPU {i} memory busy {mean:.0%}" + (f", DRAM bandwidth {dram:.0%}" if dram is not None else "")
        for i, mean, dram, _ in busy
    )
    high = [i for i, _, _, figure in busy if figure > warn_ratio]
    if high:
        return Outcome(
            check,
            WARN,
            found,
            details=details,
            why=f"Above {warn_ratio:.0%} decode is bound by memory bandwidth: a larger batch adds "
            "latency to every step and little throughput. Memory busy is the share of time memory "
            "was busy, not of bandwidth; GPM DRAM bandwidth is the real ratio where the GPU has it.",
            fix="Lower the batch limit on GPUs " + ", ".join(map(str, high)) + " (or let the breaker "
            "do it), or spread the load over more replicas.",
        )
    return Outcome(check, PASS, found + f" (threshold {warn_ratio:.0%})", details=details)


# -- host checks ----------------------------------------------------------------


def transparent_hugepages(host: HostReadings) -> Outcome:
    check = "host.transparent_hugepage"
    enabled, defrag = selected(host.thp_enabled), selected(host.thp_defrag)
    if enabled is None:
        return Outcome(check, SKIP, "/sys/kernel/mm/transparent_hugepage is absent (a kernel without THP)")
    found = f"enabled={enabled} defrag={defrag}"
    details = {"enabled": enabled, "defrag": defrag}
    if enabled != "never" and defrag == "always":
        return Outcome(
            check,
            WARN,
            found,
            details=details,
            why="defrag=always makes a page fault compact memory synchronously: the API server and "
            "scheduler threads stall for milliseconds at random, which shows in P99.",
            fix="echo defer+madvise > /sys/kernel/mm/transparent_hugepage/defrag (persist it with a "
            "tmpfiles.d entry or the kernel command line).",
        )
    if enabled == "never":
        return Outcome(
            check,
            WARN,
            found,
            details=details,
            why="Large host buffers (pinned staging, CPU KV offload) get 4 KiB pages only.",
            fix="echo madvise > /sys/kernel/mm/transparent_hugepage/enabled: allocators that ask "
            "for huge pages get them. The article's `always` also works but gives every process "
            "huge pages, and khugepaged's work with them.",
        )
    return Outcome(check, PASS, found, details=details)


def numa_balancing(host: HostReadings) -> Outcome:
    check = "host.numa_balancing"
    if host.numa_balancing is None:
        return Outcome(check, SKIP, "/proc/sys/kernel/numa_balancing is absent (a kernel without NUMA balancing)")
    value = host.numa_balancing.strip()
    found = f"kernel.numa_balancing = {value}"
    if value == "0":
        return Outcome(check, PASS, found)
    if len(host.numa_nodes) <= 1:
        return Outcome(check, PASS, found + ", but this machine has one NUMA node: there is nothing to migrate")
    return Outcome(
        check,
        WARN,
        found + f" on {len(host.numa_nodes)} NUMA nodes",
        why="Automatic NUMA balancing unmaps pages to watch who touches them and migrates them: "
        "hinting faults and migrations stall the threads that feed the GPU.",
        fix="sysctl -w kernel.numa_balancing=0, persisted in /etc/sysctl.d/. The article's "
        "`vm.zone_reclaim_mode=0` does not do this: it is a different switch.",
    )


def zone_reclaim(host: HostReadings) -> Outcome:
    check = "host.zone_reclaim_mode"
    if host.zone_reclaim_mode is None:
        return Outcome(check, SKIP, "/proc/sys/vm/zone_reclaim_mode is absent (a kernel without NUMA)")
    value = host.zone_reclaim_mode.strip()
    found = f"vm.zone_reclaim_mode = {value}"
    if value == "0":
        return Outcome(check, PASS, found + " (it does not switch NUMA balancing off; see host.numa_balancing)")
    return Outcome(
        check,
        WARN,
        found,
        why="The kernel reclaims memory on the local node (dropping page cache, even writing "
        "back) before it allocates on another node: allocation stalls under memory pressure.",
        fix="sysctl -w vm.zone_reclaim_mode=0, persisted in /etc/sysctl.d/.",
    )


def cpu_affinity(host: HostReadings, nvml: NvmlReadings, processes: Sequence[VllmProcess]) -> Outcome:
    check = "host.cpu_affinity"
    if not processes:
        return Outcome(check, SKIP, "no vLLM process runs here")
    details = {p.pid: {"name": p.name, "cpus": format_cpus(p.affinity), "gpus": list(p.gpus)} for p in processes}
    if len(host.numa_nodes) <= 1:
        return Outcome(
            check, PASS, f"{len(processes)} vLLM process(es); one NUMA node: every CPU is local", details=details
        )
    if nvml.unavailable is not None:
        return Outcome(check, SKIP, f"cannot tell the GPUs' NUMA nodes: {nvml.unavailable}", details=details)
    node_of = {g.index: g.numa_node for g in nvml.gpus}
    wrong, loose = [], []
    for p in processes:
        nodes = {node_of.get(i) for i in p.gpus} - {None}
        if len(nodes) != 1:
            continue  # no GPU, or GPUs on several nodes: no single right answer
        node = nodes.pop()
        local = host.numa_nodes.get(node, frozenset())
        if not p.affinity & local:
            wrong.append((p, node, local))
        elif not p.affinity <= local:
            loose.append((p, node, local))
    if wrong:
        p, node, local = wrong[0]
        return Outcome(
            check,
            FAIL,
            f"pid {p.pid} ({p.name}) runs on CPUs {format_cpus(p.affinity)}, none of them "
            f"on NUMA node {node} of its GPU",
            details=details,
            why="Every copy to and from the GPU crosses the sockets' interconnect, and the process's "
            "memory sits on the far node.",
            fix=f"Start vLLM with `numactl --cpunodebind={node} --membind={node}` or "
            f"`taskset -c {format_cpus(local)}`.",
        )
    if loose:
        p, node, local = loose[0]
        return Outcome(
            check,
            WARN,
            f"pid {p.pid} ({p.name}) may run on any of CPUs {format_cpus(p.affinity)}; its "
            f"GPU is on NUMA node {node} (CPUs {format_cpus(local)})",
            details=details,
            why="The scheduler can move the process to the far socket, where host-GPU copies and "
            "its memory are remote.",
            fix=f"taskset -c {format_cpus(local)} (the article's fixed `taskset -c 0-7` is right only "
            "when the GPU sits on node 0), or numactl --cpunodebind.",
        )
    return Outcome(check, PASS, f"{len(processes)} vLLM process(es) pinned to their GPU's NUMA node", details=details)


def plugin(readings: PluginReadings) -> Outcome:
    """Whether batchlens can steer this engine: the plugin answers on every connection, in every API server."""
    check, url = f"vllm.plugin[{readings.engine}]", readings.url
    statuses = [status for status, _ in readings.answers]
    asked = len(statuses)
    if not statuses or set(statuses) == {0}:
        said = readings.answers[0][1].decode(errors="replace") if readings.answers else "not asked"
        return Outcome(
            check, WARN, f"no answer from {url}: {said}", why="batchlens reads and steers the engine through its "
            "admin API", fix="start the server, or correct the engine's url in the config",
        )  # fmt: skip
    if 200 in statuses and set(statuses) != {200}:
        return Outcome(
            check, FAIL, f"{url}: the admin API answered on {statuses.count(200)} of {asked} connections, "
            f"{', '.join(str(s) for s in sorted(set(statuses) - {200}))} on the others",
            why="one of the server's API server processes runs without the plugin: the caps do not hold for the "
            "requests it takes",
            fix="set VLLM_PLUGINS=batchlens in the environment of the whole vllm serve, and restart it",
        )  # fmt: skip
    status, body = next((s, b) for s, b in readings.answers if s)
    if status == 404:
        return Outcome(check, FAIL, f"{url} answered 404", why=missing_plugin(body),
                       fix="the setting named above; docs/vllm-plugin.md")  # fmt: skip
    if status == 501:
        return Outcome(check, FAIL, f"{url}: the plugin refused this vLLM: {_said(body)}",
                       fix="a vLLM release the plugin supports (docs/compatibility.md)")  # fmt: skip
    if status != 200:
        return Outcome(check, WARN, f"{url} answered {status}: {_said(body)}")
    info = _json(body)
    found = (
        f"batchlens {info.get('batchlens_version', '?')} on vLLM {info.get('vllm_version', '?')}, "
        f"{info.get('engines', '?')} engine core(s)"
    )
    admission = readings.admission or {}
    servers, behind = admission.get("api_servers", 1), admission.get("api_servers_behind") or []
    found += f", {servers} API server(s)"
    if behind:
        return Outcome(
            check, FAIL, f"{found}: API server(s) {behind} do not have the door's caps in force",
            why="a process that does not tick is hung or runs without the plugin: the caps do not hold for the "
            "requests it takes",
            fix="set VLLM_PLUGINS=batchlens for the whole vllm serve and restart it; its log says which process failed",
        )  # fmt: skip
    return Outcome(check, PASS, found, details={"info": info, "admission": admission})


def _json(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _said(body: bytes) -> str:
    """A refusal's own reason, one line, at most 200 characters."""
    said = _json(body).get("error") or body.decode(errors="replace")
    return " ".join(str(said).split())[:200]


def run_all(
    host: HostReadings, nvml: NvmlReadings, processes: Sequence[VllmProcess], *, warn_bandwidth: float,
    plugins: Sequence[PluginReadings] = (),
) -> list[Outcome]:  # fmt: skip
    return [
        driver(nvml),
        topology(nvml),
        pcie(nvml),
        memory_bandwidth(nvml, warn_bandwidth),
        transparent_hugepages(host),
        numa_balancing(host),
        zone_reclaim(host),
        cpu_affinity(host, nvml, processes),
        *(plugin(readings) for readings in plugins),
    ]


def exit_code(outcomes: Sequence[Outcome]) -> int:
    """For CI: 1 when anything failed, 3 when something warned, else 0 (SKIP is not a failure)."""
    statuses = {o.status for o in outcomes}
    return 1 if FAIL in statuses else 3 if WARN in statuses else 0
