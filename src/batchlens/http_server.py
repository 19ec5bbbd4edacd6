"""Our aiohttp servers' common start: say "listening" only once the socket is bound."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web


def run_app(app: web.Application, host: str, port: int, *, logger: logging.Logger, ready: str, **options: Any) -> None:
    """``web.run_app``, logging ``ready`` after the bind succeeded: a taken port must never read as a start."""
    web.run_app(app, host=host, port=port, print=lambda _banner: logger.info(ready), **options)
