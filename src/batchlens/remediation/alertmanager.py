"""A small typed client for Alertmanager's API v2: post alerts, list alerts, create and expire silences.

No maintained PyPI client exists (docs/architecture.md, "Conventions"). This covers what batchlens
needs, with pydantic models of the request and reply bodies it uses.
"""

from __future__ import annotations

from datetime import UTC, datetime

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class AlertmanagerError(Exception):
    pass


class PostableAlert(BaseModel):
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: datetime | None = None
    endsAt: datetime | None = None
    generatorURL: str = ""


class Matcher(BaseModel):
    name: str
    value: str
    isRegex: bool = False
    isEqual: bool = True


class Silence(BaseModel):
    matchers: list[Matcher]
    startsAt: datetime
    endsAt: datetime
    createdBy: str
    comment: str


class AlertStatus(BaseModel):
    model_config = ConfigDict(extra="ignore")
    state: str


class GettableAlert(BaseModel):
    model_config = ConfigDict(extra="ignore")

    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: datetime
    endsAt: datetime
    fingerprint: str
    status: AlertStatus


_ALERTS = TypeAdapter(list[GettableAlert])


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


class AlertmanagerClient:
    def __init__(self, session: aiohttp.ClientSession, url: str, *, timeout: float = 5.0):
        self._session = session
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def _call(self, method: str, path: str, body: object | None = None, params: dict | None = None):
        try:
            async with self._session.request(
                method, f"{self.url}/api/v2{path}", json=body, params=params, timeout=self._timeout
            ) as reply:
                text = await reply.text()
                if reply.status >= 300:
                    raise AlertmanagerError(f"{method} {path}: {reply.status} {text[:200]}")
                return text
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AlertmanagerError(f"{method} {path}: {exc.__class__.__name__}: {exc}") from None

    async def post_alerts(self, alerts: list[PostableAlert]) -> None:
        await self._call("POST", "/alerts", [a.model_dump(mode="json", exclude_none=True) for a in alerts])

    async def alerts(self, *filters: str, active: bool = True) -> list[GettableAlert]:
        """Alerts matching every ``label="value"`` filter."""
        params = [("filter", f) for f in filters] + [("active", str(active).lower())]
        return _ALERTS.validate_json(await self._call("GET", "/alerts", params=params))

    async def create_silence(self, silence: Silence) -> str:
        text = await self._call("POST", "/silences", silence.model_dump(mode="json"))
        return TypeAdapter(dict[str, str]).validate_json(text)["silenceID"]

    async def expire_silence(self, silence_id: str) -> None:
        await self._call("DELETE", f"/silence/{silence_id}")
