"""The hook's side of the batchlens admin API: read and set one engine's batch limit, with a deadline.

Every failure (refused, timed out, 401, 503, a body that is not the contract)
becomes an :class:`AdminCallError` with a short reason for the metrics and a
message for the log. The token is sent, never logged.
"""

from __future__ import annotations

import aiohttp
from pydantic import ValidationError

from batchlens.admin_api import BATCH_PATH, BatchState, bearer

HINTS = {
    401: " (does the engine's admin token, its admin_token_env or its pod's Secret, match the server's?)",
    503: " (the server has no BATCHLENS_ADMIN_TOKEN configured)",
    404: (
        " (no batchlens plugin on this server: VLLM_PLUGINS=batchlens? Before vLLM 0.32 also "
        "--middleware batchlens.vllm_plugin.middleware.AdminMiddleware, docs/compatibility.md)"
    ),
    501: " (the plugin refused this vLLM release; the message says why, docs/compatibility.md)",
}


class AdminCallError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class AdminClient:
    def __init__(self, session: aiohttp.ClientSession, url: str, token: str | None, *, timeout: float = 5.0):
        self._session = session
        self.url = url + BATCH_PATH
        self._headers = bearer(token)
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def get(self) -> BatchState:
        return await self._call("GET", None)

    async def put(self, limit: int) -> BatchState:
        return await self._call("PUT", {"max_num_active_seqs": limit})

    async def _call(self, method: str, body: dict | None) -> BatchState:
        try:
            async with self._session.request(
                method, self.url, json=body, headers=self._headers, timeout=self._timeout
            ) as reply:
                text = await reply.content.read(64 * 1024)
                if reply.status != 200:
                    hint = HINTS.get(reply.status, "")
                    raise AdminCallError(f"http_{reply.status}", f"{method} {self.url}: {reply.status}{hint}")
                return BatchState.model_validate_json(text)
        except TimeoutError:
            raise AdminCallError("timeout", f"{method} {self.url}: no answer within {self._timeout.total} s") from None
        except aiohttp.ClientError as exc:
            raise AdminCallError("unreachable", f"{method} {self.url}: {exc.__class__.__name__}: {exc}") from None
        except ValidationError as exc:
            raise AdminCallError("invalid_reply", f"{method} {self.url}: not the admin API contract: {exc}") from None
