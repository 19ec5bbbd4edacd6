"""Our aiohttp servers' common parts: the refusals every one of them makes, and a start that says "listening"
only once the socket is bound."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Hook = Callable[[web.Application], Awaitable[None]]
log = logging.getLogger("batchlens.http")


@web.middleware
async def refuse_encoded_bodies(request: web.Request, handler: Handler) -> web.StreamResponse:
    """415 for a body sent with a Content-Encoding: no client of ours compresses one (Alertmanager, Prometheus,
    batchlens itself), and a handler would read its bytes as if it were not encoded."""
    encoding = request.headers.get("Content-Encoding", "").strip()
    if encoding and encoding.lower() != "identity":
        log.warning("refused %s %s from %s: Content-Encoding %r (415); send the body as it is", request.method,
                    request.path, request.remote, encoding[:64])  # fmt: skip
        return web.json_response({"error": f"Content-Encoding {encoding[:64]!r} is not taken: send the body as it is"},
                                 status=415)  # fmt: skip
    return await handler(request)


def application(*, middlewares: tuple[Any, ...] = (), **options: Any) -> web.Application:
    """An aiohttp app of ours: ``middlewares`` around the common refusals (so a count of answers counts them).

    aiohttp's parser does not decode bodies (``auto_decompress`` off): it decoded them as they arrived, and a body
    that was not what its Content-Encoding said raised from the parser, with a traceback, even after a 401 was
    sent and the body was only being drained. What is encoded is refused (415) before anything reads it.
    """
    return web.Application(middlewares=(*middlewares, refuse_encoded_bodies),
                           handler_args={"auto_decompress": False}, **options)  # fmt: skip


def get_app(routes: Mapping[str, Handler], *, start: Hook, stop: Hook) -> web.Application:
    """A read-only server: GET routes, and the background work that feeds them started and stopped with it."""
    app = application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def run_app(app: web.Application, host: str, port: int, *, logger: logging.Logger, ready: str, **options: Any) -> None:
    """``web.run_app``, logging ``ready`` after the bind succeeded: a taken port must never read as a start."""
    web.run_app(app, host=host, port=port, print=lambda _banner: logger.info(ready), **options)
