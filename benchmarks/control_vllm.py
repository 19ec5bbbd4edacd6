"""The adaptive controller on a real vLLM 0.32 (CPU), against static limits: goodput and its ratio to the best.

    python benchmarks/control_vllm.py

Real: vLLM from make vllm-env with the batchlens plugin from a wheel built here, `batchlens remediate` with
the controller on, the exporter, and `batchlens replay --url` judging every request at the client. The
scenario is tests/harness/control_vllm.py's: one bursty trace (60 s at 10 requests/s, CV 2) at the capacity
(32), at a small static limit (12), and steered from 12. It prints each goodput, the controller's ratio to
the best static limit and the limits it set. tests/test_control_vllm.py asserts the same run (make
test-blocked: issue 17's known faults make the ratio vary, 0.05 to 0.98, from run to run).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from batchlens.admin_api import TOKEN_ENV  # noqa: E402
from harness.control_vllm import steer_against_statics  # noqa: E402
from harness.vllm import ADMIN_TOKEN, install_plugin, start_vllm  # noqa: E402
from harness.wheel import build_distributions  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="batchlens-bench-control-") as tmp:
        work = Path(tmp)
        wheel = build_distributions(work / "dist").wheel
        env = {**install_plugin(wheel, work / "site"), TOKEN_ENV: ADMIN_TOKEN}
        server = start_vllm(work / "vllm", env=env)
        try:
            server.load(requests=48, concurrency=16, max_tokens=32)  # torch.compile's first batches, paid here
            run = steer_against_statics(work, server)
        finally:
            server.process.stop()
    print(run.summary())
    print(f"controller/best_static {run.ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
