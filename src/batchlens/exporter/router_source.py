"""The router source: whether the LiteLLM proxy in front of the engines answers (``routing.proxy_url``).

The proxy is the front door: when it is down, every engine looks idle and
healthy while clients get nothing. Its own /metrics needs its master key and
vanishes with it, so the exporter asks the unauthenticated liveness route each
interval, and ``batchlens_source_up{source="litellm"}`` says what it found
(the ``BatchlensRouterDown`` alert reads it).
"""

from __future__ import annotations

from batchlens.exporter.http_get import HttpGetter
from batchlens.exporter.snapshot import Reading

LIVENESS = "/health/liveliness"  # LiteLLM's spelling


class RouterSource:
    kind = "litellm"
    labels: tuple[tuple[str, str], ...] = ()

    def __init__(self, url: str, http: HttpGetter, *, timeout: float):
        self._url, self._http, self._timeout = url + LIVENESS, http, timeout

    async def sample(self) -> Reading:
        await self._http.text(self._url, timeout=self._timeout, limit=64 * 1024)
        return Reading()
