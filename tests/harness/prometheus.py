"""A real Prometheus (Debian package ``prometheus``) in a temporary folder."""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

from harness.procs import Process, free_port, http_get


def require_binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed: run `sudo apt-get install -y {package}` (or `make system-deps`)")
    return path


class PrometheusServer:
    def __init__(
        self,
        workdir: Path,
        scrape_configs: list[dict],
        *,
        rule_files: tuple[str, ...] = (),
        interval: str = "1s",
        alertmanager: str | list[str] | None = None,
    ):
        """``alertmanager``: host:port of the Alertmanager alerts go to, or of each replica of a cluster."""
        binary = require_binary("prometheus", "prometheus")
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": list(rule_files),
            "scrape_configs": scrape_configs,
        }
        if alertmanager:
            targets = [alertmanager] if isinstance(alertmanager, str) else alertmanager
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": targets}]}]}
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        self.process = Process("prometheus", argv, workdir / "prometheus.log")
        self.process.wait_http(self.url + "/-/ready", timeout=60)

    def api(self, path: str, **params: str) -> dict:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=10)
        reply = json.loads(body)
        assert status == 200 and reply.get("status") == "success", f"Prometheus {path} {params}: {status} {reply}"
        return reply["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait_for(self, expr: str, timeout: float = 30) -> list[dict]:
        """Wait until ``expr`` returns something; fail naming the expression otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.5)
        pytest.fail(f"Prometheus: {expr!r} returned nothing within {timeout}s\n{self.process.log_tail()}")

    def stop(self) -> int:
        return self.process.stop()
