"""`batchlens replay`: goodput (pure), the trace readers and their refusals, and simulated replays.

The engine is the simulator's model (simulator/engine.py) in simulated time: no fake anywhere, and no
server. The CLI runs as a subprocess, as users run it.
"""

from __future__ import annotations

import csv
import json
import math
import random
import subprocess
from pathlib import Path

import pytest

from batchlens.config import Control
from batchlens.control.signals import read_sample
from batchlens.goodput import Outcome, Slo, judge
from batchlens.load.plan import Planned, Result
from batchlens.replay.breaker_policy import EVALUATION_SECONDS, BreakerPolicy
from batchlens.replay.live import outcome
from batchlens.replay.output import arrival_rate, figure, rows, table, write_csv
from batchlens.replay.policies import Adaptive, Admitting, Static, oracle_limits
from batchlens.replay.policy_names import parse_policy
from batchlens.replay.simulated import Replica, Run, ShedSample, oracle, replay, turned_away, would_have_been_good
from batchlens.replay.traces import TraceError, TraceRequest, read_trace, select
from batchlens.simulator.engine import Engine, SimRequest
from batchlens.simulator.profiles import GPUS, MODELS
from harness.exporter import BATCHLENS, one, parse_samples

SLO = Slo(0.5, 0.1)

# -- goodput, pure ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "good"),
    [
        (Outcome(0.2, 2.2, 21), True),  # TPOT (2.2 - 0.2) / 20 = 0.1: on the bound is good
        (Outcome(0.6, 1.0, 5), False),  # TTFT over
        (Outcome(0.1, 3.0, 11), False),  # TPOT 0.29 over
        (Outcome(0.4, 0.4, 1), True),  # one token: no TPOT to judge
        (Outcome(None, None, 0), False),  # failed, aborted or refused
    ],
)
def test_a_request_is_good_within_both_bounds(outcome: Outcome, good: bool) -> None:
    assert outcome.good(SLO) is good


def test_goodput_counts_good_requests_over_the_whole_run_drain_included() -> None:
    outcomes = [Outcome(0.1, 1.0, 10)] * 6 + [Outcome(2.0, 3.0, 10)] * 2 + [Outcome(None, None, 0)] * 2
    j = judge(outcomes, seconds=4.0, slo=SLO)
    assert (j.requests, j.good, j.goodput_rps, j.slo_attainment) == (10, 6, 1.5, 0.6)
    assert j.p99_ttft_s == 2.0 and j.throughput_tokens_s == 80 / 4
    with pytest.raises(ValueError, match="above zero"):
        Slo(0, 0.1)
    with pytest.raises(ValueError, match="above zero"):
        Slo(0.5, 0)
    assert Slo(0.25, 0.05)  # an SLO under a second is the usual one


def test_the_slo_is_met_at_its_bound_and_every_quantile_is_of_the_completed_requests() -> None:
    slo = Slo(0.5, 0.125)
    at_bound = Outcome(0.5, 0.5 + 0.125 * 8, 9)  # TTFT and TPOT exactly the SLO's (binary fractions: exact)
    assert at_bound.good(slo) and not Outcome(0.5, 0.5 + 0.25 * 8, 9).good(slo)
    outcomes = [Outcome(0.125 * k, 0.125 * k + 0.0625 * k * 4, 5) for k in range(1, 5)] + [Outcome(None, None, 0)]
    j = judge(outcomes, seconds=0.5, slo=slo)  # a run shorter than a second is still per second
    # by hand: TTFTs 0.125..0.5 and TPOTs 0.0625..0.25, nearest rank over the four completed
    assert (j.p50_ttft_s, j.p99_ttft_s, j.p50_tpot_s, j.p99_tpot_s) == (0.25, 0.5, 0.125, 0.25)
    assert (j.good, j.goodput_rps, j.throughput_tokens_s) == (2, 4.0, 40.0)
    empty = judge([], 0, slo)
    assert (empty.goodput_rps, empty.throughput_tokens_s) == (0.0, 0.0) and math.isnan(empty.p99_tpot_s)


