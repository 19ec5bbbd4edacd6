"""The controller steering a real vLLM 0.32 (CPU) through the batchlens plugin, judged against static limits.

The scenario is tests/harness/control_vllm.py's (benchmarks/control_vllm.py prints the same figures in make
bench). This test asserts what must hold: the exporter sees the controller move the limit, the controller
makes moves (not ticks), every request is judged, and the steered goodput reaches RATIO of the best static.
"""

from __future__ import annotations

import pytest

from harness.control_vllm import SMALL, steer_against_statics

# Out of `make test` (make test-blocked runs it): issue 17 is blocked, and the law fails this test on two known
# faults, each seen on a clean clone. past_peak judged an early, noisy window a fall (12 -> 10), and its ceiling
# then held the limit at 11 under a queue of 56 for a minute (0.05 of the best). The pace cut into the cold
# start's backlog (0.26, at TPOT 20 ms on a slower machine). Three other runs gave 0.895 to 0.98.
pytestmark = [pytest.mark.vllm, pytest.mark.blocked]
# What the steered run must reach of the best static limit. The cold start's transient is a fixed cost that the
# machine's noise moves: on this test's current form clean runs measured 0.98, 0.93 and 0.895 (the last on a
# clean clone, the limit at 32 within 7 s). 0.85 still fails a controller that never leaves the small limit
# (0.04 to 0.36 of the best, measured) or cuts into a queue (0.26, the CI run of stop 25).
RATIO = 0.85


def test_the_controller_steers_a_real_vllm_to_the_goodput_of_the_best_static_limit(tmp_path, vllm_server) -> None:
    run = steer_against_statics(tmp_path, vllm_server)
    print(run.summary())
    seen = run.limits_seen
    assert seen[0] <= SMALL < max(seen), f"the exporter never saw the controller move the limit: {seen}"
    assert run.moves > 0, "the controller never moved the limit"
    assert run.steered["requests"] == run.requests and run.ratio >= RATIO, (run.steered, run.static)
