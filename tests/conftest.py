"""Fixtures over the harness (tests/harness). Fakes, where used, are named in each test module's docstring."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from batchlens.admin_api import TOKEN_ENV
from harness.litellm import install_batchlens
from harness.procs import Process, free_port, start_server_with_child
from harness.upstreams import Upstreams
from harness.vllm import ADMIN_TOKEN, RELEASE_CAPTURES, VllmServer, install_plugin, release_of, start_vllm
from harness.wheel import Distributions, build_distributions

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def vllm_exposition() -> str:
    """A /metrics body captured from a real vLLM 0.32.0 (CPU) after a few requests."""
    return (DATA / "vllm-0.32.0-cpu.prom").read_text()


@pytest.fixture(params=RELEASE_CAPTURES, ids=release_of)
def release_capture(request: pytest.FixtureRequest) -> Path:
    """One release's /metrics captured under load, vllm-<release>-cpu.prom (each test runs once per release)."""
    return request.param


@pytest.fixture(scope="session")
def distributions(tmp_path_factory: pytest.TempPathFactory) -> Distributions:
    """The sdist and the wheel of this checkout, built once per session as a release is built."""
    return build_distributions(tmp_path_factory.mktemp("dist") / "dist")


@pytest.fixture(scope="session")
def vllm_plugin_env(tmp_path_factory: pytest.TempPathFactory, distributions: Distributions) -> dict[str, str]:
    """The environment that loads the batchlens plugin (pip-installed from the built wheel) into vLLM."""
    return install_plugin(distributions.wheel, tmp_path_factory.mktemp("plugin") / "site")


@pytest.fixture(scope="session")
def litellm_env(tmp_path_factory: pytest.TempPathFactory, distributions: Distributions) -> dict[str, str]:
    """The environment that loads batchlens (pip-installed from the built wheel) into the LiteLLM proxy."""
    return install_batchlens(distributions.wheel, tmp_path_factory.mktemp("litellm") / "site")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, vllm_plugin_env: dict[str, str]) -> Iterator[VllmServer]:
    """One real vLLM 0.32 on the CPU for the whole session, with the batchlens plugin and a token.

    Startup takes about a minute.
    """
    server = start_vllm(tmp_path_factory.mktemp("vllm"), env={**vllm_plugin_env, TOKEN_ENV: ADMIN_TOKEN})
    # The first batches of each size compile (torch.compile) and stall the engine for
    # seconds; pay for that here, not inside a test that samples the running batch.
    server.load(requests=48, concurrency=16, max_tokens=32)
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
