"""How far the controller's estimates, read from vLLM's histogram buckets, fall from the exact figures.

    python benchmarks/estimates.py [--seconds 300] [--seed 1]

The controller never sees a latency: it sees vLLM's cumulative histograms and estimates percentiles within
their buckets, as Prometheus' histogram_quantile does (control/signals.py). Here the five workloads of
benchmarks/controller.py are replayed on the article profile under the controller, its samples of the
engine's /metrics are kept, and each window's estimates are set against the exact figures of the same
window, computed from every request's own timings:
- pace: the mean gap between tokens, from _sum over _count (what the law compares with slo.tpot_seconds),
  and the P90 of the gaps, interpolated within the buckets (what it compared before);
- TTFT P99, over the first tokens given in the window;
- SLO attainment, the share of requests finished in the window that were good, against the estimate
  P(TTFT ok) x P(a gap ok) (batchlens_controller_slo_attainment).
Windows of 2 s (one tick of the law) and 60 s (the exported estimates). It prints, per figure and window,
the median and P90 of the absolute error and the median ratio estimate/exact.
"""

from __future__ import annotations

import argparse
import math
import statistics
from itertools import accumulate

from batchlens.control.signals import EngineSample, read_sample, window
from batchlens.goodput import Outcome, quantile
from batchlens.replay.policies import Adaptive, Signals
from batchlens.replay.simulated import replay
from batchlens.simulator.engine import SimRequest
from controller import PROFILES, SLO, engine_of, workloads


class Recording(Adaptive):
    """The controller as it runs, keeping every sample of the engine's /metrics it reads."""

    def __init__(self) -> None:
        super().__init__(SLO)
        self.samples: list[EngineSample] = []

    def decide(self, signals: Signals) -> int:
        self.samples.append(read_sample(signals.exposition, signals.now))
        return super().decide(signals)


def token_times(request: SimRequest) -> list[float]:
    """When each token after the first came out, from the last token back through the gaps."""
    if request.last_token_at is None or not request.itl:
        return []
    back = list(accumulate(reversed(request.itl)))
    return [request.last_token_at - b + g for b, g in zip(back, reversed(request.itl), strict=True)]


def exact(requests: list[SimRequest], start: float, end: float) -> tuple[float, float, float, float]:
    """(mean gap, gap P90, TTFT P99, attainment) of what happened in [start, end)."""
    gaps = [g for r in requests for t, g in zip(token_times(r), reversed(r.itl), strict=True) if start <= t < end]
    firsts = [r.first_token_at - r.arrival for r in requests
              if r.first_token_at is not None and start <= r.first_token_at < end]  # fmt: skip
    done = [r for r in requests if r.finished_at is not None and start <= r.finished_at < end]
    good = [Outcome(r.first_token_at - r.arrival, r.finished_at - r.arrival, r.generated).good(SLO) for r in done
            if r.finish_reason == "length"]  # fmt: skip
    mean = sum(gaps) / len(gaps) if gaps else math.nan
    return mean, quantile(gaps, 0.9), quantile(firsts, 0.99), (sum(good) / len(done) if done else math.nan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    _, _, rate = PROFILES["article"]
    errors: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for trace in workloads(args.seconds, args.seed, rate).values():
        policy = Recording()
        run = replay(trace, engine_of("article"), policy, SLO)
        for span in (1, 30):  # samples are 2 s apart: windows of 2 s and 60 s
            for earlier, later in zip(policy.samples, policy.samples[span:], strict=False):
                seen = window(earlier, later)
                truth = exact(run.requests, earlier.time, later.time)
                estimates = (seen.itl.mean, seen.itl.quantile(0.9), seen.ttft.quantile(0.99), seen.attainment(SLO))
                names = ("mean gap", "gap P90", "TTFT P99", "attainment")
                for name, est, real in zip(names, estimates, truth, strict=True):
                    if not (math.isnan(est) or math.isnan(real)):
                        errors.setdefault((name, 2 * span), []).append((est, real))
    print(f"{'figure':12} {'window':>7} {'windows':>8} {'median |err|':>13} {'P90 |err|':>10} {'median est/exact':>17}")
    for (name, seconds), pairs in errors.items():
        abs_errors = sorted(abs(e - r) for e, r in pairs)
        ratios = [e / r for e, r in pairs if r > 0]
        print(f"{name:12} {seconds:6d}s {len(pairs):8d} {statistics.median(abs_errors):13.4f} "
              f"{abs_errors[int(0.9 * (len(abs_errors) - 1))]:10.4f} "
              f"{statistics.median(ratios) if ratios else math.nan:17.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
