"""The percentile every figure of batchlens uses (a load's report, goodput's P99s, a sweep's points): nearest
rank, as vLLM's `bench serve` and the SLO literature count it. Pure, and below every package that needs it."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
