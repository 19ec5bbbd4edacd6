"""The breaker's states, in order of severity: a public name shared by the hook's metrics, alerts and dashboards.

``batchlens_breaker_state{vllm_instance, state}`` is 1 for the engine's current
state and 0 for the others.
"""

from __future__ import annotations

#: state -> what it means for the engine; the order is the severity code the dashboards show.
BREAKER_STATES: dict[str, str] = {
    "closed": "normal: the batch limit is the operator's",
    "recovering": "the alert resolved: the limit grows back step by step",
    "tripped": "P99 breached: the limit was halved, and each further breach halves it again",
    "cold_start": "strikes exhausted: the limit is the cold-start limit until a human or a full recovery",
}
