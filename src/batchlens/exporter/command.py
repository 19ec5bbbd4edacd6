"""`batchlens exporter`: the click wiring. The work is in server.py and sampler.py."""

from __future__ import annotations

import logging

import click

from batchlens.clikit import config_option, flag_overrides
from batchlens.clikit import load as load_or_fail
from batchlens.config import parse_engine_flag


@click.command()
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

    overrides = flag_overrides("exporter", listen=listen, interval_seconds=interval, timeout_seconds=timeout)
    if engines:
        overrides["engines"] = [parse_engine_flag(e) for e in engines]
    config = load_or_fail(config_path, overrides)
    if not config.engines:
        logging.getLogger("batchlens.exporter").warning(
            "no engines configured: only host and GPU metrics will be exported "
            "(add --engine NAME=URL, or engines: in the config file)"
        )
    try:
        serve(config, access_log=logging.getLogger().isEnabledFor(logging.DEBUG))
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {config.exporter.listen}: {exc.strerror or exc}") from None
    except RuntimeError as exc:  # a setting that needs what is not there (batchlens[kubernetes], an API server)
        raise click.ClickException(str(exc)) from None
