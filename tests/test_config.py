"""Config: one model, layered file < env < flags, clear errors, masked output. No fakes."""

from __future__ import annotations

import json
import subprocess

import pytest

from batchlens.config import ConfigError, load_config, masked_dump, parse_engine_flag
from batchlens.masking import mask_url
from harness.exporter import BATCHLENS

FILE = """
engines:
  - name: deepseek-a
    url: http://127.0.0.1:8000/
    gpus: [0, 1]
  - url: http://10.0.0.7:8001
exporter:
  interval_seconds: 2
thresholds:
  p99_latency: e2e
"""


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "batchlens.yaml"
    path.write_text(FILE)
    return path


def test_defaults_are_the_articles_thresholds_on_loopback() -> None:
    cfg = load_config(environ={})
    assert (cfg.thresholds.bandwidth_ratio, cfg.thresholds.kv_blocks_ratio) == (0.70, 0.80)
    assert (cfg.thresholds.p99_seconds, cfg.thresholds.p99_window, cfg.thresholds.p99_latency) == (0.5, "1m", "ttft")
    assert (cfg.breaker.strikes, cfg.breaker.cold_start_limit) == (3, 1)
    assert cfg.exporter.listen.startswith("127.0.0.1:") and cfg.remediate.listen.startswith("127.0.0.1:")


def test_file_values_and_engine_defaults(config_file) -> None:
    cfg = load_config(config_file, environ={})
    a, b = cfg.engines
    assert (a.name, a.url, a.gpus) == ("deepseek-a", "http://127.0.0.1:8000", [0, 1])  # trailing slash dropped
    assert (b.name, b.port, b.is_local) == ("10.0.0.7:8001", 8001, False)  # unnamed: host:port
    assert a.is_local
    assert cfg.exporter.interval_seconds == 2 and cfg.thresholds.p99_latency == "e2e"


def test_env_overrides_file_and_flags_override_env(config_file) -> None:
    env = {
        "BATCHLENS_EXPORTER__INTERVAL_SECONDS": "7",
        "BATCHLENS_EXPORTER__LISTEN": "127.0.0.1:9999",
        "BATCHLENS_BREAKER__DRY_RUN": "true",
        "BATCHLENS_ADMIN_TOKEN": "s3cret",  # a token, not a config key: ignored by the loader
    }
    cfg = load_config(config_file, environ=env)
    assert (cfg.exporter.interval_seconds, cfg.exporter.listen, cfg.breaker.dry_run) == (7, "127.0.0.1:9999", True)
    cfg = load_config(config_file, {"exporter": {"interval_seconds": 1}}, environ=env)
    assert (cfg.exporter.interval_seconds, cfg.exporter.listen) == (1, "127.0.0.1:9999")


def test_engines_from_env() -> None:
    cfg = load_config(environ={"BATCHLENS_ENGINES": '[{"name": "x", "url": "http://127.0.0.1:1234"}]'})
    assert [(e.name, e.port) for e in cfg.engines] == [("x", 1234)]


@pytest.mark.parametrize(
    ("data", "key", "expected"),
    [
        ({"exporter": {"interval_seconds": -1}}, "exporter.interval_seconds", "greater than 0"),
        ({"exporter": {"listen": "9400"}}, "exporter.listen", "HOST:PORT"),
        ({"thresholds": {"p99_latency": "p95"}}, "thresholds.p99_latency", "'ttft', 'e2e' or 'itl'"),
        ({"thresholds": {"p99_window": "one minute"}}, "thresholds.p99_window", "Prometheus duration"),
        ({"thresholds": {"kv_blocks_ratio": 80}}, "thresholds.kv_blocks_ratio", "less than or equal to 1"),
        ({"engines": [{"url": "localhost:8000"}]}, "engines.0.url", "http(s) URL"),
        ({"engines": [{"name": "a"}]}, "engines.0.url", "Field required"),
        ({"exporter": {"intervall_seconds": 1}}, "exporter.intervall_seconds", "unknown key"),
        ({"control": {"min_limit": 10, "max_limit": 5}}, "control", "max_limit 5 is below control.min_limit 10"),
        ({"control": {"min_limit": 10, "start_limit": 5}}, "control", "start_limit 5 is outside control.min_limit 10"),
        ({"control": {"max_limit": 8, "start_limit": 16}}, "control", "start_limit 16 is outside"),
        # One window a tick: three cannot fall within a second, and the door would never set a cap.
        ({"control": {"admission": True, "admission_stale_seconds": 1}}, "control", "would never set a cap"),
        # Typed as written: a 1 is no switch, a true no number (pydantic's lax mode took both in silence).
        ({"control": {"enabled": 1}}, "control.enabled", "valid boolean"),
        ({"control": {"min_limit": True}}, "control.min_limit", "valid integer"),
        ({"control": {"max_limit": 64.5}}, "control.max_limit", "valid integer"),
    ],
)
def test_validation_errors_name_the_key_and_the_expected_value(data, key, expected) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=data, environ={})
    message = str(err.value)
    assert f" {key}: " in message and expected in message, message
    assert "(got {" not in message, "a check across a section's keys names them; the whole dict says nothing more"


