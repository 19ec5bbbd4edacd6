"""The one table of vLLM releases (src/batchlens/vllm_releases.py) and everything that must agree with it: the
matrix's captures and rows, the Makefile, the compatibility doc's check and lint-config's argument table."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from batchlens.lint import TABLE
from batchlens.simulator.dialect import dialect
from batchlens.vllm_releases import DEFAULT, RELEASES, matrix

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "releases"


def test_every_release_has_its_matrix_row_and_every_cpu_build_its_captured_metrics() -> None:
    rows = {p.stem for p in DATA.glob("*.json")}
    captures = {re.fullmatch(r"vllm-(.+)-cpu", p.stem).group(1) for p in DATA.glob("vllm-*-cpu.prom")}
    assert rows == {release.version for release in RELEASES}
    assert captures == set(matrix())
    assert DEFAULT in matrix(), "the default release is the real vLLM make test runs: it needs a CPU build"


def test_the_makefile_and_the_scripts_read_the_table_rather_than_name_a_release() -> None:
    for path in ("Makefile", "scripts/vllm-env.sh"):
        assert not re.search(r"\b0\.\d+\.\d+\b", (ROOT / path).read_text()), f"{path} names a release itself"
    printed = subprocess.run(["make", "-s", "-n", "vllm-env"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert f"VLLM_VERSION={DEFAULT} " in printed.stdout, printed.stdout


def test_the_compatibility_check_fails_while_the_rows_and_the_table_disagree(monkeypatch, capsys) -> None:
    spec = importlib.util.spec_from_file_location("compatibility", ROOT / "scripts" / "compatibility.py")
    compatibility = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compatibility)
    assert compatibility.main(["--check"]) == 0
    monkeypatch.setattr(compatibility, "RELEASES", (*RELEASES, replace(RELEASES[-1], version="0.34.0")))
    assert compatibility.main(["--check"]) == 1
    assert "are not the releases" in capsys.readouterr().err


def test_each_release_speaks_its_own_dialect_and_one_between_two_speaks_the_older() -> None:
    for release in RELEASES:
        if release.cpu_build:
            assert dialect(release.version) == release.deprecated, release.version
    assert dialect("0.12.0") == dialect("0.11.2") and dialect("0.33.0") == dialect("0.32.0")
    with pytest.raises(ValueError, match="outside the releases batchlens supports"):
        dialect("0.9.0")


def test_lint_config_reads_the_default_releases_argument_table() -> None:
    major, minor = DEFAULT.split(".")[:2]
    assert TABLE.name == f"vllm_{major}_{minor}_args.json"
    assert TABLE.is_file(), f"no argument table for vLLM {DEFAULT}: make it with scripts/vllm_args.py"
