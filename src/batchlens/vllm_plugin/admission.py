"""The two ways the plugin caps admission into a scheduler's running batch (compat.py finds which applies).

Both keep the same contract: a limit in 1..capacity, where capacity is the
startup ``max_num_running_reqs`` (the runner's slots), and nothing already
running is ever preempted by a lower limit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from batchlens.vllm_plugin.compat import ACTIVE_REQS, RUNNING_CAP

LIMIT_ATTR = "_batchlens_limit"  # RUNNING_CAP's limit, on the scheduler instance; None or absent: no cap


class ActiveReqs:
    """vLLM 0.32 and later: the scheduler's own ``max_num_active_reqs``."""

    name = ACTIVE_REQS

    def install(self, scheduler_cls: type) -> None:
        return None  # vLLM reads the field itself

    def limit(self, scheduler: Any) -> int:
        return scheduler.max_num_active_reqs

    def set_limit(self, scheduler: Any, limit: int) -> None:
        scheduler.max_num_active_reqs = limit


def capped(schedule: Callable[..., Any]) -> Callable[..., Any]:
    """``schedule()`` with the slot count lowered to the limit while it admits, and restored after.

    Never below what already runs: vLLM 0.10-0.11 stop admitting only when the
    running count *equals* the slot count, and every release asserts
    ``len(running) <= max_num_running_reqs`` at the end of the step. Only
    schedule() reads the slot count (compat.py checks that), so the lowered
    value is never seen outside it.
    """

    @functools.wraps(schedule)
    def schedule_capped(self: Any, *args: Any, **kwargs: Any) -> Any:  # 0.25 added arguments; pass them all on
        limit = getattr(self, LIMIT_ATTR, None)
        if limit is None:
            return schedule(self, *args, **kwargs)
        slots = self.max_num_running_reqs
        self.max_num_running_reqs = min(slots, max(limit, len(self.running)))
        try:
            return schedule(self, *args, **kwargs)
        finally:
            self.max_num_running_reqs = slots

    schedule_capped.batchlens_capped = True  # type: ignore[attr-defined]
    return schedule_capped


class RunningCap:
    """vLLM 0.10 to 0.31: ``max_num_running_reqs`` lowered for the span of each ``schedule()``."""

    name = RUNNING_CAP

    def install(self, scheduler_cls: type) -> None:
        if not getattr(scheduler_cls.schedule, "batchlens_capped", False):  # once, however often vLLM loads plugins
            scheduler_cls.schedule = capped(scheduler_cls.schedule)

    def limit(self, scheduler: Any) -> int:
        limit = getattr(scheduler, LIMIT_ATTR, None)
        return scheduler.max_num_running_reqs if limit is None else limit

    def set_limit(self, scheduler: Any, limit: int) -> None:
        # At the capacity the cap is lifted altogether: schedule() then runs exactly as vLLM wrote it.
        setattr(scheduler, LIMIT_ATTR, None if limit >= scheduler.max_num_running_reqs else limit)


ADAPTERS = {adapter.name: adapter for adapter in (ActiveReqs(), RunningCap())}
