"""The exporter process under broken upstreams, over real HTTP.

Fake boundary: the upstream vLLM servers (tests/harness/upstreams.py), which serve
a real vLLM 0.32 exposition or misbehave on purpose. The exporter is the real
`batchlens exporter` subprocess.
"""

from __future__ import annotations

import json
import signal
import statistics
import time

import pytest

from batchlens.admin_api import BATCH_PATH
from harness.admin import signed_with
from harness.exporter import BATCHLENS, ExporterProcess, one, pick
from harness.procs import Process, http_get

pytestmark = pytest.mark.slow

TIMEOUT = 1.0  # the exporter's per-engine timeout in these tests

FAULTS = {
    # name: (upstream behavior, expected reason)
    "down": (None, "connect"),
    "hang": ({"behavior": "hang"}, "timeout"),
    "error500": ({"behavior": "status", "status": 500}, "http_500"),
    "garbage": ({"behavior": "garbage"}, "parse"),  # binary, not even UTF-8
    "html": ({"text": "<html><body>Welcome to nginx!</body></html>\n"}, "parse"),
    "huge": ({"behavior": "huge"}, "too_large"),
    "slow": ({"behavior": "slow", "slow_seconds": 30}, "timeout"),
}


def test_faulty_engines_are_down_with_a_reason_and_the_others_unaffected(tmp_path, upstreams, vllm_exposition) -> None:
    engines = [f"good={upstreams.add('good', text=vllm_exposition)}"]
    for name, (behavior, _) in FAULTS.items():
        if behavior is None:
            engines.append(f"{name}=http://127.0.0.1:1")  # nothing listens on port 1
        else:
            engines.append(f"{name}={upstreams.add(name, **{'text': vllm_exposition, **behavior})}")
    exporter = ExporterProcess(tmp_path, engines, interval=0.5, timeout=TIMEOUT)
    try:
        every_reason = lambda s: all(  # noqa: E731
            pick(s, "batchlens_source_errors_total", vllm_instance=name, reason=reason)
            for name, (_, reason) in FAULTS.items()
        )
        exporter.wait_for(every_reason, timeout=30, what="every fault counted with its reason")

        # Keep scraping while the faults repeat: no scrape may wait on an engine.
        latencies, rss = [], []
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            elapsed, _ = exporter.scrape()
            latencies.append(elapsed)
            rss.append(exporter.rss_bytes())
            time.sleep(0.1)
        samples = exporter.samples()

        # A scrape that waited on the hanging or slow engine would take TIMEOUT or more,
        # every time. (Not max(): this VM can stall for a second on its own, rarely.)
        slow = [t for t in latencies if t >= TIMEOUT]
        assert len(slow) <= len(latencies) // 10, latencies  # how fast a scrape is: benchmarks/memory.py
        for name, (_, reason) in FAULTS.items():
            assert one(samples, "batchlens_source_up", vllm_instance=name) == 0, name
            assert one(samples, "batchlens_source_errors_total", vllm_instance=name, reason=reason) >= 2, name
            assert not pick(samples, "vllm:num_requests_running", vllm_instance=name), f"{name} has stale series"
        assert one(samples, "batchlens_source_up", vllm_instance="good") == 1
        assert not pick(samples, "batchlens_source_errors_total", vllm_instance="good")
        assert pick(samples, "vllm:e2e_request_latency_seconds_bucket", vllm_instance="good")
        assert upstreams.engines["huge"].hits >= 5  # the 50 MB body was refused again and again...
        # ...without the exporter holding on to it: its memory stays flat while a 50 MB body arrives five times or
        # more (how much it holds is benchmarks/memory.py's figure).
        assert statistics.median(rss[-10:]) - statistics.median(rss[:10]) < 16 * 2**20
        assert exporter.process.alive()
        log = exporter.process.log_path.read_text()
        assert "Traceback" not in log
        assert log.count("vllm[hang]: down:") == 1 and "[reason=timeout]" in log  # one line per change, not per tick
    finally:
        exporter.stop()


def test_a_source_that_goes_away_loses_its_series_and_comes_back(tmp_path, upstreams, vllm_exposition) -> None:
    url = upstreams.add("flaky", text=vllm_exposition)
    exporter = ExporterProcess(tmp_path, [f"flaky={url}"], interval=0.3, timeout=TIMEOUT)
    running = lambda s: pick(s, "vllm:num_requests_running", vllm_instance="flaky")  # noqa: E731
    try:
        exporter.wait_for(running, what="flaky's series")
        upstreams.engines["flaky"].behavior, upstreams.engines["flaky"].status = "status", 503
        gone = exporter.wait_for(lambda s: not running(s), what="flaky's series dropped")
        assert one(gone, "batchlens_source_up", vllm_instance="flaky") == 0
        status, body = http_get(exporter.url + "/healthz")
        health = json.loads(body)
        assert status == 200 and health["status"] == "ok"  # the exporter is healthy; the engine is not
        assert {(s["source"], s.get("vllm_instance"), s["up"]) for s in health["sources"] if s["source"] != "nvml"} == {
            ("vllm", "flaky", False),
            ("host", None, True),
        }
        assert not pick(gone, "batchlens_kv_blocks_total", vllm_instance="flaky")
        upstreams.engines["flaky"].behavior = "ok"
        back = exporter.wait_for(running, what="flaky's series back")
        assert one(back, "batchlens_source_up", vllm_instance="flaky") == 1
        assert one(back, "batchlens_source_errors_total", vllm_instance="flaky", reason="http_503") >= 1
    finally:
        exporter.stop()


