"""The `breaker:` section: the remediation hook's P99 breaker."""

from __future__ import annotations

from pydantic import Field

from batchlens.config.base import Section


class Breaker(Section):
    strikes: int = Field(3, ge=1)
    cooldown_seconds: float = Field(60, ge=0)
    cold_start_limit: int = Field(1, ge=1)
    recovery_interval_seconds: float = Field(300, gt=0)
    #: A queue this many batches long means missing capacity: the breaker holds instead of halving.
    overload_queue_ratio: float = Field(4.0, gt=0)
    #: On VllmKvCacheBlocksHigh, empty the engine's prefix cache once per cooldown, through the plugin's
    #: POST /batchlens/v1/reset_prefix_cache with the engine's admin token (never vLLM's dev-mode route).
    reset_prefix_cache: bool = False
    dry_run: bool = False
    #: Alertmanager sends a firing alert again every repeat_interval (2 m on the provisioned breaker route). An
    #: open breaker that hears nothing this long takes its episode for over: a lost resolution (the hook down
    #: when it came), or a firing that nobody will resolve, would otherwise hold the limit down for good.
    firing_silence_seconds: float = Field(
        1800, gt=0, description="an open breaker with no firing delivery this long recovers; keep it well above "
        "the breaker route's repeat_interval"
    )  # fmt: skip
