"""Each engine as the router sees it, from the batchlens exporter's /metrics: up, saturated, or unknown. Pure.

The exporter already merges what routing needs, per ``vllm_instance``: whether
its last sample succeeded (``batchlens_source_up``) and when
(``batchlens_source_last_success_timestamp_seconds``), the batch limit in
force (``batchlens_batch_limit``), and vLLM's running and waiting requests and
KV usage. An engine is:

- **down** when its last sample failed;
- **saturated** when requests wait behind a batch at its limit (vLLM admits
  no more; a request sent there queues), or its KV usage is at
  ``kv_saturated`` (preemptions are near);
- **unknown** when the exporter does not know it, or its data is older than
  ``signals_stale_seconds``: stale signals must neither send traffic away
  from a healthy engine nor toward a dead one, so the role stands;
- **ok** otherwise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from batchlens.config import Routing
from batchlens.exporter.parser import ExpositionReader
from batchlens.rules.recording import KV_USAGE

OK, SATURATED, DOWN, UNKNOWN = "ok", "saturated", "down", "unknown"
INSTANCE = "vllm_instance"
UP = "batchlens_source_up"
FRESH = "batchlens_source_last_success_timestamp_seconds"
LIMIT = "batchlens_batch_limit"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


@dataclass(frozen=True)
class EngineSignal:
    up: bool | None = None  # None: the exporter has no such source
    last_success: float = math.nan  # unix seconds
    limit: float = math.nan  # NaN: no admin API (a vLLM without the plugin)
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0

    def state(self, now: float, rules: Routing) -> str:
        """``ok``, ``saturated``, ``down`` or ``unknown`` at ``now`` (unix seconds)."""
        if self.up is None or not now - self.last_success <= rules.signals_stale_seconds:
            return UNKNOWN if self.up is not False else DOWN
        if not self.up:
            return DOWN
        full = math.isnan(self.limit) or self.running >= self.limit
        if (self.waiting > 0 and full) or self.kv_usage >= rules.kv_saturated:
            return SATURATED
        return OK


def engine_signals(text: str) -> dict[str, EngineSignal]:
    """Per ``vllm_instance``, what the exporter's exposition says (engine cores summed, KV their maximum)."""
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    wanted = {UP, FRESH, LIMIT, RUNNING, WAITING, *KV_USAGE}
    for family in ExpositionReader().parse(text):
        for series, value, _ in family.samples:
            if series.name in wanted and (instance := dict(series.labels).get(INSTANCE)):
                values[instance][series.name].append(value)
    out = {}
    for instance, seen in values.items():
        kv = next((max(seen[n]) for n in KV_USAGE if seen.get(n)), 0.0)
        up = seen.get(UP)
        out[instance] = EngineSignal(
            up=None if not up else min(up) > 0,
            last_success=min(seen[FRESH]) if seen.get(FRESH) else math.nan,
            limit=sum(seen[LIMIT]) if seen.get(LIMIT) else math.nan,
            running=sum(seen.get(RUNNING, ())),
            waiting=sum(seen.get(WAITING, ())),
            kv_usage=kv,
        )
    return out
