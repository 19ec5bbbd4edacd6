"""How much could any batch-limit schedule gain over the best static limit? A hindsight estimate, in simulated time.

    python benchmarks/hindsight.py [--profile article|published] [--segment 30] [--seconds 300] [--seed 1]

On benchmarks/controller.py's workloads, a schedule that knows the whole trace picks one static limit per
--segment seconds, greedily in time order: each segment takes the candidate limit that gives the most goodput
over the whole run, the segments after it held at the best static limit. No controller can see the future,
so this estimates what steering the limit could be worth at that time scale. It is no bound: the search is
greedy, over a grid (CANDIDATES and the best static limit) held for whole segments, so a schedule that moves
more often or to other limits could gain more (the search only ever keeps a schedule at least as good as
the best static limit), and a door beside the limit is no schedule of limits at all. It prints, per
workload, the best static limit's goodput, the schedule's, their ratio, and the adaptive controller's ratio
to the best static limit for comparison. The last line is `hindsight/best_static max X` over the non-steady
workloads: where X is under 1.10, the limit alone is unlikely to reach 1.10 there, though this does not
prove it cannot.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from batchlens.replay.policies import Adaptive, Signals
from batchlens.replay.simulated import oracle, replay
from batchlens.simulator.engine import Engine
from batchlens.simulator.profiles import GPUS
from controller import CAPACITY, PROFILES, SLO, engine_of, workloads

CANDIDATES = (8, 16, 24, 32, 48, 64, 128)


@dataclass(frozen=True)
class Schedule:
    """A static limit per segment of ``segment_seconds``, the last one held to the end."""

    limits: tuple[int, ...]
    segment_seconds: float
    tick_seconds: float = 1.0
    wants_metrics: bool = False

    @property
    def name(self) -> str:
        return "hindsight"

    def initial(self, capacity: int) -> int:
        return self.limits[0]

    def decide(self, signals: Signals) -> int:
        return self.limits[min(int(signals.now // self.segment_seconds), len(self.limits) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="article")
    parser.add_argument("--segment", type=float, default=30.0, help="seconds per segment of the schedule")
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    gpu, model, rate = PROFILES[args.profile]

    def engine() -> Engine:
        return engine_of(args.profile)

    segments = int(-(-args.seconds // args.segment))
    print(f"{args.profile}: {GPUS[gpu].name}, {model}; a limit per {args.segment:g} s ({segments} segments) "
          f"from {CANDIDATES}")  # fmt: skip
    print(f"{'workload':10} {'best static':>17} {'hindsight':>10} {'hind/best':>10} {'adapt/best':>10} {'wall s':>7}")
    ratios = {}
    for name, trace in workloads(args.seconds, args.seed, rate).items():
        started = time.perf_counter()
        best, _ = oracle(trace, engine, SLO)
        base = int(best.policy.partition(":")[2] or CAPACITY)
        chosen: list[int] = []
        score = best.judgement.goodput_rps
        for i in range(segments):
            rest = (base,) * (segments - i - 1)
            tried = {limit: replay(trace, engine(), Schedule((*chosen, limit, *rest), args.segment), SLO)
                     for limit in (base, *CANDIDATES)}  # fmt: skip
            pick = max(tried, key=lambda limit: tried[limit].judgement.goodput_rps)
            chosen.append(pick)
            score = tried[pick].judgement.goodput_rps
        adaptive = replay(trace, engine(), Adaptive(SLO), SLO).judgement.goodput_rps
        ratios[name] = score / best.judgement.goodput_rps
        print(f"{name:10} {best.policy:>9} {best.judgement.goodput_rps:7.3f} {score:10.3f} {ratios[name]:10.2f} "
              f"{adaptive / best.judgement.goodput_rps:10.2f} {time.perf_counter() - started:7.1f}")  # fmt: skip
        print(f"{'':10} schedule: {chosen}")
    print(f"hindsight/best_static max {max(v for k, v in ratios.items() if k != 'steady'):.2f}")


if __name__ == "__main__":
    main()
