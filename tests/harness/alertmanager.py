"""A real Alertmanager (Debian package prometheus-alertmanager) on a free loopback port."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from batchlens.stack import alertmanager_config, template
from harness.procs import Process, free_port, http_get
from harness.prometheus import require_binary


def local_config(out: Path, hook_url: str, token: str, breaker_timing: dict[str, str] | None = None) -> Path:
    """The provisioned routing, rendered as the demo renders it for this hook, with faster breaker timing."""
    token_file = out.with_suffix(".token")
    token_file.write_text(token)
    hook = urlsplit(hook_url).netloc
    rendered = alertmanager_config(template("alertmanager/alertmanager.yml"), lambda service: hook, str(token_file))
    config = yaml.safe_load(rendered)
    next(r for r in config["route"]["routes"] if r["receiver"] == "remediation").update(breaker_timing or {})
    out.write_text(yaml.safe_dump(config))
    return out


class AlertmanagerServer:
    """One Alertmanager; with ``cluster`` (its own gossip port, then its peers'), a replica of an HA cluster, as
    kube-prometheus-stack runs them: each replica delivers, and they gossip who sent what."""

    def __init__(self, workdir: Path, config: Path, *, cluster: tuple[int, list[int]] | None = None,
                 peer_timeout: str = "15s"):  # fmt: skip
        binary = require_binary("prometheus-alertmanager", "prometheus-alertmanager")
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        if cluster is None:
            argv.append("--cluster.listen-address=")  # no gossip: a single test instance
        else:
            gossip, peers = cluster
            argv += [f"--cluster.listen-address=127.0.0.1:{gossip}", f"--cluster.peer-timeout={peer_timeout}",
                     "--cluster.gossip-interval=100ms", "--cluster.pushpull-interval=1s",
                     *(f"--cluster.peer=127.0.0.1:{p}" for p in peers)]  # fmt: skip
        self.process = Process("alertmanager", argv, workdir / "alertmanager.log")
        self.process.wait_http(self.url + "/-/ready", timeout=30)

    def post_alerts(self, alerts: list[dict]) -> None:
        req = urllib.request.Request(
            self.url + "/api/v2/alerts", data=json.dumps(alerts).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200

    def alerts(self) -> list[dict]:
        status, body = http_get(self.url + "/api/v2/alerts", timeout=10)
        assert status == 200, body
        return json.loads(body)

    def status(self) -> dict:
        status, body = http_get(self.url + "/api/v2/status", timeout=10)
        assert status == 200, body
        return json.loads(body)

    def stop(self) -> int:
        return self.process.stop()
