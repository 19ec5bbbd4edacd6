"""The adaptive controller on a real vLLM 0.32 (CPU): its goodput against static limits, and the door's worth.

    python benchmarks/control_vllm.py [--runs 5]

Real: vLLM from make vllm-env with the batchlens plugin from a wheel built here, `batchlens remediate` with
the controller on, the exporter, and `batchlens replay --url` judging every request at the client. The
scenario is tests/harness/control_vllm.py's:

1. One bursty trace (60 s at 10 requests/s, CV 2) at the capacity (32) and at a small static limit (12), then
   steered from 12 by the limit-only controller, run after run: each run's ratio to the best static limit, and
   their median and spread.
2. What the server serves at its capacity with this mix, measured first from a backlog (it differs from
   machine to machine: 73 requests/s on an AVX-512 one with two cores), then the same kind of trace at 1.5x
   that, steered from 12 with `control.admission` on and off: goodput with the door against without, and the
   admitted requests' TTFT. Both knobs as shipped against the limit alone: with the door on, the limit law
   also regrows faster after a fall (control/law.py, ``door``), since a backlog is shed.

tests/test_vllm_api_servers.py asserts, in make test, that the controller moves the limit at all.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from batchlens.admin_api import TOKEN_ENV  # noqa: E402
from harness.control_vllm import bursty_trace, served_rate, steer, steer_against_statics  # noqa: E402
from harness.vllm import ADMIN_TOKEN, install_plugin, start_vllm  # noqa: E402
from harness.wheel import build_distributions  # noqa: E402

OVERLOAD = 1.5  # x what the server serves at its capacity


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="steered runs of the bursty trace (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchlens-bench-control-") as tmp:
        work = Path(tmp)
        wheel = build_distributions(work / "dist").wheel
        env = {**install_plugin(wheel, work / "site"), TOKEN_ENV: ADMIN_TOKEN}
        server = start_vllm(work / "vllm", env=env)
        try:
            server.load(requests=48, concurrency=16, max_tokens=32)  # the first requests' one-off costs, paid here
            comparison = steer_against_statics(work / "bursty", server, runs=args.runs)
            print(comparison.summary(), flush=True)
            served = served_rate(work / "capacity", server)
            rate = round(OVERLOAD * served, 1)
            trace, count = bursty_trace(work, rate=rate)
            door = {on: steer(work / f"overload-{on}", server, trace, admission=on) for on in (False, True)}
        finally:
            server.process.stop()
    ratios = comparison.ratios
    print(
        f"controller/best_static over {len(ratios)} runs: median {statistics.median(ratios):.2f}, "
        f"min {min(ratios):.2f}, max {max(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
    )
    print(f"served at the capacity: {served:.1f} requests/s; overload {rate:g} requests/s ({count} requests)")
    for on, s in door.items():
        refused = sum(s.accounting["refused"].values())
        print(
            f"overload, admission {'on' if on else 'off'}: goodput {s.run['goodput_rps']:.2f} (attainment "
            f"{s.run['slo_attainment']:.2f}; TTFT of the answered P50 {s.run['p50_ttft_s']:.2f} s, P99 "
            f"{s.run['p99_ttft_s']:.2f} s), refused {refused}, failed {sum(s.accounting['failed'].values())}; "
            f"limits {s.limits_seen[::10]}"
        )
    off, on = (door[k].run["goodput_rps"] for k in (False, True))
    # The same trace either way, so the attainments' ratio is the good requests': goodput's without the runs'
    # lengths (without the door the backlog drains long after the last arrival: benchmarks/controller.py).
    good_off, good_on = (door[k].run["slo_attainment"] for k in (False, True))
    print(f"overload admission/without {on / off if off else float('inf'):.2f} "
          f"(in good requests {good_on / good_off if good_off else float('inf'):.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
