"""Goodput, defined once: how policies are judged and what the controller aims for. Pure.

As vLLM's ``bench serve --goodput``: a request is good when it completed, its
TTFT is within the SLO's and its TPOT is too, where TPOT = (E2E - TTFT) /
(output tokens - 1). Goodput is good requests per second over the whole run,
drain included. Failed, aborted and shed requests are never good.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from batchlens.quantiles import percentile


class Slo(BaseModel):
    """The service-level objective goodput counts against (vLLM's `bench serve --goodput`).

    The config's own `slo:` section too, so there is one Slo: validated as the config's sections are, and there
    its TTFT bound, unless set, is the breaker's P99 bound (config.Config fills it in). ``Slo(ttft, tpot)``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    ttft_seconds: float = Field(description="time to first token; default: thresholds.p99_seconds")
    tpot_seconds: float = Field(0.1, description="time per output token after the first")

    def __init__(self, ttft_seconds: float | None = None, tpot_seconds: float | None = None, /, **fields: Any):
        positional = {"ttft_seconds": ttft_seconds, "tpot_seconds": tpot_seconds}
        super().__init__(**{k: v for k, v in positional.items() if v is not None}, **fields)

    @model_validator(mode="after")
    def _above_zero(self) -> Slo:
        if not (self.ttft_seconds > 0 and self.tpot_seconds > 0):
            raise ValueError(f"an SLO must be above zero: ttft {self.ttft_seconds:g}s, tpot {self.tpot_seconds:g}s")
        return self


@dataclass(frozen=True)
class Outcome:
    """What one request got. ``ttft`` and ``e2e`` are None for a request that did not complete."""

    ttft: float | None
    e2e: float | None
    output_tokens: int

    @property
    def completed(self) -> bool:
        return self.ttft is not None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; 0 for a one-token answer (nothing to pace)."""
        if not self.completed:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    def good(self, slo: Slo) -> bool:
        return self.completed and self.ttft <= slo.ttft_seconds and self.tpot <= slo.tpot_seconds


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1), nearest rank as the load generator reports it; NaN without values."""
    found = percentile(values, q * 100)
    return math.nan if found is None else found


@dataclass(frozen=True)
class Judgement:
    requests: int
    good: int
    seconds: float  # the whole run, drain included
    goodput_rps: float
    slo_attainment: float  # good / requests
    p50_ttft_s: float
    p99_ttft_s: float
    p50_tpot_s: float
    p99_tpot_s: float
    throughput_tokens_s: float  # output tokens of completed requests per second


def judge(outcomes: Sequence[Outcome], seconds: float, slo: Slo) -> Judgement:
    """Goodput and its companions over a run of ``seconds``; latencies over the completed requests."""
    done = [o for o in outcomes if o.completed]
    good = sum(o.good(slo) for o in outcomes)
    ttfts = [o.ttft for o in done]
    tpots = [o.tpot for o in done]
    per_second = (lambda n: n / seconds) if seconds > 0 else (lambda n: 0.0)
    return Judgement(
        requests=len(outcomes), good=good, seconds=seconds, goodput_rps=per_second(good),
        slo_attainment=good / len(outcomes) if outcomes else math.nan,
        p50_ttft_s=quantile(ttfts, 0.5), p99_ttft_s=quantile(ttfts, 0.99),
        p50_tpot_s=quantile(tpots, 0.5), p99_tpot_s=quantile(tpots, 0.99),
        throughput_tokens_s=per_second(sum(o.output_tokens for o in done)),
    )  # fmt: skip
