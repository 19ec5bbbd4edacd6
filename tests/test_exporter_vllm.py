"""The exporter against a real vLLM 0.32 on the CPU, and a real Prometheus scraping the exporter.

No fakes in the vllm test. The e2e test feeds the exporter from the upstream
fake (tests/harness/upstreams.py, serving a captured real exposition) so that
it runs without the vLLM environment.
"""

from __future__ import annotations

import re
import time

import pytest

from batchlens.admin_api import TOKEN_ENV
from harness.exporter import ExporterProcess, compare, one, parse_samples, pick
from harness.prometheus import PrometheusServer


def sampled_after(t: float):
    """Whether the exporter's last good sample of the engine is newer than ``t``; not yet where it has none (its
    first sample may still be in flight, or have timed out under the load: a clean clone's suite once found none)."""
    name = "batchlens_source_last_success_timestamp_seconds"
    return lambda samples: any(v > t for v in pick(samples, name, vllm_instance="cpu").values())


@pytest.mark.vllm
def test_exporter_passes_every_vllm_sample_through_under_load(tmp_path, vllm_server) -> None:
    env = {"BATCHLENS_LOG_LEVEL": "debug", TOKEN_ENV: vllm_server.admin_token}
    exporter = ExporterProcess(tmp_path, [f"cpu={vllm_server.url}"], interval=0.5, timeout=5, env=env)
    try:
        checks, running_seen = 0, 0.0
        give_up = time.monotonic() + 120
        with vllm_server.steady_load(concurrency=12, prompt_tokens=64, max_tokens=256) as replies:
            # Compare until the exporter has shown the batch running, at least three times.
            while checks < 3 or running_seen <= 1:
                assert time.monotonic() < give_up, f"the exporter never saw the load running ({checks} checks)"
                vllm_text, t = vllm_server.metrics_text(), time.time()
                exported = exporter.wait_for(sampled_after(t), what="a sample taken after vLLM's scrape")
                compare(vllm_text, exported, "cpu", quiescent=False)
                running_seen = max(running_seen, one(exported, "vllm:num_requests_running", vllm_instance="cpu"))
                checks += 1
        assert replies and all(r["usage"]["completion_tokens"] == 256 for r in replies)

        # Quiescent now: every gauge must be equal too.
        time.sleep(1)
        vllm_text, t = vllm_server.metrics_text(), time.time()
        exported = exporter.wait_for(sampled_after(t), what="a sample taken after the load")
        compare(vllm_text, exported, "cpu", quiescent=True)

        blocks = int(re.search(r'num_gpu_blocks="(\d+)"', vllm_text).group(1))
        assert one(exported, "batchlens_kv_blocks_total", vllm_instance="cpu", engine="0") == blocks
        assert one(exported, "batchlens_kv_blocks_used", vllm_instance="cpu", engine="0") == 0  # all done
        assert one(exported, "batchlens_source_up", vllm_instance="cpu") == 1
        # The batchlens plugin's admin API, with the token the exporter was given. Other
        # reasons are not asserted: right after a vLLM starts, this VM can stall for seconds
        # while the host backs fresh guest memory, and a sample may then time out, correctly.
        errors = pick(exported, "batchlens_source_errors_total", vllm_instance="cpu")
        assert not [lbl for lbl in errors if dict(lbl)["reason"].startswith("admin")], errors
        engine = {"vllm_instance": "cpu", "model_name": vllm_server.model, "engine": "0"}
        assert one(exported, "batchlens_batch_limit", **engine) == 32
        assert one(exported, "batchlens_batch_capacity", **engine) == 32
        # The host source found the vLLM server process and its EngineCore child.
        assert one(exported, "batchlens_engine_processes", vllm_instance="cpu") >= 2
        assert one(exported, "batchlens_engine_process_info", vllm_instance="cpu", pid=str(vllm_server.process.pid))
        assert one(exported, "batchlens_engine_process_resident_memory_bytes", vllm_instance="cpu") > 100 * 2**20
        samples = len(parse_samples(vllm_text))
        print(f"\ncompared the exporter with vLLM's own /metrics {checks + 1} times, {samples} samples")
    finally:
        exporter.stop()


@pytest.mark.e2e
def test_prometheus_ingests_the_merged_exposition(tmp_path, upstreams, vllm_exposition) -> None:
    engines = [f"a={upstreams.add('a', text=vllm_exposition)}", f"b={upstreams.add('b', text=vllm_exposition)}"]
    exporter = ExporterProcess(tmp_path, [*engines, "down=http://127.0.0.1:1"], interval=0.5)
    prometheus = PrometheusServer(
        tmp_path / "prometheus",
        [{"job_name": "batchlens", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
    )
    try:
        prometheus.wait_for('up{job="batchlens"} == 1')
        per_engine = len(parse_samples(vllm_exposition))
        for name in ("a", "b"):
            ingested = prometheus.wait_for(f'count({{vllm_instance="{name}",__name__!~"batchlens_.*"}})')
            assert int(ingested[0]["value"][1]) == per_engine, f"Prometheus stored a different sample count for {name}"
        assert len(prometheus.query("batchlens_kv_blocks_total")) == 2
        assert prometheus.query('batchlens_source_up{vllm_instance="down"} == 0')
        # Prometheus' own parser accepted every line: one sample per line of our output.
        body = exporter.scrape()[1]
        lines = [ln for ln in body.splitlines() if ln and not ln.startswith("#")]
        scraped = prometheus.wait_for('scrape_samples_scraped{job="batchlens"}')
        assert abs(int(scraped[0]["value"][1]) - len(lines)) <= 5  # the status series can change between scrapes
    finally:
        prometheus.stop()
        exporter.stop()
