"""Time the NVML source's work per GPU per tick, against the fake pynvml (no GPU needed).

    python benchmarks/nvml.py [--gpus 8] [--budget 5] [--real]

Each round times, interleaved so that both see the same machine:
- ours: one tick of the NVML source (every call, the error policy, GPM, the
  engine mapping through this process's real process tree, metric families);
- bare calls: the same NVML calls made directly in a loop, with nothing done
  with the answers: the least any exporter pays for the same data.

The fake counts the time spent inside its functions ("in driver"); on a real
GPU that time is the driver's. The figure that matters is ours minus the
driver time, per GPU: the goal is 1 ms or less. The last line is
`ratio <ours / bare calls>`.

`--real` runs the same rounds against the real driver (scripts/gpu-check.sh does,
on every GPU of the host): the driver's time cannot be told apart there, so the
figure is ours over the bare calls, whose difference is our own work.
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
from batchlens.exporter.nvml_source import GPM_METRICS, NvmlSource
from harness.fake_pynvml import GPM_DRAM, GPM_OCCUPANCY, GPM_SM, GPM_TENSOR, FakeNvml, FakeProcess, h100_sxm


class BareCalls:
    """The NVML calls of one tick, answers discarded (GPM and processes included)."""

    def __init__(self, n, count: int):
        self._n, self._count = n, count
        self._samples = [(n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()) for _ in range(count)]
        self._ids = [getattr(n, attr) for attr, _ in GPM_METRICS]
        self._flip, self._primed = 0, False

    def __call__(self) -> None:
        n = self._n
        self._flip = 1 - self._flip
        for i in range(self._count):
            h = n.nvmlDeviceGetHandleByIndex(i)
            n.nvmlDeviceGetUtilizationRates(h)
            n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
            n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)
            n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM)
            n.nvmlDeviceGetPowerUsage(h)
            n.nvmlDeviceGetTotalEnergyConsumption(h)
            n.nvmlDeviceGetTemperatureV(h, n.NVML_TEMPERATURE_GPU)
            pcie = [(n.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 0), (n.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0)]
            n.nvmlDeviceGetFieldValues(h, pcie)
            n.nvmlDeviceGetCurrentClocksEventReasons(h)
            n.nvmlDeviceGetEccMode(h)
            for kind in (n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED):
                n.nvmlDeviceGetTotalEccErrors(h, kind, n.NVML_VOLATILE_ECC)
            n.nvmlDeviceGetMigMode(h)
            n.nvmlDeviceGetComputeRunningProcesses_v3(h)
            previous, current = self._samples[i][1 - self._flip], self._samples[i][self._flip]
            n.nvmlGpmSampleGet(h, current)
            if not self._primed:  # a rate needs two samples
                continue
            req = n.c_nvmlGpmMetricsGet_t()
            req.version, req.numMetrics = n.NVML_GPM_METRICS_GET_VERSION, len(self._ids)
            req.sample1, req.sample2 = previous, current
            for k, metric_id in enumerate(self._ids):
                req.metrics[k].metricId = metric_id
            n.nvmlGpmMetricsGet(req)
        self._primed = True


class RealDriver:
    """Stands in for the fake's clock on the real driver: no time advanced, none counted as the driver's."""

    seconds_in_driver = 0.0

    def advance(self, seconds: float) -> None:
        time.sleep(0.01)  # a little time between ticks, so GPM's rates have an interval


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--budget", type=float, default=5.0, help="seconds of interleaved rounds")
    parser.add_argument("--real", action="store_true", help="the real driver and every GPU (ignores --gpus)")
    args = parser.parse_args()

    # An "engine" served by this very process, so the mapping walks a real process tree each tick.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    engine = Engine(name="bench", url=f"http://127.0.0.1:{server.getsockname()[1]}")
    if args.real:
        import pynvml as module

        module.nvmlInit()
        args.gpus = module.nvmlDeviceGetCount()
        fake = RealDriver()
    else:
        rates = {GPM_DRAM: 64.0, GPM_SM: 80.0, GPM_OCCUPANCY: 35.0, GPM_TENSOR: 55.0}
        gpus = [h100_sxm(i, gpm=rates, processes=[FakeProcess(os.getpid(), 70 << 30)]) for i in range(args.gpus)]
        fake = FakeNvml(gpus)
        module = fake.module()
    source = NvmlSource([engine], nvml=module, models=lambda: {"bench": "deepseek"})
    source.sample_now({})  # discovery, the first GPM sample, the process lineages
    bare_tick = BareCalls(module, args.gpus)
    bare_tick()  # its first GPM sample: the rounds compare two, as the source's do

    ours, ours_driver, bare, bare_driver = [], [], [], []
    deadline = time.perf_counter() + args.budget
    while len(ours) < 20 or time.perf_counter() < deadline:
        fake.advance(5)
        in_driver, t0 = fake.seconds_in_driver, time.perf_counter()
        reading = source.sample_now({"bench": "deepseek"})
        ours.append(time.perf_counter() - t0)
        ours_driver.append(fake.seconds_in_driver - in_driver)
        in_driver, t0 = fake.seconds_in_driver, time.perf_counter()
        bare_tick()
        bare.append(time.perf_counter() - t0)
        bare_driver.append(fake.seconds_in_driver - in_driver)
    if args.real:  # a real driver may lack a call (a counted soft error, as the exporter would count it)
        print("soft errors:", reading.soft_errors or "none")
    else:
        assert not reading.soft_errors, reading.soft_errors

    def per_gpu_ms(values: list[float]) -> float:
        return statistics.median(values) / args.gpus * 1e3

    def row(label: str, totals: list[float], drivers: list[float]) -> float:
        outside = per_gpu_ms([t - d for t, d in zip(totals, drivers, strict=True)])
        print(f"{label:28} {per_gpu_ms(totals):>9.3f} {per_gpu_ms(drivers):>13.3f} {outside:>18.3f}")
        return outside

    what = "real GPUs (driver time not told apart)" if args.real else "fake H100 GPUs with GPM, one engine process each"
    print(f"{args.gpus} {what}; medians of {len(ours)} interleaved rounds")
    print(f"{'per GPU per tick':28} {'total ms':>9} {'in driver ms':>13} {'outside driver ms':>18}")
    own = row("ours (NvmlSource tick)", ours, ours_driver)
    baseline = row("bare calls (baseline)", bare, bare_driver)
    if args.real:  # the driver's time is in both: our own work is the difference
        own -= baseline
    goal = "met" if own <= 1.0 else "MISSED"
    print(f"goal: at most 1 ms per GPU per tick {'over the bare calls' if args.real else 'outside the driver'}: {goal}")
    print(f"ratio {statistics.median(ours) / statistics.median(bare):.3f}")
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
