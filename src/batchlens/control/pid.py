"""The article's law: a PID on the SLO margin, re-tuning the batch limit every 30 s. Pure.

The article (stage 3) suggests a feedback regulator over a joint throughput and
latency objective. This is the plainest honest reading of it, kept to compare
with the gradient law (control/law.py), which won (docs/control.md).

- **Error.** It is the SLO margin left on the decode pace, 1 - pace /
  slo.tpot, clipped to [-1, 1] (with ``Gains.ttft``, the tighter of that and
  1 - P99 TTFT / slo.ttft). The margin only pushes the limit up while requests
  wait (throughput is wanted). Without a queue, only a negative margin counts.
- **Output.** limit x (1 + kp e + ki sum(e) + kd de), one step at most
  ``max_step`` of the limit, within the bounds. The integral is clamped to
  [-1, 1] against wind-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from batchlens.control.law import Tuning, decode_pace
from batchlens.control.signals import Window
from batchlens.goodput import Slo


@dataclass(frozen=True)
class Gains:
    kp: float = 0.5
    ki: float = 0.1
    kd: float = 0.2
    period_seconds: float = 30.0  # the article's re-tuning period
    #: Also count the TTFT margin. Off by default: TTFT over the SLO mostly means a queue, and cutting the
    #: batch then lengthens it (the breaker's overload trap); benchmarks/controller.py shows the collapse.
    ttft: bool = False


@dataclass(frozen=True)
class PidState:
    limit: int
    integral: float = 0.0
    last_error: float | None = None


def margin(w: Window, slo: Slo, tuning: Tuning, gains: Gains) -> float:
    """The SLO margin left (1: idle; 0: on the SLO; negative: broken); NaN when nothing was served."""
    signals = [(decode_pace(w, tuning), slo.tpot_seconds)]
    if gains.ttft:
        signals.append((w.ttft.quantile(0.99), slo.ttft_seconds))
    margins = [1 - value / bound for value, bound in signals if not math.isnan(value)]
    return max(-1.0, min(1.0, min(margins))) if margins else math.nan


def decide_pid(state: PidState, w: Window, slo: Slo, tuning: Tuning, gains: Gains) -> tuple[PidState, str]:
    found = margin(w, slo, tuning, gains)
    if math.isnan(found):
        return state, "idle"
    error = found if w.waiting > 0 else min(found, 0.0)
    integral = max(-1.0, min(1.0, state.integral + error))
    derivative = 0.0 if state.last_error is None else error - state.last_error
    gain = gains.kp * error + gains.ki * integral + gains.kd * derivative
    step = max(1, math.floor(state.limit * tuning.max_step))
    moved = state.limit + max(-step, min(step, round(state.limit * gain)))
    limit = tuning.clamp(moved)
    reason = "pid_up" if limit > state.limit else "pid_down" if limit < state.limit else "pid_hold"
    return replace(state, limit=limit, integral=integral, last_error=error), reason
