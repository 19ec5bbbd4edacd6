"""No secret in any output (issue 57, item 5): every URL setting, found from the config's own schema, carries a
password, and nothing batchlens prints, logs or answers shows one.

So a URL setting added later is covered without a test of its own, as long as the schema marks it a URL, and the
first test makes any setting named like a URL be one. Real processes throughout (the CLI, the hook, the exporter,
the report page); their upstreams are ports nobody listens on, so that every URL ends up in an error message.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import yaml

from batchlens.config import Config, load_config, url_settings
from batchlens.masking import MaskingFormatter, mask_urls_in
from harness.exporter import BATCHLENS, ExporterProcess
from harness.procs import Process, free_port, http_get
from harness.remediate import RemediateProcess, alert, notification

pytestmark = pytest.mark.slow
SECRET = "PW-not-to-be-shown"


def schema_urls(schema: dict | None = None, node: dict | None = None, path: str = "") -> dict[str, bool]:
    """Every string setting of the schema whose name says URL, or whose format is one: path -> marked a URL."""
    schema = schema or Config.model_json_schema()
    node = node if node is not None else schema
    if "$ref" in node:
        return schema_urls(schema, schema["$defs"][node["$ref"].rsplit("/", 1)[1]], path)
    found = {}
    for variant in node.get("anyOf", []):
        found |= schema_urls(schema, variant, path)
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        found |= schema_urls(schema, node["items"], path + "[]")
    for name, prop in node.get("properties", {}).items():
        here = f"{path}.{name}" if path else name
        if "url" in name.lower() or prop.get("format") == "uri":
            found[here] = prop.get("format") == "uri"
        found |= schema_urls(schema, prop, here)
    return found


def test_every_setting_named_like_a_url_is_a_url_setting_and_the_masking_knows_each() -> None:
    found = schema_urls()
    assert found and all(found.values()), f"not typed url_setting (config/base.py): {found}"
    assert sorted(found) == sorted(url_settings()), "masked_dump would miss one"


def with_every_url(port: int) -> dict:
    """A config whose every URL setting holds a password, each URL at a port nobody listens on."""
    data: dict = {}
    for path in schema_urls():  # found from the schema itself, not from the code that masks
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part[:-2], [{}])[0] if part.endswith("[]") else node.setdefault(part, {})
        node[leaf] = f"http://user:{SECRET}@127.0.0.1:{port}"
    load_config(None, data, {})  # a valid config: each value is where a user would write it
    return data


def test_no_password_of_any_url_setting_is_shown_by_any_command_or_endpoint(tmp_path) -> None:
    closed = free_port()
    config = with_every_url(closed)
    config["engines"][0]["name"] = "e"
    path = tmp_path / "batchlens.yaml"
    path.write_text(yaml.safe_dump(config))
    shown = subprocess.run([BATCHLENS, "config", "show", "--config", str(path)], capture_output=True, text=True)
    assert shown.returncode == 0 and f"user:***@127.0.0.1:{closed}" in shown.stdout, shown.stderr

    hook = RemediateProcess(tmp_path, {k: v for k, v in config.items() if k != "remediate"} |
                            {"remediate": config["remediate"]}, env={"BATCHLENS_ADMIN_TOKEN": "t"})  # fmt: skip
    exporter = ExporterProcess(tmp_path, [], extra_args=("--config", str(path)))
    report_port = free_port()
    report = Process("report", [BATCHLENS, "report", "--prometheus", f"http://user:{SECRET}@127.0.0.1:{closed}",
                                "--watch", "--every", "1", "--listen", f"127.0.0.1:{report_port}"],
                     tmp_path / "report.log")  # fmt: skip
    try:
        report.wait_http(f"http://127.0.0.1:{report_port}/healthz", 30)
        hook.post(notification(alert("e")))  # asks Prometheus to confirm, fails, pages through Alertmanager, fails
        deadline = time.monotonic() + 20
        while "paging through Alertmanager failed" not in hook.process.log_path.read_text():
            assert time.monotonic() < deadline, hook.process.log_tail()
            time.sleep(0.2)
        answers = [http_get(f"{server}/healthz")[1].decode() for server in
                   (hook.url, exporter.url, f"http://127.0.0.1:{report_port}")]  # fmt: skip
        answers += [http_get(f"http://127.0.0.1:{report_port}/")[1].decode(), json.dumps(hook.health())]
    finally:
        for proc in (hook, exporter, report):
            proc.stop()
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert f"127.0.0.1:{closed}" in logs[hook.process.log_path.name], "no URL was logged: the test shows nothing"
    for where, text in {"config show": shown.stdout + shown.stderr, **logs, **dict(enumerate(answers))}.items():
        assert SECRET not in text, f"{where} shows a password"


def test_the_log_formatter_masks_a_url_whoever_wrote_the_line() -> None:
    """What a library logs (aiohttp's client errors name the URL they called), or an exception's message in a
    traceback: the command line's formatter masks both, behind the masking at each of batchlens' own lines."""
    formatter = MaskingFormatter("%(message)s")
    try:
        raise OSError(f"Cannot connect to host http://am:{SECRET}@[::1]:9093/api/v2/alerts")
    except OSError:
        record = logging.LogRecord("aiohttp.client", logging.ERROR, __file__, 1, "posting to %s failed",
                                   (f"http://am:{SECRET}@127.0.0.1:9093",), sys.exc_info())  # fmt: skip
    line = formatter.format(record)
    assert SECRET not in line and "http://am:***@127.0.0.1:9093 failed" in line and "am:***@[::1]:9093" in line
    assert mask_urls_in("no URL here, nor user@host") == "no URL here, nor user@host"
