"""The building blocks every section shares: the strict section model, durations, listeners and URLs."""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

ENV_PREFIX = "BATCHLENS_"
_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(text: str) -> float:
    """A Prometheus duration ("90s", "1h30m", "24h") in seconds; ValueError for anything else."""
    if not _DURATION.match(text):
        raise ValueError(f"expected a Prometheus duration such as 30s, 1m or 1h30m, got {text!r}")
    return sum(int(n) * _UNIT_SECONDS[unit] for n, unit in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", text))


class ConfigError(Exception):
    """The configuration is invalid. The message names each bad key and what it expects."""


class Section(BaseModel):
    # No setting takes infinity or NaN: an infinite TTFT makes an infinite cap (int() overflows each tick), and an
    # infinite stale_seconds a door that never fails open. Strict: a value is taken as the type it is written
    # in (a 1 is no switch, a true no limit of 1), except that a whole number serves where a float is asked.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6) as a (host, port) pair."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {value!r}")
    return host.strip("[]"), int(port)


def _check_listen(value: str) -> str:
    parse_listen(value)
    return value


Listen = Annotated[str, AfterValidator(_check_listen)]


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML parse error in one line: where, and what."""
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return where + " ".join(str(getattr(exc, "problem", None) or exc).split())


def http_url(value: str, example: str = "http://127.0.0.1:8000") -> str:
    """A base URL, checked: http or https, a host, a valid port; returned without a trailing slash."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL such as {example}, got {value!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port in {value!r}: {exc}") from None
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


#: How a URL setting shows in the config's schema: every output masks these (:func:`masked_dump`, :func:`mask_url`).
URL_FORMAT = "uri"


def url_setting(example: str, *, optional: bool = True) -> Any:
    """The type of a URL setting: checked by :func:`http_url`, and marked in the schema (``format: uri``) so that
    every output finds it and masks its password. ``optional``: empty means "none"."""

    def check(value: str) -> str:
        return "" if optional and not value.strip() else http_url(value, example)

    return Annotated[str, AfterValidator(check), Field(json_schema_extra={"format": URL_FORMAT})]


#: The article's stage 2 (docs/routing.md): the bulk of the traffic, latency-sensitive requests, prompts over
#: the long bound, and arrivals after a quiet spell. One engine may serve several roles.
