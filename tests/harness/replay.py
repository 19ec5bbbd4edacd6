"""Traces to replay, and `batchlens replay --url` as a subprocess: shared by the tests that replay live."""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Sequence
from pathlib import Path

from harness.exporter import BATCHLENS


def write_trace(
    path: Path,
    seconds: float,
    rate: float,
    *,
    cv: float = 1.0,
    prompts: Sequence[int] = (128, 256),
    outputs: Sequence[int] = (32,),
    seed: int = 3,
) -> int:
    """A jsonl trace: Gamma gaps with coefficient of variation ``cv`` (1: Poisson) at ``rate``; its length."""
    rng, t, lines = random.Random(seed), 0.0, []
    shape = 1 / cv**2
    while (t := t + rng.gammavariate(shape, 1 / (rate * shape))) < seconds:
        lines.append(json.dumps({"t": t, "prompt_tokens": rng.choice(prompts), "output_tokens": rng.choice(outputs)}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def replay(trace: Path, url: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None):
    return subprocess.run([BATCHLENS, "replay", str(trace), "--url", url, "--json", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def write_mixed_trace(path: Path, seconds: float, streams: Sequence[dict], seed: int = 5) -> dict[str, int]:
    """A jsonl trace of several classes merged in time; each stream: class ("" for none), rate, cv, prompts,
    outputs. Returns the request count per class."""
    rng, items = random.Random(seed), []
    for stream in streams:
        t, shape = 0.0, 1 / stream["cv"] ** 2
        while (t := t + rng.gammavariate(shape, 1 / (stream["rate"] * shape))) < seconds:
            item = {
                "t": t,
                "prompt_tokens": rng.choice(stream["prompts"]),
                "output_tokens": rng.choice(stream["outputs"]),
            }
            items.append({**item, **({"class": stream["class"]} if stream["class"] else {})})
    items.sort(key=lambda item: item["t"])
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    counts: dict[str, int] = {}
    for item in items:
        counts[item.get("class", "")] = counts.get(item.get("class", ""), 0) + 1
    return counts
