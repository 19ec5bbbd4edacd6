"""`batchlens plan`: the fleet's balancers, the search for the fewest replicas that meet the SLO, the cost
arithmetic, and the command (docs/scaling.md). Simulated time and tiny traces: a few seconds in all."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchlens.cli import main
from batchlens.config import load_config
from batchlens.goodput import Slo
from batchlens.plan.fleet import LeastLoaded, RoundRobin, replay_fleet
from batchlens.plan.search import Point, Profile, Rule, cost_per_million, gpu_hours, mark_cheapest, plan_profile, search
from batchlens.replay.policies import Static
from batchlens.replay.simulated import replay
from batchlens.replay.traces import TraceRequest

SLO = Slo(0.5, 0.05)
PROFILE = Profile("a100-80g", "dense-7b")


def trace(seconds: float = 10.0, rate: float = 40.0, seed: int = 7) -> list[TraceRequest]:
    """Poisson arrivals of short chats: about three replicas' worth of the a100-80g/dense-7b engine at limit 16."""
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < seconds:
        out.append(TraceRequest(t, rng.choice((256, 512, 1024)), rng.choice((16, 32, 64))))
    return out


def test_least_loaded_picks_the_emptiest_engine_and_breaks_ties_in_turn() -> None:
    spread = LeastLoaded()
    assert spread.pick([3, 0, 2]) == 1
    assert [spread.pick([0, 0, 0]) for _ in range(4)] == [2, 0, 1, 2]  # from the one after the last pick
    assert spread.pick([5, 4, 4]) == 1  # the first of the equals at or after the turn (0 after 2)


