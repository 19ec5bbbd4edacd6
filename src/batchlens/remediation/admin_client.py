"""The hook's side of the batchlens admin API: read and set one engine's batch limit, with a deadline.

Every failure (refused, timed out, 401, 503, a body that is not the contract)
becomes an :class:`AdminCallError` with a short reason for the metrics and a
message for the log. The token signs each call (it is sent only with admin_auth: bearer), and is
never logged.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from pydantic import BaseModel, ValidationError

from batchlens.admin_api import (
    ADMISSION_PATH,
    BATCH_PATH,
    CACHE_RESET_PATH,
    AdminError,
    AdmissionState,
    BatchState,
    CacheReset,
    combine,
    missing_plugin,
)
from batchlens.admin_auth import SIGNED_401_HINT, UNAVAILABLE_HINT, admin_headers
from batchlens.masking import mask_url

HINTS = {
    401: f" (does the engine's admin token, its admin_token_env or its pod's Secret, match the server's? "
    f"{SIGNED_401_HINT})",
    503: f" ({UNAVAILABLE_HINT})",
    501: " (the plugin refused this vLLM release; the message says why, docs/compatibility.md)",
}


Reply = TypeVar("Reply", bound=BaseModel)


def _reason(body: bytes) -> str:
    """The server's own reason for a refusal (the contract's ``{"error": ...}``), fit for one log line: at most
    200 printable characters. Never a token: the admin API echoes none."""
    try:
        said = json.loads(body).get("error")
    except (ValueError, AttributeError, RecursionError):
        return ""
    if not isinstance(said, str) or not said:
        return ""
    return " " + repr("".join(c if c.isprintable() else " " for c in said)[:200])


class AdminCallError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class AdminClient:
    def __init__(self, session: aiohttp.ClientSession, url: str, token: str | None, *, timeout: float = 5.0,
                 signed: bool = True, pod: str = "", fence: Callable[[], Awaitable[bool]] | None = None):  # fmt: skip
        """``fence``: asked before every change; False refuses it (a hook that no longer leads: leader.py)."""
        self._session, self._fence = session, fence
        if token:  # the token takes the Authorization header: a user and password in the URL are the scrape's
            parts = urlsplit(url)
            url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self._base = url
        self.url = url + BATCH_PATH
        self._token, self._signed, self._pod = token, signed, pod
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def get(self) -> BatchState:
        return await self._call("GET", self.url, None, BatchState)

    async def put(self, limit: int) -> BatchState:
        return await self._call("PUT", self.url, {"max_num_active_seqs": limit}, BatchState)

    async def admission(self) -> AdmissionState:
        return await self._call("GET", self._base + ADMISSION_PATH, None, AdmissionState)

    async def set_admission(self, **caps: int | None) -> AdmissionState:
        return await self._call("PUT", self._base + ADMISSION_PATH, caps, AdmissionState)

    async def reset_prefix_cache(self) -> CacheReset:
        return await self._call("POST", self._base + CACHE_RESET_PATH, None, CacheReset)

    async def _call(self, method: str, url: str, body: dict | None, reply_model: type[Reply]) -> Reply:
        shown = mask_url(url)  # the error messages are logged
        if method != "GET" and self._fence is not None and not await self._fence():
            raise AdminCallError("not_leader", f"{method} {shown}: not sent: this hook does not hold the Lease")
        try:
            data = b"" if body is None else json.dumps(body).encode()
            headers = admin_headers(self._token, method, urlsplit(url).path, data, signed=self._signed, pod=self._pod)
            if body is not None:
                headers["Content-Type"] = "application/json"
            async with self._session.request(method, url, data=data or None, headers=headers, timeout=self._timeout,
                                             allow_redirects=False) as reply:  # fmt: skip
                text = await reply.content.read(64 * 1024)
                if reply.status != 200:
                    said, hint = _reason(text), HINTS.get(reply.status, "")
                    if reply.status == 404:
                        hint = f" ({missing_plugin(text)})"
                    raise AdminCallError(f"http_{reply.status}", f"{method} {shown}: {reply.status}{said}{hint}")
                return reply_model.model_validate_json(text)
        except TimeoutError:
            raise AdminCallError("timeout", f"{method} {shown}: no answer within {self._timeout.total} s") from None
        except aiohttp.ClientError as exc:
            raise AdminCallError("unreachable", f"{method} {shown}: {exc.__class__.__name__}: {exc}") from None
        except ValidationError as exc:
            raise AdminCallError("invalid_reply", f"{method} {shown}: not the admin API contract: {exc}") from None
        except ValueError:  # aiohttp refusing what it would send: a token with a control character (a tenant's
            # own Secret must not end the hook's worker for every tenant); its message is not repeated, it may quote it
            raise AdminCallError("invalid_request", f"{method} {shown}: not sent: a header or the URL is not valid "
                                 "HTTP (a token with a newline or a control character in it?)") from None  # fmt: skip


class DeploymentAdmin:
    """The admin API of a deployment of several servers (vLLM's external balancer: one ``vllm serve`` per DP
    rank; hybrid: one per node), as one engine: every call goes to every server, at once, and the answers are
    combined as one server combines its engine cores. A change that fails on one server fails (the hook
    retries it on all: a PUT of a limit or a cap is idempotent).

    The queued caps are per server there (each rank has its own API servers and prefill): the deployment's cap is
    split evenly, as the balancer splits the requests, and read back as the servers' sum.
    """

    def __init__(self, clients: Sequence[AdminClient]):
        self._clients = tuple(clients)
        self.url = clients[0].url

    async def _all(self, call: Callable[[AdminClient], Awaitable[Reply]]) -> list[Reply]:
        return list(await asyncio.gather(*(call(client) for client in self._clients)))

    async def get(self) -> BatchState:
        return _one_state(await self._all(lambda c: c.get()))

    async def put(self, limit: int) -> BatchState:
        return _one_state(await self._all(lambda c: c.put(limit)))

    async def admission(self) -> AdmissionState:
        return _one_door(await self._all(lambda c: c.admission()))

    async def set_admission(self, **caps: int | float | None) -> AdmissionState:
        n = len(self._clients)
        share = {name: None if cap is None else _share(name, cap, n) for name, cap in caps.items()}
        return _one_door(await self._all(lambda c: c.set_admission(**share)))

    async def reset_prefix_cache(self) -> CacheReset:
        return CacheReset(reset=all(r.reset for r in await self._all(lambda c: c.reset_prefix_cache())))


def _share(name: str, cap: int | float, n: int) -> int | float:
    """One of ``n`` pods' share of a cap: the rate and the token cap are the engine's whole, divided; the per-request
    door's TTFT is each request's own, the same on every pod."""
    if name == "max_predicted_ttft_seconds":
        return cap
    return cap / n if name == "prefill_tokens_per_second" else math.ceil(cap / n)


def _one_state(states: Sequence[BatchState]) -> BatchState:
    """The servers' engine cores as one server's (their ranks are global: ``engine`` stays unique)."""
    try:
        return combine([e.model_dump() for state in states for e in state.engines])
    except AdminError as exc:  # a server that lists no engine core
        raise AdminCallError("invalid_reply", f"the deployment's servers: {exc}") from None


def _one_door(doors: Sequence[AdmissionState]) -> AdmissionState:
    """The servers' doors as one: each cap the sum of the servers' (None where one has none), the counts summed."""

    def total(name: str) -> int | float | None:
        caps = [getattr(d, name) for d in doors]
        return None if any(c is None for c in caps) else sum(caps)

    offsets = [sum(d.api_servers for d in doors[:i]) for i in range(len(doors))]
    return AdmissionState(
        max_num_queued_tokens=total("max_num_queued_tokens"),
        max_num_queued_reqs=total("max_num_queued_reqs"),
        num_queued_tokens=sum(d.num_queued_tokens for d in doors),
        num_unfinished_reqs=sum(d.num_unfinished_reqs for d in doors),
        prefill_tokens_per_second=total("prefill_tokens_per_second"),
        # Each request's own bound, the same on every pod that has it; one that differs reads as none in force.
        max_predicted_ttft_seconds=bounds.pop()
        if len(bounds := {d.max_predicted_ttft_seconds for d in doors}) == 1
        else None,
        learned_prefill_tokens_per_second=total("learned_prefill_tokens_per_second"),
        api_servers=sum(d.api_servers for d in doors),
        api_servers_behind=[offset + i for offset, d in zip(offsets, doors, strict=True) for i in d.api_servers_behind],
    )
