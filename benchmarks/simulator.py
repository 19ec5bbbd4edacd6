"""How many requests per second one `batchlens simulate` process sustains.

    python benchmarks/simulator.py [--requests 2000] [--concurrency 128]

It starts the simulator at --speed 1000 (so simulated time costs no wall time
and the figure is the process's own cost), then times, in alternating rounds:
- completions: non-streaming /v1/completions of 16 prompt and 16 output tokens;
- baseline: GET /health on the same server, the bare HTTP round trip.
It prints the median rate of each and their ratio (last line: `ratio`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness.simulator import SimulatorProcess


async def rate(url: str, requests: int, concurrency: int, completion: bool) -> float:
    payload = {"model": "deepseek-sim", "prompt": list(range(16)), "max_tokens": 16}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                if completion:
                    async with session.post(url + "/v1/completions", json=payload) as resp:
                        assert resp.status == 200, resp.status
                        await resp.read()
                else:
                    async with session.get(url + "/health") as resp:
                        await resp.read()

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        return requests / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    completions, health = [], []
    with tempfile.TemporaryDirectory() as workdir:
        server = SimulatorProcess(Path(workdir), speed=1000, args=("--max-num-seqs", "256"))
        try:
            for _ in range(args.rounds):
                completions.append(asyncio.run(rate(server.url, args.requests, args.concurrency, True)))
                health.append(asyncio.run(rate(server.url, args.requests, args.concurrency, False)))
        finally:
            server.stop()
    c, h = statistics.median(completions), statistics.median(health)
    print(
        f"one simulator process, {args.requests} requests per round, {args.concurrency} in flight, {args.rounds} rounds"
    )
    print(f"completions (16 in, 16 out): {c:8.0f} req/s (median)   rounds: {[round(x) for x in completions]}")
    print(f"baseline GET /health:        {h:8.0f} req/s (median)   rounds: {[round(x) for x in health]}")
    print(f"ratio {c / h:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
