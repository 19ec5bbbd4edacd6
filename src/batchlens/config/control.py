"""The `control:` section: the adaptive controller and its door (docs/control.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from batchlens.config.base import Section


class Control(Section):
    """The adaptive batch controller, run inside `batchlens remediate` (docs/control.md)."""

    enabled: bool = False
    interval_seconds: float = Field(2.0, gt=0, le=300, description="how often each engine is read and decided")
    timeout_seconds: float = Field(2.0, gt=0, le=60, description="per read of an engine's /metrics or admin API")
    min_limit: int = Field(1, ge=1)
    max_limit: int | None = Field(None, ge=1, description="default: the engine's capacity; never above it")
    start_limit: int | None = Field(None, ge=1, description="where control starts; default: the limit in force")
    max_step: float = Field(0.5, gt=0, le=1, description="one move is at most this share of the limit")
    kv_target: float = Field(0.95, gt=0, le=1, description="KV usage the limit is kept under")
    drain_seconds: float = Field(30.0, ge=0, description="after a cut, the longest hold while the running batch "
                                 "drains to the new limit (the hold ends once it has)")  # fmt: skip
    past_peak: float | None = Field(0.85, gt=0, le=1, description="a larger limit serving under this share of the "
                                    "peak's tokens/s goes back to the peak's limit; null: never")  # fmt: skip
    keep_up: float | None = Field(1.15, ge=1, le=3, description="serving under this multiple of the tokens/s "
                                  "asked is falling short: then, where the pace grows faster than the batch, "
                                  "the limit steps down toward the throughput peak; null: never")  # fmt: skip
    manual_hold_seconds: float = Field(600, ge=0, description="a limit set by hand pauses control this long")
    admission: bool = Field(
        False, description="also set the engine's queued-token cap from its measured prefill throughput: "
        "wide enough that what it refuses would have missed slo.ttft_seconds (vLLM 0.29 and later, the plugin's "
        "door before; docs/admission.md)",
    )  # fmt: skip
    admission_confidence: float = Field(
        0.95, gt=0, lt=1, description="how sure the door is that a request it refuses would have missed its TTFT"
    )
    admission_margin: float = Field(
        1.0, gt=0, le=2, description="a multiple of the cap the confidence gives: under 1 refuses sooner"
    )
    admission_predict: bool = Field(
        False, description="also refuse, request by request, what the plugin predicts would miss slo.ttft_seconds by "
        "more than admission_predict_margin of it; the queued-token cap then stands behind it as a backstop, wider "
        "(docs/admission.md, the per-request door; needs control.admission)",
    )  # fmt: skip
    admission_predict_margin: float = Field(
        0.0, ge=0, le=10, description="a request is refused only where its predicted TTFT passes slo.ttft_seconds "
        "by more than this share of it (one waiting for a slot, by predicted_ttft.SLOT_MARGIN more)",
    )  # fmt: skip
    admission_min_windows: int = Field(3, ge=1, description="saturated windows before a cap is set; fewer: no cap")
    admission_stale_seconds: float = Field(
        60.0, gt=0, description="a saturated window older than this no longer counts; none left: no cap"
    )
    dry_run: bool = Field(False, description="decide, log and export the target; never set it")

    @model_validator(mode="after")
    def _bounds(self) -> Control:
        if self.max_limit is not None and self.max_limit < self.min_limit:
            raise ValueError(f"control.max_limit {self.max_limit} is below control.min_limit {self.min_limit}")
        start = self.start_limit
        if start is not None and not self.min_limit <= start <= (self.max_limit or start):
            raise ValueError(f"control.start_limit {start} is outside control.min_limit {self.min_limit} .. "
                             f"max_limit {self.max_limit or 'the capacity'}")  # fmt: skip
        if self.admission_predict and not self.admission:
            raise ValueError("control.admission_predict needs control.admission: the per-request door stands in "
                             "front of the queued-token cap, which the controller sets")  # fmt: skip
        # A window a tick: the door needs its min_windows within stale_seconds, or it never sets a cap at all.
        needed = (self.admission_min_windows - 1) * self.interval_seconds
        if self.admission and self.admission_stale_seconds < needed:
            raise ValueError(f"control.admission_stale_seconds {self.admission_stale_seconds:g} is shorter than "
                             f"the {needed:g} s that admission_min_windows {self.admission_min_windows} windows, one "
                             f"each interval_seconds {self.interval_seconds:g}, span: the door would never set a "
                             "cap")  # fmt: skip
        return self
