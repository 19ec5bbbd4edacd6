"""What the engine serves as the batch grows, learned as it runs, and what is asked of it. Pure.

Decode's pace (the mean gap between a request's tokens) rises with the running
batch: every step reads the weights once and each request's KV cache, and past
some size the KV re-reads thrash the L2 and prefill chunks stall the step.
Tokens/s is batch / pace, so it rises with the batch while the pace grows
slower than the batch, and falls once it grows faster: where the elasticity
d ln(pace) / d ln(batch) passes 1. Near capacity that fall is the cliff: on
the demo's engine a batch of 40 serves only 10-15% fewer tokens/s than one of
20, too little for 2 s windows of tokens/s to show through their noise, and
enough for the queue to grow without bound (benchmarks/demo_regime.py). The
pace, the mean of hundreds of gaps, is steadier: :class:`PaceSlope` is least
squares of ln(pace) on ln(limit), its square and the KV usage over the
saturated windows seen, old ones forgotten, and gives the elasticity where the
law has been.

:class:`Demand` is what is asked of the engine in tokens/s, against what it
served: requests arriving (finished, refused at the door, and the change in
those running and waiting) times the tokens a request took.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_WINDOWS = 10.0  # saturated windows (decayed) before the slope is believed
MIN_SPREAD = 0.02  # ... at limits spread this much in ln (2%): narrower, the standard error says how unsure


FEATURES = 4  # 1, u, u², k


@dataclass(frozen=True)
class PaceSlope:
    """Decayed sums for least squares of v = ln(pace) on 1, u, u² (u = ln(limit)) and k (KV usage), one
    weight per window: the Gram matrix's upper triangle, X'v and v'v.

    u² lets the slope change along the batch: decode's pace grows slower than the batch at small ones and
    faster past the peak, and the law must find where it crosses. The KV usage is there because the pace
    at a given batch moves with how long its requests' contexts are (each step reads them all). Left out,
    that noise hides the slope, and worse, biases it: after a cut, the requests still running at the lower
    limit are the long ones. With it, the slope in the batch is the part in u plus the part in k that comes
    with it, since KV usage grows in proportion to the batch (d k / d u = k).
    """

    gram: tuple[float, ...] = (0.0,) * (FEATURES * (FEATURES + 1) // 2)
    xv: tuple[float, ...] = (0.0,) * FEATURES
    vv: float = 0.0

    @property
    def n(self) -> float:
        return self.gram[0]

    def decayed(self, factor: float) -> PaceSlope:
        return PaceSlope(tuple(g * factor for g in self.gram), tuple(x * factor for x in self.xv), self.vv * factor)

    def observe(self, limit: float, pace: float, kv_usage: float) -> PaceSlope:
        u, v = math.log(limit), math.log(pace)
        x = (1.0, u, u * u, kv_usage)
        gram = tuple(g + x[i] * x[j] for g, (i, j) in zip(self.gram, _PAIRS, strict=True))
        return PaceSlope(gram, tuple(s + xi * v for s, xi in zip(self.xv, x, strict=True)), self.vv + v * v)

    def elasticity(self, limit: float) -> tuple[float, float] | None:
        """(d ln pace / d ln batch at ``limit``, its standard error); None until MIN_WINDOWS windows at limits
        spread MIN_SPREAD apart, or where the batches seen cannot tell the terms apart.

        The slope may only grow with the batch (u²'s coefficient at least 0), as it does for any pace of the
        form a + b·n + c·n²: where the fit bends the other way, it is noise, and the slope is taken as one."""
        n, mean_u = self.n, self.gram[1] / max(self.n, 1e-12)
        if n < MIN_WINDOWS or self.gram[_PAIRS.index((1, 1))] / n - mean_u**2 < MIN_SPREAD**2:
            return None
        found = self._fit((0, 1, 2, 3), limit)
        if found is not None and found[2]:
            return found[:2]
        found = self._fit((0, 1, 3), limit)
        return None if found is None else found[:2]

    def _fit(self, features: tuple[int, ...], limit: float) -> tuple[float, float, bool] | None:
        """(slope at ``limit``, its standard error, whether u²'s coefficient is at least 0) for least squares
        on ``features``; None where singular."""
        full = [[0.0] * FEATURES for _ in range(FEATURES)]
        for g, (i, j) in zip(self.gram, _PAIRS, strict=True):
            full[i][j] = full[j][i] = g
        inverse = _inverse([[full[i][j] for j in features] for i in features])
        if inverse is None:
            return None
        moments = [self.xv[i] for i in features]
        size = len(features)
        beta = [sum(inverse[i][j] * moments[j] for j in range(size)) for i in range(size)]
        residual = self.vv - sum(b * m for b, m in zip(beta, moments, strict=True))  # sum of squared residuals
        sigma2 = max(residual, 0.0) / max(self.n - size, 1.0)
        derivative = (0.0, 1.0, 2 * math.log(limit), self.gram[3] / self.n)  # d/du of each feature, k with u
        gradient = [derivative[f] for f in features]
        slope = sum(g * b for g, b in zip(gradient, beta, strict=True))
        variance = sigma2 * sum(gradient[i] * inverse[i][j] * gradient[j] for i in range(size) for j in range(size))
        convex = 2 not in features or beta[features.index(2)] >= 0
        return slope, math.sqrt(max(variance, 0.0)), convex


_PAIRS = tuple((i, j) for i in range(FEATURES) for j in range(i, FEATURES))


def _inverse(m: list[list[float]]) -> list[list[float]] | None:
    """The inverse of a small symmetric matrix by Gauss-Jordan with partial pivoting; None where singular."""
    size = len(m)
    rows = [list(row) + [1.0 if i == j else 0.0 for j in range(size)] for i, row in enumerate(m)]
    scale = max(abs(x) for row in m for x in row) or 1.0
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-12 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        lead = rows[col][col]
        rows[col] = [x / lead for x in rows[col]]
        for r in range(size):
            if r != col and rows[r][col] != 0.0:
                f = rows[r][col]
                rows[r] = [x - f * y for x, y in zip(rows[r], rows[col], strict=True)]
    return [row[size:] for row in rows]


@dataclass(frozen=True)
class Demand:
    """Decayed sums of what arrived and what was served, over the seconds of windows seen."""

    seconds: float = 0.0
    arrived: float = 0.0  # requests
    finished: float = 0.0  # requests
    tokens: float = 0.0  # tokens generated
    prompted: float = 0.0  # prompt tokens prefilled

    def decayed(self, factor: float) -> Demand:
        return Demand(self.seconds * factor, self.arrived * factor, self.finished * factor, self.tokens * factor,
                      self.prompted * factor)  # fmt: skip

    def observe(self, seconds: float, arrived: float, finished: float, tokens: float, prompted: float = 0.0) -> Demand:
        return Demand(self.seconds + seconds, self.arrived + arrived, self.finished + finished, self.tokens + tokens,
                      self.prompted + prompted)  # fmt: skip

    def arrived_per_second(self) -> float:
        """Requests/s that arrived; NaN before any window."""
        return self.arrived / self.seconds if self.seconds > 0 else math.nan

    def asked(self) -> float:
        """Tokens/s asked of the engine: arrivals/s x the tokens a finished request took; NaN before any finished."""
        if self.seconds <= 0 or self.finished <= 0:
            return math.nan
        return self.arrived_per_second() * self.tokens / self.finished

    def served(self) -> float:
        """Tokens/s the engine gave; NaN before any window."""
        return self.tokens / self.seconds if self.seconds > 0 else math.nan

    def prefill_share(self) -> float:
        """Of the tokens the engine processed, the share that were prompt tokens; NaN before any."""
        total = self.prompted + self.tokens
        return self.prompted / total if total > 0 else math.nan


@dataclass(frozen=True)
class Capacity:
    """The slope and the demand, as the law keeps them across ticks."""

    slope: PaceSlope = PaceSlope()
    demand: Demand = Demand()

    def aged(self, seconds: float, slope_seconds: float, demand_seconds: float) -> Capacity:
        return Capacity(self.slope.decayed(math.exp(-seconds / slope_seconds)),
                        self.demand.decayed(math.exp(-seconds / demand_seconds)))  # fmt: skip

    def short(self, margin: float) -> bool:
        """The engine serves less than ``margin`` x what is asked: the queue grows, or would at the next burst."""
        asked, served = self.demand.asked(), self.demand.served()
        return not math.isnan(asked) and served < margin * asked

    def said(self, limit: int) -> str:
        """What the law saw, for the log line of a keep_up step."""
        slope = self.slope.elasticity(limit)
        slope_said = "unknown" if slope is None else f"{slope[0]:.2f} ± {slope[1]:.2f}"
        return (f"serving {self.demand.served():.0f} of {self.demand.asked():.0f} tokens/s asked, "
                f"pace slope {slope_said} at {limit}")  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict) -> Capacity:
        """As :func:`dataclasses.asdict` wrote it; ValueError, KeyError or TypeError where it is not that."""
        slope = data["slope"]
        gram, xv = tuple(map(float, slope["gram"])), tuple(map(float, slope["xv"]))
        want = len(PaceSlope().gram)
        if len(gram) != want or len(xv) != FEATURES:
            raise ValueError(f"a pace slope of {len(gram)} and {len(xv)} sums, not {want} and {FEATURES}")
        return cls(PaceSlope(gram, xv, float(slope["vv"])), Demand(**data["demand"]))
