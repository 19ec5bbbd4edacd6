"""The exporter's worker thread: an Executor like ThreadPoolExecutor, except that the process never waits for it.

The exit with a call stuck in it is tested with the exporter itself (test_nvml_source.py)."""

from __future__ import annotations

import threading

import pytest

from batchlens.exporter.worker_thread import DaemonWorker


def test_it_runs_calls_in_order_hands_back_errors_and_refuses_work_once_shut_down() -> None:
    worker = DaemonWorker("test-worker")
    gate = threading.Event()
    first = worker.submit(gate.wait)
    queued = [worker.submit(lambda n=n: n * n) for n in range(3)]
    failing = worker.submit(int, "not a number")
    gate.set()
    assert first.result(5) is True and [f.result(5) for f in queued] == [0, 1, 4]
    with pytest.raises(ValueError):
        failing.result(5)
    stuck = threading.Event()
    worker.submit(stuck.wait)
    behind = worker.submit(lambda: "never")
    refused = []

    def resubmit(_future) -> None:  # a callback that submits again must be refused, not deadlock the shutdown
        with pytest.raises(RuntimeError):
            worker.submit(lambda: None)
        refused.append(True)

    behind.add_done_callback(resubmit)
    worker.shutdown(wait=False, cancel_futures=True)
    assert behind.cancelled() and refused == [True]
    with pytest.raises(RuntimeError, match="after shutdown"):  # queued behind the stop, it would never run
        worker.submit(lambda: None)
    stuck.set()