def test_admin_api_gives_the_batch_limit_and_a_bad_token_is_counted_not_fatal(tmp_path, upstreams, vllm_exposition):
    state = {"max_num_seqs": 64, "max_num_active_seqs": 16, "num_running": 2, "num_waiting": 0}
    right = upstreams.add("right", text=vllm_exposition, admin=state, admin_token="tok-right")
    wrong = upstreams.add("wrong", text=vllm_exposition, admin=state, admin_token="tok-other")
    plain = upstreams.add("plain", text=vllm_exposition)  # no admin API: 404
    old = upstreams.add("old", text=vllm_exposition, admin=state, admin_token="tok-right")  # a plugin before signing
    config = tmp_path / "c.yaml"
    config.write_text(
        f"engines:\n  - {{name: right, url: '{right}'}}\n"
        f"  - {{name: wrong, url: '{wrong}', admin_token_env: WRONG_TOKEN}}\n  - {{name: plain, url: '{plain}'}}\n"
        f"  - {{name: old, url: '{old}', admin_auth: bearer}}\n"
    )
    env = {"BATCHLENS_ADMIN_TOKEN": "tok-right", "WRONG_TOKEN": "tok-mistyped"}
    exporter = ExporterProcess(tmp_path, [], extra_args=["--config", str(config)], env=env)
    try:
        samples = exporter.wait_for(
            lambda s: (
                pick(s, "batchlens_source_errors_total", vllm_instance="wrong", reason="admin_http_401")
                and pick(s, "batchlens_batch_limit", vllm_instance="right")
                and pick(s, "batchlens_batch_limit", vllm_instance="old")
            ),
            what="batch limit and the 401 counted",
        )
        assert one(samples, "batchlens_batch_limit", vllm_instance="right", engine="0") == 16
        assert upstreams.engines["old"].admin_auth_seen[-1] == "Bearer tok-right"  # asked for by its admin_auth
        assert one(samples, "batchlens_batch_capacity", vllm_instance="right", engine="0") == 64
        assert not pick(samples, "batchlens_batch_limit", vllm_instance="wrong")
        assert not pick(samples, "batchlens_batch_limit", vllm_instance="plain")
        assert one(samples, "batchlens_source_up", vllm_instance="wrong") == 1  # the metrics still flow
        assert not pick(samples, "batchlens_source_errors_total", vllm_instance="plain")  # 404 is not an error
        seen = upstreams.engines["right"].admin_auth_seen
        assert signed_with("tok-right", seen[-1], "GET", BATCH_PATH) and "tok-right" not in str(seen)
        log = exporter.process.log_path.read_text()
        assert "tok-right" not in log and "tok-mistyped" not in log
        lines = log.splitlines()
        # "HTTP 401", not "401": a port such as 24012 holds it too, and the plain vLLM's 404 line names its URL.
        assert sum("admin API" in line and "HTTP 401" in line for line in lines) == 1 and "WRONG_TOKEN" in log
        # The plain vLLM's 404, said once however often it is scraped, with the settings that would give it one.
        said = [line for line in lines if "vllm[plain]" in line and "answered 404" in line]
        assert len(said) == 1 and "VLLM_PLUGINS=batchlens" in said[0] and "VLLM_USE_RUST_FRONTEND" in said[0]
    finally:
        exporter.stop()


def test_sigterm_shuts_down_cleanly(tmp_path, upstreams, vllm_exposition) -> None:
    exporter = ExporterProcess(
        tmp_path, [f"a={upstreams.add('a', text=vllm_exposition)}", "hang=http://10.255.255.1:9"]
    )
    exporter.wait_for(lambda s: pick(s, "vllm:num_requests_running"), what="first sample")
    started = time.monotonic()
    code = exporter.process.stop(signal.SIGTERM, timeout=10)
    assert code == 0 and time.monotonic() - started < 8
    assert "stopped" in exporter.process.log_path.read_text()


def test_a_busy_port_is_a_clear_error(tmp_path) -> None:
    first = ExporterProcess(tmp_path, [])
    try:
        second = Process("second", [BATCHLENS, "exporter", "--listen", f"127.0.0.1:{first.port}"], tmp_path / "2.log")
        assert second.proc.wait(30) != 0
        log = second.log_tail()
        assert f"cannot listen on 127.0.0.1:{first.port}" in log and "Traceback" not in log
    finally:
        first.stop()
