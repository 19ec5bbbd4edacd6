"""Servers that are not what a command expects: one that accepts and never answers, one that speaks HTML, one
that refuses every request at the door (503 and 429, as an admission cap or a rate limit answers).

Real sockets in a background thread of the test process; the fake boundary is the server itself
(a Prometheus, a vLLM or an exporter is what the command thinks it reaches).
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class SilentServer:
    """Accepts every connection and never sends a byte: a wedged server behind a live port."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="silent-server").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._held.append(conn)

    def close(self) -> None:
        self._sock.close()
        for conn in self._held:
            conn.close()


class _Html(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = b"<!doctype html><html><body>It works!</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer  # http.server's names

    def log_message(self, *_args) -> None:
        pass


class HtmlServer:
    """Answers 200 with an HTML page on every path: a web server where an API was expected."""

    def __init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Html)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="html-server").start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Refusing(BaseHTTPRequestHandler):
    counter = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.lock:  # one server thread per request: 503, 429, 503, ... in arrival order
            type(self).counter += 1
            status = 503 if type(self).counter % 2 else 429
        body = b'{"error": {"message": "refused", "type": "ServiceUnavailable", "code": %d}}' % status
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args) -> None:
        pass


class RefusingServer:
    """Answers every POST at once with 503 and 429 in turn: an engine at its admission cap, a proxy's limit."""

    def __init__(self) -> None:
        handler = type("Handler", (_Refusing,), {"counter": 0, "lock": threading.Lock()})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="refusing-server").start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
