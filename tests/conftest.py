"""Fixtures over the harness (tests/harness). Fakes, where used, are named in each test module's docstring."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.procs import Process, free_port, start_server_with_child
from harness.upstreams import Upstreams
from harness.vllm import VllmServer, start_vllm

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def vllm_exposition() -> str:
    """A /metrics body captured from a real vLLM 0.32.0 (CPU) after a few requests."""
    return (DATA / "vllm-0.32.0-cpu.prom").read_text()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One real vLLM 0.32 on the CPU for the whole session (startup takes about a minute)."""
    server = start_vllm(tmp_path_factory.mktemp("vllm"))
    yield server
    server.process.stop()


@pytest.fixture
def upstreams() -> Iterator[Upstreams]:
    ups = Upstreams()
    yield ups
    ups.close()


@pytest.fixture
def server_with_child(tmp_path: Path) -> Iterator[tuple[int, Process]]:
    """A real process tree shaped like vLLM's: a server listening on a port, with one child (the "worker")."""
    port = free_port()
    proc = start_server_with_child(tmp_path, port)
    yield port, proc
    proc.stop()
