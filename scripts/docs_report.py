"""Make docs/report/: `batchlens report` on simulator data, so readers see what the overview dashboard shows.

    .venv/bin/python scripts/docs_report.py [--phase-seconds 75] [--speed 1]

The stack is the test harness's: simulator -> exporter -> Prometheus with the committed rules.
The batch limit steps through 1, 2, 4, 8, 16, 32 with as many clients in flight as the limit
(a closed loop, as in the article's sweep), so each phase is one operating point.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.admin import AdminClient  # noqa: E402
from harness.exporter import BATCHLENS, ExporterProcess  # noqa: E402
from harness.prometheus import PrometheusServer  # noqa: E402
from harness.simulator import SimulatorProcess  # noqa: E402

LIMITS = (1, 2, 4, 8, 16, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-seconds", type=float, default=75, help="seconds at each batch limit")
    parser.add_argument("--speed", type=float, default=1, help="simulated seconds per second; 1 keeps rates real")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "report")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="batchlens-report-"))
    sim = SimulatorProcess(tmp, speed=args.speed, args=("--max-num-seqs", "32"))
    config = tmp / "batchlens.yaml"
    config.write_text(f'{{"engines": [{{"name": "sim", "url": "{sim.url}", "simulated_gpu": true}}]}}')
    exporter = ExporterProcess(tmp, [], interval=1, extra_args=("--config", str(config)),
                               env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
    prometheus = PrometheusServer(
        tmp / "prom",
        [{"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
        rule_files=tuple(str(p) for p in sorted((ROOT / "alerts").glob("*.yml"))),
    )
    limit = [LIMITS[0]]

    def request(i: int) -> dict | None:
        """Client i works while i < the limit: as many requests in flight as the batch holds."""
        if i >= limit[0]:
            return None
        return {"model": "deepseek-sim", "prompt": [1] * (256, 512, 1024, 2048)[i % 4], "max_tokens": 256}

    admin = AdminClient(sim.url, sim.token)
    try:
        with sim.clients(max(LIMITS), request):
            started = time.time()
            for value in LIMITS:
                admin.set_limit(value)
                limit[0] = value
                print(f"batch limit {value} for {args.phase_seconds:.0f} s", flush=True)
                time.sleep(args.phase_seconds)
        minutes = int((time.time() - started) / 60) + 1
        subprocess.run([BATCHLENS, "report", "--prometheus", prometheus.url, "--range", f"{minutes}m",
                        "--out", str(args.out)], check=True)  # fmt: skip
    finally:
        prometheus.stop()
        exporter.stop()
        sim.stop()


if __name__ == "__main__":
    main()
