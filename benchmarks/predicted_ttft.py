"""The per-request door's predicted TTFT against the TTFT each admitted request got: real vLLM and the simulator.

    python benchmarks/predicted_ttft.py [--seconds 40] [--replay-seconds 300] [--no-vllm] [--no-replay]

The door (batchlens.predicted_ttft) refuses a request whose predicted TTFT passes its bound; how good that
prediction is decides what it refuses. Here its bound is so wide that it refuses nothing, and every admitted
request's prediction is set beside its TTFT (error = predicted - actual). Each table prints per row: n (the
admitted requests that got a prediction; "blind": admitted before the door had learned its rates, so without
one), the median TTFT got and predicted, the error's median, the absolute error's median and P90, and, at the
SLO's TTFT, how many got a TTFT over it and the share of those predicted over it ("caught"), and how many were
predicted over it and the share of those that were over it ("right").

1. Real vLLM 0.32 on the CPU (the tiny test model, --max-num-seqs 32; the plugin from a wheel built here, as
   benchmarks/control_vllm.py starts it). The door is on at 3600 s, the batch route read once (so it knows the
   limit). What the server serves is read from a backlog of the mix, then a bursty trace (gaps with a CV of 2)
   at 1.2x that for --seconds streams its completions: text prompts of 50-1500 tokens, answers of 16-64. The
   TTFT is the client's: from sending the request to the first streamed token, so it holds the HTTP round trip
   and vLLM's tokenizing, which the door's prediction (made as the request arrives) does not see. The test
   model's tokenizer is one token a word; the words here are three letters, so the door's estimate of a text
   prompt (4 characters a token, batchlens.prompt_size) is exact: this measures the prediction, not the estimate.
2. The simulator's engine model, replayed in simulated time: benchmarks/controller.py's bursty and phase
   workloads on its published and article profiles, and one slice of the Azure conversation trace (if
   ~/.cache/batchlens/traces/AzureLLMInferenceTrace_conv.csv exists: [1200, 2100) s at 0.8x its rate, on
   benchmarks/near_cliff.py's H200 engine, SLO TTFT 2 s), each under `adaptive+predict` with its margin so wide
   that the door refuses nothing (the queued-token cap behind it may still shed: the shed column). The
   prediction is the replay's own (Replica.predicted_miss: the backlog, the request's prompt, the rates learned
   from the steps, the limit), plus what the request had waited when the replay took it in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import aiohttp  # noqa: E402

from batchlens.admin_api import ADMISSION_PATH, TOKEN_ENV  # noqa: E402
from batchlens.goodput import Slo  # noqa: E402
from batchlens.predicted_ttft import predict  # noqa: E402
from batchlens.replay.simulated import Replica  # noqa: E402
from batchlens.replay.traces import TraceRequest, read_trace, select  # noqa: E402
from batchlens.simulator.engine import Engine, SimRequest  # noqa: E402
from controller import PROFILES, engine_of, policy, slo_of, workloads  # noqa: E402
from harness.admin import AdminClient, set_caps  # noqa: E402
from harness.vllm import ADMIN_TOKEN, VllmServer, install_plugin, start_vllm  # noqa: E402
from harness.wheel import build_distributions  # noqa: E402
from near_cliff import SLO as NEAR_CLIFF_SLO  # noqa: E402
from near_cliff import engine as near_cliff_engine  # noqa: E402

HEADER = "x-batchlens-predicted-ttft"
WIDE = 3600.0  # the door's bound on the real server: it predicts, and refuses nothing
CPU_SLO_TTFT = 0.5  # benchmarks/control_vllm.py's
PROMPTS, OUTPUTS = (50, 1500), (16, 64)  # token ranges of the real server's mix
OVERLOAD = 1.2  # x what the real server serves from a backlog of the mix
WORDS = ["the", *(f"w{i}" for i in range(10, 100))]  # one token each to the test model, 3 letters: 4 chars a token
WORKLOADS = ("bursty", "phase")  # of benchmarks/controller.py
AZURE = Path.home() / ".cache" / "batchlens" / "traces" / "AzureLLMInferenceTrace_conv.csv"


@dataclass(frozen=True)
class Pair:
    predicted: float
    actual: float
    prompt_tokens: int


def p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def share(part: int, whole: int) -> str:
    return f"{part / whole:6.0%}" if whole else f"{'-':>6}"


HEAD = (f"{'':24} {'n':>5} {'blind':>5} {'TTFT P50':>9} {'pred P50':>9} {'err P50':>8} {'|err| P50':>9} "
        f"{'|err| P90':>9} {'over':>5} {'caught':>6} {'p.over':>6} {'right':>6}")  # fmt: skip


def row(name: str, pairs: Sequence[Pair], blind: int, slo_ttft: float) -> str:
    if not pairs:
        return f"{name:24} {0:5d} {blind:5d} (no prediction)"
    errors = [p.predicted - p.actual for p in pairs]
    over = [p for p in pairs if p.actual > slo_ttft]
    predicted_over = [p for p in pairs if p.predicted > slo_ttft]
    return (f"{name:24} {len(pairs):5d} {blind:5d} {statistics.median(p.actual for p in pairs):9.3f} "
            f"{statistics.median(p.predicted for p in pairs):9.3f} {statistics.median(errors):8.3f} "
            f"{statistics.median(abs(e) for e in errors):9.3f} {p90([abs(e) for e in errors]):9.3f} "
            f"{len(over):5d} {share(sum(p.predicted > slo_ttft for p in over), len(over))} {len(predicted_over):6d} "
            f"{share(sum(p.actual > slo_ttft for p in predicted_over), len(predicted_over))}")  # fmt: skip


# --- 1. the real vLLM -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    prompt_tokens: int
    status: int
    ttft: float | None  # at the client: sending to the first streamed token
    predicted: float | None  # the door's header; None: it had no prediction


def text(tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=tokens))


async def complete(session: aiohttp.ClientSession, url: str, model: str, tokens: int, output: int,
                   rng: random.Random) -> Sent:  # fmt: skip
    payload = {"model": model, "prompt": text(tokens, rng), "max_tokens": output, "ignore_eos": True, "stream": True}
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with session.post(url + "/v1/completions", json=payload, timeout=aiohttp.ClientTimeout(total=600)) as resp:
        said = resp.headers.get(HEADER)
        predicted = float(said) if said is not None else None
        if resp.status != 200:
            await resp.read()
            return Sent(tokens, resp.status, None, predicted)
        first = None
        async for line in resp.content:
            if first is None and line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                first = loop.time() - started
        return Sent(tokens, 200, first, predicted)


async def drive(server: VllmServer, plan: Sequence[tuple[float, int, int]], seed: int) -> list[Sent]:
    """Each planned (time, prompt tokens, output tokens) sent at its time, streamed; what came of each."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=4)) as session:
        start = asyncio.get_running_loop().time()

        async def at(t: float, tokens: int, output: int) -> Sent:
            await asyncio.sleep(max(0.0, start + t - asyncio.get_running_loop().time()))
            return await complete(session, server.url, server.model, tokens, output, rng)

        return list(await asyncio.gather(*(at(*p) for p in plan)))


