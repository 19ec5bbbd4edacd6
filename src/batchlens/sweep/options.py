"""The knee's command-line option, shared by `batchlens sweep` and `batchlens advise`."""

from __future__ import annotations

import click

from batchlens.sweep.knee import DEFAULT_MIN_GAIN

min_gain_option = click.option(
    "--min-gain", type=click.FloatRange(min=1), default=DEFAULT_MIN_GAIN, show_default=True,
    help="The least throughput gain per doubling of the batch limit that is worth it: the knee is where "
    "a doubling stops paying this much.",
)  # fmt: skip
