"""The configuration as `batchlens config show` prints it: every secret and URL credential masked."""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from batchlens.config.base import URL_FORMAT
from batchlens.config.model import Config
from batchlens.masking import mask_url


def url_settings(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """The dotted paths of the URL settings (``format: uri`` in the schema), ``name[]`` standing for a list's items."""
    paths = []
    for name, field in (model or Config).model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get("format") == URL_FORMAT:
            paths.append(prefix + name)
        listed = typing.get_origin(field.annotation) is list
        for sub in typing.get_args(field.annotation) if listed else (field.annotation,):
            if isinstance(sub, type) and typing.get_origin(sub) is None and issubclass(sub, BaseModel):
                paths += url_settings(sub, f"{prefix}{name}{'[]' if listed else ''}.")
    return paths


def _mask_at(data: Any, path: list[str]) -> None:
    head, *rest = path
    if head.endswith("[]"):
        for item in data.get(head[:-2]) or []:
            _mask_at(item, rest)
    elif rest:
        _mask_at(data.get(head) or {}, rest)
    elif isinstance(data.get(head), str):
        data[head] = mask_url(data[head])


def masked_dump(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The effective config as plain data, safe to print: no secret leaves it.

    Every URL setting's password is masked, and a ``secrets`` section says whether each token variable is set,
    never what it holds.
    """
    environ = os.environ if environ is None else environ
    data = config.model_dump(mode="json")
    for path in url_settings():
        _mask_at(data, path.split("."))
    data["secrets"] = {name: ("set (****)" if environ.get(name) else "NOT SET") for name in config.token_envs()}
    return data
