"""The report's data: what each query reads, counted as the breaker and the controller counted it (issue 58).

Pure rules first, then against a real Prometheus that scrapes a counter born during the range (the fake
boundary: harness/upstreams.py serves the hook's exposition, set by the test instead of by a hook).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from batchlens.config import Thresholds
from batchlens.prometheus_api import Prometheus
from batchlens.report.data import counted, fetch
from harness.prometheus import PrometheusServer


@pytest.mark.parametrize(
    ("samples", "expected", "why"),
    [
        ([(110, 1.0), (120, 1.0)], 1, "born in the range at 1: its first sample counts (increase() says 0)"),
        ([(90, 3.0), (110, 3.0), (120, 5.0)], 2, "existed before the range: from the count it had then"),
        ([(90, 3.0), (110, 5.0), (115, 1.0), (120, 2.0)], 4, "a restart in the range: from 0 again"),
        ([(90, 3.0), (95, 4.0)], 0, "nothing after the start"),
        ([], 0, "no samples"),
    ],
)
def test_a_counter_counts_from_the_range_start_its_first_sample_included(samples, expected, why) -> None:
    assert counted(samples, 100.0) == expected, why


@pytest.mark.e2e
def test_an_action_whose_counter_first_appears_at_1_is_counted_once(tmp_path, upstreams) -> None:
    """The live page said `breaker set_limit: ok 1` while the hook had halved 64 -> 32: a counter series that
    first appears at 1 increases by 0 for Prometheus' increase()."""
    upstreams.add("hook", text="# no action yet\n")
    prometheus = PrometheusServer(tmp_path / "prom", [{"job_name": "hook", "metrics_path": "/hook/metrics",
                                  "static_configs": [{"targets": [f"127.0.0.1:{upstreams.port}"]}]}])  # fmt: skip
    try:
        prometheus.wait_for('up{job="hook"} == 1')
        start = time.time()
        upstreams.engines["hook"].text = (
            'batchlens_remediation_actions_total{vllm_instance="a",action="halve",result="decided"} 1\n'
            'batchlens_remediation_actions_total{vllm_instance="a",action="set_limit",result="ok"} 1\n'
            'batchlens_controller_decisions_total{vllm_instance="a",reason="past_peak"} 2\n'
        )
        prometheus.wait_for("count(count_over_time(batchlens_remediation_actions_total[1m]) > 2) == 2")

        async def actions() -> list:
            async with aiohttp.ClientSession() as session:
                return (await fetch(Prometheus(session, prometheus.url), Thresholds(), start, time.time(), 1)).actions

        found = {(a.vllm_instance, a.by, a.what, a.count) for a in asyncio.run(actions())}
        assert found == {("a", "breaker", "halve: decided", 1), ("a", "breaker", "set_limit: ok", 1),
                         ("a", "controller", "past_peak", 2)}, found  # fmt: skip
    finally:
        prometheus.stop()
