"""Sizing a fleet: for each profile, the fewest replicas that meet the SLO, found with few replays. Pure.

The search starts at a lower bound, the trace's token demand over what one replica serves flat out
(:func:`lower_bound`), grows from there in doubling steps until a fleet meets the SLO, then bisects back to
the fewest that do; one fewer is always replayed too, so the table shows where the SLO stops being met. It
takes meeting the SLO to be monotone in the replica count, as it is behind a least-loaded balancer.

A fleet **meets the SLO** (:class:`Rule`) when at least ``target_attainment`` of the trace's requests are good
(completed with TTFT and TPOT within the SLO: shed and refused requests are not good) and at most
``max_shed_share`` were shed at the door. Its cost per million good tokens is its GPU-hours (replicas x GPUs
per replica x the trace's hours) times the price of a GPU-hour, over the prompt and output tokens of the good
requests, in millions: what the tokens served within the SLO cost.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from batchlens.goodput import Slo
from batchlens.plan.fleet import FleetRun, replay_fleet
from batchlens.replay.policies import Policy, Static, oracle_limits
from batchlens.replay.simulated import Run, outcome, replay
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine
from batchlens.simulator.profiles import GPUS, MODELS

#: GPUs one replica of a model profile holds, where not one: vLLM's TP8 recipe is one engine over 8 GPUs. A DP
#: rank (deepseek-v3-dp8ep, -dp16ep) is an engine of one GPU, its ranks deployed 8 or 16 to a deployment.
GPUS_PER_REPLICA = {"deepseek-v3-tp8ep": 8}


@dataclass(frozen=True)
class Profile:
    gpu: str  # a key of simulator.profiles.GPUS
    model: str  # a key of simulator.profiles.MODELS

    @property
    def name(self) -> str:
        return f"{self.gpu}/{self.model}"

    @property
    def gpus_per_replica(self) -> int:
        return GPUS_PER_REPLICA.get(self.model, 1)

    def engine(self, max_num_seqs: int = 256) -> Engine:
        """A fresh engine of this profile; ValueError where the model does not fit the GPU."""
        return Engine(GPUS[self.gpu], MODELS[self.model], max_num_seqs=max_num_seqs)


@dataclass(frozen=True)
class Rule:
    """What meeting the SLO means for a fleet (the config's plan: section)."""

    target_attainment: float = 0.99
    max_shed_share: float = 0.01

    def meets(self, attainment: float, shed_share: float) -> bool:
        return attainment >= self.target_attainment and shed_share <= self.max_shed_share

    def most_not_good(self, requests: int) -> tuple[int, int]:
        """(requests not good, requests shed) beyond which a fleet of ``requests`` can no longer meet the SLO."""
        return (math.floor(requests * (1 - self.target_attainment) + 1e-9),
                math.floor(requests * self.max_shed_share + 1e-9))  # fmt: skip

    def describe(self, slo: Slo) -> str:
        return (f"meets the SLO: at least {self.target_attainment:.1%} of requests good (TTFT <= "
                f"{slo.ttft_seconds:g}s and TPOT <= {slo.tpot_seconds:g}s; shed and refused are not good) and at "
                f"most {self.max_shed_share:.1%} shed")  # fmt: skip


@dataclass(frozen=True)
class Point:
    """One fleet replayed: a row of the plan."""

    profile: str
    replicas: int
    gpus: int  # replicas x GPUs per replica
    policy: str
    balancer: str
    limit: float  # the batch limit, averaged over time and over the replicas (a static policy's own)
    door: int | None  # the door's queued-token cap at the end, the replicas' median; None: open (no cap)
    requests: int
    goodput_rps: float
    slo_attainment: float
    shed_share: float
    p99_ttft_s: float
    p99_tpot_s: float
    gpu_hours: float
    good_tokens: int
    usd: float
    usd_per_million_good_tokens: float  # inf where no token was good
    meets: bool
    cheapest: bool = False  # the cheapest of all the points that meet the SLO
    stopped_at: float | None = None  # sure to miss, the replay stopped here (seconds); its figures are until then


def gpu_hours(replicas: int, gpus_per_replica: int, seconds: float) -> float:
    return replicas * gpus_per_replica * seconds / 3600


def cost_per_million(usd: float, good_tokens: int) -> float:
    """USD per million good tokens; infinite where none was good (a fleet that serves nothing in time)."""
    return usd / (good_tokens / 1e6) if good_tokens > 0 else math.inf


def good_tokens(fleet: FleetRun, slo: Slo) -> int:
    """The prompt and output tokens of the requests that met the SLO."""
    return sum(r.prompt_tokens + r.max_tokens for r in fleet.requests if outcome(r).good(slo))


def mean_limit(run: Run, seconds: float) -> float:
    """The batch limit averaged over ``seconds`` of the run, each limit weighted by how long it held."""
    if not run.limits or seconds <= 0:
        return math.nan
    times = [t for t, _ in run.limits] + [max(seconds, run.limits[-1][0])]
    spans = [b - a for a, b in itertools.pairwise(times)]
    if not (total := sum(spans)):
        return float(run.limits[0][1])
    return sum(s * limit for s, (_, limit) in zip(spans, run.limits, strict=True)) / total


def point(fleet: FleetRun, profile: Profile, slo: Slo, rule: Rule, *, seconds: float, price: float,
          policies: Sequence[Policy] = ()) -> Point:  # fmt: skip
    """The row of one fleet's replay: ``seconds``, the trace's length; ``price``, USD per GPU-hour; ``policies``,
    the replicas' policies as the run left them (for the door's cap)."""
    j = fleet.judgement
    hours = gpu_hours(fleet.replicas, profile.gpus_per_replica, seconds)
    tokens = good_tokens(fleet, slo)
    caps = [getattr(p, "queued_token_cap", None) for p in policies]
    door = int(statistics.median(caps)) if caps and None not in caps else None
    return Point(
        profile.name, fleet.replicas, fleet.replicas * profile.gpus_per_replica, fleet.runs[0].policy, fleet.balancer,
        statistics.fmean(mean_limit(run, j.seconds) for run in fleet.runs), door, j.requests, j.goodput_rps,
        j.slo_attainment, fleet.shed_share, j.p99_ttft_s, j.p99_tpot_s, hours, tokens, hours * price,
        cost_per_million(hours * price, tokens) if fleet.stopped_at is None else math.nan,
        fleet.stopped_at is None and rule.meets(j.slo_attainment, fleet.shed_share), stopped_at=fleet.stopped_at,
    )  # fmt: skip


def capacity(trace: Sequence[TraceRequest], make_engine: Callable[[], Engine], *, sample: int = 400,
             max_model_len: int = 8192) -> float:  # fmt: skip
    """What one replica serves flat out, in tokens (prompt and output) per second: the trace's first ``sample``
    requests that fit, all arriving at once, on one engine at each static limit from 4 up to its capacity in
    doublings (a batch past the throughput peak serves less), the best of them."""
    fits = [r for r in trace if r.prompt_tokens + r.output_tokens <= max_model_len][:sample]
    if not fits:
        return math.inf  # every request is refused as too long: no replica count serves it
    burst = [replace(r, t=0.0) for r in fits]
    limits = [n for n in oracle_limits(make_engine().max_num_seqs) if n >= 4] or [make_engine().max_num_seqs]
    return max(saturated_rate(replay(burst, make_engine(), Static(n), Slo(1e9, 1e9), max_model_len=max_model_len))
               for n in limits)  # fmt: skip


def saturated_rate(run: Run) -> float:
    """Tokens per second of a burst's run while the engine is saturated: the tokens of the requests that finish
    between the tenth and the ninetieth percentile of the finishing times, over that span (neither the first
    batch's ramp nor the drain's tail)."""
    done = sorted((r for r in run.requests if r.finished_at is not None), key=lambda r: r.finished_at)
    if not done:
        return 0.0
    first, last = done[len(done) // 10].finished_at, done[len(done) * 9 // 10].finished_at
    if last <= first:  # too few to tell a span: the whole run
        first, last = 0.0, done[-1].finished_at
    served = sum(r.prompt_tokens + r.max_tokens for r in done if first < r.finished_at <= last)
    return served / (last - first) if last > first else math.inf


def demand(trace: Sequence[TraceRequest], seconds: float) -> float:
    """The trace's tokens (prompt and output) per second, over ``seconds``."""
    return sum(r.prompt_tokens + r.output_tokens for r in trace) / seconds if seconds > 0 else math.inf


def lower_bound(tokens_per_second: float, replica_capacity: float) -> int:
    """ceil(demand / one replica's capacity), 1 at least: fewer replicas cannot keep up even flat out."""
    if not math.isfinite(tokens_per_second) or replica_capacity <= 0:
        return 1
    if not math.isfinite(replica_capacity):
        return 1
    return max(1, math.ceil(tokens_per_second / replica_capacity))


def search(evaluate: Callable[[int], Point], start: int, most: int) -> list[Point]:
    """The fewest replicas in 1..``most`` that meet the SLO, and one fewer, from ``start`` (a lower bound):
    every point replayed, by replica count. None meets where even ``most`` does not (then ``most`` is the last)."""
    seen: dict[int, Point] = {}

    def at(n: int) -> Point:
        if n not in seen:
            seen[n] = evaluate(n)
        return seen[n]

    start = max(1, min(start, most))
    if at(start).meets:
        n = start
        while n > 1 and at(n - 1).meets:  # the bound was loose: walk down to the first that fails
            n -= 1
        return [seen[k] for k in sorted(seen)]
    fails, step, n = start, 1, start
    while n < most:
        n = min(most, fails + step)
        if at(n).meets:
            break
        fails, step = n, step * 2
    else:
        return [seen[k] for k in sorted(seen)]  # none up to most meets
    meets = n
    while meets - fails > 1:  # bisect (fails, meets]: fails never meets, meets always does
        middle = (fails + meets) // 2
        if at(middle).meets:
            meets = middle
        else:
            fails = middle
    return [seen[k] for k in sorted(seen)]


def mark_cheapest(points: Sequence[Point]) -> list[Point]:
    """The points with the cheapest that meets the SLO marked (by cost per million good tokens, then GPUs)."""
    meeting = [p for p in points if p.meets]
    best = min(meeting, key=lambda p: (p.usd_per_million_good_tokens, p.gpus, p.profile)) if meeting else None
    return [replace(p, cheapest=p is best) for p in points]


def plan_profile(
    trace: Sequence[TraceRequest], profile: Profile, make_policy: Callable[[], Policy], slo: Slo, rule: Rule, *,
    seconds: float, price: float, balancer_name: str = "least-loaded", max_replicas: int = 64,
    max_num_seqs: int = 256, max_model_len: int = 8192, on_point: Callable[[Point], None] = lambda _p: None,
    whole: bool = False,
) -> tuple[int, list[Point]]:  # fmt: skip
    """One profile's search: (its lower bound, the points replayed). ValueError where the model does not fit.
    A fleet sure to miss the SLO stops there (replay_fleet's most_bad), unless ``whole``."""
    profile.engine(max_num_seqs)  # fails early, and clearly, where the model does not fit the GPU

    most_bad, most_shed = (None, None) if whole else rule.most_not_good(len(trace))

    def evaluate(n: int) -> Point:
        policies: list[Policy] = []

        def make() -> Policy:
            policies.append(make_policy())
            return policies[-1]

        fleet = replay_fleet(trace, lambda: profile.engine(max_num_seqs), make, slo, n, balancer_name=balancer_name,
                             max_model_len=max_model_len, most_bad=most_bad, most_shed=most_shed)  # fmt: skip
        found = point(fleet, profile, slo, rule, seconds=seconds, price=price, policies=policies)
        on_point(found)
        return found

    bound = lower_bound(demand(trace, seconds), capacity(trace, lambda: profile.engine(max_num_seqs),
                                                          max_model_len=max_model_len))  # fmt: skip
    return bound, search(evaluate, bound, max_replicas)
