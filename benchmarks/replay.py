"""How much faster than real time `batchlens replay --simulated` replays a trace.

    python benchmarks/replay.py [--minutes 60] [--rate 5] [--gpu h100] [--rounds 3]

A Poisson trace of --rate requests/s for --minutes (chat lengths: prompts of
256-1024 tokens, answers of 64-256), replayed under vLLM's default
policy on the simulator's engine model. It prints the median wall time of
--rounds replays, the simulated seconds, and the speed-up over real time
(last line: `speedup X`, the trace's length over the median wall time).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from batchlens.goodput import Slo
from batchlens.replay.policies import Static
from batchlens.replay.simulated import replay
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine
from batchlens.simulator.profiles import GPUS, MODELS


def trace(minutes: float, rate: float, seed: int = 1) -> list[TraceRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < minutes * 60:
        out.append(TraceRequest(t, rng.choice((256, 512, 1024)), rng.choice((64, 128, 256))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--rate", type=float, default=5)
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    requests = trace(args.minutes, args.rate)
    walls, run = [], None
    for _ in range(args.rounds):
        engine = Engine(GPUS[args.gpu], MODELS["dense-7b"], max_num_seqs=256)
        started = time.perf_counter()
        run = replay(requests, engine, Static(), Slo(0.5, 0.1))
        walls.append(time.perf_counter() - started)
    wall = statistics.median(walls)
    j = run.judgement
    print(f"{len(requests)} requests over {args.minutes * 60:.0f} s of trace ({args.rate:g}/s), {args.gpu}, dense-7b")
    print(f"replayed in {wall:.1f} s wall (median of {args.rounds}: {', '.join(f'{w:.1f}' for w in walls)}); "
          f"{j.seconds:.0f} s simulated, goodput {j.goodput_rps:.2f}/s, attainment {j.slo_attainment:.1%}")  # fmt: skip
    print(f"speedup {args.minutes * 60 / wall:.0f}")


if __name__ == "__main__":
    main()
