"""What every command's click wiring shares: the config option and loader, URL and list types, output checks.

Command packages (replay/command.py, ...) import these, so that cli.py only assembles the commands.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from batchlens.config import Config, ConfigError, duration_seconds, http_url, load_config


def renamed_option(new: str, old: str, dest: str, **settings: Any) -> Callable[[Callable], Callable]:
    """The option ``new`` (click's ``settings``), with its ``old`` name kept beside it, hidden, for one release: the
    old name still sets it, and says on stderr that it is renamed. The new name wins where both are given."""
    key = f"batchlens.renamed.{dest}"

    def remember(ctx: click.Context, _param: click.Parameter, value: Any) -> None:
        if value is not None:
            click.echo(f"batchlens: {old} is now {new}; {old} will be removed in the next release", err=True)
            ctx.meta[key] = value

    def pick(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        defaulted = ctx.get_parameter_source(dest) in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)
        return ctx.meta[key] if defaulted and key in ctx.meta else value

    hidden = click.option(old, expose_value=False, hidden=True, is_eager=True, callback=remember,
                          type=settings.get("type"))  # fmt: skip
    shown = click.option(new, dest, callback=pick, **settings)
    return lambda command: shown(hidden(command))


def flag_overrides(section: str, **values: Any) -> dict[str, Any]:
    """Config overrides from a command's flags: the ones given, under their config section."""
    given = {key: value for key, value in values.items() if value is not None}
    return {section: given} if given else {}


class HttpUrl(click.ParamType):
    """An http(s) base URL, checked before any work starts; ``strip`` drops a suffix users often paste (/v1)."""

    name = "url"

    def __init__(self, example: str, strip: tuple[str, ...] = ()):
        self.example, self.strip = example, strip

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            url = http_url(str(value), self.example)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        for suffix in self.strip:
            url = url.removesuffix(suffix)
        return url


config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="BATCHLENS_CONFIG",
    help="YAML config file (env BATCHLENS_CONFIG). Env BATCHLENS_<SECTION>__<KEY> and flags override it.",
)

prometheus_option = click.option(
    "--prometheus",
    "prometheus_url",
    required=True,
    type=HttpUrl("http://127.0.0.1:9090"),
    metavar="URL",
    help="Base URL of the Prometheus that scrapes the exporter and runs batchlens' recording rules.",
)
range_option = click.option(
    "--range", "range_", default="24h", show_default=True, metavar="DURATION",
    help="How far back to look, as a Prometheus duration (30m, 6h, 7d).",
)  # fmt: skip

prometheus_timeout_option = click.option(
    "--timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True, metavar="SECONDS",
    help="How long one Prometheus query may take.",
)  # fmt: skip

slo_option = click.option(
    "--slo", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
    help="Your P99 latency requirement; the batch limit must keep P99 within it [default: thresholds.p99_seconds].",
)  # fmt: skip


def load(config_path: str | None, overrides: dict[str, Any]) -> Config:
    try:
        return load_config(config_path, overrides)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def token_counts(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[int, ...]:
    """A list such as 256,512 (token counts, batch limits): positive integers. A click callback."""
    try:
        counts = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated positive integers such as 256,512, got {value!r}") from None
    if not counts or min(counts) < 1:
        raise click.BadParameter("expected positive integers")
    return counts


def duration(value: str, flag: str) -> float:
    try:
        return duration_seconds(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from None


def writable_folder(path: str, flag: str) -> Path:
    """The folder an output goes to, made if missing and proven writable now, before any long work."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot write to {path}: {exc.strerror or exc}", param_hint=flag) from None
    return folder
