"""The admin API on a port of its own, for clusters whose ingress forwards every path of vLLM's port.

With ``BATCHLENS_ADMIN_PORT`` set, the plugin serves ``/batchlens/v1/*`` only
there (vLLM's own port answers 404 for them), on ``BATCHLENS_ADMIN_HOST``
(default 127.0.0.1; a pod sets its IP or 0.0.0.0). The server is uvicorn's,
which every vLLM already runs, in vLLM's own event loop, without signal
handlers of its own: vLLM's uvicorn owns SIGINT and SIGTERM, and this one
ends with the loop.

A port that cannot be used is never a fallback to vLLM's port: the admin API is
then served nowhere, and the log says why. An operator who asked for a separate
port has said that vLLM's port is reachable by people who must not get it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm.batchlens")

PORT_ENV = "BATCHLENS_ADMIN_PORT"
HOST_ENV = "BATCHLENS_ADMIN_HOST"


@dataclass(frozen=True)
class AdminListen:
    """Where the admin API listens: vLLM's port (``port`` None), a port of its own, or nowhere (``refusal``)."""

    host: str = "127.0.0.1"
    port: int | None = None
    refusal: str | None = None

    @property
    def separate(self) -> bool:
        """Whether vLLM's own port must leave ``/batchlens/v1/*`` unserved."""
        return self.port is not None or self.refusal is not None


def admin_listen(environ: Mapping[str, str]) -> AdminListen:
    """What the environment asks for; a value that cannot be a port is a refusal, never vLLM's port."""
    raw = environ.get(PORT_ENV, "").strip()
    host = environ.get(HOST_ENV, "").strip() or "127.0.0.1"
    if not raw:
        return AdminListen(host)
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        return AdminListen(host, refusal=f"{PORT_ENV}={raw!r} is not a port (1-65535)")
    return AdminListen(host, int(raw))


def _quiet_server(config: Any) -> Any:
    """uvicorn's Server, minus its signal handling: the process's signals are vLLM's server's."""
    import uvicorn

    class QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # uvicorn 0.29 and later
            yield

        def install_signal_handlers(self) -> None:  # uvicorn before 0.29
            return None

    return QuietServer(config)


def start_admin_server(app: Any, listen: AdminListen) -> asyncio.Task | None:
    """Serve ``app`` where ``listen`` says, as a task of the running loop; None (logged) where it cannot."""
    if listen.refusal is not None:
        log.error("batchlens: the admin API is served nowhere: %s", listen.refusal)
        return None
    if listen.port is None:
        return None
    import uvicorn

    config = uvicorn.Config(app, host=listen.host, port=listen.port, log_level="warning", lifespan="off",
                            access_log=False)  # fmt: skip
    server = _quiet_server(config)

    async def serve() -> None:
        try:
            await server.serve()
        except (OSError, SystemExit) as exc:  # uvicorn exits on a port it cannot bind
            log.error("batchlens: the admin API could not listen on %s:%d (%s): it is served nowhere",
                      listen.host, listen.port, exc)  # fmt: skip
            return
        if not server.started:
            log.error("batchlens: the admin API could not listen on %s:%d: it is served nowhere",
                      listen.host, listen.port)  # fmt: skip

    log.info("batchlens: admin API on its own port, %s:%d; vLLM's port answers 404 for it", listen.host, listen.port)
    return asyncio.get_running_loop().create_task(serve(), name="batchlens-admin-api")
