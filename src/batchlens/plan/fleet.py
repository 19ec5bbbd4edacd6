"""A fleet of replicas in simulated time: N engines of one profile, each under its own copy of a policy, and a
balancer in front that sends each arrival to one of them. Pure and deterministic.

Each replica is the single-engine replay's own :class:`~batchlens.replay.simulated.Replica`: before an arrival,
every engine is stepped to its time; the balancer then sees each engine as a live balancer would (its requests
queued and running) and picks one; that engine takes the arrival through vLLM's checks (too long: refused; its
door: shed). A shed request is not retried on another replica: it counts as not good, as a 503 does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from batchlens.config.plan import BALANCERS
from batchlens.goodput import Judgement, Slo, judge
from batchlens.replay.policies import Policy
from batchlens.replay.simulated import Replica, Run, outcome
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine, SimRequest


class RoundRobin:
    """Each arrival to the next replica in turn, whatever their load."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, loads: Sequence[int]) -> int:
        chosen = self._next % len(loads)
        self._next = chosen + 1
        return chosen


class LeastLoaded:
    """Each arrival to the replica with the fewest requests in its engine (queued and running, vLLM's
    num_requests_waiting + num_requests_running); among equals, the first at or after the one after the last
    pick, so an idle fleet is filled in turn rather than always from the first."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, loads: Sequence[int]) -> int:
        n = len(loads)
        order = [(self._next + i) % n for i in range(n)]
        chosen = min(order, key=lambda i: loads[i])  # min keeps the first of equals: the turn order breaks ties
        self._next = chosen + 1
        return chosen


def balancer(name: str) -> RoundRobin | LeastLoaded:
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown balancer {name!r}: one of {', '.join(BALANCERS)}")


@dataclass
class FleetRun:
    """A fleet's replay: the whole fleet judged as one service, and each replica's own run."""

    replicas: int
    balancer: str
    judgement: Judgement
    shed: int
    refused: int
    runs: list[Run] = field(default_factory=list, repr=False)
    requests: list[SimRequest] = field(default_factory=list, repr=False)  # those replayed (all, unless stopped)
    stopped_at: float | None = None  # where a fleet sure to miss stopped (simulated seconds); None: replayed whole

    @property
    def shed_share(self) -> float:
        return self.shed / self.judgement.requests if self.judgement.requests else 0.0


def replay_fleet(
    trace: Sequence[TraceRequest],
    make_engine: Callable[[], Engine],
    make_policy: Callable[[], Policy],
    slo: Slo,
    replicas: int,
    *,
    balancer_name: str = "least-loaded",
    max_model_len: int = 8192,
    most_bad: int | None = None,
    most_shed: int | None = None,
) -> FleetRun:
    """Replay ``trace`` on ``replicas`` engines from ``make_engine``, each under a fresh ``make_policy()``,
    behind the named balancer; judged over every request and the run's length (the last engine's drain).

    ``most_bad``, ``most_shed``: stop as soon as more requests than that are sure not to be good (refused,
    shed, or finished outside the SLO), or more than that were shed: the fleet can no longer meet the SLO,
    whatever the rest of the trace does. It is then judged over the requests that arrived until then, over
    that time (those still in the engines as not completed), and says where it stopped."""
    if not trace:
        raise ValueError("an empty trace: nothing to replay")
    if replicas < 1:
        raise ValueError(f"a fleet has one replica or more, not {replicas}")
    spread = balancer(balancer_name)
    fleet = [Replica(make_engine(), make_policy(), slo, max_model_len=max_model_len, false_sheds=False)
             for _ in range(replicas)]  # fmt: skip
    requests = [SimRequest(str(i), r.prompt_tokens, r.output_tokens, r.t) for i, r in enumerate(trace)]
    mine: list[list[SimRequest]] = [[] for _ in fleet]
    stopped_at = None
    for index, request in enumerate(requests):
        for replica in fleet:
            replica.advance(request.arrival)
        if _sure_to_miss(fleet, most_bad, most_shed):
            stopped_at, requests = request.arrival, requests[:index]
            break
        chosen = spread.pick([replica.engine.unfinished for replica in fleet])
        fleet[chosen].arrive(request)
        mine[chosen].append(request)
    else:
        for replica in fleet:
            replica.advance(math.inf)
    seconds = max(replica.now for replica in fleet) if stopped_at is None else stopped_at
    runs = [replica.result(own, seconds) for replica, own in zip(fleet, mine, strict=True)]
    judgement = judge([outcome(r) for r in requests], seconds, slo)
    return FleetRun(replicas, spread.name, judgement, sum(r.shed for r in runs), sum(r.refused for r in runs), runs,
                    requests, stopped_at)  # fmt: skip


def _sure_to_miss(fleet: Sequence[Replica], most_bad: int | None, most_shed: int | None) -> bool:
    return (most_bad is not None and sum(r.bad for r in fleet) > most_bad) or (
        most_shed is not None and sum(r.run.shed for r in fleet) > most_shed
    )
