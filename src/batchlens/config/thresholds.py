"""The `thresholds:` section: the article's three thresholds, the P99 breaker's latency, and the scaling signal's
headroom and stabilisation windows (docs/scaling.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from batchlens.config.base import Section, duration_seconds


class Thresholds(Section):
    bandwidth_ratio: float = Field(0.70, gt=0, le=1)
    bandwidth_for: str = "5m"
    kv_blocks_ratio: float = Field(0.80, gt=0, le=1)
    kv_blocks_for: str = "2m"
    p99_seconds: float = Field(0.5, gt=0)
    p99_window: str = "1m"
    p99_latency: Literal["ttft", "e2e", "itl"] = "ttft"
    # batchlens:desired_replicas: the arrival rate x (1 + headroom) over the capacity of a replica; it rises once
    # every evaluation of scale_up_window wants more, and falls to the most any evaluation of scale_down_window wanted.
    scale_headroom: float = Field(0.2, ge=0, le=4)
    scale_up_window: str = "3m"
    scale_down_window: str = "15m"

    @field_validator("bandwidth_for", "kv_blocks_for", "p99_window", "scale_up_window", "scale_down_window")
    @classmethod
    def _duration(cls, value: str) -> str:
        duration_seconds(value)
        return value
