"""The harness hands each port out once per run, across xdist's workers (harness.procs.free_ports): a port checked
free is bound seconds later, and CI saw LiteLLM exit on "address already in use" when two workers drew one port."""

from __future__ import annotations

import pytest

from harness import procs


def test_a_port_handed_out_once_is_not_handed_out_again_from_the_same_record(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(procs, "HANDED_OUT", tmp_path / "ports")
    one, other = procs.free_port(), procs.free_port()
    assert one != other and (tmp_path / "ports").read_text().split() == [str(one), str(other)]
    with pytest.raises(RuntimeError, match="no free ports"):
        procs.free_ports(lambda: [one])  # free to bind, but another worker reading this record was given it
