"""The gap since the previous arrival, and the cold-path threshold it is judged against. Pure (time is given).

The article's cold path takes an arrival after a gap longer than the P90 of
the gaps. ``auto`` takes that quantile live, over the most recent gaps the
router itself saw: the router is the one place that sees every arrival. Each
engine's own arrival histogram (what ``batchlens advise`` reads) sees only the
share routed to it, whose gaps are longer, so it would set the bar too high.

The quantile is taken again at most once per ``routing.signals_ttl_seconds``
of arrivals, as often as the signals move, not on every request: sorting a
thousand gaps was a fifth of the plugin's time per request (benchmarks/
proxy_cost.py), and one gap more moves the quantile by at most one rank.
"""

from __future__ import annotations

import math
from collections import deque

from batchlens.config import Routing


class ArrivalGaps:
    def __init__(self, rules: Routing):
        self._fixed = None if rules.cold_gap == "auto" else float(rules.cold_gap)
        self._quantile = rules.cold_gap_quantile
        self._enough = rules.cold_gap_min_gaps
        self._recent: deque[float] = deque(maxlen=rules.cold_gap_window)
        self._last: float | None = None
        self._every = rules.signals_ttl_seconds
        self._taken: tuple[float, float] | None = None  # (when, the quantile then), once there are enough gaps

    def arrived(self, now: float) -> float | None:
        """Record an arrival at ``now`` (monotonic seconds); the gap since the previous one (None: the first)."""
        gap = None if self._last is None else max(0.0, now - self._last)
        self._last = now
        if gap is not None:
            self._recent.append(gap)
        return gap

    def threshold(self) -> float | None:
        """The cold-path threshold in force: the fixed one, or the quantile of the recent gaps (None: too few)."""
        if self._fixed is not None:
            return self._fixed
        if len(self._recent) < self._enough:
            return None
        if self._taken is None or self._last - self._taken[0] >= self._every:
            ordered = sorted(self._recent)
            # The nearest-rank quantile: a gap that happened, never one interpolated between two.
            self._taken = (
                self._last,
                ordered[min(len(ordered) - 1, max(0, math.ceil(self._quantile * len(ordered)) - 1))],
            )
        return self._taken[1]
