"""Send a planned load to an OpenAI-compatible server and time every request."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp

from batchlens.load.plan import Planned, Result, Tally


def prompt(tokens: int) -> list[int]:
    """A prompt of exactly ``tokens`` token ids: servers started without a tokenizer take these as they are."""
    return [3 + i % 1000 for i in range(tokens)]


#: A word that is one token to tiktoken's cl100k (LiteLLM's counter) and to the simulator (4 characters).
TEXT_TOKEN = " the"


def text_prompt(tokens: int) -> str:
    """A text prompt of ``tokens`` tokens, for a proxy that takes no token ids (LiteLLM's completions route)."""
    return TEXT_TOKEN * tokens


@dataclass(frozen=True)
class Via:
    """How requests reach the server: straight (token ids), or through a proxy (text, a key, the class header)."""

    text: bool = False
    api_key: str | None = None
    class_header: str = "x-batchlens-latency-class"

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def headers(self, p: Planned) -> dict[str, str]:
        out = self.auth()
        if p.latency_class:
            out[self.class_header] = p.latency_class
        return out


DIRECT = Via()


async def first_model(session: aiohttp.ClientSession, url: str, timeout: float = 10, via: Via = DIRECT) -> str:
    """The first model the server lists; ValueError, saying what came back, when it is no OpenAI server."""
    target = url + "/v1/models"
    try:
        async with session.get(target, headers=via.auth(), timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            status, text = resp.status, await resp.text(errors="replace")
    except TimeoutError:
        raise ValueError(f"{target} did not answer within {timeout:g} s") from None
    except aiohttp.ClientError as exc:
        raise ValueError(f"cannot read {target}: {exc or type(exc).__name__}") from None
    if status != 200:
        raise ValueError(f"{target} answered HTTP {status}, expected the OpenAI model list: {text[:80].strip()!r}")
    try:
        models = [model["id"] for model in json.loads(text)["data"]]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{target} did not answer an OpenAI model list: {text[:80].strip()!r}") from None
    if not models:
        raise ValueError(f"{target} lists no model")
    return models[0]


async def reason(resp: aiohttp.ClientResponse) -> str:
    """What a server said when it refused a request: the OpenAI-style error message, or the body's start."""
    text = (await resp.content.read(4096)).decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:200]
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message") or error.get("detail") if isinstance(error, dict) else error
    return str(message or text)[:200]


async def send(
    session: aiohttp.ClientSession, url: str, model: str, p: Planned, timeout: float, via: Via = DIRECT
) -> Result:
    loop = asyncio.get_running_loop()
    text = text_prompt(p.prompt_tokens) if via.text else prompt(p.prompt_tokens)
    payload: dict = {"model": model, "prompt": text, "max_tokens": p.max_tokens, "ignore_eos": True}
    if p.stream:
        payload.update(stream=True, stream_options={"include_usage": True})
    started = loop.time()
    try:
        async with session.post(
            url + "/v1/completions", json=payload, headers=via.headers(p), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                return Result(p, False, f"http_{resp.status}", reason=await reason(resp))
            if not p.stream:
                body = await resp.json()
                return Result(p, True, e2e=loop.time() - started, output_tokens=body["usage"]["completion_tokens"])
            first = last = None
            gaps, events, usage = [], 0, None
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if choices and choices[0].get("finish_reason") is None:
                    now = loop.time()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    events += 1
            tokens = usage["completion_tokens"] if usage else events
            ttft = first - started if first is not None else None
            return Result(p, True, e2e=loop.time() - started, ttft=ttft, itl=tuple(gaps), output_tokens=tokens)
    except TimeoutError:
        return Result(p, False, "timeout")
    except aiohttp.ClientConnectorError:
        return Result(p, False, "connect")
    except aiohttp.ServerDisconnectedError:  # the server closed the connection without an answer
        return Result(p, False, "disconnected")
    except aiohttp.ClientOSError as exc:  # a connection reset mid-request
        return Result(p, False, "reset", reason=str(exc)[:200])
    except (aiohttp.ClientError, ValueError, KeyError):
        return Result(p, False, "protocol")


#: How long an idle connection is kept for the next request: under the 5 s after which uvicorn (vLLM's API server,
#: the LiteLLM proxy) closes one. Kept longer (aiohttp's default is 15 s), a request sent as the server closes
#: the connection is lost before it reaches the application: no answer, no access-log line (issue 32).
KEEPALIVE_SECONDS = 4.0


def connector(max_connections: int) -> aiohttp.TCPConnector:
    """The connection pool of a load or a replay: at most ``max_connections``, none kept idle past the server's."""
    return aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=KEEPALIVE_SECONDS)


async def run(
    url: str,
    planned: Iterable[Planned],
    *,
    model: str | None,
    timeout: float,
    max_connections: int,
    via: Via = DIRECT,
    stop: asyncio.Event | None = None,
) -> tuple[str, Tally, float]:
    """Send each planned request at its time; return the model used, what the results add up to and the wall time.

    The schedule is read as it comes due, and each result is tallied as it comes: memory follows the requests in
    flight, not the run's length. ``stop`` set ends the run early: nothing more is sent, what is in flight is
    abandoned (not counted), and the tally is of what finished.
    """
    stop = stop or asyncio.Event()
    tally, in_flight = Tally(), set()
    async with aiohttp.ClientSession(connector=connector(max_connections)) as session:
        model = model or await first_model(session, url, min(timeout, 10), via)
        loop = asyncio.get_running_loop()
        start = loop.time()

        def done(task: asyncio.Task) -> None:
            in_flight.discard(task)
            if not task.cancelled():
                tally.add(task.result())

        for p in planned:
            with contextlib.suppress(TimeoutError):  # the time to send it came first
                await asyncio.wait_for(stop.wait(), max(0.0, start + p.at - loop.time()))
            if stop.is_set():
                break
            task = asyncio.create_task(send(session, url, model, p, timeout, via))
            in_flight.add(task)
            task.add_done_callback(done)
        waiting = asyncio.ensure_future(stop.wait())
        while in_flight and not stop.is_set():  # the last replies, unless stopped
            await asyncio.wait([*in_flight, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        for task in list(in_flight):
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
        return model, tally, loop.time() - start
