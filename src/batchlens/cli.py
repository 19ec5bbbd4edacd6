"""The ``batchlens`` command line."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click
import yaml

from batchlens import __version__
from batchlens.config import Config, ConfigError, load_config, masked_dump, parse_engine_flag

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="BATCHLENS_CONFIG",
    help="YAML config file (env BATCHLENS_CONFIG). Env BATCHLENS_<SECTION>__<KEY> and flags override it.",
)


def _load(config_path: str | None, overrides: dict[str, Any]) -> Config:
    try:
        return load_config(config_path, overrides)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="batchlens")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
    envvar="BATCHLENS_LOG_LEVEL",
    help="How much to log (env BATCHLENS_LOG_LEVEL). Logs go to stderr.",
)
def main(log_level: str) -> None:
    """batchlens: see and tame vLLM's batch-size trade-off.

    Throughput, P99 latency and GPU utilization, from one exporter, with the
    alerts and the remediation hook built on it. Every command reads the same
    config file; `batchlens config show` prints the effective settings.
    """
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        stream=sys.stderr,
    )


@main.command()
@config_option
@click.option(
    "--engine",
    "engines",
    multiple=True,
    metavar="NAME=URL",
    help="A vLLM server to scrape, e.g. deepseek-a=http://127.0.0.1:8000 (repeatable; replaces the "
    "config's engines). A bare URL is named host:port.",
)
@click.option("--listen", metavar="HOST:PORT", help="Where to serve /metrics [default: 127.0.0.1:9400].")
@click.option("--interval", type=float, metavar="SECONDS", help="Sample every SECONDS [default: 5].")
@click.option("--timeout", type=float, metavar="SECONDS", help="Per-engine request timeout [default: 3].")
def exporter(
    config_path: str | None, engines: tuple[str, ...], listen: str | None, interval: float | None, timeout: float | None
) -> None:
    """Serve vLLM and host metrics on one Prometheus target.

    Every vLLM sample is passed through unchanged with the label vllm_instance
    added, beside batchlens' derived KV-block and batch-limit view and
    batchlens_source_up for each source. Sources are sampled in the background;
    a scrape never waits on a slow or dead engine.

    \b
    Example:
      batchlens exporter --engine deepseek-a=http://127.0.0.1:8000
      curl -s http://127.0.0.1:9400/metrics | grep batchlens_source_up
    """
    from batchlens.exporter.server import serve

    section = {
        k: v
        for k, v in {"listen": listen, "interval_seconds": interval, "timeout_seconds": timeout}.items()
        if v is not None
    }
    overrides: dict[str, Any] = {"exporter": section} if section else {}
    if engines:
        overrides["engines"] = [parse_engine_flag(e) for e in engines]
    config = _load(config_path, overrides)
    if not config.engines:
        logging.getLogger("batchlens.exporter").warning(
            "no engines configured: only host and GPU metrics will be exported "
            "(add --engine NAME=URL, or engines: in the config file)"
        )
    try:
        serve(config, access_log=logging.getLogger().isEnabledFor(logging.DEBUG))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {config.exporter.listen}: {exc.strerror or exc}") from None


@main.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@config_option
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True)
def config_show(config_path: str | None, fmt: str) -> None:
    """Print the effective configuration (file + env + defaults), secrets masked.

    Token values never appear: the `secrets` section only says whether each
    token variable is set.
    """
    data = masked_dump(_load(config_path, {}))
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(yaml.safe_dump(data, sort_keys=False), nl=False)
