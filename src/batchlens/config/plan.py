"""The `plan:` section: `batchlens plan`, the fleet sizer (docs/scaling.md)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator

from batchlens.config.base import Section

Balancer = Literal["least-loaded", "round-robin"]
BALANCERS: tuple[str, ...] = get_args(Balancer)

#: USD per GPU-hour, by the simulator's GPU names: indicative on-demand cloud prices, to be replaced by yours.
DEFAULT_PRICES = {"a100-40g": 1.30, "a100-80g": 1.80, "h100": 2.50, "h200": 3.50, "t4": 0.35}


class Plan(Section):
    """How `batchlens plan` sizes a fleet: what it pays per GPU-hour and what meeting the SLO means."""

    gpu_hour_price: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_PRICES),
        description="USD per GPU-hour by the simulator's GPU name (a100-80g, h100, ...): the cost per million "
        "good tokens is GPU-hours times this over the good tokens; defaults are indicative on-demand prices",
    )  # fmt: skip
    target_attainment: float = Field(
        0.99, gt=0, le=1, description="a fleet meets the SLO when at least this share of the requests is good "
        "(TTFT and TPOT within slo:; shed and refused requests count as not good) ..."
    )  # fmt: skip
    max_shed_share: float = Field(0.01, ge=0, le=1, description="... and at most this share is shed at the door")
    balancer: Balancer = Field(
        "least-loaded", description="how requests are spread over the replicas: least-loaded (fewest requests in "
        "the engine, queued and running; ties in turn) or round-robin"
    )  # fmt: skip
    max_replicas: int = Field(64, ge=1, le=1024, description="the search stops here, meeting the SLO or not")

    @field_validator("gpu_hour_price")
    @classmethod
    def _prices_are_amounts(cls, prices: dict[str, float]) -> dict[str, float]:
        for gpu, price in prices.items():
            if not price >= 0:
                raise ValueError(f"gpu_hour_price.{gpu} is {price!r}: a price is 0 or more (USD per GPU-hour)")
        return prices
