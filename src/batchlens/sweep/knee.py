"""The knee of the batch-size curve. Pure.

Walking up the batch limits, each step must buy enough throughput for what a
larger batch costs (KV memory, step time), and P99 must stay within the SLO.
The knee is the last limit reached that way: the largest limit whose
throughput gain per doubling stays at or above ``min_gain`` all the way up,
with P99 within the SLO. A gain between limits that are not a doubling apart
is scaled to one (4 -> 12 is 1.58 doublings).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MIN_GAIN = 1.15  # at least 15% more throughput for each doubling of the batch


@dataclass(frozen=True)
class Point:
    limit: int
    throughput: float  # output tokens per second
    p99: float  # seconds, of the latency the SLO is about


@dataclass(frozen=True)
class Knee:
    limit: int | None  # None: not even the smallest limit meets the SLO
    gains: dict[int, float]  # limit -> throughput gain per doubling from the limit below it
    reason: str


def gain_per_doubling(low: Point, high: Point) -> float:
    doublings = math.log2(high.limit / low.limit)
    if low.throughput <= 0:
        return math.inf if high.throughput > 0 else 1.0
    return (high.throughput / low.throughput) ** (1 / doublings)


def find_knee(points: Sequence[Point], *, slo: float, min_gain: float = DEFAULT_MIN_GAIN) -> Knee:
    ordered = sorted(points, key=lambda p: p.limit)
    if not ordered:
        raise ValueError("no operating points")
    gains = {high.limit: gain_per_doubling(low, high) for low, high in itertools.pairwise(ordered)}
    # Where history mixes limits (advise), a small limit can be over the SLO from its queue alone: the knee
    # is searched from the smallest limit within the SLO, and only none within it is a capacity problem.
    within = [i for i, p in enumerate(ordered) if p.p99 <= slo]
    if not within:
        first = ordered[0]
        return Knee(None, gains, f"P99 {first.p99:.3g}s at the smallest limit {first.limit} is over the {slo:g}s SLO")
    first = ordered[within[0]]
    knee = first
    reason = f"the largest limit measured ({first.limit})"
    for point in ordered[within[0] + 1 :]:
        gain = gains[point.limit]
        if gain < min_gain:
            reason = f"going to {point.limit} gains only x{gain:.2f} per doubling (< x{min_gain:g})"
            break
        if not point.p99 <= slo:
            reason = f"at {point.limit} P99 is {point.p99:.3g}s, over the {slo:g}s SLO"
            break
        knee = point
        reason = f"the largest limit measured ({point.limit})"
    return Knee(knee.limit, gains, reason)
