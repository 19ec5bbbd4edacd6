"""A body that cannot be decoded is refused in one line, never with a traceback, by every server batchlens runs
(issue 57, item 6): the hook's webhook, the simulator's OpenAI API and admin API (on its own port too), the
exporter and the report page, each a real process.

A body sent with a Content-Encoding (gzip that is not gzip, or a coding nobody knows) is what aiohttp's parser
used to decode on the way in and raise from, logging a traceback even after the hook had answered 401. The
vLLM plugin's own admin API refuses it the same way: tests/harness/admin.py::check_signatures, on a real vLLM.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from batchlens.admin_api import BATCH_PATH
from harness.exporter import BATCHLENS, ExporterProcess
from harness.procs import Process, free_port
from harness.remediate import WEBHOOK_TOKEN, RemediateProcess
from harness.simulator import SimulatorProcess

pytestmark = pytest.mark.slow
BODIES = {"gzip": b"notgzip", "deflate": b"\x00\xff not deflate", "br": b"junk", "x-unknown": b"{}"}


def post(url: str, encoding: str, body: bytes, token: str | None = None) -> int:
    headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_body_that_cannot_be_decoded_is_a_415_and_one_line_on_every_server(tmp_path) -> None:
    admin_port, report_port = free_port(), free_port()
    sim = SimulatorProcess(tmp_path, args=("--admin-port", str(admin_port)))
    hook = RemediateProcess(tmp_path, {"engines": [{"name": "sim", "url": sim.url, "admin_port": admin_port}]},
                            env={"BATCHLENS_ADMIN_TOKEN": sim.token})  # fmt: skip
    exporter = ExporterProcess(tmp_path, [f"sim={sim.url}"])
    report = Process("report", [BATCHLENS, "report", "--prometheus", f"http://127.0.0.1:{free_port()}", "--watch",
                                "--listen", f"127.0.0.1:{report_port}"], tmp_path / "report.log")  # fmt: skip
    servers = [sim.process, hook.process, exporter.process, report]
    try:
        report.wait_http(f"http://127.0.0.1:{report_port}/healthz", 30)
        targets = {
            "webhook, no token": (hook.url + "/alertmanager", None),
            "webhook": (hook.url + "/alertmanager", WEBHOOK_TOKEN),
            "simulator": (sim.url + "/v1/completions", None),
            "admin API": (f"http://127.0.0.1:{admin_port}{BATCH_PATH}", sim.token),
            "report page": (f"http://127.0.0.1:{report_port}/", None),  # no POST route: refused before that
        }
        for what, (url, token) in targets.items():
            for encoding, body in BODIES.items():
                assert post(url, encoding, body, token) == 415, (what, encoding)
        # the exporter's own server (h11) decodes nothing, and has no POST route
        assert post(exporter.url + "/metrics", "gzip", b"notgzip") == 405
        assert sim.post("/v1/completions", {"model": "deepseek-sim", "prompt": [1], "max_tokens": 1})[0] == 200
    finally:
        for server in servers:
            server.stop()
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    for name, text in logs.items():
        assert "Traceback" not in text and "Unhandled exception" not in text, (name, text[-3000:])
    refused = [line for text in logs.values() for line in text.splitlines() if "Content-Encoding" in line]
    assert len(refused) == len(targets) * len(BODIES), refused  # one line each, saying what was refused
