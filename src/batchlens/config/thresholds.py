"""The `thresholds:` section: the article's three thresholds and the P99 breaker's latency."""

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

    @field_validator("bandwidth_for", "kv_blocks_for", "p99_window")
    @classmethod
    def _duration(cls, value: str) -> str:
        duration_seconds(value)
        return value
