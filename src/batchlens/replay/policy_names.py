"""The replay's policies by name, as `batchlens replay --policy` takes them: the one place that knows them all
(the breaker's builds on policies.py, which therefore cannot name it)."""

from __future__ import annotations

from batchlens.config import Control, Thresholds
from batchlens.control.pid import Gains
from batchlens.control.steering import door_settings
from batchlens.goodput import Slo
from batchlens.replay.breaker_policy import BreakerPolicy
from batchlens.replay.policies import Adaptive, Admitting, Policy, Predicting, Static

POLICIES = (
    "default",
    "static:N",
    "breaker",
    "adaptive",
    "pid",
    "admit",
    "adaptive+admit",
    "predict",
    "adaptive+predict",
)


def parse_policy(text: str, slo: Slo, thresholds: Thresholds | None = None, control: Control | None = None) -> Policy:
    """One of POLICIES; ValueError naming what exists otherwise. ``control``: the config's control: section, which
    the controller's policies then follow as the live controller does (its tick, bounds, law and door settings);
    None: their defaults."""
    name, _, arg = text.strip().partition(":")
    tick = control.interval_seconds if control is not None else 2.0
    door = door_settings(control, slo.ttft_seconds) if control is not None else None
    if name == "admit" and not arg:
        return Admitting(slo, Static(), door, tick)
    if name == "adaptive+admit" and not arg:
        return Admitting(slo, Adaptive(slo, tick_seconds=tick, control=control), door)
    if name in ("predict", "adaptive+predict") and not arg:  # the config's control:, with the per-request door on
        predicting = (control or Control()).model_copy(update={"admission": True, "admission_predict": True})
        limits = Adaptive(slo, tick_seconds=tick, control=control) if name.startswith("adaptive") else Static()
        admitting = Admitting(slo, limits, door_settings(predicting, slo.ttft_seconds), tick)
        return Predicting(slo, admitting, predicting.admission_predict_margin)
    if name == "adaptive" and not arg:
        return Adaptive(slo, tick_seconds=tick, control=control)
    if name == "pid" and not arg:
        return Adaptive(slo, pid=Gains())
    if name == "breaker" and not arg:
        return BreakerPolicy(thresholds)
    if name == "default" and not arg:
        return Static()
    if name == "static":
        try:
            limit = int(arg)
        except ValueError:
            limit = 0
        if limit < 1:
            raise ValueError(f"static:N takes a batch limit N of 1 or more, got {text!r}")
        return Static(limit)
    raise ValueError(f"unknown policy {text!r}: one of {', '.join(POLICIES)}")
