"""The hook's clients, in process, for the tests that drive its worker between two awaits: each is the fake
boundary of the tests that use it (an admin API that answers when the test opens a gate, an Alertmanager that
records what is posted)."""

from __future__ import annotations

import asyncio

from batchlens.admin_api import BatchState
from batchlens.remediation.alertmanager import AlertmanagerError


class GatedAdmin:
    """The admin API's client, in process: its GET answers when the test opens the gate, so a pass can be caught
    mid-flight (a real engine cannot be paused at one await). The fake boundary is AdminClient's get and put."""

    def __init__(self, limit: int = 64) -> None:
        self.gate, self.limit, self.gets = asyncio.Event(), limit, 0
        self.gate.set()

    async def get(self) -> BatchState:
        self.gets += 1
        await self.gate.wait()
        return BatchState(max_num_active_seqs=self.limit, max_num_seqs=64, num_running=0, num_waiting=0)

    async def put(self, limit: int) -> BatchState:
        self.limit = limit
        return await self.get()


class Alertmanager:
    """Alertmanager's client, in process: it records what is posted, after refusing the first ``refuse`` posts."""

    def __init__(self, refuse: int = 0) -> None:
        self.posted: list = []
        self.calls, self.refuse = 0, refuse

    async def post_alerts(self, alerts) -> None:
        self.calls += 1
        if self.calls <= self.refuse:
            raise AlertmanagerError("POST /api/v2/alerts: 503")
        self.posted += alerts
