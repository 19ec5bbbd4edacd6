"""Replay a trace on the simulator's engine model, in simulated time. Pure and deterministic.

Arrivals enter the engine at their trace time; the engine steps as vLLM's
scheduler does (simulator/engine.py); every ``tick`` simulated seconds the
policy sees the engine's gauges and sets the limit. The run lasts from the
first arrival until the last request is done (drain included), and is judged
by goodput (batchlens.goodput).

A request longer than ``max_model_len`` is refused at arrival, as vLLM answers
400: it counts as not good. Under an admitting policy, a request that arrives
while the prompts still in prefill reach the policy's queued-token cap is shed,
as vLLM's door answers 503 (queued_caps.py): not good either. Whether shedding
it was needed is measured counterfactually on a sample of the sheds
(:func:`would_have_been_good`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from batchlens.admin_api import AdmissionState
from batchlens.control.signals import SAMPLES_READ
from batchlens.goodput import Judgement, Outcome, Slo, judge
from batchlens.predicted_ttft import Backlog, Seen
from batchlens.queued_caps import PREDICTED_TTFT, refusal
from batchlens.replay.policies import Policy, Signals, Static, oracle_limits
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine, SimRequest
from batchlens.simulator.vllm_metrics import VllmMetrics

#: The replay's door holds the queued-token cap alone (an admitting policy's queued_token_cap).
SHED_REASON = "max_num_queued_tokens"


@dataclass
class Run:
    policy: str
    judgement: Judgement
    limits: list[tuple[float, int]] = field(default_factory=list)  # (time, limit) at each change
    refused: int | None = 0  # longer than max_model_len; None live, where LiveRun.accounting says what came back
    shed: int = 0  # refused at the door by the queued-token cap (an admitting policy), or by the per-request door
    refused_queued: int = 0  # of those, refused by the per-request door's second look, while queued (Replica.rejudge)
    false_sheds: int | None = None  # sheds that would have been good had they been admitted (estimated)
    false_shed_sample: int = 0  # the sheds replayed counterfactually to estimate false_sheds
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
    replica_type: Callable[..., Replica] | None = None,
) -> Run:
    """Replay ``trace`` on ``engine`` under ``policy``; ``on_progress`` gets the simulated time each tick.
    ``replica_type``: makes a :class:`Replica` that does more at its door (benchmarks/queued_refusal.py's)."""
    if not trace:
        raise ValueError("an empty trace: nothing to replay")
    replica = (replica_type or Replica)(engine, policy, slo, max_model_len=max_model_len, tick=tick,
                                        on_progress=on_progress)  # fmt: skip
    requests = [SimRequest(str(i), r.prompt_tokens, r.output_tokens, r.t) for i, r in enumerate(trace)]
    for index, request in enumerate(requests):
        replica.advance(request.arrival)
        replica.arrive(request, lambda index=index: requests[index + 1 :])
    replica.advance(math.inf)
    return replica.result(requests, replica.now)


class Replica:
    """One engine under one policy, in simulated time, fed its arrivals one by one: the replay's loop, which a
    fleet (plan/fleet.py) runs one of per engine, its balancer choosing where each arrival goes.

    :meth:`advance` steps the engine to a time (the policy deciding every tick), :meth:`arrive` takes an
    arrival through vLLM's checks (too long: refused; the door: shed; else queued), :meth:`result` judges.
    ``false_sheds``: whether to estimate, on a sample of the sheds, how many would have been good (a shadow
    run each: a fleet, which cannot know which engine later arrivals would go to, turns it off).
    """

    def __init__(self, engine: Engine, policy: Policy, slo: Slo, *, max_model_len: int = 8192, tick: float = 1.0,
                 on_progress: Callable[[float], None] = lambda _t: None, false_sheds: bool = True):  # fmt: skip
        self.engine, self.policy, self.slo, self.max_model_len = engine, policy, slo, max_model_len
        self.on_progress = on_progress
        self.capacity = engine.max_num_seqs
        engine.set_limit(policy.initial(self.capacity))
        self.run = Run(policy.name, judge([], 0.0, slo), [(0.0, engine.max_num_active_seqs)])
        self.steers = not isinstance(policy, Static)
        self.metrics = VllmMetrics(engine, "replay") if policy.wants_metrics else None
        self.tick = policy.tick_seconds if self.steers else tick
        self.sample = ShedSample() if false_sheds else None
        self.bad = 0  # requests already sure not to be good: refused, shed, or finished outside the SLO
        self.predicts = getattr(policy, "rates", None) is not None  # a per-request door (Predicting) in front
        self.in_prefill = [0, 0]  # prompt tokens and requests admitted without their first token: in prefill
        self.limit_seen = engine.max_num_active_seqs
        self.later: Callable[[], Sequence[SimRequest]] = tuple  # the arrivals still to come (arrive's ``later``)
        # A steering policy reads the idle engine at 0 too, as a live controller reads an engine before the load
        # comes: its first window then ends at the first tick, not the second (a decision 2 s later on every run).
        self.now, self.next_tick = 0.0, 0.0 if self.steers else self.tick

    @property
    def busy(self) -> bool:
        return bool(self.engine.running or self.engine.waiting)

    def arrive(self, request: SimRequest, later: Callable[[], Sequence[SimRequest]] = tuple) -> None:
        """``request`` arrives now (at or after its arrival time): refused, shed or queued. ``later``: the arrivals
        still to come to this engine, for a shed's counterfactual run."""
        engine, run = self.engine, self.run
        self.later = later
        request.finish_reason = turned_away(engine, request, cap := cap_of(self.policy), self.max_model_len)
        reason = SHED_REASON
        if request.finish_reason is None and self.predicts and self.predicted_miss(request):
            request.finish_reason, reason = "shed", PREDICTED_TTFT
        if request.finish_reason == "refused":
            run.refused += 1
            self.bad += 1
        elif request.finish_reason == "shed":
            run.shed += 1
            self.bad += 1
            if self.metrics is not None:  # counted as vLLM counts it: what the policy reads next tick, as live
                self.metrics.admission_rejections[reason].inc()
            if self.sample is not None and self.sample.takes(run.shed):
                good = would_have_been_good(engine, request, later(), self.now, cap, self.slo, self.max_model_len)
                self.sample.add(run.shed, good)
        else:
            engine.add(request)
            self.in_prefill[0] += request.prompt_tokens
            self.in_prefill[1] += 1

    def predicted_miss(self, request: SimRequest) -> bool:
        """The per-request door's verdict, from what the API server has: each unfinished request's arrival, prompt
        and whether its first token came, and the rates learned from what it saw of the steps."""
        engine, policy = self.engine, self.policy
        backlog = Backlog.of(Seen(r.prompt_tokens, r.first_token_at is None, r.generated, r.max_tokens)
                             for r in (*engine.running, *engine.waiting))  # fmt: skip
        return policy.refuses(request.prompt_tokens, backlog, engine.max_num_active_seqs, self.now - request.arrival)

    def rejudge(self) -> None:
        """The per-request door's second look, before each step (the plugin's, on each tick of its sampler): the
        requests in prefill that would now miss their TTFT, with the queue as it stands, are refused as at the door
        (their clients get the 503)."""
        engine = self.engine
        queued = engine.awaiting_first_token
        if queued:
            late = self.policy.refuses_queued([r.prompt_tokens for r in queued], [self.now - r.arrival for r in queued],
                                              engine.unfinished - len(queued), engine.max_num_active_seqs,
                                              engine.max_num_batched_tokens)  # fmt: skip
            for index in late:
                self.refuse_queued(queued[index])

    def refuse_queued(self, request: SimRequest) -> None:
        """Refuse ``request``, in prefill: aborted, and counted as a shed (whether it would have been good had it
        stayed is estimated on the sheds' sample, as at the door)."""
        engine, run = self.engine, self.run
        run.shed += 1
        run.refused_queued += 1
        self.bad += 1
        if self.metrics is not None:
            self.metrics.admission_rejections[PREDICTED_TTFT].inc()
        if self.sample is not None and self.sample.takes(run.shed):
            shadow = copy.deepcopy(engine)
            mine = next(r for r in (*shadow.running, *shadow.waiting) if r.id == request.id)
            self.sample.add(run.shed, served_in_time(shadow, mine, self.later(), self.now, cap_of(self.policy),
                                                     self.slo, self.max_model_len))  # fmt: skip
        engine.abort(request, self.now)
        request.finish_reason = "shed"
        self.in_prefill[0] -= request.prompt_tokens
        self.in_prefill[1] -= 1

    def advance(self, until: float) -> None:
        """Step the engine until its clock reaches ``until`` (a step may end past it) or it has nothing to do;
        an idle engine's clock jumps to ``until``. ``math.inf``: drain."""
        while self.busy and self.now < until:
            self.step()
        if not self.busy and until != math.inf:
            self.now = max(self.now, until)

    def step(self) -> None:
        """One scheduler iteration, and the policy's decision where a tick falls due."""
        engine, policy = self.engine, self.policy
        if self.predicts and policy.second_look:
            self.rejudge()
        limit, prefilling = engine.max_num_active_seqs, self.in_prefill[1]
        added, self.limit_seen = max(0, limit - self.limit_seen), limit  # the policy's growth frees slots too
        busy, full = prefilling > 0 and engine.unfinished - prefilling < limit, engine.unfinished >= limit
        step = engine.step(self.now)
        self.now += step.duration
        now = self.now
        if self.predicts:  # what the API server sees of this step: first tokens and finishes
            first = [r.prompt_tokens for r in step.produced if r.generated == 1]
            decoded = len(step.produced) - len(first)  # a token each, after a step's length since their last
            self.in_prefill[0] -= sum(first)
            self.in_prefill[1] -= len(first)
            policy.rates.observe(now, step.duration, busy=busy, full=full, prefilled_tokens=sum(first),
                                 prefills=len(first), finishes=len(step.finished), in_prefill=tuple(self.in_prefill),
                                 slots_added=added, decoded=(decoded, decoded * step.duration))  # fmt: skip
        self.bad += sum(not outcome(r).good(self.slo) for r in step.finished)
        if self.metrics is not None:
            self.metrics.observe_step(step)
        if now >= self.next_tick:
            self.on_progress(now)
            if self.steers:
                exposition = self.metrics.render(SAMPLES_READ).decode() if self.metrics is not None else ""
                limit = policy.decide(Signals(now, engine.max_num_active_seqs, self.capacity, len(engine.running),
                                              len(engine.waiting), engine.kv_usage, exposition))  # fmt: skip
                if limit != engine.max_num_active_seqs:
                    engine.set_limit(max(1, min(self.capacity, limit)))
                    self.run.limits.append((now, engine.max_num_active_seqs))
            self.next_tick = now - (now % self.tick) + self.tick

    def result(self, requests: Sequence[SimRequest], seconds: float) -> Run:
        """The run, judged over ``requests`` (those that arrived here) and ``seconds`` (the run's length)."""
        run = self.run
        run.judgement = judge([outcome(r) for r in requests], seconds, self.slo)
        run.decisions = dict(getattr(self.policy, "decisions", {}))
        run.requests = list(requests)
        if run.shed and self.sample is not None:
            run.false_sheds, run.false_shed_sample = self.sample.estimate(run.shed), len(self.sample.good)
        return run


def cap_of(policy: Policy) -> int | None:
    """The queued-token cap ``policy`` has in force: None (no cap) for a policy of the limit alone."""
    return getattr(policy, "queued_token_cap", None)


def turned_away(engine: Engine, request: SimRequest, cap: int | None, max_model_len: int) -> str | None:
    """Why vLLM would not admit ``request`` now: ``refused`` (too long, a 400), ``shed`` (its door, with the
    queued-token cap ``cap`` in force, a 503), or None: admitted."""
    if request.prompt_tokens + request.max_tokens > max_model_len:
        return "refused"
    if cap is None:
        return None
    state = AdmissionState(max_num_queued_tokens=cap, num_queued_tokens=engine.queued_tokens,
                           num_unfinished_reqs=engine.unfinished)  # fmt: skip
    return "shed" if refusal(state) is not None else None


@dataclass
class ShedSample:
    """A systematic sample of the sheds, evenly spread over the run however many there are: every
    ``stride``-th, the stride doubling (and every other sample dropped) whenever ``most`` are held."""

    most: int = 200
    stride: int = 1
    good: dict[int, bool] = field(default_factory=dict)  # shed ordinal -> whether admitting it would have been good

    def takes(self, ordinal: int) -> bool:
        return ordinal % self.stride == 0

    def add(self, ordinal: int, good: bool) -> None:
        self.good[ordinal] = good
        if len(self.good) >= self.most:
            self.stride *= 2
            self.good = {n: g for n, g in self.good.items() if n % self.stride == 0}

    def estimate(self, sheds: int) -> int:
        return round(sheds * sum(self.good.values()) / len(self.good)) if self.good else 0


def would_have_been_good(
    engine: Engine, request: SimRequest, later: Sequence[SimRequest], now: float, cap: int | None, slo: Slo,
    max_model_len: int, horizon: float = 600.0,
) -> bool:  # fmt: skip
    """Whether ``request``, shed at ``now``, would have met the SLO had it been admitted: a copy of the engine
    with it admitted, run on with the later arrivals through the same door, the limit and cap held as they
    are (for the few seconds until it finishes), ``horizon`` simulated seconds at most."""
    shadow = copy.deepcopy(engine)
    shadow.add(mine := _unserved(request))
    return served_in_time(shadow, mine, later, now, cap, slo, max_model_len, horizon)


def served_in_time(
    shadow: Engine, mine: SimRequest, later: Sequence[SimRequest], now: float, cap: int | None, slo: Slo,
    max_model_len: int, horizon: float = 600.0,
) -> bool:  # fmt: skip
    """Whether ``mine``, queued on ``shadow`` (an engine of no further use), meets the SLO as ``shadow`` runs on
    from ``now`` with the ``later`` arrivals through the cap, ``horizon`` simulated seconds at most."""
    index, t = 0, now
    while mine.finished_at is None and t - now < horizon:
        while index < len(later) and later[index].arrival <= t:
            if turned_away(shadow, later[index], cap, max_model_len) is None:
                shadow.add(_unserved(later[index]))
            index += 1
        if missed(mine, t, slo):
            return False  # no need to run on to its end
        duration = shadow.step(t).duration
        if duration <= 0:  # nothing could run, not even this request: it would not have been served
            break
        t += duration
    return mine.finished_at is not None and outcome(mine).good(slo)


def missed(request: SimRequest, now: float, slo: Slo) -> bool:
    """Whether ``request``, unfinished at ``now``, can no longer be good: its TTFT is past, or its output
    (all ``max_tokens`` of it, as every completion here runs to its length) cannot end within its TPOT."""
    if request.first_token_at is None:
        return now - request.arrival > slo.ttft_seconds
    return now - request.first_token_at > slo.tpot_seconds * max(request.max_tokens - 1, 1)


def _unserved(request: SimRequest) -> SimRequest:
    """A copy of a request not yet served (the shadow run must not touch the real one's timings)."""
    return SimRequest(request.id, request.prompt_tokens, request.max_tokens, request.arrival)


def outcome(request: SimRequest) -> Outcome:
    """What ``request`` got, as goodput judges it: no timings unless it ran to its length."""
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
