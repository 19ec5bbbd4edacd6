"""Fixtures over the harness (tests/harness). Fakes, where used, are named in each test module's docstring."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from batchlens.admin_api import TOKEN_ENV
from harness import procs
from harness.litellm import install_batchlens
from harness.procs import Process, free_port, start_server_with_child
from harness.shared import once_per_run, run_folder
from harness.upstreams import Upstreams
from harness.vllm import (
    ADMIN_TOKEN,
    RELEASE_CAPTURES,
    VllmServer,
    install_plugin,
    release_of,
    start_vllm,
)
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


#: The modules whose vLLMs start and serve on a second worker, beside the first's: the data-parallel servers
#: (`vllm serve --data-parallel-size 2`, a head and a headless rank) and the routing test's two servers, each
#: module its own servers. One group was the suite's critical path; two vLLMs at a time fit this machine.
SECOND_WORKER_MODULES = frozenset({"test_vllm_api_servers.py", "test_routing_vllm.py"})
VLLM_GROUPS = ("vllm", "vllm_b")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that start a real vLLM run on two xdist workers, one after another on each (make test: --dist
    loadgroup): three vLLMs at once ran this machine out of memory, and each busies a core while it serves."""
    for item in items:
        if item.get_closest_marker("vllm"):
            group = VLLM_GROUPS[1] if item.path.name in SECOND_WORKER_MODULES else VLLM_GROUPS[0]
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _vllm_tests_grouped(request: pytest.FixtureRequest) -> None:
    """Under --dist loadgroup, xdist tells its scheduler a test's group in the test's id: without it the vLLM
    tests spread over the workers, and three vLLMs at once ran this machine out of memory. Fail each loudly
    (pytest 9.2 dropped the group in silence: pytest-dev/pytest-xdist#1386)."""
    grouped = request.node.nodeid.rpartition("@")[2] in VLLM_GROUPS
    if getattr(request.config.option, "loadgroup", False) and request.node.get_closest_marker("vllm") and not grouped:
        pytest.fail(
            "--dist loadgroup does not group the vLLM tests: this pytest and pytest-xdist do not work together "
            "(pytest-dev/pytest-xdist#1386); install the pytest the test extra pins (pip install -e '.[test]')"
        )


@pytest.fixture(scope="session", autouse=True)
def _ports_handed_out_once_per_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    """xdist's workers draw their ports from one record (harness.procs.free_port), so no two get the same."""
    if (root := run_folder(tmp_path_factory)) is not None:
        procs.HANDED_OUT = root / "ports-handed-out"


@pytest.fixture(scope="session")
def distributions(tmp_path_factory: pytest.TempPathFactory) -> Distributions:
    """The sdist and the wheel of this checkout, built once per run as a release is built."""

    def build(folder: Path) -> list[str]:
        built = build_distributions(folder / "dist")
        return [str(built.sdist), str(built.wheel)]

    sdist, wheel = once_per_run(tmp_path_factory, "dist", build)
    return Distributions(Path(sdist), Path(wheel))


@pytest.fixture(scope="session")
def vllm_plugin_env(tmp_path_factory: pytest.TempPathFactory, distributions: Distributions) -> dict[str, str]:
    """The environment that loads the batchlens plugin (pip-installed from the built wheel) into vLLM."""
    return once_per_run(tmp_path_factory, "plugin", lambda folder: install_plugin(distributions.wheel, folder / "site"))


@pytest.fixture(scope="session")
def litellm_env(tmp_path_factory: pytest.TempPathFactory, distributions: Distributions) -> dict[str, str]:
    """The environment that loads batchlens (pip-installed from the built wheel) into the LiteLLM proxy."""
    return once_per_run(tmp_path_factory, "litellm", lambda f: install_batchlens(distributions.wheel, f / "site"))


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, vllm_plugin_env: dict[str, str]) -> Iterator[VllmServer]:
    """One real vLLM 0.32 on the CPU for the whole session, with the batchlens plugin and a token.

    Startup takes about 40 s. The server runs eager (harness.vllm), so no batch size stalls on a compile later.
    """
    server = start_vllm(tmp_path_factory.mktemp("vllm"), env={**vllm_plugin_env, TOKEN_ENV: ADMIN_TOKEN})
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
