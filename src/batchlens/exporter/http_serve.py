"""The exporter's HTTP server: GET and HEAD on a few read-only routes, HTTP/1.1 by h11 over asyncio streams.

Why not aiohttp: see ``http_get``. Prometheus, a browser and curl are the clients. h11 parses
the requests (and bounds a request's head at 8 KiB); each connection is one coroutine, bounded
here in idle time, body size and number, so that no client can hold the exporter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import NamedTuple

import h11

log = logging.getLogger("batchlens.exporter")

_READ = 4096  # small reads, so that h11 sees an oversized head before it completes
_MAX_HEAD = 8 * 1024  # nginx's default; Prometheus sends about 300 bytes
_MAX_BODY = 64 * 1024  # a GET has no business sending one; a stray small one is read and ignored


class Answer(NamedTuple):
    status: int
    content_type: str
    body: bytes


Route = Callable[[], Answer]


def text_answer(status: int, text: str) -> Answer:
    return Answer(status, "text/plain; charset=utf-8", text.encode())


class HttpServer:
    """Serves ``routes`` (path -> answer); anything else gets 404, a method other than GET or HEAD 405."""

    def __init__(
        self,
        routes: Mapping[str, Route],
        *,
        access_log: logging.Logger | None = None,
        idle_seconds: float = 75.0,
        max_connections: int = 64,
    ):
        self._routes = routes
        self._access_log = access_log
        self._idle_seconds = idle_seconds
        self._max_connections = max_connections
        self._connections: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        """Bind, or raise OSError (a taken port): only a bound socket may be reported as listening."""
        self._server = await asyncio.start_server(self._accept, host, port, limit=_READ)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self._max_connections:
            log.warning("refused a connection: %d are open already", len(self._connections))
            writer.close()
            return
        self._connections.add(task)
        try:
            await self._converse(reader, writer)
        except (TimeoutError, OSError):
            pass  # an idle, slow or vanished client: nothing to answer
        finally:
            self._connections.discard(task)
            writer.close()

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        wire = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        while True:
            try:
                event = await self._next(wire, reader)
                if isinstance(event, h11.ConnectionClosed):
                    return
                assert isinstance(event, h11.Request)
                answer = await self._read_request(wire, reader, event)
            except h11.RemoteProtocolError as exc:
                if wire.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    await self._send(wire, writer, None, text_answer(exc.error_status_hint, f"bad request: {exc}\n"))
                return
            await self._send(wire, writer, event, answer)
            if wire.our_state is not h11.DONE or wire.their_state is not h11.DONE:
                return  # either side asked to close, or the request's body was left unread
            wire.start_next_cycle()

    async def _next(self, wire: h11.Connection, reader: asyncio.StreamReader) -> object:
        while (event := wire.next_event()) is h11.NEED_DATA:
            wire.receive_data(await asyncio.wait_for(reader.read(_READ), self._idle_seconds))
        return event

    async def _read_request(self, wire: h11.Connection, reader: asyncio.StreamReader, request: h11.Request) -> Answer:
        size = 0
        while not isinstance(event := await self._next(wire, reader), h11.EndOfMessage):
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > _MAX_BODY:
                    return text_answer(413, "a request body is not accepted here\n")
        if request.method not in (b"GET", b"HEAD"):
            return text_answer(405, "only GET and HEAD are served here\n")
        path = request.target.decode("ascii", "replace").partition("?")[0]
        route = self._routes.get(path)
        if route is None:
            return text_answer(404, f"no such page: {path} (try /metrics)\n")
        try:
            return route()
        except Exception:
            log.exception("GET %s failed", path)
            return text_answer(500, "internal error: see the exporter's log\n")

    async def _send(
        self, wire: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request | None, answer: Answer
    ) -> None:
        headers = [("Content-Type", answer.content_type), ("Content-Length", str(len(answer.body)))]
        if answer.status == 405:
            headers.append(("Allow", "GET, HEAD"))
        data = wire.send(h11.Response(status_code=answer.status, headers=headers))
        if request is None or request.method != b"HEAD":
            data += wire.send(h11.Data(data=answer.body))
        data += wire.send(h11.EndOfMessage())
        writer.write(data)
        await writer.drain()
        if self._access_log is not None and request is not None:
            self._access_log.debug(
                "%s %s %d %d", request.method.decode(), request.target.decode("ascii", "replace"),
                answer.status, len(answer.body),
            )  # fmt: skip
