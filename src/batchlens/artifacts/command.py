"""`batchlens build`: the click wiring. The work is in this package's __init__."""

from __future__ import annotations

import click

from batchlens.clikit import config_option, writable_folder
from batchlens.clikit import load as load_or_fail


@click.command()
@config_option
@click.option("--root", type=click.Path(file_okay=False),
              help="Folder that receives alerts/, dashboards/, provisioning/ and deploy/helm/batchlens/files/ "
              "[default: the batchlens checkout "
              "around the current folder].")  # fmt: skip
@click.option("--check", is_flag=True, help="Write nothing; fail if a generated file is missing or stale.")
def build(config_path: str | None, root: str | None, check: bool) -> None:
    """Generate the rules (alerts/), the dashboards (dashboards/), the stack's provisioning (provisioning/),
    the Helm chart's PrometheusRule and dashboard payloads (deploy/helm/batchlens/files/) and, when the config
    sets routing.model and lists engines with their roles, the LiteLLM proxy's config and llm-d's endpoint
    picker config (routing/; docs/routing.md).

    Rules and dashboards come from the code and the config's thresholds, so an
    alert and the line on its panel always agree. In a checkout the files are
    committed, so `docker compose up` needs no build step; CI runs `batchlens
    build --check` to catch a file that no longer matches the code. From an
    installed batchlens, `--root DIR` writes the same files anywhere: load them
    into your own Prometheus, Alertmanager and Grafana.

    \b
    Examples:
      batchlens build                                   # in a checkout: rewrite the committed files
      batchlens build --check                           # what CI runs: fail on a stale file
      batchlens build --config my.yaml --root /etc/batchlens-build
    """
    from pathlib import Path

    from batchlens.artifacts import artifacts, find_checkout
    from batchlens.artifacts import build as write

    if root is None:
        checkout = find_checkout(Path.cwd())
        if checkout is None:
            raise click.ClickException(
                f"{Path.cwd()} is not in a batchlens checkout, so there is no repository to build into: "
                "run it in one, or pass --root DIR to write the files there"
            )
        root = str(checkout)
    if not check:
        writable_folder(root, "--root")
    config = load_or_fail(config_path, {})
    for warning in config.routing_warnings():
        click.echo(f"Warning: {warning}", err=True)
    try:
        stale = write(config, Path(root), check=check)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write under {root}: {exc.strerror or exc}") from None
    if stale:
        again = " ".join(["batchlens build", *([f"--config {config_path}"] if config_path else []), "--root", root])
        raise click.ClickException(f"stale generated files (run `{again}`): {', '.join(stale)}")
    click.echo(f"{len(artifacts(config))} files under {root}: {'up to date' if check else 'written'}")
