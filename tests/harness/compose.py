"""docker-compose.yml as compose reads it, without Docker: the services, and ${VAR} filled from .env.example."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
ENV_EXAMPLE = dict(
    line.split("#")[0].strip().split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines()
    if "=" in line.split("#")[0]
)  # fmt: skip


def interpolate(value: str) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}, with the values of .env.example."""

    def sub(match: re.Match) -> str:
        name, op, arg = match.group(1), match.group(2) or "", match.group(3) or ""
        if name in ENV_EXAMPLE and ENV_EXAMPLE[name].strip():
            return ENV_EXAMPLE[name].strip()
        assert op != ":?", f"${{{name}}} is required and .env.example does not set it"
        return arg if op == ":-" else ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", sub, value)


def batchlens_services() -> list[str]:
    """The services that run our image (Dockerfile), in the file's order."""
    return [name for name, s in COMPOSE["services"].items() if s.get("image") == "batchlens:local"]
