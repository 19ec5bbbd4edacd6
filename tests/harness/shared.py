"""What a test run builds once, however many pytest-xdist workers share it.

Every worker has its own session fixtures, so an expensive one (the wheel, the plugin installed into vLLM's
environment) would be built once per worker. Here the first worker to ask builds it in the run's shared
temporary folder, under a lock, and writes down the result; the others wait on the lock and read it.
Without xdist it is built as before, once.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def once_per_run(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> Any:
    """``make(folder)`` in a folder of its own, once per test run; its result must survive JSON."""
    root = run_folder(factory)
    if root is None:
        return make(factory.mktemp(name))
    folder, result = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.exists():
            return json.loads(result.read_text())
        folder.mkdir(exist_ok=True)
        value = make(folder)
        result.write_text(json.dumps(value))
        return value


def run_folder(factory: pytest.TempPathFactory) -> Path | None:
    """The run's folder that every xdist worker shares, above each worker's own; None without xdist."""
    return factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None
