"""The demo's regime, near its engine's capacity: every policy against the best static limit, in simulated time.

    python benchmarks/demo_regime.py [--rate 3.25 --rate 3.5] [--seconds 600] [--seed 1]

`batchlens demo` runs one simulated engine (A100-80GB, dense-7b, max_num_seqs 64) under `batchlens load`'s
bursty arrivals (2 s at 3x the rate, then quiet) with the article's prompt buckets (256-2048 tokens) and 128
output tokens. Live, that engine took 2.9-3 requests/s within the SLO (TTFT 0.5 s, TPOT 0.1 s), where the
controller settled past the throughput peak and the breaker cold-started the limit at 1; in simulated time
every request can still be good at 3.0, and the cliff comes at 3.25-3.5. This replays the demo's own load
plan (batchlens.load.plan, the same seed) at those rates, without the periodic overload phase, under
`default`, `breaker`, `adaptive`, `admit` and `adaptive+admit`, beside the best static limit. The controller
starts where it does in the demo, at the limit in force (64, the engine's max_num_seqs), not at the eighth
of the capacity a replay starts from by default
(batchlens.replay.simulated.oracle). It prints goodput, the ceiling (every request good), the ratios to the
best static limit and the share shed. The last lines are `adaptive/best_static min X` and
`adaptive+admit/best_static min Y` over the rates.
"""

from __future__ import annotations

import argparse
import time

from batchlens.control.law import Tuning
from batchlens.goodput import Slo
from batchlens.load.plan import LoadSpec, plan
from batchlens.replay.policies import Adaptive, Admitting, Policy
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine
from batchlens.simulator.profiles import GPUS, MODELS
from controller import ceiling, policy, ratio, versus_best

POLICIES = ("default", "breaker", "adaptive", "admit", "adaptive+admit")
MAX_NUM_SEQS = 64  # the demo's engine (batchlens demo --max-num-seqs)
RATES = (2.9, 3.0, 3.25, 3.5)  # what the demo's engine takes live, and past it to the cliff in simulated time


def demo_trace(rate: float, seconds: float, seed: int) -> list[TraceRequest]:
    """The demo's load plan (bursty, the article's prompt buckets, 128 output tokens) as a trace."""
    return [TraceRequest(p.at, p.prompt_tokens, p.max_tokens)
            for p in plan(LoadSpec(rate, seconds, arrival="bursty", seed=seed))]  # fmt: skip


def engine() -> Engine:
    return Engine(GPUS["a100-80g"], MODELS["dense-7b"], max_num_seqs=MAX_NUM_SEQS)


def demo_policy(name: str, slo: Slo) -> Policy:
    """The policy as the demo runs it: the controller starts from the limit in force, the engine's capacity."""
    live = Tuning(max_limit=MAX_NUM_SEQS, start_limit=MAX_NUM_SEQS)
    if name == "adaptive":
        return Adaptive(slo, live)
    if name == "adaptive+admit":
        return Admitting(slo, Adaptive(slo, live))
    return policy(name, slo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rate", type=float, action="append", help="requests/s; default: " + ", ".join(map(str, RATES))
    )
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"demo engine: A100-80GB, dense-7b, max_num_seqs {MAX_NUM_SEQS}; bursty load, {args.seconds:g} s; "
          "goodput in good requests/s")  # fmt: skip
    print(f"{'rate':>5} {'requests':>8} {'ceiling':>7} " + " ".join(f"{p:>9}" for p in POLICIES)
          + f" {'best static':>17} {'adapt/best':>10} {'adp+adm/best':>12} {'shed':>6} {'wall s':>6}")  # fmt: skip
    adaptive, both = [], []
    for rate in args.rate or list(RATES):
        started = time.perf_counter()
        trace = demo_trace(rate, args.seconds, args.seed)
        runs, best = versus_best(trace, engine, POLICIES, make_policy=demo_policy)
        best_rps = best.judgement.goodput_rps
        adaptive.append(ratio(runs["adaptive"].judgement.goodput_rps, best_rps))
        both.append(ratio(runs["adaptive+admit"].judgement.goodput_rps, best_rps))
        print(f"{rate:5.2f} {len(trace):8d} {ceiling(trace):7.2f} "
              + " ".join(f"{r.judgement.goodput_rps:9.3f}" for r in runs.values())
              + f" {best.policy:>9} {best_rps:7.3f} {adaptive[-1]:10.2f} {both[-1]:12.2f}"
              f" {runs['adaptive+admit'].shed / len(trace):6.1%} {time.perf_counter() - started:6.0f}")  # fmt: skip
    print(f"adaptive/best_static min {min(adaptive):.2f}")
    print(f"adaptive+admit/best_static min {min(both):.2f}")


if __name__ == "__main__":
    main()
