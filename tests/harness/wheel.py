"""batchlens as users get it: the sdist and wheel built from this checkout, the wheel in a clean virtualenv.

The wheel is built the way a release is (``python -m build``: the sdist first, then the
wheel from the unpacked sdist), so a file missing from either shows up here. Nothing
below imports batchlens from the checkout: the installed commands run as subprocesses,
from a folder outside the checkout.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def run(argv: list[str], *, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)


@dataclass(frozen=True)
class Distributions:
    sdist: Path
    wheel: Path

    def wheel_files(self) -> list[str]:
        with zipfile.ZipFile(self.wheel) as archive:
            return archive.namelist()

    @property
    def version(self) -> str:
        return self.wheel.name.split("-")[1]


def build_distributions(out: Path) -> Distributions:
    """``python -m build`` of this checkout into ``out`` (setuptools from the test environment, no download)."""
    done = run([PYTHON, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)], cwd=out.parent)
    if done.returncode != 0:
        pytest.fail(f"python -m build failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    [sdist], [wheel] = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    return Distributions(sdist, wheel)


def install_in_new_venv(wheel: Path, venv: Path) -> Path:
    """A fresh virtualenv with the wheel and its dependencies (from the package index); its bin folder."""
    made = run([PYTHON, "-m", "venv", str(venv)], cwd=venv.parent)
    assert made.returncode == 0, made.stderr
    done = run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", str(wheel)],
               cwd=venv.parent)  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"pip install {wheel.name} into a new virtualenv failed:\n{done.stderr[-3000:]}")
    return venv / "bin"
