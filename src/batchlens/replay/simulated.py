"""Replay a trace on the simulator's engine model, in simulated time. Pure and deterministic.

Arrivals enter the engine at their trace time; the engine steps as vLLM's
scheduler does (simulator/engine.py); every ``tick`` simulated seconds the
policy sees the engine's gauges and sets the limit. The run lasts from the
first arrival until the last request is done (drain included), and is judged
by goodput (batchlens.goodput).

A request longer than ``max_model_len`` is refused at arrival, as vLLM answers
400: it counts as not good.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from batchlens.goodput import Judgement, Outcome, Slo, judge
from batchlens.replay.policies import Policy, Signals, Static, oracle_limits
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine, SimRequest
from batchlens.simulator.vllm_metrics import VllmMetrics


@dataclass
class Run:
    policy: str
    judgement: Judgement
    limits: list[tuple[float, int]] = field(default_factory=list)  # (time, limit) at each change
    refused: int | None = 0  # longer than max_model_len; None live, where LiveRun.accounting says what came back
    decisions: dict[str, int] = field(default_factory=dict)  # a steering policy's decisions, by reason
    requests: list[SimRequest] = field(default_factory=list, repr=False)  # as the engine left them: exact timings


def replay(
    trace: Sequence[TraceRequest],
    engine: Engine,
    policy: Policy,
    slo: Slo,
    *,
    max_model_len: int = 8192,
    tick: float = 1.0,
    on_progress: Callable[[float], None] = lambda _t: None,
) -> Run:
    """Replay ``trace`` on ``engine`` under ``policy``; ``on_progress`` gets the simulated time each tick."""
    if not trace:
        raise ValueError("an empty trace: nothing to replay")
    capacity = engine.max_num_seqs
    engine.set_limit(policy.initial(capacity))
    run = Run(policy.name, judge([], 0.0, slo), [(0.0, engine.max_num_active_seqs)])
    requests = [SimRequest(str(i), r.prompt_tokens, r.output_tokens, r.t) for i, r in enumerate(trace)]
    steers = not isinstance(policy, Static)
    metrics = VllmMetrics(engine, "replay") if policy.wants_metrics else None
    tick = policy.tick_seconds if steers else tick
    now, index, next_tick = 0.0, 0, tick
    while index < len(requests) or engine.running or engine.waiting:
        while index < len(requests) and requests[index].arrival <= now:
            request = requests[index]
            index += 1
            if request.prompt_tokens + request.max_tokens > max_model_len:
                request.finish_reason = "refused"
                run.refused += 1
            else:
                engine.add(request)
        if not (engine.running or engine.waiting):
            if index < len(requests):
                now = max(now, requests[index].arrival)  # idle: jump to the next arrival
            continue
        step = engine.step(now)
        now += step.duration
        if metrics is not None:
            metrics.observe_step(step)
        if now >= next_tick:
            on_progress(now)
            if steers:
                exposition = metrics.render().decode() if metrics is not None else ""
                limit = policy.decide(Signals(now, engine.max_num_active_seqs, capacity, len(engine.running),
                                              len(engine.waiting), engine.kv_usage, exposition))  # fmt: skip
                if limit != engine.max_num_active_seqs:
                    engine.set_limit(max(1, min(capacity, limit)))
                    run.limits.append((now, engine.max_num_active_seqs))
            next_tick = now - (now % tick) + tick
    run.judgement = judge([_outcome(r) for r in requests], now, slo)
    run.decisions = dict(getattr(policy, "decisions", {}))
    run.requests = requests
    return run


def _outcome(request: SimRequest) -> Outcome:
    if request.finish_reason != "length":
        return Outcome(None, None, 0)
    return Outcome(request.first_token_at - request.arrival, request.finished_at - request.arrival, request.generated)


def oracle(
    trace: Sequence[TraceRequest],
    make_engine: Callable[[], Engine],
    slo: Slo,
    *,
    max_model_len: int = 8192,
    on_run: Callable[[Run], None] = lambda _run: None,
) -> tuple[Run, list[Run]]:
    """The best static limit on this trace, knowing the whole trace in advance: (best, every run tried).

    Powers of two and the capacity first, then the midpoints on either side of the best.
    """
    runs: dict[int, Run] = {}

    def attempt(limit: int) -> None:
        if limit not in runs:
            runs[limit] = replay(trace, make_engine(), Static(limit), slo, max_model_len=max_model_len)
            on_run(runs[limit])

    capacity = make_engine().max_num_seqs
    for limit in oracle_limits(capacity):
        attempt(limit)
    ordered = sorted(runs)
    best = max(ordered, key=lambda limit: runs[limit].judgement.goodput_rps)
    at = ordered.index(best)
    for neighbour in ordered[max(0, at - 1) : at] + ordered[at + 1 : at + 2]:
        attempt((best + neighbour) // 2)
    winner = max(sorted(runs), key=lambda limit: runs[limit].judgement.goodput_rps)
    return runs[winner], [runs[limit] for limit in sorted(runs)]
