"""The hook's typed Alertmanager API v2 client against a real Alertmanager 0.25."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from batchlens.remediation.alertmanager import (
    AlertmanagerClient,
    AlertmanagerError,
    Matcher,
    PostableAlert,
    Silence,
    utc,
)
from harness.alertmanager import AlertmanagerServer
from harness.procs import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


def test_post_list_silence_and_expire_against_a_real_alertmanager(tmp_path) -> None:
    am = AlertmanagerServer(tmp_path / "am", ROOT / "provisioning" / "alertmanager" / "alertmanager.yml")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            client = AlertmanagerClient(session, am.url)
            labels = {"alertname": "VllmBreakerEscalation", "vllm_instance": "a", "severity": "critical"}
            await client.post_alerts([PostableAlert(labels=labels, annotations={"summary": "s"})])
            [got] = await client.alerts('vllm_instance="a"')
            assert got.labels == labels and got.status.state == "active"
            now = time.time()
            silence = Silence(matchers=[Matcher(name="vllm_instance", value="a")], startsAt=utc(now),
                              endsAt=utc(now + 600), createdBy="batchlens", comment="test")  # fmt: skip
            silence_id = await client.create_silence(silence)
            [got] = await client.alerts('vllm_instance="a"')
            assert got.status.state == "suppressed"
            await client.expire_silence(silence_id)
            [got] = await client.alerts('vllm_instance="a"')
            assert got.status.state == "active"
            assert await client.alerts('vllm_instance="nobody"') == []
            with pytest.raises(AlertmanagerError, match="400"):
                await client.post_alerts([PostableAlert(labels={})])  # Alertmanager refuses an alert without labels

    try:
        asyncio.run(scenario())
    finally:
        am.stop()


def test_an_unreachable_alertmanager_is_a_clear_error() -> None:
    async def scenario() -> None:
        async with aiohttp.ClientSession() as session:
            client = AlertmanagerClient(session, f"http://127.0.0.1:{free_port()}", timeout=2)
            with pytest.raises(AlertmanagerError, match="POST /alerts"):
                await client.post_alerts([PostableAlert(labels={"alertname": "x"})])

    asyncio.run(scenario())
