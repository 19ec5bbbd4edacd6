"""Resident memory of `batchlens load` at the demo's rate: a day's schedule against a minute's.

    python benchmarks/load_memory.py [--rate 2.5] [--seconds 30]

Both runs send to the simulator at the same rate for the same seconds; only the schedule's length differs: the
demo's 86,400 s, and a baseline of 60 s (in the same run). A load that planned its whole schedule up front held
every request of the day before it sent the first (546 MB for the demo's day). Memory that follows the requests
in flight is the same for both: the ratio is near 1.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.exporter import BATCHLENS  # noqa: E402
from harness.simulator import SimulatorProcess  # noqa: E402

MiB = 2**20


def rss_of_load(url: str, rate: float, duration: float, seconds: float) -> tuple[float, float]:
    """Peak and median resident memory of a load of ``duration`` seconds, over its first ``seconds``."""
    load = subprocess.Popen([BATCHLENS, "load", "--url", url, "--rate", str(rate), "--duration", str(duration),
                             "--arrival", "bursty", "--output-tokens", "64,128,256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    samples = []
    try:
        process = psutil.Process(load.pid)
        end = time.monotonic() + seconds
        while time.monotonic() < end and load.poll() is None:
            samples.append(process.memory_info().rss)
            time.sleep(0.5)
    finally:
        load.terminate()
        load.wait(30)
    late = samples[len(samples) // 2 :] or samples  # once the interpreter and its imports have settled
    return max(samples), statistics.median(late)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=2.5, help="requests per second (the demo's)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each load runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sim = SimulatorProcess(Path(tmp), speed=10)
        try:
            day = rss_of_load(sim.url, args.rate, 86400, args.seconds)
            minute = rss_of_load(sim.url, args.rate, 60, args.seconds)
        finally:
            sim.stop()
    print(f"batchlens load at {args.rate:g} requests/s, {args.seconds:g} s each, resident memory (MiB):")
    print(f"{'schedule':>10} {'peak':>8} {'median':>8}")
    for name, (peak, median) in (("86400 s", day), ("60 s", minute)):
        print(f"{name:>10} {peak / MiB:8.1f} {median / MiB:8.1f}")
    print(f"load_memory day/minute median {day[1] / minute[1]:.2f}, peak {day[0] / minute[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
