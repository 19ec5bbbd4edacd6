"""The exporter's HTTP server: prometheus_client's own server class (wsgiref, a thread per request).

prometheus_client serves a registry; the exporter's body also passes each engine's own samples through as
text, so its few read-only routes are a small WSGI app on that same server class. Measured against the
hand-written h11 server it replaced (8 engines, 1 s interval, a scrape every 5 s): 46.8 MiB resident against
47.2, 4.70 ms a scrape against 5.08; benchmarks/memory.py keeps measuring it against the 50 MiB goal.

What this module adds, each a bound no client can lift: at most ``max_connections`` at once (past it a
connection is closed unanswered), an idle limit per connection, a request head of 8 KiB (431), no request
body past 64 KiB (413), GET and HEAD only (405), and the access log at debug. One request a connection
(HTTP/1.0, as prometheus_client's own): Prometheus opens a new one per scrape.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger("batchlens.exporter")

_MAX_HEAD = 8 * 1024  # nginx's default; Prometheus sends about 300 bytes
_MAX_BODY = 64 * 1024  # a GET has no business sending one; a stray small one is ignored


class Answer(NamedTuple):
    status: int
    content_type: str
    body: bytes


Route = Callable[[], Answer]


def text_answer(status: int, text: str) -> Answer:
    return Answer(status, "text/plain; charset=utf-8", text.encode())


class _HeadLimit:
    """The connection's reader, refusing a request head past ``_MAX_HEAD``: http.server alone takes 100 header
    lines of 64 KiB each. Its parser answers the LineTooLong raised here with 431."""

    def __init__(self, raw: Any):
        self._raw, self._left = raw, _MAX_HEAD

    def readline(self, size: int = -1) -> bytes:
        if self._left <= 0:
            raise http.client.LineTooLong(f"a request head over {_MAX_HEAD} bytes")
        line: bytes = self._raw.readline(self._left if size < 0 else min(size, self._left))
        self._left -= len(line)
        if self._left <= 0 and not line.endswith(b"\n"):
            raise http.client.LineTooLong(f"a request head over {_MAX_HEAD} bytes")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _Handler(WSGIRequestHandler):
    default_request_version = "HTTP/1.0"  # not 0.9: every answer, a 400 for garbage too, has its status line

    def setup(self) -> None:
        self.timeout = self.server.idle_seconds  # type: ignore[attr-defined]
        super().setup()
        self.rfile = _HeadLimit(self.rfile)  # type: ignore[assignment]

    def log_message(self, format: str, *args: object) -> None:
        if self.server.access_log is not None:  # type: ignore[attr-defined]
            self.server.access_log.debug("%s " + format, self.address_string(), *args)  # type: ignore[attr-defined]


class _Server(ThreadingWSGIServer):
    """prometheus_client's server class with a cap on the connections it serves at once."""

    def __init__(self, address: tuple[str, int], handler: type, *, max_connections: int, idle_seconds: float,
                 access_log: logging.Logger | None):  # fmt: skip
        self.address_family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0][0]  # ::1 as well
        self.idle_seconds, self.access_log = idle_seconds, access_log
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_connections = max_connections
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("refused a connection: %d are open already", self._max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread started to release it
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # An idle, slow or vanished client, or a request line past the head's limit: nothing to answer, and no
        # traceback on stderr for each.
        log.debug("a connection from %s ended early", client_address, exc_info=True)


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
        self._options = {"access_log": access_log, "idle_seconds": idle_seconds, "max_connections": max_connections}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    async def start(self, host: str, port: int) -> None:
        """Bind, or raise OSError (a taken port): only a bound socket may be reported as listening."""
        self._server = make_server(host, port, self._app, lambda address, handler: _Server(address, handler,
                                   **self._options), handler_class=_Handler)  # type: ignore[arg-type]  # fmt: skip
        self._thread = threading.Thread(target=self._server.serve_forever, name="batchlens-http", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        if self._server is not None:
            await asyncio.to_thread(self._server.shutdown)  # waits for serve_forever's loop, up to half a second
            self._server.server_close()

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        answer = self._answer(environ)
        headers = [("Content-Type", answer.content_type), ("Content-Length", str(len(answer.body)))]
        if answer.status == 405:
            headers.append(("Allow", "GET, HEAD"))
        start_response(f"{answer.status} {http.client.responses.get(answer.status, '')}", headers)
        return [b""] if environ["REQUEST_METHOD"] == "HEAD" else [answer.body]

    def _answer(self, environ: dict) -> Answer:
        if environ["SERVER_PROTOCOL"] == "HTTP/1.1" and "HTTP_HOST" not in environ:
            return text_answer(400, "bad request: HTTP/1.1 needs a Host header\n")
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return text_answer(400, "bad request: Content-Length is no number\n")
        if length > _MAX_BODY:
            return text_answer(413, "a request body is not accepted here\n")
        if environ["REQUEST_METHOD"] not in ("GET", "HEAD"):
            return text_answer(405, "only GET and HEAD are served here\n")
        path = environ.get("PATH_INFO", "")
        route = self._routes.get(path)
        if route is None:
            return text_answer(404, f"no such page: {path} (try /metrics)\n")
        try:
            return route()
        except Exception:
            log.exception("GET %s failed", path)
            return text_answer(500, "internal error: see the exporter's log\n")
