"""Resident memory of the exporter over a long run: N engines, a short interval, scraped like Prometheus.

    python benchmarks/memory.py [--engines 8] [--interval 1] [--minutes 10] [--scrape-every 5]

The engines are upstreams (tests/harness/upstreams.py) serving a real vLLM 0.32
exposition (tests/data). The baseline, measured in the same run, is the same
exporter with no engines: the interpreter and its imports, counted too (Python's
own -X importtime, in that exporter's log). The goal is 50 MiB or less after
10 minutes with 8 engines at a 1 s interval.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.exporter import ExporterProcess  # noqa: E402
from harness.upstreams import Upstreams  # noqa: E402

MiB = 2**20


def settle_rss(exporter: ExporterProcess, seconds: float) -> float:
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        exporter.scrape()
        samples.append(exporter.rss_bytes())
        time.sleep(0.5)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--scrape-every", type=float, default=5.0)
    args = parser.parse_args()

    text = (ROOT / "tests" / "data" / "vllm-0.32.0-cpu.prom").read_text()
    upstreams = Upstreams()
    with tempfile.TemporaryDirectory() as tmp:
        baseline_exporter = ExporterProcess(Path(tmp), [], interval=args.interval, env={"PYTHONPROFILEIMPORTTIME": "1"})
        baseline = settle_rss(baseline_exporter, 5)
        baseline_exporter.stop()
        log = baseline_exporter.process.log_path.read_text()
        modules = sum(1 for line in log.splitlines() if line.startswith("import time:") and "|" in line) - 1

        engines = [f"e{i}={upstreams.add(f'e{i}', text=text)}" for i in range(args.engines)]
        exporter = ExporterProcess(Path(tmp), engines, interval=args.interval, timeout=2)
        print(f"baseline (no engines): {baseline / MiB:.1f} MiB, {modules} modules imported")
        print(f"{'minute':>7} {'rss MiB':>8} {'scrape ms':>10}")
        rss, scrape_ms = [], []
        start = time.monotonic()
        next_report = 0.0
        while (elapsed := time.monotonic() - start) < args.minutes * 60:
            took, _ = exporter.scrape()
            rss.append(exporter.rss_bytes())
            scrape_ms.append(took * 1e3)
            if elapsed >= next_report:
                print(
                    f"{elapsed / 60:>7.1f} {rss[-1] / MiB:>8.1f} {statistics.median(scrape_ms[-12:]):>10.2f}",
                    flush=True,
                )
                next_report += 60
            time.sleep(args.scrape_every)
        hits = sum(u.hits for u in upstreams.engines.values())
        exporter.stop()
    upstreams.close()
    final = statistics.median(rss[-6:])
    print(f"engines {args.engines}, interval {args.interval}s, {args.minutes:g} min, {hits} engine samples taken")
    print(f"rss final {final / MiB:.1f} MiB, peak {max(rss) / MiB:.1f} MiB, baseline {baseline / MiB:.1f} MiB")
    print(f"scrape median {statistics.median(scrape_ms):.2f} ms")
    print(f"ratio {final / baseline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
