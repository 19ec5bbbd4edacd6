"""``batchlens remediate`` as a real subprocess, and Alertmanager-shaped webhook payloads to send it."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import yaml

from harness.exporter import BATCHLENS, parse_samples
from harness.procs import Process, free_port, http_get

WEBHOOK_TOKEN = "hook-webhook-token"
BREAKER = "VllmP99LatencyBreaker"


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def alert(instance: str, status: str = "firing", starts_at: float = 1_790_000_000.0, name: str = BREAKER) -> dict:
    return {
        "status": status,
        "labels": {"alertname": name, "severity": "critical", "vllm_instance": instance, "engine": "0"},
        "annotations": {"summary": "P99 breach"},
        "startsAt": iso(starts_at),
        "endsAt": iso(starts_at + 3600) if status == "resolved" else "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": f"{abs(hash((instance, name))) % 10**16:016x}",
    }


def notification(*alerts: dict, truncated: int = 0) -> dict:
    """A version-4 webhook body, as Alertmanager 0.25 sends it."""
    return {
        "version": "4",
        "groupKey": '{}:{alertname="VllmP99LatencyBreaker"}',
        "truncatedAlerts": truncated,
        "status": "firing" if any(a["status"] == "firing" for a in alerts) else "resolved",
        "receiver": "remediation",
        "groupLabels": {"alertname": BREAKER},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": list(alerts),
    }


class RemediateProcess:
    def __init__(
        self,
        workdir: Path,
        config: dict,
        *,
        env: dict[str, str] | None = None,
        token: str = WEBHOOK_TOKEN,
        defer: bool = False,
    ):
        """``defer``: reserve the port and write nothing yet; call start() (after editing ``config``)."""
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_path = workdir / "hook-state.sqlite"
        self.config_path = workdir / "hook.yaml"
        remediate = {"listen": f"127.0.0.1:{self.port}", "state_path": str(self.state_path)}
        self.config = {**config, "remediate": {**remediate, **config.get("remediate", {})}}
        self.env = {"BATCHLENS_WEBHOOK_TOKEN": token, **(env or {})}
        if not defer:
            self.start()

    def start(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config))
        argv = [BATCHLENS, "--log-level", "debug", "remediate", "--config", str(self.config_path)]
        log = self.workdir / f"remediate-{self.port}-{time.monotonic_ns()}.log"
        self.process = Process("remediate", argv, log, env=self.env)
        self.process.wait_http(self.url + "/healthz", timeout=30)

    def post(self, body: object, token: str | None = WEBHOOK_TOKEN) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        req = urllib.request.Request(self.url + "/alertmanager", data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                return exc.code, json.loads(raw or b"{}")
            except ValueError:
                return exc.code, {"raw": raw.decode(errors="replace")}

    def health(self) -> dict:
        status, body = http_get(self.url + "/healthz", timeout=10)
        assert status == 200, body
        return json.loads(body)

    def samples(self):
        status, body = http_get(self.url + "/metrics", timeout=10)
        assert status == 200
        return parse_samples(body.decode())

    def actions(self) -> list[dict]:
        path = self.state_path.with_name(self.state_path.name + ".actions.jsonl")
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def kill9(self) -> None:
        self.process.stop(signal.SIGKILL)

    def stop(self) -> int:
        return self.process.stop()
