"""What a queued-token cap can give a load at all: a static limit with a fixed cap, swept, in simulated time.

    python benchmarks/fixed_cap.py [--profile published] [--workload bursty] [--limit 192]
                                   [--cap 16000 --cap 8000 ...] [--seconds 300] [--seed 1]

The controller sets its cap from what it measures (control/admission.py). This sweep sets it by hand, with
no estimate at all, beside the best static limit of benchmarks/controller.py's workload, to ask what any cap
could be worth there. Per cap it prints the goodput, its ratio to the limit alone (no cap), the requests
shed, and the share of the sheds that would have met the SLO had they been admitted (false sheds, estimated
counterfactually as in controller.py).

Its default is the published profile's bursty load, where the issue asks adaptive+admit for 1.02 of the best
static limit (within 5% of every request good) with under 5% of the sheds false. The last line gives the
best ratio any cap reached with under 5% false, and the best with any share false: where the two differ,
no cap on queued tokens meets both bounds on this load (docs/admission.md says why: the late first tokens
there are a burst's own prefills, and the cap that refuses them refuses requests that would have made it).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from batchlens.replay.policies import Static
from batchlens.replay.simulated import replay
from batchlens.replay.traces import TraceRequest
from controller import CAPACITY, PROFILES, SLO, ceiling, engine_of, workloads

FALSE_BOUND = 0.05  # the bound on the share of false sheds


@dataclass(frozen=True)
class CappedStatic(Static):
    """A fixed limit with a fixed queued-token cap at the door (the replay reads ``queued_token_cap``)."""

    queued_token_cap: int | None = None


def load_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The load and the static limit to try it on (:func:`chosen_trace` reads them)."""
    parser.add_argument("--profile", choices=sorted(PROFILES), default="published")
    parser.add_argument("--workload", default="bursty", help="one of benchmarks/controller.py's (default: bursty)")
    parser.add_argument("--limit", type=int, default=192, help="the static limit (default: the best on the default)")
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=1)
    return parser


def chosen_trace(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[TraceRequest]:
    """The workload :func:`load_arguments` named; a usage error for one that does not exist, or a limit past the
    engine's slots."""
    _, _, rate = PROFILES[args.profile]
    loads = workloads(args.seconds, args.seed, rate)
    if args.workload not in loads:
        parser.error(f"--workload: one of {', '.join(loads)}, got {args.workload!r}")
    if not 1 <= args.limit <= CAPACITY:
        parser.error(f"--limit takes 1 to the engine's {CAPACITY} slots, got {args.limit}")
    return loads[args.workload]


def main() -> None:
    parser = load_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--cap", type=int, action="append", metavar="TOKENS",
                        help="a cap to try (default: 16000, 8000, 6000, 5000, 4000)")  # fmt: skip
    args = parser.parse_args()
    if any(cap < 1 for cap in args.cap or ()):
        parser.error("--cap takes a positive number of tokens")
    trace = chosen_trace(parser, args)

    def run(cap: int | None):
        return replay(trace, engine_of(args.profile), CappedStatic(args.limit, queued_token_cap=cap), SLO)

    alone = run(None).judgement.goodput_rps
    print(f"{args.profile} {args.workload}: {len(trace)} requests, static:{args.limit} alone {alone:.3f} good "
          f"requests/s; every request good would be {ceiling(trace):.3f}")  # fmt: skip
    print(f"{'cap':>7} {'goodput':>8} {'/alone':>7} {'shed':>6} {'false':>6}")
    within, best = [], []
    for cap in args.cap or (16000, 8000, 6000, 5000, 4000):
        r = run(cap)
        false = r.false_sheds / r.shed if r.shed else 0.0
        ratio = r.judgement.goodput_rps / alone
        print(f"{cap:7d} {r.judgement.goodput_rps:8.3f} {ratio:7.3f} {r.shed:6d} {false:6.1%}", flush=True)
        best.append(ratio)
        if false < FALSE_BOUND:
            within.append(ratio)
    under = f"{max(within):.3f}" if within else "none"
    print(f"fixed_cap/alone max {under} with under {FALSE_BOUND:.0%} false, {max(best):.3f} with any")


if __name__ == "__main__":
    main()
