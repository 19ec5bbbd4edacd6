"""docker-compose.yml and the image, checked without Docker (none here): the compose-spec schema, every mount,
every batchlens command parsed by the real CLI, and the conventions an operator relies on."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest
import yaml

from batchlens.cli import main
from batchlens.config import load_config
from batchlens.stack import SERVICES, compose
from harness.compose import COMPOSE, ENV_EXAMPLE, batchlens_services, interpolate

ROOT = Path(__file__).resolve().parent.parent


def test_the_compose_file_validates_against_the_compose_spec() -> None:
    checker = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yml")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(COMPOSE["services"]))
def test_every_mounted_file_and_folder_exists(name: str) -> None:
    service = COMPOSE["services"][name]
    for volume in service.get("volumes", []):
        source = volume.split(":")[0]
        if source.startswith("."):
            assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
        else:
            assert source in COMPOSE["volumes"], f"{name} uses volume {source}, which is not declared"
    build = service.get("build")
    if isinstance(build, dict):
        assert (ROOT / build.get("context", ".") / build["dockerfile"]).exists()


@pytest.mark.parametrize("name", batchlens_services())
def test_every_batchlens_command_is_a_real_subcommand_with_valid_flags(name: str) -> None:
    args = [interpolate(a) for a in COMPOSE["services"][name]["command"]]
    command = main.get_command(click.Context(main), args[0])
    assert command is not None, f"{name}: `batchlens {args[0]}` does not exist"
    try:
        ctx = command.make_context(args[0], args[1:])  # parses and validates every flag, runs nothing
    except click.UsageError as exc:
        pytest.fail(f"{name}: batchlens {' '.join(args)}: {exc}")
    config = ctx.params.get("config_path")
    if config:  # the config the container reads is one of ours, and it loads
        local = ROOT / "provisioning" / "batchlens" / Path(config).name
        assert config.startswith("/etc/batchlens/") and local.exists(), config
        loaded = load_config(str(local), {}, {})
        assert loaded.engines, f"{local.name} names no engine"


def test_compose_and_the_native_demo_send_the_same_load_and_steer_both_knobs(tmp_path) -> None:
    """`docker compose --profile demo up` and `make demo` are the same stack: the load (with its overload phases,
    at speed 1) and the controller's two knobs, as each writes them."""
    from batchlens.demo import Demo
    from batchlens.demo.command import OVERLOAD_EVERY, OVERLOAD_FACTOR, OVERLOAD_SECONDS

    demo = Demo(tmp_path, litellm="off", overload=(OVERLOAD_EVERY, OVERLOAD_SECONDS, OVERLOAD_FACTOR))
    [load] = [s for s in demo.prepare() if s.name == "load"]
    native = load.argv[load.argv.index("load") + 1 :]
    composed = COMPOSE["services"]["batchlens-load"]["command"][1:]

    def shape(argv: list[str]) -> dict[str, str]:  # the flags that shape the load, not where it goes
        flags = ("--rate", "--arrival", "--output-tokens", "--overload-every", "--overload-seconds",
                 "--overload-factor")  # fmt: skip
        return {f: argv[argv.index(f) + 1] for f in flags}

    assert shape(native) == shape(composed) and shape(native)["--overload-every"] == "300"
    native_control = yaml.safe_load((tmp_path / "batchlens.yaml").read_text())["control"]
    composed_control = yaml.safe_load((ROOT / "provisioning" / "batchlens" / "demo.yaml").read_text())["control"]
    assert native_control["admission"] is composed_control["admission"] is True


@pytest.mark.parametrize("stack", ["demo", "gpu"])
def test_each_stack_config_points_at_its_compose_services(stack: str) -> None:
    config = load_config(str(ROOT / "provisioning" / "batchlens" / f"{stack}.yaml"), {}, {})
    engines = {"demo": ["simulate", "simulate-interactive"], "gpu": ["vllm"]}[stack]
    where = {name: f"http://{compose(name)}" if name in SERVICES else f"http://{name}:8000" for name in engines}
    assert [e.url for e in config.engines] == list(where.values())
    for name in engines:
        service = SERVICES[name][0] if name in SERVICES else name
        assert service in COMPOSE["services"] and COMPOSE["services"][service]["profiles"] == [stack]
    # The proxy runs in both stacks, configured from this file, and Prometheus scrapes it without its key.
    assert stack in COMPOSE["services"]["litellm"]["profiles"]
    assert config.routing.proxy_url == f"http://{compose('litellm')}" and not config.routing.metrics_auth
    assert config.routing.exporter_url == f"http://{compose('exporter')}"
    assert config.remediate.alertmanager_url == "http://alertmanager:9093"
    assert config.exporter.listen.endswith(f":{SERVICES['exporter'][1]}")