def mix(rng: random.Random) -> tuple[int, int]:
    return rng.randint(*PROMPTS), rng.randint(*OUTPUTS)


def served_rate(server: VllmServer, requests: int = 48) -> float:
    """Requests/s the server serves of the mix from a backlog: ``requests`` sent at once, over the time to the last."""
    rng = random.Random(7)
    started = time.monotonic()
    sent = asyncio.run(drive(server, [(0.0, *mix(rng)) for _ in range(requests)], seed=7))
    assert all(s.status == 200 for s in sent), [s.status for s in sent]
    return requests / (time.monotonic() - started)


def bursty(seconds: float, rate: float, seed: int) -> list[tuple[float, int, int]]:
    """Arrivals with gaps of a CV of 2 (Gamma, shape 1/4) at ``rate``, each with a prompt and an output of the mix."""
    rng, plan, t = random.Random(seed), [], 0.0
    while (t := t + rng.gammavariate(0.25, 1 / (rate * 0.25))) < seconds:
        plan.append((t, *mix(rng)))
    return plan


def prompt_len(server: VllmServer, words: str) -> int:
    """vLLM's count of a text prompt's tokens (its usage)."""
    payload = {"model": server.model, "prompt": words, "max_tokens": 1}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)["usage"]["prompt_tokens"]


