"""The adaptive controller against the best static limit (the oracle) and vLLM's default, in simulated time.

    python benchmarks/controller.py [--seconds 300] [--seed 1] [--profile article|published|deepseek] [--start N]

Three engine profiles of the simulator, max_num_seqs 256 each:
- article: A100-80GB and a 7B model, calibrated to the article (throughput stops rising past batch 8 or so,
  and falls when prompts are long);
- published: A100-40GB and Llama-3.1-8B, calibrated to a published vLLM measurement
  (batchlens.simulator.profiles.PUBLISHED): throughput keeps rising with the batch until KV or the SLO binds;
- deepseek: one rank of DeepSeek-V3 on 8xH200 with --data-parallel-size 8 --enable-expert-parallel (the mission's
  model class, docs/simulator.md): every step reads 17 GB of dense weights and the experts its 8 lock-step ranks'
  tokens reach, so throughput rises with the batch far past where a dense model's stops; its SLO is TTFT 2 s,
  TPOT 0.1 s (SLOS).
On each, five workloads of chat requests (prompts of 256-1024 tokens, answers of 64-256) are replayed under
`default`, `breaker` (today's hook, driven by its alert), `pid` (the article's PID on the pace margin, every
30 s), `adaptive` (the gradient law the controller ships, the limit alone), `admit` (vLLM's default limit with
the controller's queued-token cap at the door), `adaptive+admit` (both knobs) and every static limit the oracle
tries (batchlens.replay.simulated.oracle), all judged by goodput at the profile's SLO (TTFT 0.5 s, TPOT 0.1 s),
a shed request counting as not good:
1. steady: Poisson arrivals at about 0.8x what the engine serves within the SLO (3.6 requests/s on the
   article profile, 17 on the published one, 4 on a deepseek rank: the other rates scale with it);
2. bursty: Gamma gaps with a coefficient of variation of 2, same mean rate;
3. phase: 0.7x that rate; a third of the run chat, a third with prompts of 3000-5000 tokens, a third chat;
4. ramp: the rate rising from 0.28x to 1.9x it, into overload;
5. overload: steady Poisson at 1.5x what the engine serves (1.875x the steady rate).
It prints, per workload, each policy's goodput, the ceiling (every request good: requests / the last arrival),
the ratios to the best static limit, and the sheds with the share of them that would have met the SLO had they
been admitted (false sheds, estimated counterfactually: batchlens.replay.simulated.would_have_been_good).
Goodput divides a run's good requests by its own length, to its last answer, as vLLM's benchmark does. Under
overload a run without the door drains its backlog long after the last arrival (the article profile's 1.5x
overload: 530 s for the best static limit, 305 s with the door, on a 300 s trace), so its goodput is lower
for that alone. The columns `n` give adaptive's and adaptive+admit's ratios in good requests instead, which
the runs' lengths do not touch.
`--start N` starts adaptive and adaptive+admit at a limit of N (`control.start_limit`) instead of the replay's
eighth of the capacity (32): what a cold start costs, above all under overload, where the good requests are the
ones that arrive before a queue forms (docs/control.md, "What the start decides").
The last lines are `adaptive/best_static min X` over every workload and profile, `adaptive+admit/best_static
min Y (non-steady)` and `false_sheds max Z`, the largest share of false sheds in any run that shed.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence

from batchlens.config import Control
from batchlens.control.pid import Gains
from batchlens.goodput import Slo
from batchlens.replay.breaker_policy import BreakerPolicy
from batchlens.replay.policies import Adaptive, Policy
from batchlens.replay.policy_names import parse_policy
from batchlens.replay.simulated import Run, oracle, replay
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine
from batchlens.simulator.profiles import GPUS, MODELS

SLO = Slo(0.5, 0.1)
CHAT_PROMPTS, LONG_PROMPTS, OUTPUTS = (256, 512, 1024), (3000, 4000, 5000), (64, 128, 256)


def arrivals(seconds: float, rng: random.Random, gap: Callable[[float], float]) -> list[float]:
    out, t = [], 0.0
    while (t := t + gap(t)) < seconds:
        out.append(t)
    return out


def workloads(seconds: float, seed: int, rate: float = 3.6) -> dict[str, list[TraceRequest]]:
    def chat(times: list[float], rng: random.Random, long_from: float = -1, long_to: float = -1):
        return [TraceRequest(t, rng.choice(LONG_PROMPTS if long_from <= t < long_to else CHAT_PROMPTS),
                             rng.choice(OUTPUTS)) for t in times]  # fmt: skip

    shape = 0.25  # Gamma shape 1/CV^2: CV 2
    out = {}
    rng = random.Random(seed)
    out["steady"] = chat(arrivals(seconds, rng, lambda _t: rng.expovariate(rate)), rng)
    rng = random.Random(seed)
    out["bursty"] = chat(arrivals(seconds, rng, lambda _t: rng.gammavariate(shape, 1 / (rate * shape))), rng)
    rng = random.Random(seed)
    out["phase"] = chat(
        arrivals(seconds, rng, lambda _t: rng.expovariate(0.7 * rate)), rng, seconds / 3, 2 * seconds / 3
    )
    rng = random.Random(seed)
    out["ramp"] = chat(arrivals(seconds, rng, lambda t: rng.expovariate(rate * (0.28 + 1.66 * t / seconds))), rng)
    rng = random.Random(seed)
    out["overload"] = chat(arrivals(seconds, rng, lambda _t: rng.expovariate(1.5 * rate / 0.8)), rng)
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def in_good(run: Run, best: Run) -> float:
    """``run``'s good requests over the best static limit's, on the same trace: goodput's ratio without the runs'
    lengths, which under overload differ by the backlog each drains after the last arrival."""
    return ratio(run.judgement.good, best.judgement.good)


def ceiling(trace: Sequence[TraceRequest]) -> float:
    """Every request good, in requests/s: goodput counts a run's seconds to its last answer, which comes after the
    last arrival, so no policy can pass this. (Not the slice's length: a slice of a real trace can end in a lull.)
    """
    last = max((r.t for r in trace), default=0.0)
    return len(trace) / last if last > 0 else float("inf")


#: name -> (GPU, model, the steady rate: about 0.8x what it serves within the SLO, found by static sweeps)
PROFILES = {
    "article": ("a100-80g", "dense-7b", 3.6),
    "published": ("a100-40g", "llama-3.1-8b", 17.0),
    # One DP rank of DeepSeek-V3 on 8xH200 (DP8+EP); its steady rate is the rank's: the node takes 8x that.
    "deepseek": ("h200", "deepseek-v3-dp8ep", 4.0),
}
#: A profile's SLO where it is not SLO: DeepSeek's prefill (~6k tokens/s a GPU) cannot start a 1k-token prompt
#: within 0.5 s once a few queue, and its deployments promise seconds (the Azure runs' 2 s).
SLOS = {"deepseek": Slo(2.0, 0.1)}
CAPACITY = 256  # every profile's engine: max_num_seqs


def slo_of(profile: str) -> Slo:
    return SLOS.get(profile, SLO)


def engine_of(profile: str) -> Engine:
    """A fresh engine of ``profile`` (a replay leaves its engine spent)."""
    gpu, model, _ = PROFILES[profile]
    return Engine(GPUS[gpu], MODELS[model], max_num_seqs=CAPACITY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", choices=sorted(PROFILES), action="append", help="default: all")
    parser.add_argument("--start", type=int, metavar="N", help="the controller's starting limit (default: 32)")
    args = parser.parse_args()
    if args.start is not None and not 1 <= args.start <= CAPACITY:
        parser.error(f"--start takes a limit of 1 to the engines' {CAPACITY} slots, got {args.start}")
    ratios, false_shares = {}, []
    for profile in args.profile or list(PROFILES):
        got, shares = run_profile(profile, args.seconds, args.seed, args.start)
        ratios.update(got)
        false_shares += shares
    print(f"adaptive/best_static min {min(v['adaptive'] for v in ratios.values()):.2f}")
    non_steady = [v["adaptive+admit"] for (_, k), v in ratios.items() if k != "steady"]
    print(f"adaptive+admit/best_static min {min(non_steady):.2f} (non-steady)")
    versus_admit = [v["adaptive+predict"] / v["adaptive+admit"] for v in ratios.values()]
    print(f"adaptive+predict/adaptive+admit min {min(versus_admit):.3f}")
    print(f"false_sheds max {max(false_shares, default=0):.1%}")


POLICIES = ("default", "breaker", "pid", "adaptive", "admit", "adaptive+admit", "adaptive+predict")


def policy(name: str, slo: Slo = SLO, start: int | None = None):
    """``start``: where the controller's policies start (None: the replay's eighth of the capacity)."""
    if name == "breaker":
        return BreakerPolicy()
    if name == "pid":
        return Adaptive(slo, pid=Gains())
    return parse_policy(name, slo, control=None if start is None else Control(start_limit=start))


def versus_best(
    trace: list[TraceRequest], make_engine: Callable[[], Engine], names: Sequence[str], slo: Slo = SLO,
    make_policy: Callable[[str, Slo], Policy] = policy,
) -> tuple[dict[str, Run], Run]:  # fmt: skip
    """Each named policy's run on ``trace``, and the best static limit's (the oracle), on fresh engines."""
    runs = {name: replay(trace, make_engine(), make_policy(name, slo), slo) for name in names}
    best, _ = oracle(trace, make_engine, slo)
    return runs, best


def run_profile(profile: str, seconds: float, seed: int,
                start: int | None = None) -> tuple[dict[tuple[str, str], dict[str, float]], list[float]]:  # fmt: skip
    """Each workload's ratios to the best static limit, by policy, and the share of false sheds of each run that
    shed."""
    gpu, model, rate = PROFILES[profile]
    slo = slo_of(profile)

    def engine() -> Engine:
        return engine_of(profile)

    ratios, false_shares = {}, []
    print(f"\n{profile}: {GPUS[gpu].name}, {model}, max_num_seqs {CAPACITY}, steady rate {rate:g}/s, SLO TTFT "
          f"{slo.ttft_seconds:g} s TPOT {slo.tpot_seconds:g} s; goodput in good "
          "requests/s; shed: share of requests shed (false: share of the sheds that would have been good)"
          + ("" if start is None else f"; the controller starts at {start}"))  # fmt: skip
    print(f"{'workload':9} {'requests':>8} {'ceiling':>7} " + " ".join(f"{p:>8}" for p in ("default", "breaker", "pid",
          "adaptive", "admit", "adp+adm", "adp+prd")) + f" {'best static':>17} {'adapt/best':>10} {'admit/best':>10} "
          f"{'adp+adm/best':>12} {'n':>5} {'n':>5} {'shed':>6} {'false':>6} {'adp+prd/best':>12} {'shed':>6} "
          f"{'false':>6} {'wall s':>6}")  # fmt: skip
    for name, trace in workloads(seconds, seed, rate).items():
        started = time.perf_counter()
        runs, best = versus_best(trace, engine, POLICIES, slo, make_policy=lambda name, slo: policy(name, slo, start))
        best_rps = best.judgement.goodput_rps
        ratios[(profile, name)] = got = {p: ratio(r.judgement.goodput_rps, best_rps) for p, r in runs.items()}
        both, predicted = runs["adaptive+admit"], runs["adaptive+predict"]
        false_share = both.false_sheds / both.shed if both.shed else 0.0
        predicted_false = predicted.false_sheds / predicted.shed if predicted.shed else 0.0
        false_shares += [r.false_sheds / r.shed for r in runs.values() if r.shed]
        print(f"{name:9} {len(trace):8d} {ceiling(trace):7.2f} "
              + " ".join(f"{r.judgement.goodput_rps:8.3f}" for r in runs.values())
              + f" {best.policy:>9} {best_rps:7.3f} {got['adaptive']:10.2f} {got['admit']:10.2f} "
              f"{got['adaptive+admit']:12.2f} {in_good(runs['adaptive'], best):5.2f} {in_good(both, best):5.2f} "
              f"{both.shed / len(trace):6.1%} {false_share:6.1%} {got['adaptive+predict']:12.2f} "
              f"{predicted.shed / len(trace):6.1%} {predicted_false:6.1%} "
              f"{time.perf_counter() - started:6.0f}")  # fmt: skip
    return ratios, false_shares


if __name__ == "__main__":
    main()
