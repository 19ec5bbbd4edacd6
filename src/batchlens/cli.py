"""The ``batchlens`` command line: the group and its commands, assembled.

Each command's click wiring lives in its own package (``<package>/command.py``),
next to the code it drives; what the wirings share is in clikit.py.
"""

from __future__ import annotations

import logging
import sys

import click

from batchlens import __version__
from batchlens.advise.command import advise
from batchlens.artifacts.command import build
from batchlens.config.command import config_group
from batchlens.demo.command import demo
from batchlens.doctor.command import doctor
from batchlens.exporter.command import exporter
from batchlens.lint.command import lint_config
from batchlens.load.command import load
from batchlens.remediation.command import remediate
from batchlens.replay.command import replay
from batchlens.report.command import report
from batchlens.simulator.command import simulate
from batchlens.sweep.command import sweep


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


COMMANDS = (exporter, remediate, simulate, load, build, report, demo, advise, sweep, replay, lint_config, doctor,
            config_group)  # fmt: skip
for command in COMMANDS:
    main.add_command(command)
