"""What users install: the wheel, in a clean virtualenv, run from a folder that is not the checkout.

Every other test runs the editable install, which reads files straight from the source tree
and so hides package data that the wheel lacks. Here nothing comes from the checkout but the
wheel itself (and, where a command reads a user's file, a copy of that file). Real components:
pip, the built sdist and wheel, twine and check-wheel-contents, the installed commands over real
HTTP, Prometheus 2.42 and Alertmanager 0.25 for the demo.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from batchlens.stack import SERVICES
from harness.compose import COMPOSE, batchlens_services, interpolate
from harness.exporter import parse_samples, pick
from harness.litellm import litellm_venv
from harness.procs import Process, free_port, http_get
from harness.prometheus import require_binary
from harness.shared import once_per_run
from harness.wheel import REPO, Distributions, install_in_new_venv, run

# One worker makes the clean virtualenv (a session fixture is made once per xdist worker that asks for it).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("install")]
TOKEN = "install-test-token"


@pytest.fixture(scope="session")
def installed(distributions: Distributions, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of a new virtualenv holding the wheel: one for the run, whichever workers use it (no test
    installs anything more into it)."""
    make = lambda folder: str(install_in_new_venv(distributions.wheel, folder / "venv"))  # noqa: E731
    return Path(once_per_run(tmp_path_factory, "wheel-venv", make))


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A working folder that is not the checkout, nor inside it."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    assert REPO not in folder.parents
    return folder


def batchlens(installed: Path, *args: str, cwd: Path, timeout: float = 120):
    done = run([str(installed / "batchlens"), *args], cwd=cwd, timeout=timeout)
    assert "Traceback" not in done.stdout + done.stderr, f"batchlens {' '.join(args)}:\n{done.stderr[-3000:]}"
    return done


def installed_commands(installed: Path, cwd: Path) -> list[list[str]]:
    """Every command path of the installed CLI, found from click's own tree (groups and their subcommands)."""
    script = (
        "import json, click\nfrom batchlens.cli import main\n"
        "def walk(cmd, path):\n"
        "    yield path\n"
        "    if isinstance(cmd, click.Group):\n"
        "        ctx = click.Context(cmd)\n"
        "        for name in cmd.list_commands(ctx):\n"
        "            yield from walk(cmd.get_command(ctx, name), path + [name])\n"
        "print(json.dumps(list(walk(main, []))))\n"
    )
    done = run([str(installed / "python"), "-c", script], cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_wheel_holds_every_file_of_the_package_and_passes_the_checkers(distributions: Distributions) -> None:
    names = set(distributions.wheel_files())
    package = REPO / "src" / "batchlens"
    data = sorted(
        str(path.relative_to(REPO / "src"))
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )
    assert [name for name in data if name not in names] == [], "files of src/batchlens missing from the wheel"
    assert any(name.endswith(".json") for name in data), "the test no longer sees the package's data files"
    tools = Path(sys.executable).parent  # twine and check-wheel-contents come with the test extras
    twine = run([str(tools / "twine"), "check", "--strict", str(distributions.sdist), str(distributions.wheel)],
                cwd=distributions.wheel.parent)  # fmt: skip
    assert twine.returncode == 0, twine.stdout + twine.stderr
    contents = run([str(tools / "check-wheel-contents"), str(distributions.wheel)], cwd=distributions.wheel.parent)
    assert contents.returncode == 0, contents.stdout + contents.stderr
    size = distributions.wheel.stat().st_size
    print(f"{distributions.wheel.name}: {size / 1024:.0f} KiB, {len(names)} files")
    print("\n".join(sorted(names)))


def test_every_command_answers_help_and_the_version_is_the_wheels(installed: Path, outside: Path,
                                                                   distributions: Distributions) -> None:  # fmt: skip
    commands = installed_commands(installed, outside)
    assert len(commands) > 10 and ["lint-config"] in commands and ["config", "show"] in commands, commands
    for path in commands:
        done = batchlens(installed, *path, "--help", cwd=outside)
        assert done.returncode == 0 and "Usage: batchlens" in done.stdout, (path, done.stderr)
    version = batchlens(installed, "--version", cwd=outside)
    assert version.stdout.strip() == f"batchlens, version {distributions.version}"


def test_lint_config_reads_its_argument_table_from_the_wheel(installed: Path, outside: Path) -> None:
    template = outside / "engine.yaml"  # the article's template, and a misspelt key only the table can name
    template.write_text((REPO / "tests" / "data" / "article-engine-config.yaml").read_text()
                        + "  max_num_batched_token: 4096\n")  # fmt: skip
    done = batchlens(installed, "lint-config", "--json", str(template), cwd=outside)
    assert done.returncode == 1, done.stderr  # the article's template has errors
    findings = {finding["key"]: finding["message"] for finding in json.loads(done.stdout)}
    assert {"engine_config.max_paddings", "engine_config.speculative_decoding"} <= set(findings), findings
    assert "max_num_batched_tokens" in findings["engine_config.max_num_batched_token"], findings


def test_build_writes_the_committed_artifacts_anywhere_and_refuses_to_guess_a_repository(
    installed: Path, outside: Path
) -> None:
    root = outside / "artifacts"
    done = batchlens(installed, "build", "--root", str(root), cwd=outside)
    assert done.returncode == 0, done.stderr
    written = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert "alerts/batchlens.alerts.yml" in written and "provisioning/prometheus/prometheus.yml" in written
    for name in written:  # the wheel's build is the checkout's committed build
        assert (root / name).read_text() == (REPO / name).read_text(), f"{name} differs from the committed file"
    check = batchlens(installed, "build", "--check", "--root", str(root), cwd=outside)
    assert check.returncode == 0 and "up to date" in check.stdout, check.stderr
    (root / "alerts" / "batchlens.alerts.yml").write_text("stale\n")
    stale = batchlens(installed, "build", "--check", "--root", str(root), cwd=outside)
    assert stale.returncode == 1 and "batchlens.alerts.yml" in stale.stderr, stale.stderr

    nowhere = batchlens(installed, "build", cwd=outside)
    assert nowhere.returncode != 0 and "--root" in nowhere.stderr, nowhere.stderr
    assert len(nowhere.stderr.strip().splitlines()) == 1, nowhere.stderr
    assert not any(outside.glob("alerts")), "build without --root wrote into a folder that is no checkout"


@pytest.fixture
def simulator(installed: Path, outside: Path) -> Iterator[str]:
    port = free_port()
    proc = Process("simulate", [str(installed / "batchlens"), "simulate", "--listen", f"127.0.0.1:{port}",
                                "--speed", "20"], outside / "simulate.log", env={"BATCHLENS_ADMIN_TOKEN": TOKEN},
                   cwd=outside)  # fmt: skip
    proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=30)
    yield f"http://127.0.0.1:{port}"
    proc.stop()


