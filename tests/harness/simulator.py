"""``batchlens simulate`` as a real subprocess on a free loopback port."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from harness.exporter import BATCHLENS
from harness.procs import Process, free_port

SIM_TOKEN = "sim-admin-token"


class SimulatorProcess:
    def __init__(
        self,
        workdir: Path,
        *,
        token: str | None = SIM_TOKEN,
        speed: float = 20,
        args: Sequence[str] = (),
        port: int | None = None,
    ):
        self.port = port or free_port()
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

    @contextmanager
    def clients(self, count: int, payload: Callable[[int], dict | None]) -> Iterator[None]:
        """``count`` closed-loop clients posting completions while the block runs.

        Client ``i`` posts ``payload(i)`` again as soon as its reply comes, or idles while that is None. Refused
        (a door's 503), it waits a moment first, as a client told to retry after a while does.
        """
        stop = threading.Event()

        def client(i: int) -> None:
            while not stop.is_set():
                body = payload(i)
                if body is None or self.post("/v1/completions", body)[0] != 200:
                    time.sleep(0.2)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        try:
            yield
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)

    def stop(self) -> int:
        return self.process.stop()
