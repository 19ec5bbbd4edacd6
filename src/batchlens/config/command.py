"""`batchlens config show`: the click wiring. The settings are in this package's __init__."""

from __future__ import annotations

import json

import click
import yaml

from batchlens.clikit import config_option
from batchlens.clikit import load as load_or_fail
from batchlens.config import masked_dump


@click.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@config_option
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True)
def config_show(config_path: str | None, fmt: str) -> None:
    """Print the effective configuration (file + env + defaults), secrets masked.

    Token values never appear: the `secrets` section only says whether each
    token variable is set.

    \b
    Examples:
      batchlens config show --config batchlens.yaml
      BATCHLENS_EXPORTER__INTERVAL_SECONDS=2 batchlens config show --format json
    """
    data = masked_dump(load_or_fail(config_path, {}))
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(yaml.safe_dump(data, sort_keys=False), nl=False)
