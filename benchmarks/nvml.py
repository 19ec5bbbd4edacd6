"""Time the NVML source's work per GPU per tick, against the fake pynvml (no GPU needed).

    python benchmarks/nvml.py [--gpus 8] [--budget 5]

Each round times, interleaved so that both see the same machine:
- ours: one tick of the NVML source (every call, the error policy, GPM, the
  engine mapping through this process's real process tree, metric families);
- bare calls: the same NVML calls made directly in a loop, with nothing done
  with the answers: the least any exporter pays for the same data.

The fake counts the time spent inside its functions ("in driver"); on a real
GPU that time is the driver's. The figure that matters is ours minus the
driver time, per GPU: the goal is 1 ms or less. The last line is
`ratio <ours / bare calls>`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from batchlens.config import Engine
from batchlens.exporter.nvml_source import NvmlSource
from harness.fake_pynvml import GPM_DRAM, GPM_OCCUPANCY, GPM_SM, GPM_TENSOR, FakeNvml, FakeProcess, h100_sxm


def bare_calls(n, count: int) -> None:
    """The NVML calls of one tick, answers discarded (GPM and processes included)."""
    for i in range(count):
        h = n.nvmlDeviceGetHandleByIndex(i)
        n.nvmlDeviceGetUtilizationRates(h)
        n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)
        n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)
        n.nvmlDeviceGetPowerUsage(h)
        n.nvmlDeviceGetTotalEnergyConsumption(h)
        n.nvmlDeviceGetTemperatureV(h, n.NVML_TEMPERATURE_GPU)
        n.nvmlDeviceGetFieldValues(h, [(n.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0), (n.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0)])
        n.nvmlDeviceGetCurrentClocksEventReasons(h)
        n.nvmlDeviceGetEccMode(h)
        n.nvmlDeviceGetMigMode(h)
        n.nvmlDeviceGetComputeRunningProcesses_v3(h)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--budget", type=float, default=5.0, help="seconds of interleaved rounds")
    args = parser.parse_args()

    # An "engine" served by this very process, so the mapping walks a real process tree each tick.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    engine = Engine(name="bench", url=f"http://127.0.0.1:{server.getsockname()[1]}")
    rates = {GPM_DRAM: 64.0, GPM_SM: 80.0, GPM_OCCUPANCY: 35.0, GPM_TENSOR: 55.0}
    gpus = [h100_sxm(i, gpm=rates, processes=[FakeProcess(os.getpid(), 70 << 30)]) for i in range(args.gpus)]
    fake = FakeNvml(gpus)
    module = fake.module()
    source = NvmlSource([engine], nvml=module, models=lambda: {"bench": "deepseek"})
    source.sample_now({})  # discovery, the first GPM sample, the process lineages

    ours, ours_driver, bare, bare_driver = [], [], [], []
    deadline = time.perf_counter() + args.budget
    while len(ours) < 20 or time.perf_counter() < deadline:
        fake.advance(5)
        in_driver, t0 = fake.seconds_in_driver, time.perf_counter()
        reading = source.sample_now({"bench": "deepseek"})
        ours.append(time.perf_counter() - t0)
        ours_driver.append(fake.seconds_in_driver - in_driver)
        in_driver, t0 = fake.seconds_in_driver, time.perf_counter()
        bare_calls(module, args.gpus)
        bare.append(time.perf_counter() - t0)
        bare_driver.append(fake.seconds_in_driver - in_driver)
    assert not reading.soft_errors, reading.soft_errors

    def per_gpu_ms(values: list[float]) -> float:
        return statistics.median(values) / args.gpus * 1e3

    def row(label: str, totals: list[float], drivers: list[float]) -> float:
        outside = per_gpu_ms([t - d for t, d in zip(totals, drivers, strict=True)])
        print(f"{label:28} {per_gpu_ms(totals):>9.3f} {per_gpu_ms(drivers):>13.3f} {outside:>18.3f}")
        return outside

    print(f"{args.gpus} fake H100 GPUs with GPM, one engine process each; medians of {len(ours)} interleaved rounds")
    print(f"{'per GPU per tick':28} {'total ms':>9} {'in driver ms':>13} {'outside driver ms':>18}")
    own = row("ours (NvmlSource tick)", ours, ours_driver)
    row("bare calls (baseline)", bare, bare_driver)
    goal = "met" if own <= 1.0 else "MISSED"
    print(f"goal: at most 1 ms per GPU per tick outside the driver: {goal}")
    print(f"ratio {statistics.median(ours) / statistics.median(bare):.3f}")
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