# -- traces -------------------------------------------------------------------------------------------

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,879,0
2023-11-16 18:16:07.5000000,1024,28
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
46,GPT-4,417,276,693,API log
"""


def test_each_format_reads_into_seconds_from_the_first_arrival(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text(AZURE)
    (tmp_path / "b.csv").write_text(BURSTGPT)
    (tmp_path / "c.jsonl").write_text('{"t": 3, "prompt_tokens": 10, "output_tokens": 5}\n\n'
                                      '{"t": 3.5, "prompt_tokens": 20, "output_tokens": 6}\n')  # fmt: skip
    azure = read_trace(tmp_path / "a.csv", "azure")
    assert [(round(r.t, 4), r.prompt_tokens, r.output_tokens) for r in azure] == [
        (0.0, 374, 44),
        (4.3146, 396, 109),
        (20.8194, 1024, 28),
    ]  # fmt: skip  (the failed request is left out)
    assert read_trace(tmp_path / "b.csv", "burstgpt") == [TraceRequest(0, 472, 18), TraceRequest(41, 417, 276)]
    assert read_trace(tmp_path / "c.jsonl", "jsonl") == [TraceRequest(0, 10, 5), TraceRequest(0.5, 20, 6)]
    trace = [TraceRequest(float(t), 1, 1) for t in range(10)]
    assert [r.t for r in select(trace, start=2, duration=4, rate_scale=2)] == [0, 0.5, 1, 1.5]


@pytest.mark.parametrize(
    ("fmt", "text", "said"),
    [
        ("jsonl", "", "no requests to replay"),
        ("jsonl", '{"t": 1, "prompt_tokens": 5, "output_tokens": 5}\nnot json\n', ":2: not JSON"),
        (
            "jsonl",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n",
            ":1: not JSON: Expecting value: line 1 column 1 (char 0) (a CSV",
        ),
        (
            "jsonl",
            '{"t": 5, "prompt_tokens": 5, "output_tokens": 5}\n{"t": 1, "prompt_tokens": 5, "output_tokens": 5}\n',
            ":2: time goes back",
        ),
        ("jsonl", '{"t": 1, "prompt_tokens": 5}\n', ':1: expected {"t": seconds'),
        ("jsonl", '{"t": 1, "prompt_tokens": 99999999999, "output_tokens": 5}\n', "is not a token count"),
        ("jsonl", '{"t": 1, "prompt_tokens": 5, "output_tokens": 5, "pad": "' + "x" * 70_000 + '"}\n', ":1: a line of"),
        ("azure", "", "empty: no header"),
        ("azure", "time,prompt\n1,2\n", "the header lacks TIMESTAMP, ContextTokens, GeneratedTokens"),
        ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", ":2: TIMESTAMP is not a date"),
        ("burstgpt", BURSTGPT.splitlines()[0] + "\n5,ChatGPT,472\n", ":2: 3 columns where the header has 6"),
    ],
)
def test_a_bad_trace_is_refused_with_its_line(tmp_path: Path, fmt: str, text: str, said: str) -> None:
    path = tmp_path / "trace"
    path.write_text(text)
    with pytest.raises(TraceError, match=None) as raised:
        read_trace(path, fmt)
    assert said in str(raised.value) and str(path) in str(raised.value), raised.value


# -- simulated replay -----------------------------------------------------------------------------------


def poisson(rate: float, seconds: float, seed: int = 1) -> list[TraceRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(TraceRequest(t, rng.choice([256, 512, 1024]), rng.choice([64, 128, 256])))


def engine(capacity: int = 128) -> Engine:
    return Engine(GPUS["a100-80g"], MODELS["dense-7b"], max_num_seqs=capacity)


def test_a_replay_is_deterministic_and_refuses_what_vllm_would() -> None:
    trace = [*poisson(2, 30), TraceRequest(31, 9000, 10)]  # the last is longer than max_model_len
    first, again = (replay(trace, engine(), Static(), SLO) for _ in range(2))
    assert first.judgement == again.judgement and first.refused == 1
    assert first.judgement.requests == len(trace) and first.judgement.good < len(trace)
    assert first.judgement.seconds >= trace[-2].t, "the run lasts until the last request is done"
    assert first.limits == [(0.0, 128)]


def test_policies_parse_and_refuse_nonsense() -> None:
    assert parse_policy("default", SLO) == Static() and parse_policy("static:16", SLO) == Static(16)
    assert parse_policy("breaker", SLO).name == "breaker" and parse_policy("adaptive", SLO).name == "adaptive"
    assert parse_policy("pid", SLO).name == "pid" and parse_policy("pid", SLO).tick_seconds == 30
    for bad in ("static:0", "static:x", "adaptiv", "default:3", "breaker:2"):
        with pytest.raises(ValueError):
            parse_policy(bad, SLO)
    with pytest.raises(ValueError, match="above the engine's capacity"):
        Static(300).initial(256)
    assert oracle_limits(48) == [1, 2, 4, 8, 16, 32, 48]


def test_the_controllers_policies_follow_the_configs_control_section_as_live() -> None:
    """`batchlens replay --config`: what an operator tunes in replay is what runs live (the door's settings are
    built by the same function the live controller uses)."""
    control = Control(interval_seconds=1, start_limit=8, max_limit=32, keep_up=None, admission=True,
                      admission_margin=0.5, admission_stale_seconds=30)  # fmt: skip
    both = parse_policy("adaptive+admit", SLO, control=control)
    assert both.tick_seconds == 1 and both.initial(64) == 8
    assert (both.limits.tuning.max_limit, both.limits.tuning.keep_up, both.limits.tuning.door) == (32, None, True)
    assert (both.settings.margin, both.settings.stale_seconds) == (0.5, 30)
    admit = parse_policy("admit", SLO, control=control)
    assert admit.tick_seconds == 1 and admit.settings.margin == 0.5 and admit.initial(64) == 64
    assert parse_policy("adaptive", SLO, control=Control()).initial(256) == 32, "the defaults: an eighth, as ever"


def test_the_breaker_policy_acts_on_its_alert_as_the_hook_does() -> None:
    """Today's hook, replayed: the generated alert's condition on the engine's TTFT histogram, Alertmanager's
    timing, and the hook's own state machine."""
    overloaded = replay(poisson(5, 90), engine(), BreakerPolicy(), SLO)
    assert overloaded.decisions.get("halve", 0) >= 1 and overloaded.limits[:2] == [
        (0.0, 128),
        (overloaded.limits[1][0], 64),
    ]
    assert overloaded.limits[1][0] >= EVALUATION_SECONDS, "nothing acts before the first rule evaluation"
    calm = replay(poisson(1, 60), engine(), BreakerPolicy(), SLO)
    assert calm.decisions == {} and calm.limits == [(0.0, 128)]


