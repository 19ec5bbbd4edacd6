"""One daemon thread that runs blocking reads for the event loop: an ``Executor`` for ``run_in_executor``.

ThreadPoolExecutor's threads are joined when the interpreter exits. A read stuck for good (an NVML call in a
wedged driver, a /proc file of a process that never lets go) then held the exporter past SIGTERM until the
kubelet killed it. The exporter's reads change nothing, so nothing is lost by leaving one unfinished: its
threads are daemons, and the process exits without them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class DaemonWorker(Executor):
    """Runs what is submitted, in order, on one daemon thread named ``name``."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple, dict] | None] = queue.SimpleQueue()
        self._stopped = False
        self._lock = threading.Lock()  # a submit and a shutdown in two threads: nothing queued behind the stop
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._stopped:  # it would wait behind the stop, forever: ThreadPoolExecutor's answer
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._calls.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop after what is queued (cancelled first with ``cancel_futures``); ``wait`` waits for the thread."""
        dropped = []
        with self._lock:
            self._stopped = True
            while cancel_futures:
                try:
                    dropped.append(self._calls.get_nowait())
                except queue.Empty:
                    break
            self._calls.put(None)
        for call in dropped:  # outside the lock: a future's callback may submit (and be refused)
            if call is not None:
                call[0].cancel()
        if wait:
            self._thread.join()

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to whoever awaits the future, as ThreadPoolExecutor does
                future.set_exception(exc)
