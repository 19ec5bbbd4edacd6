"""Subprocesses that tests start, and ways to wait for them."""

from __future__ import annotations

import fcntl
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

#: This run's record of the ports handed out, one file for all of xdist's workers (tests/conftest.py names it;
#: without it, this process's own). A port checked free is bound by its server seconds later, LiteLLM's only after
#: its startup, so a check alone can hand one port to two workers (seen in CI: LiteLLM exited on "address already
#: in use").
HANDED_OUT: Path | None = None
_HANDED_OUT_HERE: set[int] = set()


def port_range() -> tuple[int, int]:
    """The ports tests draw from: below the kernel's ephemeral range. A port that bind(0) hands out comes from that
    range, where every outgoing connection takes its own port: one could take it before the server binds it (seen:
    a compose service's "address already in use" in a clean clone's suite)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return max(1024, low - 12000), low - 1


def free_port() -> int:
    """A port free to listen on, handed out once in this run."""
    low, high = port_range()
    return free_ports(lambda: [random.randint(low, high)])[0]


def free_ports(draw: Callable[[], list[int]]) -> list[int]:
    """The first of up to 100 ``draw()``s whose ports are all free to bind and not handed out before in this run,
    now recorded as handed out."""
    with _handed_out() as taken:
        for _ in range(100):
            ports = draw()
            if taken.isdisjoint(ports) and all(map(_binds, ports)):
                taken.update(ports)
                return ports
    raise RuntimeError(f"no free ports in 100 draws in {port_range()}")


@contextmanager
def _handed_out() -> Iterator[set[int]]:
    if HANDED_OUT is None:
        yield _HANDED_OUT_HERE
        return
    with open(HANDED_OUT, "a+") as record:
        fcntl.flock(record, fcntl.LOCK_EX)  # one worker draws at a time
        record.seek(0)
        taken = {int(port) for port in record.read().split()}
        before = set(taken)
        yield taken
        record.write("".join(f"{port}\n" for port in sorted(taken - before)))


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Process:
    """A subprocess in its own process group, with its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None, cwd=None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            # Its own process group, to signal the whole tree; not its own session: with
            # the kernel's autogroup scheduling, a new session is a new CPU group, and
            # vLLM's busy-polling processes then starve its worker (a 30x slowdown here).
            process_group=0,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The log's last ``lines``, under its first ERROR line where that came before them: a server that dies
        logs why, then pages of the tasks it cancelled (seen: LiteLLM's bind error above 60 lines of traceback)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        first = next((line for line in text[:-lines] if re.search(r"\bERROR\b", line)), None)
        return "\n".join([first, "[...]", *text[-lines:]] if first else text[-lines:])

    def wait_http(self, url: str, timeout: float, ok=(200,)) -> None:
        """Wait until ``url`` answers one of ``ok``; fail with the log if the process dies or it times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                pytest.fail(f"{self.name} exited with {self.proc.returncode} before {url} answered:\n{self.log_tail()}")
            try:
                if http_get(url, timeout=2)[0] in ok:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        pytest.fail(f"{self.name}: {url} did not answer within {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        """Signal the whole group, wait, escalate to SIGKILL; return the exit code."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode


SERVER_WITH_CHILD = textwrap.dedent(
    """
    import socket, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
    print("listening", flush=True)
    time.sleep(600)
    """
)


def start_server_with_child(workdir: Path, port: int) -> Process:
    """A server listening on ``port`` with one child process, as vLLM's API server has its EngineCore."""
    proc = Process("listener", [sys.executable, "-c", SERVER_WITH_CHILD, str(port)], workdir / f"listener-{port}.log")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if "listening" in proc.log_tail() and len(psutil.Process(proc.pid).children()) == 1:
            return proc
        time.sleep(0.05)
    proc.stop()
    pytest.fail(f"listener on port {port} did not start:\n{proc.log_tail()}")


def wait_until(predicate, timeout: float = 20, what: str = "condition", every: float = 0.2) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout}s")
        time.sleep(every)