def test_the_oracle_is_the_best_of_the_limits_it_tries_each_replayed_here_on_its_own() -> None:
    """Issue 29 finding 7: the oracle against static limits it had itself replayed proved nothing. Here every
    limit it names as tried is replayed apart, and its pick must be the one with the most goodput."""
    trace = poisson(5, 60)
    best, tried = oracle(trace, lambda: engine(64), SLO)
    tried_limits = sorted(int(r.policy.removeprefix("static:")) for r in tried)
    assert set(oracle_limits(64)) <= set(tried_limits)  # the powers of two and the capacity, then neighbours
    by_hand = {n: replay(trace, engine(64), Static(n), SLO).judgement.goodput_rps for n in tried_limits}
    assert best.judgement.goodput_rps == max(by_hand.values()), (best.policy, by_hand)
    assert by_hand[int(best.policy.removeprefix("static:"))] == best.judgement.goodput_rps
    assert len(set(by_hand.values())) > 1, "a trace where every limit serves the same proves nothing"
    # and it searched where its docstring says: the midpoints on either side of the best of the first sweep
    powers = oracle_limits(64)
    top = max(powers, key=by_hand.__getitem__)
    at = powers.index(top)
    assert {(top + n) // 2 for n in powers[max(0, at - 1) : at] + powers[at + 1 : at + 2]} <= set(tried_limits)


def test_the_cli_compares_policies_and_finds_a_better_static_limit_than_vllms_default(tmp_path: Path) -> None:
    """At 5 requests/s this engine overloads with every limit allowed in: a cap holds TPOT and wins."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"t": r.t, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens})
                             + "\n" for r in poisson(5, 90)))  # fmt: skip
    done = subprocess.run(
        [BATCHLENS, "replay", str(trace), "--simulated", "--max-num-seqs", "128", "--policy", "default",
         "--policy", "static:8", "--policy", "breaker", "--policy", "adaptive", "--oracle", "--json", "--out",
         str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    policies = {p["policy"]: p for p in result["policies"]}
    keys = {"policy", "goodput_rps", "slo_attainment", "requests", "good", "p99_ttft_s", "p99_tpot_s",
            "throughput_tokens_s"}  # fmt: skip
    assert keys <= set(policies["default"]) and keys <= set(result["oracle"])
    oracle, default = result["oracle"], policies["default"]
    print(f"default {default['goodput_rps']:.3f}/s, oracle {oracle['policy']} {oracle['goodput_rps']:.3f}/s")
    assert oracle["goodput_rps"] >= 1.5 * default["goodput_rps"], (oracle, default)
    assert default["p99_tpot_s"] > SLO.tpot_seconds, "vLLM's default breaks the TPOT bound here"
    # The oracle reports a limit in the range it sweeps, and replaying that limit alone gives what it reported.
    limit = int(oracle["policy"].removeprefix("static:"))
    assert 1 <= limit <= 128 and oracle["requests"] == len(poisson(5, 90))
    again = replay(read_trace(trace, "jsonl"), engine(), Static(limit), SLO).judgement.goodput_rps
    assert again == pytest.approx(oracle["goodput_rps"]), (limit, again, oracle)
    # The controller, from the engine's own metrics only, steers well clear of the default
    # (benchmarks/controller.py compares it with the oracle on five workloads).
    adaptive = policies["adaptive"]
    print(f"adaptive {adaptive['goodput_rps']:.3f}/s, {adaptive['limit_changes']} changes, ends at "
          f"{adaptive['final_limit']}")  # fmt: skip
    assert adaptive["limit_changes"] > 0 and adaptive["goodput_rps"] >= 1.5 * default["goodput_rps"], adaptive
    cuts = {r: n for r, n in adaptive["decisions"].items() if r in ("pace_over", "keep_up", "past_peak", "kv_ceiling")}
    assert cuts and default["decisions"] is None, adaptive["decisions"]
    assert adaptive["goodput_rps"] >= policies["breaker"]["goodput_rps"], "never worse than today's breaker"
    rows = list(csv.DictReader((tmp_path / "out" / "replay.csv").open()))
    assert [r["policy"] for r in rows] == ["default", "static:8", "breaker", "adaptive", oracle["policy"]]
    assert rows[-1]["oracle"] == "1"
    assert (tmp_path / "out" / "replay.png").read_bytes()[:4] == b"\x89PNG"
    assert "replaying" in done.stderr  # the progress bar


def test_the_slo_and_the_policy_are_checked_before_the_replay(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 0, "prompt_tokens": 5, "output_tokens": 5}\n')
    for args, said in ((["--slo-ttft", "0"], "must be above zero"), (["--policy", "static:999"], "capacity"),
                       (["--policy", "magic"], "unknown policy")):  # fmt: skip
        done = subprocess.run([BATCHLENS, "replay", str(trace), "--simulated", *args], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert math.isnan(judge([], 0, SLO).slo_attainment)


def test_a_spreadsheets_byte_order_mark_is_not_part_of_the_header(tmp_path: Path) -> None:
    (tmp_path / "b.csv").write_bytes(b"\xef\xbb\xbf" + BURSTGPT.encode())
    assert read_trace(tmp_path / "b.csv", "burstgpt") == [TraceRequest(0, 472, 18), TraceRequest(41, 417, 276)]


def test_the_arrival_rate_is_drawn_in_whole_buckets_and_bounded() -> None:
    steady = [TraceRequest(i / 4.5, 10, 10) for i in range(int(4.5 * 95))]  # 95 s at 4.5/s: a partial last 10 s
    starts, rates = arrival_rate(steady)
    assert starts[-1] == pytest.approx(steady[-1].t) and min(rates) > 4.0 and max(rates) < 5.0, rates
    starts, _ = arrival_rate([TraceRequest(0, 1, 1), TraceRequest(3e7, 1, 1)])  # a gap of a year: 1000 buckets
    assert len(starts) == 1001


def test_the_picture_shows_every_policys_limit_in_plain_numbers_over_arrivals_from_zero() -> None:
    """Issue 58, item 8: two of seven legend entries were hidden under other lines, the limit axis read 6×10^1,
    the arrival rate was one spike on an axis from 1.94, and nothing said where adaptive starts."""
    trace = poisson(2, 60)
    runs = [replay(trace, engine(), policy, SLO) for policy in (Static(), Static(8), Static(8), Adaptive(SLO))]
    fig = figure(runs, None, trace, title="t")
    _goodput, rate, limit = fig.axes
    lines = limit.get_lines()
    assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == len(lines) == 4, "each told apart"
    fig.canvas.draw()
    ticks = [t.get_text() for t in limit.get_yticklabels() if t.get_text()]
    assert ticks and all(t.replace(".", "").isdigit() for t in ticks), ticks  # 64, not 6×10^1
    assert rate.get_ylim()[0] == 0
    assert any("adaptive starts at" in t.get_text() for t in limit.texts)


def test_the_csv_holds_a_runs_decisions_as_json(tmp_path) -> None:
    """Issue 58, item 11: the decisions column was Python's repr of a dict, which no spreadsheet or jq reads."""
    trace = poisson(2, 60)
    runs = [replay(trace, engine(), Static(), SLO), replay(trace, engine(), Adaptive(SLO), SLO)]
    write_csv(runs, None, tmp_path / "replay.csv")
    with (tmp_path / "replay.csv").open() as f:
        default, adaptive = list(csv.DictReader(f))
    assert default["decisions"] == "" and json.loads(adaptive["decisions"]) == runs[1].decisions != {}


def test_a_live_run_draws_no_batch_limit_axis_and_a_refused_run_says_why() -> None:
    trace = poisson(2, 10)
    live = Run("live", judge([], 10, SLO), [], refused=None)
    assert len(figure([live], None, trace, title="t").axes) == 2  # goodput, arrivals: no empty limit axis
    steered = replay(trace, engine(), Static(8), SLO)
    assert len(figure([steered], None, trace, title="t").axes) == 3
    refused = replay([TraceRequest(0, 9000, 10), TraceRequest(1, 9000, 10)], engine(), Static(), SLO)
    shown = table([refused], None, SLO)
    assert "default: 2 of 2 requests refused at arrival as longer than --max-model-len" in shown, shown


def test_a_live_request_is_judged_by_its_first_token_not_its_last() -> None:
    """A long answer that started at once meets the TTFT bound although its last token came long after it."""
    planned = Planned(at=0.0, prompt_tokens=100, max_tokens=101, stream=True)
    answered = outcome(Result(planned, ok=True, e2e=5.2, ttft=0.2, output_tokens=101))
    assert (answered.ttft, answered.e2e, answered.output_tokens) == (0.2, 5.2, 101) and answered.good(SLO)
    assert outcome(Result(planned, ok=False, e2e=0.1, ttft=0.1)) == Outcome(None, None, 0)


# -- admission in replay: the door, the sheds, and the sheds that were needless ----------------------------


def test_vllms_door_sheds_at_the_queued_token_cap_and_refuses_the_too_long_first() -> None:
    busy = engine()
    for i, prompt in enumerate((600, 400)):
        busy.add(SimRequest(str(i), prompt, 10, 0.0))  # both still in prefill: 1000 queued tokens
    arriving = SimRequest("new", 256, 64, 0.0)
    assert turned_away(busy, arriving, None, 8192) is None, "no cap: the door is open"
    assert turned_away(busy, arriving, 1001, 8192) is None
    assert turned_away(busy, arriving, 1000, 8192) == "shed", "vLLM sheds once the backlog reaches the cap"
    assert turned_away(busy, SimRequest("long", 9000, 10, 0.0), 1001, 8192) == "refused"
    busy.step(0.0)  # prefilled: they no longer count
    assert busy.queued_tokens == 0 and turned_away(busy, arriving, 1000, 8192) is None


def test_the_counterfactual_admits_the_shed_request_on_a_copy_and_judges_it_alone() -> None:
    later = [SimRequest(str(i), 512, 64, 0.01 * i) for i in range(1, 5)]
    idle = engine()
    shed = SimRequest("shed", 256, 64, 0.0)
    assert would_have_been_good(idle, shed, later, 0.0, None, SLO, 8192), "an idle engine serves it in time"
    backlog = engine()
    for i in range(200):  # 200 × 1024 prompt tokens ahead of it: far more than 0.5 s of prefill
        backlog.add(SimRequest(f"b{i}", 1024, 64, 0.0))
    assert not would_have_been_good(backlog, shed, later, 0.0, None, SLO, 8192)
    # the real run is untouched: same backlog, no timings on the shed request or on the later ones
    assert len(backlog.waiting) == 200 and backlog.queued_tokens == 200 * 1024
    assert shed.first_token_at is None and all(r.first_token_at is None and not r.itl for r in later)


def test_the_shed_sample_stays_between_100_and_200_spread_over_the_run() -> None:
    sample = ShedSample()
    for ordinal in range(1, 1001):
        if sample.takes(ordinal):
            sample.add(ordinal, good=ordinal <= 250)  # the first quarter of the sheds would have been good
    assert 100 <= len(sample.good) < 200
    assert min(sample.good) <= 1000 / len(sample.good) * 2 and max(sample.good) > 900, "spread, not the first ones"
    assert abs(sample.estimate(1000) - 250) <= 10, "a sample of the first sheds would say 1000"
    assert ShedSample().estimate(10) == 0


def test_past_capacity_admission_sheds_at_the_door_and_the_ones_it_admits_do_better() -> None:
    """At 8 requests/s this engine (about 4.5 served) drowns in its queue under vLLM's default; with the cap
    the queue is bounded: sheds count as not good, yet goodput rises and the admitted wait far less."""
    trace = poisson(8, 40)
    assert parse_policy("admit", SLO).name == "admit" and parse_policy("adaptive+admit", SLO).name == "adaptive+admit"
    both, alone = parse_policy("adaptive+admit", SLO), parse_policy("adaptive", SLO)
    both.initial(64), alone.initial(64)
    assert both.limits.tuning.door and not alone.tuning.door, "the law beside the door regrows knowing it sheds"
    default = replay(trace, engine(), Static(), SLO)
    admit = replay(trace, engine(), parse_policy("admit", SLO), SLO)
    assert default.shed == 0 and default.false_sheds is None
    assert admit.shed > 0 and admit.judgement.requests == len(trace)
    shed = [r for r in admit.requests if r.finish_reason == "shed"]
    assert len(shed) == admit.shed and all(r.first_token_at is None for r in shed)
    assert admit.judgement.good <= len(trace) - admit.shed, "a shed request is never good"
    assert admit.judgement.goodput_rps > default.judgement.goodput_rps
    assert admit.judgement.p99_ttft_s < default.judgement.p99_ttft_s / 2
    assert admit.false_shed_sample == min(admit.shed, 200) or 100 <= admit.false_shed_sample < 200
    assert 0 <= admit.false_sheds <= admit.shed
    shown = table([admit], None, SLO)
    assert f"admit: {admit.shed} of {len(trace)} requests shed at the door" in shown, shown
    row = rows([admit])[0]
    assert (row["shed"], row["false_sheds"], row["refused"]) == (admit.shed, admit.false_sheds, 0)
    admit.policy = "adaptive+admit"  # wider than a column: the column widens, and every line keeps its place
    header, line = table([admit], None, SLO).splitlines()[:2]
    assert len(header) == len(line) and line.split()[0] == "adaptive+admit", (header, line)


def test_a_shed_is_counted_in_vllms_rejection_counter_the_policy_reads_as_live() -> None:
    """The policy sees each shed in vllm:admission_rejections_total at its next tick, as the controller reads a
    live engine's; without it the replay's door would never count a window with refusals as saturated."""
    seen: list[float] = []

    class Watching(Admitting):
        def decide(self, signals):
            seen.append(read_sample(signals.exposition, signals.now).rejected)
            return super().decide(signals)

    admit = replay(poisson(8, 40), engine(), Watching(SLO, Static()), SLO)
    assert admit.shed > 0 and seen == sorted(seen) and 0 < seen[-1] <= admit.shed


def test_a_steering_policy_reads_the_idle_engine_at_the_start_and_decides_at_its_first_tick() -> None:
    """As a live controller reads an engine before the load comes, the replay samples the idle engine at the
    start: the first window ends at the first tick (2 s), not the second. Read at 2 s first, every steered run
    began with 4 s at its start limit (the published profile's steady load lost 3% of its requests there)."""
    ticks: list[float] = []

    class Watching(Admitting):
        def decide(self, signals):
            ticks.append(signals.now)
            return super().decide(signals)

    run = replay(poisson(8, 10), engine(), Watching(SLO, parse_policy("adaptive", SLO)), SLO)
    assert ticks[0] < 0.5 and 2.0 <= ticks[1] < 2.5, ticks[:3]
    assert run.limits[1][0] == ticks[1], f"a queue from the start: slow start at the first window, {run.limits}"


def test_the_doors_second_look_refuses_a_request_waiting_for_a_slot_once_it_would_miss_and_no_sooner() -> None:
    """Two requests of 400 output tokens hold an engine's two slots; three more, admitted under a bound so wide that
    nothing misses, wait for one. The bound falls to the SLO's TTFT (as the controller's PUT would set it): before
    each step the door looks again (Replica.rejudge) and refuses each waiting request once its wait and the least
    its prefill can take pass the TTFT, not while it could still make it. They count as sheds, in vLLM's counter
    as live and none of them false (no slot frees for 400 decode steps); the decoding two run to their end."""
    door = parse_policy("predict", SLO)
    replica = Replica(engine(capacity=2), door, SLO)
    arrivals = [SimRequest(f"learn{i}", 256 * (1 + i % 4), 1, float(i)) for i in range(10)]  # a prefill rate
    arrivals += [SimRequest(f"long{i}", 64, 400, 20.0) for i in range(2)]
    waiting = [SimRequest(f"wait{i}", 512, 8, 20.5) for i in range(3)]
    for request in arrivals:
        replica.advance(request.arrival)
        replica.arrive(request)
    replica.advance(20.5)
    door.margin = 1000.0  # a bound of 500 s: admitted
    for request in waiting:
        replica.arrive(request)
    assert replica.run.shed == 0 and all(r in replica.engine.waiting for r in waiting)
    door.margin = 0.0
    replica.advance(math.inf)
    run = replica.result([*arrivals, *waiting], replica.now)
    assert run.shed == run.refused_queued == 3 and [r.finish_reason for r in waiting] == ["shed"] * 3
    assert all(0.3 < r.finished_at - r.arrival <= SLO.ttft_seconds for r in waiting), [r.finished_at for r in waiting]
    assert run.false_sheds == 0 and run.false_shed_sample == 3
    assert [r.finish_reason for r in arrivals[-2:]] == ["length", "length"]
    assert ", 3 of them while queued (the door's second look)" in table([run], None, SLO)
    assert rows([run])[0]["refused_queued"] == 3
    counted = parse_samples(replica.metrics.render().decode())
    assert one(counted, "vllm:admission_rejections_total", reason="predicted_ttft") == 3
