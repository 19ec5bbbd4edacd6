"""Loading: defaults, the YAML file, `BATCHLENS_*` variables and flags, merged in that order; errors that say
where."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from batchlens.config.base import ENV_PREFIX, ConfigError, yaml_problem
from batchlens.config.model import Config


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config overrides from ``BATCHLENS_<SECTION>__<KEY>`` and ``BATCHLENS_ENGINES``.

    Other ``BATCHLENS_*`` variables (tokens, ``BATCHLENS_CONFIG``) are not config keys
    and are left alone. Values are read as YAML scalars, so ``2`` is a number and
    ``true`` a boolean.
    """
    out: dict[str, Any] = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key != "engines" and "__" not in key:
            if (meant := _one_underscore(key)) is not None:  # ignored in silence, it would look applied
                raise ConfigError(f"{var}: not a config key; {ENV_PREFIX}{meant.upper()} (two underscores after "
                                  "the section) sets one")  # fmt: skip
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError as exc:
            raise ConfigError(f"{var}: not a valid YAML value: {yaml_problem(exc)}") from None
        path = key.split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _one_underscore(key: str) -> str | None:
    """``section__key`` where ``key`` (lowercased, after the prefix) is a section's key joined by one underscore."""
    for section, field in Config.model_fields.items():
        model = field.annotation
        rest = key.removeprefix(f"{section}_")
        if rest != key and isinstance(model, type) and issubclass(model, BaseModel) and rest in model.model_fields:
            return f"{section}__{rest}"
    return None


def _format_errors(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see `batchlens config show` for every key)"
        elif (
            "input" in err
            and err["type"] != "missing"
            and not isinstance(err["input"], dict)
            and (repr(err["input"]) not in msg)
        ):  # a whole section's dict says nothing the message does not (a check across its keys)
            msg += f" (got {err['input']!r})"
        lines.append(f"  {key}: {msg}")
    if len(lines) == 2:  # one error: one line
        return f"{lines[0][:-1]}: {lines[1].strip()}"
    return "\n".join(lines)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the effective config from file, environment and flag overrides."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    origin = "defaults"
    if path:
        file = Path(path)
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {file} is not valid YAML: {yaml_problem(exc)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file}: expected a mapping at the top level, got {type(loaded).__name__}")
        data, origin = loaded, f"file {file}"
    env = env_overrides(environ)
    if env:
        data = _deep_merge(data, env)
        origin += " + BATCHLENS_* environment"
    if overrides:
        data = _deep_merge(data, overrides)
        origin += " + command-line flags"
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origin)) from None
