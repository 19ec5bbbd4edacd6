"""`batchlens remediate`: the click wiring. The work is in server.py, service.py and the breaker."""

from __future__ import annotations

import os

import click

from batchlens.clikit import config_option, flag_overrides
from batchlens.clikit import load as load_or_fail


@click.command()
@config_option
@click.option("--listen", metavar="HOST:PORT", help="Where to serve the webhook [default: 127.0.0.1:9401].")
@click.option("--alertmanager", "alertmanager_url", metavar="URL", help="Alertmanager to page through (API v2).")
@click.option(
    "--prometheus", "prometheus_url", metavar="URL",
    help="The Prometheus that evaluates the breaker: an alert it does not show firing moves nothing "
    "(remediate.prometheus_url).",
)  # fmt: skip
@click.option("--state", "state_path", metavar="PATH", help="SQLite state file [default: batchlens-state.sqlite].")
@click.option(
    "--dry-run",
    is_flag=True,
    default=None,
    help="Decide and log, but change nothing: no batch limit, no admission cap (breaker.dry_run).",
)
def remediate(
    config_path: str | None, listen: str | None, alertmanager_url: str | None, prometheus_url: str | None,
    state_path: str | None, dry_run: bool | None,
) -> None:  # fmt: skip
    """Run the P99 breaker: Alertmanager webhook in, batch limit changes out.

    When VllmP99LatencyBreaker fires for an engine, the hook halves its batch
    limit through the batchlens admin API; each later notification outside the
    cooldown is another strike, and the last strike sets the cold-start limit
    and pages on-call. When the alert resolves, the limit grows back step by
    step. State survives restarts (SQLite); every action is appended to
    STATE.actions.jsonl. The webhook needs the bearer token from the variable
    remediate.webhook_token_env names (BATCHLENS_WEBHOOK_TOKEN by default).

    With --prometheus (remediate.prometheus_url) it acts only on an alert that
    Prometheus shows firing for the engine, and starts recovery only once it
    shows it resolved: Alertmanager's API takes alerts from anyone, so one
    posted by hand moves nothing, and pages on-call as "unconfirmed".

    With control.enabled it also runs the adaptive controller (docs/control.md):
    every control.interval_seconds it reads each engine's own /metrics and
    steers the limit toward the most good requests per second within the SLO;
    the breaker stays the safety layer around it, and a limit set by hand
    pauses it for that engine (control.manual_hold_seconds).

    \b
    Examples:
      batchlens remediate --config batchlens.yaml --prometheus http://127.0.0.1:9090
      batchlens remediate --config batchlens.yaml --dry-run      # decide and log, change nothing

    \b
    Alertmanager receiver:
      webhook_configs:
        - url: http://127.0.0.1:9401/alertmanager
          http_config: {authorization: {credentials_file: /etc/batchlens/webhook-token}}
    """
    from batchlens.remediation.server import serve
    from batchlens.remediation.store import StoreError

    overrides = flag_overrides("remediate", listen=listen, alertmanager_url=alertmanager_url,
                               prometheus_url=prometheus_url, state_path=state_path)  # fmt: skip
    if dry_run:
        overrides["breaker"] = {"dry_run": True}
    config = load_or_fail(config_path, overrides)
    if not config.engines and not config.kubernetes.discover:
        raise click.ClickException(
            "no engines configured: the hook needs engines: in the config file, or kubernetes.discover"
        )
    try:
        if config.kubernetes.fill_secrets:
            restart_for_filled_tokens(config)
        serve(config)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {config.remediate.listen}: {exc.strerror or exc}") from None
    except RuntimeError as exc:  # a setting that needs what is not there (batchlens[kubernetes], an API server)
        raise click.ClickException(str(exc)) from None


def restart_for_filled_tokens(config) -> None:
    """Fill the Secrets the chart rendered empty; exit if this pod's own tokens were among them.

    Kubernetes resolves a container's secretKeyRef once, when it starts: a token written now reaches this
    pod's environment only when it starts again, so it exits (75, "try again") and is restarted with it.
    """
    import asyncio
    import logging

    from batchlens.discovery.kubernetes import fill_tokens

    written = asyncio.run(fill_tokens(config.kubernetes))
    variables = [config.remediate.webhook_token_env, *(e.admin_token_env for e in config.engines)]
    unset = [name for name in dict.fromkeys(variables) if not os.environ.get(name)]
    if written and unset:
        logging.getLogger("batchlens.remediate").warning(
            "tokens: %s unset in this pod's environment; exiting so that Kubernetes restarts it with the tokens "
            "just written", ", ".join(unset))  # fmt: skip
        raise SystemExit(75)  # not click's Exit: the command maps a RuntimeError, which that is, to 1
