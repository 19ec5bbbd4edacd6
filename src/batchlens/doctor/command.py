"""`batchlens doctor`: the click wiring. The work is in probe.py and checks.py."""

from __future__ import annotations

import json
import sys

import click

from batchlens.clikit import config_option
from batchlens.clikit import load as load_or_fail


@click.command()
@config_option
@click.option("--sample-seconds", type=click.FloatRange(0, 60), default=2.0, show_default=True,
              help="How long to sample each GPU's memory busy ratio.")  # fmt: skip
@click.option("--host-root", type=click.Path(file_okay=False, exists=True), default="/", show_default=True,
              help="Read /proc and /sys under this folder: /host when doctor runs in a container with the "
              "host's root mounted there.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the outcomes as JSON.")
def doctor(config_path: str | None, sample_seconds: float, host_root: str, as_json: bool) -> None:
    """Check this host for vLLM: GPUs, links, kernel settings, CPU affinity, and the engines' plugin.

    \b
    gpu.driver            the driver and the CUDA version it supports
    gpu.topology          NVLink state and GPU pairs across sockets (nvidia-smi topo -m)
    gpu.pcie_link         PCIe generation and width against their maximum
    gpu.memory_bandwidth  a short sample of memory busy (and GPM DRAM bandwidth)
    host.transparent_hugepage, host.numa_balancing, host.zone_reclaim_mode
    host.cpu_affinity     vLLM processes against their GPU's NUMA node
    vllm.plugin[ENGINE]   each configured engine's batchlens plugin, asked on 8
                          connections (every API server process of the server)

    Each check says PASS, WARN, FAIL or SKIP, what it found, why it matters and
    what to do. Without a GPU the GPU checks SKIP. Exit code: 1 on any FAIL,
    3 on WARNs only, 0 otherwise (SKIPs included), for CI.

    \b
    Examples:
      batchlens doctor
      batchlens doctor --host-root /host --json     # in a container, the host's root mounted at /host
      batchlens doctor --config batchlens.yaml      # and the plugin of every engine it lists
    """
    from pathlib import Path

    from batchlens.doctor import checks, probe

    config = load_or_fail(config_path, {})
    nvml = probe.read_nvml(sample_seconds=sample_seconds, root=Path(host_root))
    outcomes = checks.run_all(
        probe.read_host(Path(host_root)),
        nvml,
        probe.vllm_processes(nvml.gpu_pids),
        warn_bandwidth=config.thresholds.bandwidth_ratio,
        plugins=probe.read_plugins(config.engines),
    )
    if as_json:
        click.echo(json.dumps([o.to_dict() for o in outcomes], indent=2))
    else:
        for o in outcomes:
            click.echo(f"{o.status:<5} {o.check:<26} {o.found}")
            for label, text in (("why", o.why), ("fix", o.fix)):
                if text and o.status in (checks.WARN, checks.FAIL):
                    click.echo(f"{'':32}{label}: {text}")
        counts = {s: sum(o.status == s for o in outcomes) for s in checks.STATUSES}
        click.echo(", ".join(f"{n} {s}" for s, n in counts.items()))
    sys.exit(checks.exit_code(outcomes))
