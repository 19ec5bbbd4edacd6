"""Our aiohttp servers' common start: say "listening" only once the socket is bound."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Hook = Callable[[web.Application], Awaitable[None]]


def get_app(routes: Mapping[str, Handler], *, start: Hook, stop: Hook) -> web.Application:
    """A read-only server: GET routes, and the background work that feeds them started and stopped with it."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def run_app(app: web.Application, host: str, port: int, *, logger: logging.Logger, ready: str, **options: Any) -> None:
    """``web.run_app``, logging ``ready`` after the bind succeeded: a taken port must never read as a start."""
    web.run_app(app, host=host, port=port, print=lambda _banner: logger.info(ready), **options)
