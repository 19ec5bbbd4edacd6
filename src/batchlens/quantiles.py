"""The percentile every figure of batchlens uses (a load's report, goodput's P99s, a sweep's points): nearest
rank, as vLLM's `bench serve` and the SLO literature count it; and the Poisson quantile both doors judge by. Pure,
and below every package that needs it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

# Past this mean a Poisson's quantile is the normal one's to within a request (its skew, 1/sqrt(mean), is 3%).
NORMAL_FROM = 1000.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def poisson_quantile(mean: float, p: float) -> int:
    """The smallest n with P(N <= n) >= p for N ~ Poisson(mean).

    Each term in log space: e^-mean underflows to 0 past a mean of about 745 (a busy engine's finishes within a
    TTFT), and a sum of zeros never reaches p."""
    if mean > NORMAL_FROM:  # the sum below takes ~mean steps, on the hook's event loop
        return math.ceil(mean + NormalDist().inv_cdf(p) * math.sqrt(mean))
    n, log_term = 0, -mean
    total = math.exp(log_term)
    while total < p and n < 10 * mean + 100:  # the bound only guards a p of 1 against rounding
        n += 1
        log_term += math.log(mean / n)
        total += math.exp(log_term)
    return n
