"""Time the exporter's per-tick work against prometheus_client's parser on the same input.

    python benchmarks/parse.py FILE...        (e.g. tests/data/vllm-0.32.0-cpu.prom)

For each exposition it prints medians of repeated runs; ours warm and
prometheus_client's are interleaved round by round, so that both see the same
machine (these machines are noisy):
- ours, warm: parse + merge + render with the series cache filled, as on every tick after the first;
- ours, cold: the same with an empty cache, as on the first tick;
- prometheus_client: text_string_to_metric_families over the same text (parse only).
The last line is `ratio <ours warm / prometheus_client>` over all files. The goal is 0.1 or less.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from batchlens.exporter.derive import kv_block_metrics
from batchlens.exporter.parser import ExpositionReader
from batchlens.exporter.render import family_blocks, render
from batchlens.exporter.snapshot import Reading, SnapshotStore, SourceState


def interleaved_medians(
    fns: list[Callable[[], object]], budget: float, min_rounds: int = 10
) -> tuple[list[float], int]:
    """Median seconds of each function, timed in rounds of one call each."""
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget
    while len(times[0]) < min_rounds or time.perf_counter() < deadline:
        for fn, bucket in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times], len(times[0])


def exporter_tick(reader: ExpositionReader, text: str) -> bytes:
    """What the exporter does with one engine's exposition: parse, derive, render the snapshot."""
    base = {"vllm_instance": "bench"}
    families = reader.parse(text)
    reading = Reading(blocks=family_blocks(families), metrics=tuple(kv_block_metrics(families, base)))
    store = SnapshotStore()
    store.publish(SourceState("vllm", tuple(base.items()), True, reading, time.time(), 0.0, {}))
    return render(store.snapshot())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--budget", type=float, default=5.0, help="seconds of repeated rounds per file")
    args = parser.parse_args()

    total_ours = total_theirs = 0.0
    print(f"{'file':40} {'lines':>6} {'ours warm ms':>13} {'ours cold ms':>13} {'prom_client ms':>15} {'ratio':>7}")
    for path in args.files:
        text = path.read_text()
        warm_reader = ExpositionReader({"vllm_instance": "bench"})
        exporter_tick(warm_reader, text)
        (warm, theirs), rounds = interleaved_medians(
            [
                lambda: exporter_tick(warm_reader, text),  # noqa: B023
                lambda: list(text_string_to_metric_families(text)),  # noqa: B023
            ],
            args.budget,
        )
        (cold,), _ = interleaved_medians(
            [lambda: exporter_tick(ExpositionReader({"vllm_instance": "bench"}), text)],  # noqa: B023
            args.budget / 4,
        )
        total_ours += warm
        total_theirs += theirs
        lines = text.count("\n")
        print(
            f"{str(path)[-40:]:40} {lines:>6} {warm * 1e3:>13.3f} {cold * 1e3:>13.3f} {theirs * 1e3:>15.3f} "
            f"{warm / theirs:>7.3f}   (medians of {rounds} interleaved rounds)"
        )
    print(f"ratio {total_ours / total_theirs:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
