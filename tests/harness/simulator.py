"""``batchlens simulate`` as a real subprocess on a free loopback port."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from harness.exporter import BATCHLENS
from harness.procs import Process, free_port

SIM_TOKEN = "sim-admin-token"


class SimulatorProcess:
    def __init__(self, workdir: Path, *, token: str | None = SIM_TOKEN, speed: float = 20, args: Sequence[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        argv = [BATCHLENS, "simulate", "--listen", f"127.0.0.1:{self.port}", "--speed", str(speed), *args]
        env = {"BATCHLENS_ADMIN_TOKEN": token or ""}
        self.process = Process("simulator", argv, workdir / f"simulator-{self.port}.log", env=env)
        self.process.wait_http(self.url + "/health", timeout=30)

    def post(self, path: str, payload: object, timeout: float = 60) -> tuple[int, dict]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def stop(self) -> int:
        return self.process.stop()
