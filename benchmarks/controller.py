"""The adaptive controller against the best static limit (the oracle) and vLLM's default, in simulated time.

    python benchmarks/controller.py [--seconds 300] [--seed 1] [--profile article|published]

Two engine profiles of the simulator, max_num_seqs 256 each:
- article: A100-80GB and a 7B model, calibrated to the article (throughput stops rising past batch 8 or so,
  and falls when prompts are long);
- published: A100-40GB and Llama-3.1-8B, calibrated to a published vLLM measurement
  (batchlens.simulator.profiles.PUBLISHED): throughput keeps rising with the batch until KV or the SLO binds.
On each, four workloads of chat requests (prompts of 256-1024 tokens, answers of 64-256) are replayed under
`default`, `breaker` (today's hook, driven by its alert), `pid` (the article's PID on the pace margin, every
30 s), `pid+ttft` (the same with the TTFT margin too), `adaptive` (the gradient law the controller ships) and
every static limit the oracle tries (batchlens.replay.simulated.oracle), all judged by goodput at the default SLO (TTFT
0.5 s, TPOT 0.1 s):
1. steady: Poisson arrivals at about 0.8x what the engine serves within the SLO (3.6 requests/s on the
   article profile, 17 on the published one: the other rates scale with it);
2. bursty: Gamma gaps with a coefficient of variation of 2, same mean rate;
3. phase: 0.7x that rate; a third of the run chat, a third with prompts of 3000-5000 tokens, a third chat;
4. ramp: the rate rising from 0.28x to 1.9x it, into overload.
It prints, per workload, each policy's goodput and the ratios adaptive/best_static, adaptive/default and
adaptive/breaker.
The last line is `adaptive/best_static min X`, the minimum over the non-steady workloads of every profile.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from batchlens.control.pid import Gains
from batchlens.goodput import Slo
from batchlens.replay.breaker_policy import BreakerPolicy
from batchlens.replay.policies import Adaptive, Static
from batchlens.replay.simulated import oracle, replay
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
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


#: name -> (GPU, model, the steady rate: about 0.8x what it serves within the SLO, found by static sweeps)
PROFILES = {"article": ("a100-80g", "dense-7b", 3.6), "published": ("a100-40g", "llama-3.1-8b", 17.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", choices=sorted(PROFILES), action="append", help="default: both")
    args = parser.parse_args()
    ratios = {}
    for profile in args.profile or list(PROFILES):
        ratios.update(run_profile(profile, args.seconds, args.seed))
    print(f"adaptive/best_static min {min(v for (_, k), v in ratios.items() if k != 'steady'):.2f}")


def run_profile(profile: str, seconds: float, seed: int) -> dict[tuple[str, str], float]:
    gpu, model, rate = PROFILES[profile]

    def engine() -> Engine:
        return Engine(GPUS[gpu], MODELS[model], max_num_seqs=256)

    ratios = {}
    print(f"\n{profile}: {GPUS[gpu].name}, {model}, max_num_seqs 256, steady rate {rate:g}/s")
    print(f"{'workload':10} {'requests':>8} {'default':>9} {'breaker':>9} {'pid+ttft':>9} {'pid':>9} {'adaptive':>9} "
          f"{'best static':>17} {'pid/best':>8} {'adapt/best':>10} {'adapt/default':>13} {'adapt/breaker':>13} "
          f"{'wall s':>7}")  # fmt: skip
    for name, trace in workloads(seconds, seed, rate).items():
        started = time.perf_counter()
        default = replay(trace, engine(), Static(), SLO).judgement.goodput_rps
        breaker = replay(trace, engine(), BreakerPolicy(), SLO).judgement.goodput_rps
        pid_ttft = replay(trace, engine(), Adaptive(SLO, pid=Gains(ttft=True)), SLO).judgement.goodput_rps
        pid = replay(trace, engine(), Adaptive(SLO, pid=Gains()), SLO).judgement.goodput_rps
        adaptive = replay(trace, engine(), Adaptive(SLO), SLO).judgement.goodput_rps
        best, _ = oracle(trace, engine, SLO)
        best_rps = best.judgement.goodput_rps
        ratios[(profile, name)] = ratio(adaptive, best_rps)
        print(f"{name:10} {len(trace):8d} {default:9.3f} {breaker:9.3f} {pid_ttft:9.3f} {pid:9.3f} {adaptive:9.3f} "
              f"{best.policy:>9} {best_rps:7.3f} {ratio(pid, best_rps):8.2f} {ratios[(profile, name)]:10.2f} "
              f"{ratio(adaptive, default):13.2f} {ratio(adaptive, breaker):13.2f} "
              f"{time.perf_counter() - started:7.1f}")  # fmt: skip
    return ratios


if __name__ == "__main__":
    main()