def test_an_env_override_with_one_underscore_after_its_section_is_refused_not_ignored() -> None:
    """BATCHLENS_CONTROL_ADMISSION=true looks applied and is not: the operator believes the door is on."""
    with pytest.raises(ConfigError, match="CONTROL_ADMISSION: not a config key; BATCHLENS_CONTROL__ADMISSION"):
        load_config(environ={"BATCHLENS_CONTROL_ADMISSION": "true"})
    tokens = {"BATCHLENS_ADMIN_TOKEN": "t", "BATCHLENS_WEBHOOK_TOKEN": "w", "BATCHLENS_ADMIN_PORT": "9"}
    assert load_config(environ=tokens).control.admission is False, "a token's variable is no config key"


def test_duplicate_engine_names_are_refused() -> None:
    engines = [{"name": "a", "url": "http://127.0.0.1:1"}, {"name": "a", "url": "http://127.0.0.1:2"}]
    with pytest.raises(ConfigError, match="used twice"):
        load_config(overrides={"engines": engines}, environ={})


def test_unreadable_and_malformed_files_are_clear_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad, environ={})


def test_engine_flag_forms() -> None:
    assert parse_engine_flag("a=http://h:1") == {"name": "a", "url": "http://h:1"}
    assert parse_engine_flag("http://h:1/x?y=1") == {"url": "http://h:1/x?y=1"}


def test_masked_dump_hides_secrets() -> None:
    cfg = load_config(overrides={"engines": [{"url": "http://bob:hunter2@127.0.0.1:8000"}]}, environ={})
    dumped = json.dumps(masked_dump(cfg, {"BATCHLENS_ADMIN_TOKEN": "tok-123"}))
    assert "hunter2" not in dumped and "tok-123" not in dumped
    assert "bob:***@127.0.0.1:8000" in dumped
    assert '"BATCHLENS_ADMIN_TOKEN": "set (****)"' in dumped and '"BATCHLENS_WEBHOOK_TOKEN": "NOT SET"' in dumped
    assert mask_url("http://bob:hunter2@[::1]:8000/metrics") == "http://bob:***@[::1]:8000/metrics"


def test_config_show_cli_prints_the_effective_config_without_secrets(config_file) -> None:
    env = {"BATCHLENS_ADMIN_TOKEN": "tok-very-secret", "BATCHLENS_EXPORTER__TIMEOUT_SECONDS": "1.5", "PATH": "/usr/bin"}
    out = subprocess.run(
        [BATCHLENS, "config", "show", "--config", str(config_file), "--format", "json"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout  # fmt: skip
    data = json.loads(out)
    assert data["exporter"]["timeout_seconds"] == 1.5 and data["engines"][0]["name"] == "deepseek-a"
    assert "tok-very-secret" not in out


def test_cli_reports_a_bad_config_without_a_traceback(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("exporter:\n  interval_seconds: fast\n")
    run = subprocess.run([BATCHLENS, "config", "show", "--config", str(path)], capture_output=True, text=True)
    assert run.returncode != 0
    assert "exporter.interval_seconds" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("url", "admin_url"),
    [
        ("http://vllm-a:8000", "http://vllm-a:8001"),
        ("http://u:p@[fd00::1]:8000/base", "http://u:p@[fd00::1]:8001/base"),
        ("https://vllm.example.com", "https://vllm.example.com:8001"),
    ],
)
def test_an_admin_port_keeps_the_engines_host_so_the_token_goes_nowhere_else(url, admin_url) -> None:
    engine = load_config(None, {"engines": [{"url": url, "admin_port": 8001}]}).engines[0]
    plain = load_config(None, {"engines": [{"url": url}]}).engines[0]
    assert (engine.admin_url, engine.name, plain.admin_url) == (admin_url, plain.name, url)