def test_operators_conventions() -> None:
    for name, service in COMPOSE["services"].items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
        assert service.get("restart") == "unless-stopped", f"{name} does not restart"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        image = service.get("image", "")
        assert ":latest" not in image and (":" in image or "build" in service), f"{name}: unpinned image {image}"
        for dep, cond in service.get("depends_on", {}).items():
            assert cond["condition"] in ("service_healthy", "service_completed_successfully"), (name, dep)
    grafana = COMPOSE["services"]["grafana"]["image"]
    assert tuple(int(x) for x in grafana.split(":")[1].split(".")[:2]) >= (11, 5)
    assert {"prometheus-data", "grafana-data", "remediate-state"} <= set(COMPOSE["volumes"])
    gpu = COMPOSE["services"]["vllm"]
    assert gpu["environment"]["VLLM_PLUGINS"] == "batchlens" and "BATCHLENS_ADMIN_TOKEN" in gpu["environment"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_no_secret_is_committed() -> None:
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert not (ROOT / ".env").exists() or ".env" in subprocess.run(
        ["git", "check-ignore", ".env"], cwd=ROOT, capture_output=True, text=True).stdout  # fmt: skip
    for name, service in COMPOSE["services"].items():
        for key, value in service.get("environment", {}).items():
            if "TOKEN" in key or "PASSWORD" in key or key.endswith("_KEY"):
                assert str(value).startswith("${"), f"{name}: {key} is written in the file, not taken from .env"


#: The secrets each service may hold (issue 30: `env_file: .env` gave Grafana and vLLM every one of them).
SECRETS_OF = {
    "prometheus": set(),
    "alertmanager": set(),
    "batchlens-report": set(),  # the token reaches Alertmanager as a file
    "grafana": {"GF_SECURITY_ADMIN_PASSWORD"},
    "batchlens-remediate": {"BATCHLENS_ADMIN_TOKEN", "BATCHLENS_WEBHOOK_TOKEN"},
    "litellm": {"LITELLM_MASTER_KEY"},
    "batchlens-load": {"LITELLM_MASTER_KEY", "BATCHLENS_ADMIN_TOKEN"},
    "vllm": {"BATCHLENS_ADMIN_TOKEN", "HF_TOKEN"},
}


def test_each_service_gets_only_the_secrets_it_needs() -> None:
    secrets = {k for k in ENV_EXAMPLE if "TOKEN" in k or "PASSWORD" in k or k.endswith("_KEY")}
    for name, service in COMPOSE["services"].items():
        assert "env_file" not in service, f"{name}: env_file hands it every secret in .env"
        held = secrets & set(service.get("environment", {}))
        allowed = SECRETS_OF.get(name, {"BATCHLENS_ADMIN_TOKEN"})  # the exporter and the simulators: engines
        assert held <= allowed, f"{name} holds {sorted(held - allowed)}"


def test_the_image_runs_as_a_user_with_a_healthcheck() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER batchlens$", dockerfile, re.M) and "HEALTHCHECK" in dockerfile
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)


@pytest.mark.parametrize("path", ["Dockerfile", "docker/vllm.Dockerfile", "docker/litellm.Dockerfile"])
def test_each_image_installs_the_wheel_and_only_the_wheel(path: str) -> None:
    """What an image runs is what users install: a wheel built in a first stage from what the sdist needs.
    (tests/test_install.py runs the compose commands from such a wheel.)"""
    first, *_, last = re.split(r"^FROM ", (ROOT / path).read_text(), flags=re.M)[1:]
    assert first.splitlines()[0].endswith(" AS wheel") and "pip wheel --no-cache-dir --no-deps" in first
    copied = {word for line in first.splitlines() if line.startswith("COPY ") for word in line.split()[1:-1]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"pyproject.toml", "src", project["readme"], *project["license-files"]} <= copied, copied
    assert "COPY --from=wheel /dist" in last and re.search(
        r"pip install --no-cache-dir \"?(\$\(echo )?/tmp/dist/batchlens-\*\.whl", last
    )
    assert not re.search(r"^COPY (?!--from)", last, re.M), "the final stage copies the source, not the wheel"


def test_the_stacks_addresses_come_from_one_table() -> None:
    from batchlens.stack import COMPOSE_TOKEN_FILE, alertmanager_config, native

    am = yaml.safe_load((ROOT / "provisioning" / "alertmanager" / "alertmanager.compose.yml").read_text())
    [hook] = next(r for r in am["receivers"] if r["name"] == "remediation")["webhook_configs"]
    assert (
        hook["url"] == f"http://{compose('remediate')}/alertmanager" == "http://batchlens-remediate:9401/alertmanager"
    )
    assert hook["http_config"]["authorization"]["credentials_file"] == COMPOSE_TOKEN_FILE
    assert COMPOSE["services"]["alertmanager"]["secrets"] == [Path(COMPOSE_TOKEN_FILE).name]
    for service in ("exporter", "remediate", "alertmanager", "litellm"):
        compose_target = yaml.safe_load((ROOT / f"provisioning/prometheus/targets-compose/{service}.yml").read_text())
        native_target = yaml.safe_load((ROOT / f"provisioning/prometheus/targets/{service}.yml").read_text())
        name, port = SERVICES[service]
        assert compose_target == [{"targets": [f"{name}:{port}"]}] and name in COMPOSE["services"]
        assert native_target == [{"targets": [f"127.0.0.1:{port}"]}]
    assert native(7)("exporter") == "127.0.0.1:9407"
    with pytest.raises(ValueError, match="no longer holds"):
        alertmanager_config("receivers: []", native(), "/x")


def test_the_litellm_release_is_pinned_in_one_place_and_installed_as_pinned() -> None:
    from batchlens.routing.proxy_config import LITELLM_VERSION, SERVER_ARGS

    script = (ROOT / "scripts" / "litellm-env.sh").read_text()
    dockerfile = (ROOT / "docker" / "litellm.Dockerfile").read_text()
    assert f'LITELLM_VERSION="${{LITELLM_VERSION:-{LITELLM_VERSION}}}"' in script
    assert f"ARG LITELLM_VERSION={LITELLM_VERSION}\n" in dockerfile
    assert f"--port 4000 {' '.join(SERVER_ARGS)} " in dockerfile  # the server settings the demo and tests use
