"""What each action and reason the report names means: the page's legend, one line each.

The breaker's actions (remediation/breaker.py, and the hook's calls in remediation/service.py), and the
controller's reasons: the law's (control/law.py, docs/control.md's table), the loop's own
(control/steering.py), and the door's (control/admission.py, prefixed ``admission_``). A test holds this to
every one the code can say.
"""

from __future__ import annotations

BREAKER = {
    "halve": "the P99 breaker fired outside the cooldown: the batch limit halved, a strike counted",
    "cold_start": "the strike that reached breaker.strikes: the limit set to the cold-start limit, on-call paged",
    "hold_overload": "the breaker fired while the queue was long or the door refused: limit held, capacity paged",
    "raise": "recovery: the alert stayed resolved a recovery interval, the limit grew by a step",
    "recovered": "recovery reached the limit before the first strike: the breaker closed",
    "resolved": "the alert resolved (or went silent): recovery begins",
    "set_limit": "a PUT of the batch limit to the engine's admin API",
    "observe": "a read of the engine's admin API before a decision",
    "reset_prefix_cache": "the engine's prefix cache emptied on VllmKvCacheBlocksHigh",
}
RESULTS = {
    "decided": "the decision, as taken",
    "ok": "the engine confirmed it",
    "dry_run": "dry run: said, not done",
    "in_use": "not reset: running requests hold the cache",
}
CONTROLLER = {
    "drain": "after a cut: waiting for the running batch to come down to the new limit",
    "pace_over": "the time per output token is over the SLO: cut",
    "kv_ceiling": "KV usage over control.kv_target: cut before preemption",
    "idle": "nothing runs: hold",
    "app_limited": "under half the limit runs and nothing waits: the limit does not bind, hold",
    "keep_up": "requests wait behind a full batch, the engine serves too little and slows as it grows: cut",
    "past_peak": "a larger batch served fewer tokens/s than the peak: back to the peak's batch",
    "ttft_flat": "a batch past the peak's served no more tokens/s and a tenth of its first tokens were late: no growth",
    "slow_start": "requests wait and the pace is far within the SLO: double",
    "headroom": "requests wait and the pace is within the SLO: grow by the square root of the limit",
    "steady": "nothing to change: hold",
    "manual_hold": "the limit was set by hand: the controller leaves it alone for control.manual_hold_seconds",
    "breaker_open": "the breaker is open: the controller would not cut, so the breaker's limit stands",
    "gpu_fault": "a GPU of the engine is failing (lost, Xid, ECC, throttled): the limit holds and nothing is learned",
    "no_signal": "the engine's /metrics or admin API could not be read this tick",
    "warming_up": "no window of the engine's metrics yet to decide on",
    "out_of_bounds": "the limit in force is outside control.min_limit..max_limit: brought back within",
    "admission_estimated": "the door's cap set from the prefill rate the engine showed",
    "admission_too_few_windows": "too few saturated windows for a cap yet: the door open",
    "admission_stale": "no saturated window for admission_stale_seconds: the door open",
    "admission_no_signal": "no saturated window yet (idle since the hook started, or unreadable): the door open",
    "admission_manual_hold": "the cap was set by hand: the controller leaves it alone for a while",
    "admission_resumed": "just started: the cap in force stands until the estimate is sure",
    "admission_error": "the engine's admission route failed: the door fails open",
}


def meaning(by: str, what: str) -> str:
    """The legend's line for an action the page lists (``by``: breaker or controller), or "" if none is known."""
    if by == "breaker":
        action, _, result = what.partition(": ")
        known = BREAKER.get(action, "")
        said = RESULTS.get(result, f"failed ({result}): retried with backoff" if result else "")
        return f"{known}; {said}" if known and said else known
    return CONTROLLER.get(what, "")