def test_round_robin_cycles_whatever_the_load() -> None:
    spread = RoundRobin()
    assert [spread.pick([9, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_a_fleet_of_one_is_the_single_engine_replay() -> None:
    """The fleet steps each engine with the single replay's own machinery: one replica, the same run."""
    requests = trace(seconds=3)
    alone = replay(requests, PROFILE.engine(64), Static(16), SLO)
    fleet = replay_fleet(requests, lambda: PROFILE.engine(64), lambda: Static(16), SLO, 1)
    assert fleet.judgement == alone.judgement


def test_least_loaded_spreads_a_burst_evenly() -> None:
    burst = [TraceRequest(0.0, 256, 16)] * 9
    fleet = replay_fleet(burst, lambda: PROFILE.engine(64), lambda: Static(16), SLO, 3)
    assert [r.judgement.requests for r in fleet.runs] == [3, 3, 3]


def test_the_search_finds_the_fewest_that_meet_and_replays_one_fewer() -> None:
    calls: list[int] = []

    def evaluate(n: int) -> Point:
        calls.append(n)
        return _point(n, meets=n >= 11)

    points = search(evaluate, 2, 64)
    assert next(p.replicas for p in points if p.meets) == 11 and any(p.replicas == 10 and not p.meets for p in points)
    assert calls == [2, 3, 5, 9, 17, 13, 11, 10]  # doubling steps from the bound, then bisecting: none twice
    assert [p.replicas for p in search(lambda n: _point(n, meets=n >= 3), 5, 64)] == [2, 3, 4, 5]  # a loose bound
    assert not any(p.meets for p in search(lambda n: _point(n, meets=False), 1, 4))  # none up to the most


def test_plan_on_a_small_trace_chooses_a_count_that_meets_while_one_fewer_does_not() -> None:
    requests = trace()
    bound, points = plan_profile(requests, PROFILE, lambda: Static(16), SLO, Rule(), seconds=10, price=2.0,
                                 max_num_seqs=64)  # fmt: skip
    chosen = mark_cheapest(points)
    best = next(p for p in chosen if p.cheapest)
    assert best.meets and bound <= best.replicas + 1
    fewer = next(p for p in points if p.replicas == best.replicas - 1)
    assert not fewer.meets
    for n, meets in ((best.replicas, True), (best.replicas - 1, False)):  # replayed again, on its own
        fleet = replay_fleet(requests, lambda: PROFILE.engine(64), lambda: Static(16), SLO, n)
        assert Rule().meets(fleet.judgement.slo_attainment, fleet.shed_share) is meets


def test_a_fleet_sure_to_miss_stops_where_it_is_sure_and_only_then() -> None:
    requests = trace()
    rule = Rule()
    most_bad, most_shed = rule.most_not_good(len(requests))
    assert (most_bad, most_shed) == (len(requests) // 100, len(requests) // 100)
    short = replay_fleet(requests, lambda: PROFILE.engine(64), lambda: Static(16), SLO, 1, most_bad=most_bad,
                         most_shed=most_shed)  # fmt: skip
    whole = replay_fleet(requests, lambda: PROFILE.engine(64), lambda: Static(16), SLO, 1)
    assert short.stopped_at is not None and len(short.requests) < len(requests) and whole.stopped_at is None
    assert whole.judgement.requests - whole.judgement.good > most_bad  # it did miss, replayed whole
    enough = replay_fleet(requests, lambda: PROFILE.engine(64), lambda: Static(16), SLO, 4, most_bad=most_bad,
                          most_shed=most_shed)  # fmt: skip
    assert enough.stopped_at is None and rule.meets(enough.judgement.slo_attainment, enough.shed_share)


def test_the_cost_arithmetic() -> None:
    assert gpu_hours(3, 8, 1800) == 12.0
    assert cost_per_million(12 * 2.5, 6_000_000) == 5.0
    assert cost_per_million(30.0, 0) == math.inf
    requests = trace(seconds=2)
    loose = Slo(1e6, 1e6)  # every request good: the good tokens are all of them, prompt and output
    _, points = plan_profile(requests, PROFILE, lambda: Static(16), loose, Rule(), seconds=3600, price=2.0,
                             max_num_seqs=64)  # fmt: skip
    one = points[0]
    tokens = sum(r.prompt_tokens + r.output_tokens for r in requests)
    assert one.replicas == 1 and one.good_tokens == tokens and one.gpu_hours == 1.0 and one.usd == 2.0
    assert one.usd_per_million_good_tokens == pytest.approx(2.0 / (tokens / 1e6))
    assert Profile("h200", "deepseek-v3-tp8ep").gpus_per_replica == 8


def test_the_cheapest_meeting_point_is_marked() -> None:
    points = [_point(2, meets=False, usd=1.0), _point(3, meets=True, usd=3.0), _point(4, meets=True, usd=2.0)]
    assert [p.cheapest for p in mark_cheapest(points)] == [False, False, True]
    assert not any(p.cheapest for p in mark_cheapest(points[:1]))


def test_the_config_section_and_its_checks() -> None:
    plan = load_config(None).plan
    assert plan.gpu_hour_price["h100"] > 0 and plan.balancer == "least-loaded" and plan.target_attainment == 0.99
    with pytest.raises(Exception, match=r"gpu_hour_price\.h100"):
        load_config(None, {"plan": {"gpu_hour_price": {"h100": -1.0}}})


def _write(path: Path, requests: list[TraceRequest]) -> Path:
    path.write_text("".join(json.dumps({"t": r.t, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens})
                            + "\n" for r in requests))  # fmt: skip
    return path


def test_the_command_writes_its_table_csv_and_png(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", trace(seconds=4, rate=20))
    done = CliRunner().invoke(main, ["plan", str(path), "--gpu", "a100-80g", "--policy", "static:16",
                                     "--max-num-seqs", "64", "--slo-ttft", "0.5", "--slo-tpot", "0.05",
                                     "--price", "a100-80g=2", "--out", str(tmp_path / "out")])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "<- cheapest" in done.output and "least-loaded" in done.output and "meets the SLO" in done.output
    assert (tmp_path / "out" / "plan.png").read_bytes()[:4] == b"\x89PNG"
    assert "usd_per_million_good_tokens" in (tmp_path / "out" / "plan.csv").read_text()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--price", "h100"], "GPU=USD"),
        (["--price", "h100=-3"], "GPU=USD"),
        (["--price", "b200=3"], "GPU=USD"),
        (["--policy", "static:0"], "--policy"),
        (["--policy", "breaker"], "not a fleet's policy"),
    ],
)
def test_the_command_refuses_a_bad_price_or_policy(tmp_path: Path, args: list[str], said: str) -> None:
    path = _write(tmp_path / "t.jsonl", trace(seconds=1))
    done = CliRunner().invoke(main, ["plan", str(path), *args])
    assert done.exit_code == 2 and said in done.output, done.output


def test_the_command_refuses_a_bad_trace_and_shows_help(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("hello\n")
    done = CliRunner().invoke(main, ["plan", str(tmp_path / "bad.jsonl")])
    assert done.exit_code == 1 and "bad.jsonl:1: not JSON" in done.output
    shown = CliRunner().invoke(main, ["plan", "--help"])
    assert shown.exit_code == 0 and "--price GPU=USD" in shown.output and "Examples" in shown.output


def _point(n: int, *, meets: bool, usd: float = 1.0) -> Point:
    return Point("g/m", n, n, "static:16", "least-loaded", 16.0, None, 100, 1.0, 1.0 if meets else 0.5, 0.0, 0.1,
                 0.01, n * 1.0, 1000, usd * n, usd, meets)  # fmt: skip