def test_exporter_and_remediate_serve_from_the_wheel(installed: Path, outside: Path, simulator: str) -> None:
    exporter_port, hook_port = free_port(), free_port()
    env = {"BATCHLENS_ADMIN_TOKEN": TOKEN, "BATCHLENS_WEBHOOK_TOKEN": TOKEN}
    exporter = Process("exporter", [str(installed / "batchlens"), "exporter", "--engine", f"sim={simulator}",
                                    "--listen", f"127.0.0.1:{exporter_port}", "--interval", "0.5"],
                       outside / "exporter.log", env=env, cwd=outside)  # fmt: skip
    config = outside / "batchlens.yaml"
    config.write_text(yaml.safe_dump({"engines": [{"name": "sim", "url": simulator}]}))
    hook = Process("remediate", [str(installed / "batchlens"), "remediate", "--config", str(config), "--listen",
                                 f"127.0.0.1:{hook_port}", "--state", str(outside / "state.sqlite")],
                   outside / "remediate.log", env=env, cwd=outside)  # fmt: skip
    try:
        exporter.wait_http(f"http://127.0.0.1:{exporter_port}/healthz", timeout=30)
        deadline = time.monotonic() + 30
        while True:
            text = http_get(f"http://127.0.0.1:{exporter_port}/metrics")[1].decode()
            if re.search(r'^batchlens_batch_limit\{.*vllm_instance="sim".*\} \d', text, re.M):
                break
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.5)
        assert re.search(r'^vllm:num_requests_running\{.*vllm_instance="sim"', text, re.M), "no vLLM sample"
        hook.wait_http(f"http://127.0.0.1:{hook_port}/healthz", timeout=30)
        status, body = http_get(f"http://127.0.0.1:{hook_port}/healthz")
        assert status == 200, body
    finally:
        exporter.stop()
        hook.stop()
    assert "Traceback" not in exporter.log_tail(400) + hook.log_tail(400)


def test_the_demo_starts_and_stops_from_the_wheel(installed: Path, outside: Path) -> None:
    require_binary("prometheus", "prometheus")
    require_binary("prometheus-alertmanager", "prometheus-alertmanager")
    from test_demo import ctrl_c, free_offset  # the demo test's own port picking and stopping

    offset = free_offset()
    # The routing proxy is test_demo's (and the compose test's below): here the demo alone, from the wheel.
    argv = [str(installed / "batchlens"), "demo", "--run-dir", str(outside / "run"), "--port-offset", str(offset),
            "--speed", "10", "--litellm", "off"]  # fmt: skip
    demo = Process("demo", argv, outside / "demo.log", cwd=outside)
    try:
        t0 = time.monotonic()
        while "batchlens demo is running" not in demo.log_tail():
            assert demo.alive() and time.monotonic() - t0 < 60, demo.log_tail()
            time.sleep(0.5)
        prometheus = f"http://127.0.0.1:{9090 + offset}"
        groups = json.loads(http_get(prometheus + "/api/v1/rules")[1])["data"]["groups"]
        assert {g["name"] for g in groups} == {"batchlens.recording", "batchlens.alerts"}
        assert http_get(f"http://127.0.0.1:{9093 + offset}/-/ready")[0] == 200
    finally:
        ctrl_c(demo)
    assert demo.proc.returncode == 0, demo.log_tail()
    assert "Traceback" not in demo.log_tail(400)


