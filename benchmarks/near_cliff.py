"""Real traces near the engine's capacity: the controller's two knobs against the best static limit.

    python benchmarks/near_cliff.py TRACE [--format azure] [--start 0 --start 600] [--duration 600] \
        [--scale 1 --scale 2]

A public production trace (the Azure LLM inference traces, BurstGPT: batchlens.replay.traces reads them) is
replayed in simulated time on the H200 / dense-7b engine model (max_num_seqs 256), judged at TTFT 2 s and
TPOT 0.1 s, at each --scale (the arrival rate times X, same shape). Choose scales that put the engine just
under, at and just over its capacity: at the cliff, where the best static limit first loses requests, the
limit law once fell to 0.05 of it. Per scale it prints the ceiling (every request good), the goodput of
`default`, `adaptive` (the limit alone) and `adaptive+admit` (with the queued-token cap), the best static
limit (batchlens.replay.simulated.oracle), the ratios to it (and, under `n`, adaptive's and
adaptive+admit's in good requests, which the runs' lengths do not touch: benchmarks/controller.py), and the
share shed with the share of those that would have been good; then the same for `adaptive+predict` (the
per-request door in front of a wider cap: docs/admission.md). Each --start is a slice of the trace, replayed
at every scale: the first slice is the one the law was tuned near, the others hold it out, except where
docs/admission.md says a slice was used to find a change (the code trace's, since 2026-12-05). The last lines
give the ratios' minimum and median over every slice and scale. The traces are not part of batchlens: download them
(https://github.com/Azure/AzurePublicDataset, data/AzureLLMInferenceTrace_*.csv).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from batchlens.goodput import Slo
from batchlens.replay.traces import read_trace, select
from batchlens.simulator.engine import Engine
from batchlens.simulator.profiles import GPUS, MODELS
from controller import ceiling, in_good, ratio, versus_best

SLO = Slo(2.0, 0.1)
POLICIES = ("default", "adaptive", "adaptive+admit", "adaptive+predict")


def engine() -> Engine:
    return Engine(GPUS["h200"], MODELS["dense-7b"], max_num_seqs=256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--format", default="azure", choices=("azure", "burstgpt", "jsonl"))
    parser.add_argument("--start", type=float, action="append", help="a slice's start in the trace, s; default: 0")
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--scale", type=float, action="append", help="rate scales; default: 1")
    args = parser.parse_args()
    whole = read_trace(args.trace, args.format)
    adaptive, both, predicted = [], [], []
    for start in args.start or [0.0]:
        print(f"{args.trace.name} [{start:g}, {start + args.duration:g}) s on H200, dense-7b, max_num_seqs 256;"
              f" SLO TTFT {SLO.ttft_seconds:g} s, TPOT {SLO.tpot_seconds:g} s; goodput in good requests/s")  # fmt: skip
        print(f"{'scale':>5} {'requests':>8} {'ceiling':>7} " + " ".join(f"{p:>14}" for p in POLICIES)
              + f" {'best static':>17} {'adapt/best':>10} {'adp+adm/best':>12} {'n':>5} {'n':>5} {'shed':>6}"
              f" {'false':>6} {'adp+prd/best':>12} {'shed':>6} {'false':>6} {'wall s':>6}")  # fmt: skip
        for scale in args.scale or [1.0]:
            started = time.perf_counter()
            trace = select(whole, start=start, duration=args.duration, rate_scale=scale)
            if not trace:
                print(f"{scale:5.2f} no requests in this slice")
                continue
            runs, best = versus_best(trace, engine, POLICIES, SLO)
            best_rps = best.judgement.goodput_rps
            both_run, predicted_run = runs["adaptive+admit"], runs["adaptive+predict"]
            adaptive.append(ratio(runs["adaptive"].judgement.goodput_rps, best_rps))
            both.append(ratio(both_run.judgement.goodput_rps, best_rps))
            predicted.append(ratio(predicted_run.judgement.goodput_rps, best_rps))
            false_share, predicted_false = (false_of(r) for r in (both_run, predicted_run))
            print(f"{scale:5.2f} {len(trace):8d} {ceiling(trace):7.2f} "
                  + " ".join(f"{r.judgement.goodput_rps:14.3f}" for r in runs.values())
                  + f" {best.policy:>9} {best_rps:7.3f} {adaptive[-1]:10.2f} {both[-1]:12.2f}"
                  f" {in_good(runs['adaptive'], best):5.2f} {in_good(both_run, best):5.2f}"
                  f" {both_run.shed / len(trace):6.1%} {false_share:6.1%} {predicted[-1]:12.2f}"
                  f" {predicted_run.shed / len(trace):6.1%} {predicted_false:6.1%}"
                  f" {time.perf_counter() - started:6.0f}")  # fmt: skip
    if adaptive:
        print(f"adaptive/best_static min {min(adaptive):.2f} median {statistics.median(adaptive):.2f}")
        print(f"adaptive+admit/best_static min {min(both):.2f} median {statistics.median(both):.2f}")
        print(f"adaptive+predict/best_static min {min(predicted):.2f} median {statistics.median(predicted):.2f}")


def false_of(run) -> float:
    """The share of a run's sheds that would have been good (0 where it shed none)."""
    return (run.false_sheds or 0) / run.shed if run.shed else 0.0


if __name__ == "__main__":
    main()
