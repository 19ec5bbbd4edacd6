"""Run a coroutine that changes an engine so that every way of stopping it lets it put the engine back.

``timeout``, systemd, Kubernetes and a cancelled CI job send SIGTERM; a closed
terminal sends SIGHUP; Ctrl-C sends SIGINT. Each of them cancels the coroutine's
task, so its ``finally`` blocks run (and restore what it changed) before the
process exits. A second signal while it restores is logged and otherwise
ignored: cancelling the restore itself would leave the engine changed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

log = logging.getLogger("batchlens.stopping")


class Stopped(Exception):
    """The run was stopped by a signal, after its clean-up ran."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "killed by signal N"


def run_stoppable(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coroutine)``, where SIGINT, SIGTERM and SIGHUP cancel it and then raise :class:`Stopped`."""

    async def main() -> T:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        received: list[int] = []

        def stop(signum: int) -> None:
            if received:
                log.warning("%s while stopping: still putting the engine back", signal.Signals(signum).name)
                return
            received.append(signum)
            log.warning("%s: stopping, and putting the engine back first", signal.Signals(signum).name)
            task.cancel()

        for signum in SIGNALS:
            loop.add_signal_handler(signum, stop, signum)
        try:
            return await coroutine
        except asyncio.CancelledError:
            if received:
                raise Stopped(received[0]) from None
            raise
        finally:
            for signum in SIGNALS:
                loop.remove_signal_handler(signum)

    return asyncio.run(main())


async def finish(awaitable: Coroutine[Any, Any, T]) -> T:
    """Await a clean-up to its end even if the caller is cancelled meanwhile; then pass the cancel on.

    A restore that a signal cut short would leave the engine changed: the signal
    only stops what comes after it.
    """
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