def real_vllm(seconds: float, seed: int) -> None:
    with tempfile.TemporaryDirectory(prefix="batchlens-bench-predicted-") as tmp:
        work = Path(tmp)
        wheel = build_distributions(work / "dist").wheel
        env = {**install_plugin(wheel, work / "site"), TOKEN_ENV: ADMIN_TOKEN}
        server = start_vllm(work / "vllm", env=env, text=True)
        try:
            # The prompt the door reads is the prompt vLLM counts (one token a word of three letters).
            words = text(300, random.Random(1))
            server.load(requests=48, concurrency=16, max_tokens=32)  # the first requests' one-off costs, paid here
            admin = AdminClient(server.url, ADMIN_TOKEN)
            set_caps(admin, max_predicted_ttft_seconds=WIDE)
            admin.state()  # the batch route read: the door knows the limit it counts slots against
            counted = prompt_len(server, words)
            served = served_rate(server)
            rate = OVERLOAD * served
            plan = bursty(seconds, rate, seed)
            started = time.monotonic()
            sent = asyncio.run(drive(server, plan, seed))
            wall = time.monotonic() - started
            state = admin.request("GET", ADMISSION_PATH)[1]
        finally:
            server.process.stop()
    ok = [s for s in sent if s.status == 200 and s.ttft is not None]
    pairs = [Pair(s.predicted, s.ttft, s.prompt_tokens) for s in ok if s.predicted is not None]
    blind = sum(s.predicted is None for s in ok)
    print(f"\nreal vLLM 0.32, CPU, tiny model, max_num_seqs 32: a 300-word prompt is {counted} tokens to vLLM "
          f"(the door reads 300); served from a backlog {served:.1f} requests/s; a bursty trace at {rate:.1f} "
          f"requests/s for {seconds:g} s: {len(plan)} requests, {len(ok)} answered, {len(sent) - len(ok)} not "
          f"({sorted({s.status for s in sent if s.status != 200}) or 'none'}), {wall:.0f} s to the last answer; the "
          f"door's learned prefill rate at the end {state['learned_prefill_tokens_per_second'] or 0:.0f} tokens/s. "
          f"TTFT at the client, seconds; SLO TTFT {CPU_SLO_TTFT:g} s", flush=True)  # fmt: skip
    print(HEAD)
    print(row("all", pairs, blind, CPU_SLO_TTFT))
    for low, high in ((50, 500), (500, 1000), (1000, PROMPTS[1] + 1)):
        band = [p for p in pairs if low <= p.prompt_tokens < high]
        print(row(f"prompts {low}-{high - 1}", band, 0, CPU_SLO_TTFT))
    # The same requests in the order they were sent: the error as the queue builds.
    for i, name in enumerate(("first third", "second third", "last third")):
        part = pairs[i * len(pairs) // 3 : (i + 1) * len(pairs) // 3]
        print(row(f"arrivals, {name}", part, 0, CPU_SLO_TTFT))
    sys.stdout.flush()


# --- 2. the simulator's engine model ----------------------------------------------------------------------------


class Recording(Replica):
    """A replica that keeps, for each request the door judged, the prediction it judged by."""

    def __init__(self, engine: Engine, pol, slo: Slo):
        super().__init__(engine, pol, slo, false_sheds=False)
        self.predicted: dict[str, float | None] = {}
        self._judging: SimRequest | None = None
        judged = pol.refuses

        def refuses(prompt_tokens, backlog, limit, waited=0.0) -> bool:  # what Replica.predicted_miss asks
            prediction = predict(backlog, prompt_tokens, pol.rates, limit)
            self.predicted[self._judging.id] = None if prediction is None else prediction.ttft_seconds + waited
            return judged(prompt_tokens, backlog, limit, waited)

        pol.refuses = refuses

    def predicted_miss(self, request: SimRequest) -> bool:
        self._judging = request
        return super().predicted_miss(request)


def replayed(trace: Sequence[TraceRequest], engine: Engine, slo: Slo) -> tuple[list[Pair], int, int]:
    """``trace`` under adaptive+predict, its door refusing nothing: (the admitted requests' predictions and TTFTs,
    the admitted without a prediction, the shed by the cap behind it), as benchmarks/controller.py replays it."""
    pol = policy("adaptive+predict", slo)
    pol.margin = 1e9  # a miss by a billion times the SLO: nothing
    replica = Recording(engine, pol, slo)
    requests = [SimRequest(str(i), r.prompt_tokens, r.output_tokens, r.t) for i, r in enumerate(trace)]
    for index, request in enumerate(requests):  # batchlens.replay.simulated.replay's loop
        replica.advance(request.arrival)
        replica.arrive(request, lambda index=index: requests[index + 1 :])
    replica.advance(math.inf)
    served = [r for r in requests if r.finish_reason == "length" and r.first_token_at is not None]
    pairs = [Pair(replica.predicted[r.id], r.first_token_at - r.arrival, r.prompt_tokens)
             for r in served if replica.predicted.get(r.id) is not None]  # fmt: skip
    blind = sum(replica.predicted.get(r.id) is None for r in served)
    return pairs, blind, replica.run.shed


def replays(seconds: float, seed: int) -> None:
    print(f"\nsimulator (replay, simulated time), adaptive+predict refusing nothing; TTFT in simulated seconds; "
          f"controller.py's workloads ({seconds:g} s, seed {seed}) and an Azure conversation slice",
          flush=True)  # fmt: skip
    print(HEAD + f" {'slo':>4} {'shed':>5} {'wall s':>6}")
    runs: list[tuple[str, list[TraceRequest], Engine, Slo]] = []
    for profile in ("published", "article"):
        rate = PROFILES[profile][2]
        traces = workloads(seconds, seed, rate)
        runs += [(f"{profile} {name}", traces[name], engine_of(profile), slo_of(profile)) for name in WORKLOADS]
    if AZURE.exists():
        trace = select(read_trace(AZURE, "azure"), start=1200, duration=900, rate_scale=0.8)
        runs.append(("azure conv 1200+900 x0.8", trace, near_cliff_engine(), NEAR_CLIFF_SLO))
    else:
        print(f"(no {AZURE}: the Azure slice is left out)")
    for name, trace, engine, slo in runs:
        started = time.perf_counter()
        pairs, blind, shed = replayed(trace, engine, slo)
        print(row(name, pairs, blind, slo.ttft_seconds)
              + f" {slo.ttft_seconds:4g} {shed:5d} {time.perf_counter() - started:6.0f}", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40, help="the real server's bursty trace (default 40)")
    parser.add_argument("--replay-seconds", type=float, default=300, help="controller.py's workloads (default 300)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-vllm", action="store_true", help="the replay's table alone")
    parser.add_argument("--no-replay", action="store_true", help="the real server's table alone")
    args = parser.parse_args()
    if not args.no_vllm:
        real_vllm(args.seconds, args.seed)
    if not args.no_replay:
        replays(args.replay_seconds, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
