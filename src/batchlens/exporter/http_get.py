"""The exporter's HTTP client: GET only, HTTP/1.1 by h11 over asyncio streams, connections kept alive.

Why not aiohttp: the exporter runs beside every engine for weeks, and aiohttp's import alone is
12 MiB of its resident memory (``benchmarks/memory.py``), for a client that only ever sends GETs.
h11 parses the wire (the hostile part); this module only moves bytes and maps failures to the
sources' bounded reasons: ``connect``, ``timeout``, ``http_<code>``, ``too_large``, ``protocol``.

Redirects are not followed: an engine that answers 3xx is misconfigured, and following one would
carry the admin token to wherever the answer points.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
from collections.abc import Callable, Mapping
from urllib.parse import SplitResult, unquote, urlsplit

import h11

from batchlens import __version__
from batchlens.exporter.sampler import SourceError
from batchlens.masking import mask_url

_READ = 64 * 1024
# Below uvicorn's (so vLLM's and LiteLLM's) 5 s keep-alive: an idle connection is dropped here
# before the server may close it, so a request is rarely sent into a closing socket.
_IDLE_SECONDS = 4.0

Origin = tuple[str, str, int]  # scheme, host, port


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.wire = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def close(self) -> None:
        self.writer.close()


class HttpGetter:
    """GETs with one pool of kept-alive connections per origin. Used from one event loop."""

    def __init__(self) -> None:
        self._idle: dict[Origin, list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def text(self, url: str, *, timeout: float, limit: int,
                   headers: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None) -> str:  # fmt: skip
        """GET ``url`` and return its 200 body as UTF-8 text, or raise :class:`SourceError`.

        The body is abandoned as soon as it passes ``limit`` bytes, so a huge (or endless)
        reply costs at most that much memory. ``headers`` may be a function, called for each
        attempt: a signed admin call is signed afresh where a kept-alive connection turned out
        closed and the GET goes again, since the server takes each signature once.
        """
        shown = mask_url(url)  # every message below is logged: never a password of the URL
        make_headers = headers if callable(headers) else lambda: headers or {}
        try:
            body = await asyncio.wait_for(self._get(url, make_headers, limit), timeout)
        except TimeoutError:
            raise SourceError("timeout", f"GET {shown} took longer than {timeout:g}s") from None
        except SourceError as exc:
            raise SourceError(exc.reason, str(exc).replace(url, shown)) from None
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceError("parse", f"GET {shown}: body is not UTF-8 ({exc.reason} at byte {exc.start})") from None

    async def _get(self, url: str, make_headers: Callable[[], Mapping[str, str]], limit: int) -> bytes:
        parts = urlsplit(url)
        origin = _origin_of(parts)
        request = _request(parts, url, make_headers())
        kept = self._take(origin)
        if kept is not None:
            with contextlib.suppress(_Stale):  # the server closed it meanwhile: once more, on a fresh one
                return await self._exchange(kept, origin, request, url, limit)
            request = _request(parts, url, make_headers())  # made afresh: a signature goes on the wire once
        try:
            return await self._exchange(await self._connect(origin, url), origin, request, url, limit)
        except _Stale:
            raise SourceError("protocol", f"GET {url}: the server closed the connection without answering") from None

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin, [])
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < _IDLE_SECONDS and not conn.reader.at_eof():
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin, url: str) -> _Connection:
        scheme, host, port = origin
        tls = None
        if scheme == "https":
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            reader, writer = await asyncio.open_connection(host, port, ssl=tls, limit=_READ)
        except OSError as exc:  # refused, unreachable, no such host, a failed TLS handshake
            raise SourceError("connect", f"cannot connect to {url}: {exc.strerror or exc}") from None
        return _Connection(reader, writer)

    async def _exchange(self, conn: _Connection, origin: Origin, request: h11.Request, url: str, limit: int) -> bytes:
        pooled = False
        try:
            body = await self._roundtrip(conn, request, url, limit)
            if conn.wire.our_state is h11.DONE and conn.wire.their_state is h11.DONE:
                conn.wire.start_next_cycle()
                conn.idle_since = asyncio.get_running_loop().time()
                self._idle.setdefault(origin, []).append(conn)
                pooled = True
            return body
        except h11.ProtocolError as exc:
            raise SourceError("protocol", f"GET {url}: not a valid HTTP/1.1 answer ({exc})") from None
        finally:
            if not pooled:
                conn.close()

    @staticmethod
    async def _roundtrip(conn: _Connection, request: h11.Request, url: str, limit: int) -> bytes:
        wire = conn.wire
        try:
            conn.writer.write(wire.send(request) + wire.send(h11.EndOfMessage()))
            await conn.writer.drain()
        except OSError:
            raise _Stale from None
        chunks: list[bytes] = []
        size = 0
        heard = False  # any byte at all: after one, a closed connection is no longer a stale one
        while True:
            event = wire.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await conn.reader.read(_READ)
                except OSError:
                    data = b""
                if not data and not heard:
                    raise _Stale
                heard = True
                wire.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
                if status != 200:
                    raise SourceError(
                        f"http_{status}", f"GET {url} answered HTTP {status} {event.reason.decode('latin-1')}"
                    )
                length = dict(event.headers).get(b"content-length")
                if length is not None and length.isdigit() and int(length) > limit:
                    raise _too_large(url, limit)
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
                size += len(event.data)
                if size > limit:
                    raise _too_large(url, limit)
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise SourceError("protocol", f"GET {url}: the connection closed before the body ended")

    async def aclose(self) -> None:
        conns = [conn for idle in self._idle.values() for conn in idle]
        self._idle.clear()
        for conn in conns:
            conn.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()


class _Stale(Exception):
    """The server closed the connection before answering: safe to send a GET again."""


def _request(parts: SplitResult, url: str, given: Mapping[str, str]) -> h11.Request:
    """The GET for ``parts`` with ``given`` headers, and Basic auth from the URL's user where they send none."""
    headers = dict(given)
    if parts.username is not None and "authorization" not in {k.lower() for k in headers}:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()  # http://user:pass@host
        headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.netloc.rpartition("@")[2]
    try:
        return h11.Request(
            method="GET", target=target, headers=[("Host", host), ("User-Agent", f"batchlens/{__version__}"),
                                                  *headers.items()],
        )  # fmt: skip
    except h11.LocalProtocolError:  # its message quotes the header: a token with a newline in it (a Secret
        # made --from-file) would be logged whole
        raise SourceError("invalid_header", f"GET {url}: a header is not valid HTTP (a token with a newline or "
                          "a control character in it?); not sent") from None  # fmt: skip


def _origin_of(parts: SplitResult) -> Origin:
    return (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))


def _too_large(url: str, limit: int) -> SourceError:
    return SourceError("too_large", f"GET {url}: body is larger than {limit} bytes (exporter.max_response_bytes)")