def dependencies_first(names: list[str]) -> list[str]:
    """``names`` in compose's start order: each after the services it depends on (among ``names``)."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        for dependency in COMPOSE["services"][name].get("depends_on", {}):
            if dependency in names and dependency not in ordered:
                visit(dependency)
        if name not in ordered:
            ordered.append(name)

    for name in names:
        visit(name)
    return ordered


def image_entrypoint(dockerfile: Path) -> tuple[list[str], dict[str, str]]:
    """The final stage's ENTRYPOINT (exec form) and ENV of a Dockerfile."""
    last = dockerfile.read_text().split("\nFROM ")[-1]
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", last, re.M)[1])
    env = dict(line[4:].split("=", 1) for line in last.splitlines() if line.startswith("ENV "))
    return entrypoint, env


@pytest.mark.litellm
def test_the_compose_services_run_from_the_wheel_as_the_image_runs_them(
    installed: Path, outside: Path, litellm_env: dict[str, str]
) -> None:
    """Each batchlens service of docker-compose.yml: the image's entrypoint (the installed `batchlens`) with the
    service's command, its config mounted at /etc/batchlens, then the service's own healthcheck. The LiteLLM
    proxy runs as its image runs it (docker/litellm.Dockerfile's entrypoint), from `make litellm-env`'s
    environment with the same wheel. Docker is the one thing replaced: compose's host names and ports become
    loopback ports, its paths become folders here."""
    ports = {port: free_port() for _, port in SERVICES.values()}
    proxy_port = ports[SERVICES["litellm"][1]]

    def local(text: str) -> str:
        text = re.sub(r"(?<![\w.-])[\w.-]+:(\d{4})\b",
                      lambda m: f"127.0.0.1:{ports[int(m[1])]}" if int(m[1]) in ports else m[0], text)  # fmt: skip
        text = text.replace("--host 0.0.0.0 --port 4000", f"--host 127.0.0.1 --port {proxy_port}")
        return text.replace("/etc/batchlens", str(outside / "etc")).replace("/var/lib/batchlens", str(outside))

    (outside / "etc").mkdir()
    (outside / "state").mkdir()
    for config in (REPO / "provisioning" / "batchlens").glob("*.yaml"):  # the files compose mounts
        (outside / "etc" / config.name).write_text(local(config.read_text()))
    env = {"BATCHLENS_ADMIN_TOKEN": TOKEN, "BATCHLENS_WEBHOOK_TOKEN": TOKEN}
    proxy_argv, proxy_env = image_entrypoint(REPO / "docker" / "litellm.Dockerfile")
    proxy_env["PATH"] = f"{litellm_venv() / 'bin'}:{os.environ['PATH']}"
    started: list[Process] = []
    try:
        for name in dependencies_first([*batchlens_services(), "litellm"]):
            service = COMPOSE["services"][name]
            own = {key: local(interpolate(str(value))) for key, value in service.get("environment", {}).items()}
            if name == "litellm":
                argv = [local(arg) for arg in proxy_argv]
                own.update(proxy_env, **litellm_env)
            else:
                argv = [str(installed / "batchlens"), *(local(interpolate(arg)) for arg in service["command"])]
            started.append(Process(name, argv, outside / f"{name}.log", env={**env, **own}, cwd=outside))
            kind, *check = service["healthcheck"]["test"]
            assert kind == "CMD" and check[0] == "python", check
            deadline = time.monotonic() + (120 if name == "litellm" else 30)
            while (probe := run([str(installed / "python"), *(local(arg) for arg in check[1:])], cwd=outside,
                                timeout=10)).returncode != 0:  # fmt: skip
                assert started[-1].alive(), f"{name} exited:\n{started[-1].log_tail()}"
                assert time.monotonic() < deadline, f"{name}: healthcheck fails: {probe.stderr[-500:]}"
                time.sleep(0.5)
        exporter = f"http://127.0.0.1:{ports[SERVICES['exporter'][1]]}/metrics"
        deadline = time.monotonic() + 30
        while 'vllm_instance="demo"' not in (text := http_get(exporter)[1].decode()):  # the exporter reads the engine
            assert time.monotonic() < deadline, text[-1500:]
            time.sleep(1)
        # The load goes through the proxy, which sends each class to its engine, and Prometheus could read that
        # on its /metrics/ without the key (routing.metrics_auth: false in the stack's config).
        deadline = time.monotonic() + 60
        while True:
            status, body = http_get(f"http://127.0.0.1:{proxy_port}/metrics/")
            assert status == 200, body[:300]
            roles = {dict(k)["role"] for k, v in pick(parse_samples(body.decode()),
                                                      "batchlens_routing_decisions_total").items() if v}  # fmt: skip
            if roles >= {"main", "interactive"}:
                break
            assert time.monotonic() < deadline, roles
            time.sleep(1)
        assert all(p.alive() for p in started), [p.name for p in started if not p.alive()]
    finally:
        for proc in reversed(started):
            proc.stop()
    assert not [p.name for p in started if "Traceback" in p.log_tail(400)]
