"""Request shapes and a closed-loop run of the engine in simulated time. Pure.

The article's length buckets (256/512/1024/2048 tokens) are the default
prompt lengths; ``closed_loop`` keeps a fixed number of requests in flight,
which saturates the batch without a queue, so that latency reflects the batch
size and not the backlog.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from batchlens.simulator.engine import Engine, SimRequest, StepResult

ARTICLE_PROMPT_TOKENS = (256, 512, 1024, 2048)
DEFAULT_OUTPUT_TOKENS = (128, 256, 512)


@dataclass(frozen=True)
class RunSummary:
    batch_limit: int
    requests: int
    seconds: float
    output_tokens_per_second: float
    p99_e2e_seconds: float
    mean_kv_usage: float
    mean_bandwidth_ratio: float  # bytes read per second over the run / the GPU's peak bandwidth
    preemptions: int


def drain(engine: Engine, now: float = 0.0) -> Iterator[StepResult]:
    """Step the engine until nothing runs or waits; yields each step."""
    while engine.running or engine.waiting:
        step = engine.step(now)
        now += step.duration
        yield step


def closed_loop(
    engine: Engine,
    concurrency: int,
    requests: int,
    seed: int = 1,
    prompt_tokens: Sequence[int] = ARTICLE_PROMPT_TOKENS,
    output_tokens: Sequence[int] = DEFAULT_OUTPUT_TOKENS,
) -> RunSummary:
    """Keep ``concurrency`` requests in flight until ``requests`` have finished (`vllm bench serve
    --max-concurrency`), their lengths drawn from ``prompt_tokens`` and ``output_tokens``."""
    rng = random.Random(seed)
    made = 0

    def new(now: float) -> SimRequest:
        nonlocal made
        made += 1
        return SimRequest(f"r{made}", rng.choice(prompt_tokens), rng.choice(output_tokens), now)

    for _ in range(concurrency):
        engine.add(new(0.0))
    now, tokens, bytes_read, finished, kv = 0.0, 0, 0.0, [], []
    while len(finished) < requests:
        step = engine.step(now)
        if step.duration == 0:
            raise RuntimeError("the engine made no progress: a request larger than the whole KV cache?")
        now += step.duration
        tokens += len(step.produced)
        finished += step.finished
        kv.append(engine.kv_usage)
        bytes_read += step.bytes_read
        for _ in step.finished:
            engine.add(new(now))
    e2e = sorted(r.finished_at - r.arrival for r in finished)
    return RunSummary(
        batch_limit=engine.max_num_active_seqs,
        requests=len(finished),
        seconds=now,
        output_tokens_per_second=tokens / now,
        p99_e2e_seconds=e2e[min(len(e2e) - 1, int(0.99 * len(e2e)))],
        mean_kv_usage=statistics.fmean(kv),
        mean_bandwidth_ratio=bytes_read / now / engine.gpu.bandwidth_bytes_per_second,
        preemptions=engine.preemptions,
    )
