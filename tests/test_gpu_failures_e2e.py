"""A GPU that fails pages someone, end to end: the exporter (in process, serving its /metrics over HTTP) on a node
of four GPUs, scraped by a real Prometheus that evaluates the generated GPU alerts, and the overview dashboard's
GPU health panels read back from it.

Fake boundary: the GPUs are the fake NVML (tests/harness/fake_pynvml.py) and the host's PCI bus a directory in
sysfs's layout (tests/harness/fake_sysfs.py); there is no GPU here. The alerts are the generated ones with their
``for:`` dropped, so that they fire within seconds: when each fires is promtool's to test
(alerts/tests/gpu-alerts.test.yml), what fires and with which labels is this test's.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
import yaml

from batchlens.config import load_config
from batchlens.dashboards.overview import GPU_HEALTH_PANELS
from batchlens.exporter.http_serve import HttpServer
from batchlens.exporter.server import Exporter
from harness.fake_pynvml import FakeNvml, h100_sxm
from harness.fake_sysfs import gpu_host
from harness.procs import free_port
from harness.prometheus import PrometheusServer

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]


def gpu_alerts_now(workdir: Path) -> Path:
    """The generated GPU alerts, each firing on its first evaluation (no ``for:``)."""
    groups = yaml.safe_load((ROOT / "alerts" / "batchlens.alerts.yml").read_text())["groups"]
    rules = [{k: v for k, v in rule.items() if k != "for"} for group in groups for rule in group["rules"]
             if rule["alert"].startswith("BatchlensGpu")]  # fmt: skip
    path = workdir / "gpu-alerts.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "gpu", "rules": rules}]}))
    return path


@pytest.fixture
def node(tmp_path, upstreams, vllm_exposition) -> Iterator[tuple[FakeNvml, str]]:
    """Four H100s serving engine deepseek (GPU 3 with a row remapping pending from the start), its exporter
    running on a thread of its own; yields the fake driver and the exporter's host:port."""
    gpus = [h100_sxm(i) for i in range(3)] + [h100_sxm(3, remapped_rows=(2, 0, 1, 0))]
    fake, port = FakeNvml(gpus), free_port()
    url = upstreams.add("deepseek", text=vllm_exposition)
    config = load_config(None, {
        "engines": [{"name": "deepseek", "url": url, "gpus": [0, 1, 2, 3]}],
        "exporter": {"interval_seconds": 0.2, "sysfs_path": str(gpu_host(tmp_path / "sys", 4))},
    }, {})  # fmt: skip
    exporter = Exporter(config, environ={}, nvml=fake.module())
    started, stop = threading.Event(), threading.Event()

    async def serve() -> None:
        server = HttpServer(exporter.routes())
        await server.start("127.0.0.1", port)
        await exporter.start()
        started.set()
        await asyncio.to_thread(stop.wait)
        await server.close()
        await exporter.stop()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="exporter")
    thread.start()
    assert started.wait(30), "the exporter did not start"
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(30)


def firing(prometheus: PrometheusServer, alertname: str) -> list[dict[str, str]]:
    """The alert's firing series' labels, waited for."""
    query = f'ALERTS{{alertname="{alertname}", alertstate="firing"}}'
    prometheus.wait_for(query, timeout=30)
    return [sample["metric"] for sample in prometheus.query(query)]


def test_lost_gpus_xids_a_pending_remap_and_a_driver_gone_each_page_with_their_gpu(tmp_path, node) -> None:
    fake, target = node
    scrape = [{"job_name": "batchlens", "static_configs": [{"targets": [target]}]}]
    prometheus = PrometheusServer(tmp_path / "prometheus", scrape, rule_files=(str(gpu_alerts_now(tmp_path)),))
    try:
        [pending] = firing(prometheus, "BatchlensGpuRowRemapPending")
        assert (pending["gpu"], pending["vllm_instance"], pending["severity"]) == ("3", "deepseek", "warning")

        fake.xid(1, 79)
        fake.xid(2, 48)
        fake.xid(2, 13)  # an application's: counted, no page
        prometheus.wait_for('count(ALERTS{alertname="BatchlensGpuXidCritical", alertstate="firing"}) == 2')
        xids = firing(prometheus, "BatchlensGpuXidCritical")
        assert sorted((x["gpu"], x["xid"], x["vllm_instance"]) for x in xids) == [
            ("1", "79", "deepseek"), ("2", "48", "deepseek")]  # fmt: skip
        assert prometheus.query('batchlens_gpu_xid_errors_total{gpu="2", xid="13"} == 1')

        fake.gpus[1].failure = pynvml.NVML_ERROR_GPU_IS_LOST  # the Xid 79's GPU falls off the bus
        [lost] = firing(prometheus, "BatchlensGpuLost")
        assert (lost["gpu"], lost["uuid"], lost["vllm_instance"]) == ("1", "GPU-h100-0000-1", "deepseek")
        assert "It serves deepseek" in alert_description(prometheus, "BatchlensGpuLost")

        # The overview's GPU health row, under the P99: every panel has the failure on it.
        board = json.loads((ROOT / "dashboards" / "batchlens-overview.json").read_text())
        for panel in gpu_health_panels(board):
            results = [prometheus.query(interpolated(t["expr"])) for t in panel["targets"]]
            assert any(results), f"{panel['title']}: no data"

        fake.unload()  # the driver goes away: no GPU series at all, and the bus still holds 4 GPUs
        [gone] = firing(prometheus, "BatchlensGpuDriverGone")
        assert gone["instance"] == target and gone["severity"] == "critical"
    finally:
        prometheus.stop()


def alert_description(prometheus: PrometheusServer, alertname: str) -> str:
    [alert] = [a for a in prometheus.api("alerts")["alerts"] if a["labels"]["alertname"] == alertname]
    return alert["annotations"]["description"]


def gpu_health_panels(board: dict) -> list[dict]:
    panels = [p for p in board["panels"] if p.get("title") in GPU_HEALTH_PANELS]
    assert len(panels) == len(GPU_HEALTH_PANELS) == 4, [p.get("title") for p in board["panels"]]
    return panels


def interpolated(expr: str) -> str:
    return expr.replace("$cluster", ".*").replace("$vllm_instance", ".*")
