"""Traces to replay, and `batchlens replay --url` as a subprocess: shared by the tests that replay live."""

from __future__ import annotations

import json
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


def replay(trace: Path, url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([BATCHLENS, "replay", str(trace), "--url", url, "--json", *args], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
