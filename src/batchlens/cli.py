"""The ``batchlens`` command line: the group and its commands, assembled.

Each command's click wiring lives in its own package (``<package>/command.py``),
next to the code it drives; what the wirings share is in clikit.py. A command is
imported only when it runs (or when help lists it): `batchlens exporter` loads
neither the Grafana SDK nor matplotlib nor the other commands' code, and a long-running
exporter holds only the memory it uses (benchmarks/memory.py).
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from batchlens import __version__
from batchlens.masking import MaskingFormatter

#: name -> "module:attribute" of its click command, in the order help lists them.
COMMANDS = {
    "exporter": "batchlens.exporter.command:exporter",
    "remediate": "batchlens.remediation.command:remediate",
    "simulate": "batchlens.simulator.command:simulate",
    "load": "batchlens.load.command:load",
    "build": "batchlens.artifacts.command:build",
    "report": "batchlens.report.command:report",
    "demo": "batchlens.demo.command:demo",
    "advise": "batchlens.advise.command:advise",
    "sweep": "batchlens.sweep.command:sweep",
    "replay": "batchlens.replay.command:replay",
    "plan": "batchlens.plan.command:plan",
    "lint-config": "batchlens.lint.command:lint_config",
    "doctor": "batchlens.doctor.command:doctor",
    "config": "batchlens.config.command:config_group",
}


class LazyGroup(click.Group):
    """A group whose commands are imported when asked for, as click's docs show ("Lazily Loading Subcommands")."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, _, attribute = COMMANDS[cmd_name].partition(":")
        command = getattr(importlib.import_module(module), attribute)
        assert command.name == cmd_name, f"{COMMANDS[cmd_name]} is named {command.name!r}, listed as {cmd_name!r}"
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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

    "The article" in this help is the one batchlens grew from: docs/article.md
    says what it claims, what batchlens takes from it, and where it is wrong.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(MaskingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S"))
    logging.basicConfig(level=log_level.upper(), handlers=[handler])
