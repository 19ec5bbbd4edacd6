"""The hook at fleet scale: one `batchlens remediate` steering 16, 64 and 256 engines on this machine's cores.

    python benchmarks/hook_fleet.py [--engines 16,64,256] [--seconds 60] [--interval 2]

The engines are upstreams (tests/harness/upstreams.py, one aiohttp server in a thread of this process), each
serving a real vLLM 0.32 exposition and the batchlens admin API (the batch limit; not the door's caps, so the
controller steers the limit alone). Every `--interval` the hook reads each engine's admin API and /metrics and
decides, as it does live. Per fleet it prints, over the last `--seconds`:
- the tick's p50 and p99 (batchlens_controller_tick_seconds, interpolated within its buckets) and the share of
  ticks longer than the interval (late);
- the ticks done against those due (engines x seconds / interval): under 1, the hook falls behind;
- the hook's CPU (a share of one core) and resident memory.
The last line is the ratios of the largest fleet to the smallest, measured in the same run (the baseline).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.exporter import pick  # noqa: E402
from harness.remediate import RemediateProcess  # noqa: E402
from harness.upstreams import Upstreams  # noqa: E402

TOKEN = "fleet-admin-token"
MiB = 2**20


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The q-quantile of a cumulative histogram (bound, count), linear within a bucket as histogram_quantile()."""
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            return bound if math.isinf(bound) else lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return math.inf


def tick_histogram(hook: RemediateProcess) -> tuple[list[tuple[float, float]], float]:
    """The hook's tick histogram (bound, cumulative count), and the ticks done by reason other than the door's."""
    samples = hook.samples()
    buckets = sorted((float(dict(labels)["le"]), value) for labels, value in
                     pick(samples, "batchlens_controller_tick_seconds_bucket").items())  # fmt: skip
    return buckets, sum(pick(samples, "batchlens_controller_tick_seconds_count").values())


def run(fleet: int, upstreams: Upstreams, exposition: str, seconds: float, interval: float) -> dict[str, float]:
    admin = {"max_num_seqs": 256, "max_num_active_seqs": 64, "num_running": 0, "num_waiting": 0}
    engines = [{"name": f"f{fleet}-{i}", "url": upstreams.add(f"f{fleet}-{i}", text=exposition, admin=dict(admin),
                                                             admin_token=TOKEN)} for i in range(fleet)]  # fmt: skip
    control = {"enabled": True, "interval_seconds": interval, "timeout_seconds": min(2.0, interval)}
    with tempfile.TemporaryDirectory() as tmp:
        hook = RemediateProcess(Path(tmp), {"engines": engines, "control": control},
                                env={"BATCHLENS_ADMIN_TOKEN": TOKEN})  # fmt: skip
        try:
            time.sleep(3 * interval)  # every engine read and decided once, warmed up
            process = psutil.Process(hook.process.pid)
            before, done_before = tick_histogram(hook)
            cpu_before, started = process.cpu_times(), time.monotonic()
            time.sleep(seconds)
            after, done_after = tick_histogram(hook)
            cpu_after, took = process.cpu_times(), time.monotonic() - started
            rss = process.memory_info().rss
        finally:
            hook.stop()
    window = [(bound, count - dict(before).get(bound, 0.0)) for bound, count in after]
    late = window[-1][1] - max((count for bound, count in window if bound <= interval), default=0.0)
    cpu = (cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system) / took
    return {
        "p50": quantile(window, 0.5), "p99": quantile(window, 0.99), "late": late / max(window[-1][1], 1),
        "done_share": (done_after - done_before) / (fleet * took / interval), "cpu": cpu, "rss": rss / MiB,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="16,64,256", help="fleet sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured per fleet, after a warm-up")
    parser.add_argument("--interval", type=float, default=2.0, help="control.interval_seconds (the default: 2)")
    args = parser.parse_args()
    fleets = [int(n) for n in args.engines.split(",")]
    exposition = (ROOT / "tests" / "data" / "vllm-0.32.0-cpu.prom").read_text()
    upstreams = Upstreams()
    rows = {}
    try:
        for fleet in fleets:
            rows[fleet] = run(fleet, upstreams, exposition, args.seconds, args.interval)
    finally:
        upstreams.close()
    print(f"interval {args.interval:g} s, {args.seconds:g} s measured per fleet, {psutil.cpu_count()} cores")
    print(f"{'engines':>7} {'tick p50 ms':>11} {'tick p99 ms':>11} {'late':>6} {'done/due':>8} {'cpu':>6} "
          f"{'rss MiB':>8}")  # fmt: skip
    for fleet, row in rows.items():
        print(f"{fleet:>7} {row['p50'] * 1e3:>11.1f} {row['p99'] * 1e3:>11.1f} {row['late']:>6.1%} "
              f"{row['done_share']:>8.2f} {row['cpu']:>6.0%} {row['rss']:>8.1f}")  # fmt: skip
    small, large = rows[fleets[0]], rows[fleets[-1]]
    print(f"ratio {fleets[-1]}/{fleets[0]} engines: tick p99 {large['p99'] / small['p99']:.2f}, cpu "
          f"{large['cpu'] / max(small['cpu'], 1e-9):.1f}, rss {large['rss'] / small['rss']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
