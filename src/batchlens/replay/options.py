"""The command-line options for reading a trace and its SLO, shared by `batchlens replay` and `batchlens plan`."""

from __future__ import annotations

from pathlib import Path

import click

from batchlens.config import Config
from batchlens.goodput import Slo
from batchlens.replay.traces import (
    FORMATS,
    MAX_RATE_SCALE,
    MIN_RATE_SCALE,
    TraceError,
    TraceRequest,
    read_trace,
    select,
)


def trace_options(verb: str):
    """TRACE, --format, --start, --duration and --rate-scale; ``verb`` says what --duration's span is for."""

    def decorate(command):
        for option in reversed((
            click.argument("trace", type=click.Path(dir_okay=False, exists=True)),
            click.option("--format", "fmt", type=click.Choice(FORMATS), default="jsonl", show_default=True,
                         help="azure: TIMESTAMP,ContextTokens,GeneratedTokens; burstgpt: its CSV; jsonl: one "
                         '{"t": s, "prompt_tokens": N, "output_tokens": N} per line.'),
            click.option("--start", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="SECONDS",
                         help="Skip this much of the trace."),
            click.option("--duration", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
                         help=f"{verb} this much of the trace [default: all of it]."),
            click.option("--rate-scale", type=click.FloatRange(MIN_RATE_SCALE, MAX_RATE_SCALE), default=1.0,
                         show_default=True,
                         help="X times the request rate, same shape: the gaps between arrivals divided by X."),
        )):  # fmt: skip
            command = option(command)
        return command

    return decorate


def slo_options(command):
    """--slo-ttft and --slo-tpot, each defaulting to the config's slo: section (:func:`slo_of`)."""
    command = click.option("--slo-tpot", type=float, metavar="SECONDS",
                           help="Good requests' TPOT bound [default: slo.tpot_seconds].")(command)  # fmt: skip
    return click.option("--slo-ttft", type=float, metavar="SECONDS",
                        help="Good requests' TTFT bound [default: slo.ttft_seconds].")(command)  # fmt: skip


def slo_of(config: Config, ttft: float | None, tpot: float | None) -> Slo:
    """The SLO of --slo-ttft and --slo-tpot over the config's; a usage error naming them where it is not one."""
    try:
        return Slo(ttft if ttft is not None else config.slo.ttft_seconds,
                   tpot if tpot is not None else config.slo.tpot_seconds)  # fmt: skip
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--slo-ttft/--slo-tpot") from None


def read_requests(trace: str, fmt: str, start: float, duration: float | None, rate_scale: float) -> list[TraceRequest]:
    """The trace's requests in the slice the options chose; an error that says why where there are none."""
    try:
        whole = read_trace(Path(trace), fmt)
        requests = select(whole, start=start, duration=duration, rate_scale=rate_scale)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    if requests:
        return requests
    last = whole[-1].t
    if start > last:
        raise click.ClickException(f"{trace}: --start {start:g} is past the trace's end: its last request is at "
                                   f"{last:g} s")  # fmt: skip
    raise click.ClickException(f"{trace}: no request between {start:g} s and {start + (duration or 0):g} s (the "
                               f"trace spans 0..{last:g} s)")  # fmt: skip
