"""What the harness (tests/harness/procs.py) promises the rest of the suite, where CI has shown the need.

A port is handed out once per run, across xdist's workers: a port checked free is bound seconds later, and CI saw
LiteLLM exit on "address already in use" when two workers drew one. A dead server's log shows why it died, not
only the traceback that followed."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest

from harness import procs


def test_a_port_handed_out_once_is_not_handed_out_again_from_the_same_record(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(procs, "HANDED_OUT", tmp_path / "ports")
    one, other = procs.free_port(), procs.free_port()
    assert one != other and (tmp_path / "ports").read_text().split() == [str(one), str(other)]
    with pytest.raises(RuntimeError, match="no free ports"):
        procs.free_ports(lambda: [one])  # free to bind, but another worker reading this record was given it


def _draw(record: Path) -> list[int]:  # one xdist worker's draws, in a process of its own
    procs.HANDED_OUT = record
    return [procs.free_port() for _ in range(50)]


def test_workers_drawing_at_once_through_one_record_never_share_a_port(tmp_path) -> None:
    with multiprocessing.get_context("fork").Pool(4) as pool:
        drawn = [port for ports in pool.map(_draw, [tmp_path / "ports"] * 4) for port in ports]
    assert len(set(drawn)) == len(drawn) == 200 and len((tmp_path / "ports").read_text().split()) == 200


def test_a_dead_servers_log_tail_keeps_the_reason_it_gave_before_its_traceback(tmp_path) -> None:
    why = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 4000): address already in use"
    script = f"print({why!r}); [print('  File x, line', n) for n in range(100)]"
    server = procs.Process("server", [sys.executable, "-c", script], tmp_path / "server.log")
    server.proc.wait(10)
    server.stop()
    assert server.log_tail().splitlines()[:2] == [why, "[...]"] and server.log_tail().endswith("line 99")
