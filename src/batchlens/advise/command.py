"""`batchlens advise`: the click wiring. The work is in evidence.py, decide.py and text.py."""

from __future__ import annotations

import json

import click

from batchlens.clikit import (
    config_option,
    duration,
    prometheus_option,
    prometheus_timeout_option,
    range_option,
    slo_option,
)
from batchlens.clikit import load as load_or_fail
from batchlens.sweep.options import min_gain_option


@click.command()
@config_option
@prometheus_option
@range_option
@click.option(
    "--resolution",
    metavar="DURATION",
    help="The window of the QPS whose peak and trough are compared [default: the article's 5m, or a tenth of "
    "the data on a young deployment].",
)
@slo_option
@min_gain_option
@prometheus_timeout_option
@click.option("--engine", "engines", multiple=True, metavar="NAME", help="Only this vllm_instance (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON.")
def advise(
    config_path: str | None, prometheus_url: str, range_: str, resolution: str | None, slo: float | None,
    min_gain: float, timeout: float, engines: tuple[str, ...], as_json: bool,
) -> None:  # fmt: skip
    """Decide continuous against static batching from real traffic, and recommend settings.

    The article's decision table, per engine: inter-arrival CV (> 0.7), peak to
    trough QPS (> 5), mean tokens per request (> 2048), streaming share (> 30%)
    and the latency requirement (< 300 ms); any one calls for continuous
    batching. Then: the batch limit (the knee of the operating points seen,
    within the requirement) and max_num_seqs, max_num_batched_tokens, the block
    size, whether long prompts need their own instance, and the cold-path
    threshold (the P90 inter-arrival time), each with its evidence.

    It looks at the data there is: --range is the most it looks back. Every
    batch limit held for a few scrapes is listed with the requests behind its
    P99, and a verdict needs at least 100 requests behind it; with less it says
    so instead of guessing. Inter-arrival times and the streaming share come
    from the batchlens vLLM plugin (VLLM_PLUGINS=batchlens); without it they are
    unknown.

    \b
    Example:
      batchlens advise --prometheus http://127.0.0.1:9090 --range 7d --slo 0.3
    """
    import asyncio
    import time

    import aiohttp

    from batchlens.advise.decide import decide
    from batchlens.advise.evidence import EvidenceError, fetch
    from batchlens.advise.text import format_advice
    from batchlens.prometheus_api import Prometheus, PrometheusError

    config = load_or_fail(config_path, {})
    seconds = duration(range_, "--range")
    step = None if resolution is None else duration(resolution, "--resolution")
    if step is not None and step <= 0:
        raise click.BadParameter("must be longer than 0s", param_hint="--resolution")

    async def gather() -> list:
        async with aiohttp.ClientSession() as session:
            prometheus = Prometheus(session, prometheus_url, timeout)
            return await fetch(prometheus, config.thresholds, seconds=seconds, resolution=step, end=time.time())

    try:
        found = asyncio.run(gather())
    except (PrometheusError, EvidenceError) as exc:
        raise click.ClickException(str(exc)) from None
    found = [e for e in found if not engines or e.vllm_instance in engines]
    if not found:
        raise click.ClickException(
            f"no vLLM traffic in {prometheus_url} over the last {range_}"
            + (f" for {', '.join(engines)}" if engines else "")
            + ": does it scrape the batchlens exporter?"
        )
    requirement = slo or config.thresholds.p99_seconds
    advice = [decide(e, requirement=requirement, latency=config.thresholds.p99_latency, min_gain=min_gain)
              for e in found]  # fmt: skip
    if as_json:
        click.echo(json.dumps([a.to_dict() for a in advice], indent=2))
    else:
        click.echo("\n\n".join(format_advice(a) for a in advice))
