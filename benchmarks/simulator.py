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
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

BATCHLENS = str(Path(sys.executable).parent / "batchlens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [BATCHLENS, "simulate", "--listen", f"127.0.0.1:{port}", "--speed", "1000", "--max-num-seqs", "256"]
    server = subprocess.Popen(argv, stderr=subprocess.DEVNULL, env={**os.environ, "BATCHLENS_ADMIN_TOKEN": "bench"})
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        completions, health = [], []
        for _ in range(args.rounds):
            completions.append(asyncio.run(rate(url, args.requests, args.concurrency, True)))
            health.append(asyncio.run(rate(url, args.requests, args.concurrency, False)))
    finally:
        server.terminate()
        server.wait(10)
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
