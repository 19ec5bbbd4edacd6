"""`batchlens load`: the click wiring. The work is in plan.py and client.py."""

from __future__ import annotations

import json
import sys

import click

from batchlens.clikit import HttpUrl, renamed_option, token_counts
from batchlens.load.options import proxy_options, proxy_via
from batchlens.load.plan import ARRIVALS
from batchlens.masking import mask_url


@click.command()
@click.option(
    "--url",
    required=True,
    type=HttpUrl("http://127.0.0.1:8000", strip=("/v1",)),
    metavar="URL",
    help="Base URL of an OpenAI-compatible server (vLLM, batchlens simulate); a trailing /v1 is fine.",
)
@renamed_option("--served-model-name", "--model", "model", metavar="NAME",
                help="The model name to ask for, as vLLM's --served-model-name [default: the first /v1/models "
                "lists].")  # fmt: skip
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Mean requests per second.")  # fmt: skip
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds during which requests are sent; the run then waits for the last replies.")  # fmt: skip
@click.option("--arrival", type=click.Choice(ARRIVALS), default="poisson", show_default=True,
              help="poisson: random arrivals at a steady mean. bursty: 2 s at 3x the rate, then quiet, same mean. "
              "steady: evenly spaced (a scheduled feed).")  # fmt: skip
@click.option("--prompt-tokens", default="256,512,1024,2048", show_default=True, callback=token_counts,
              help="Prompt lengths to draw from, evenly (the article's buckets by default).")  # fmt: skip
@click.option("--output-tokens", default="128", show_default=True, callback=token_counts,
              help="Output lengths to draw from (ignore_eos).")  # fmt: skip
@click.option("--stream-share", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Share of requests that stream (only those give TTFT and ITL).")  # fmt: skip
@click.option("--interactive-share", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Share of requests sent as the interactive latency class (the header "
              "x-batchlens-latency-class: interactive), for a routing proxy (docs/routing.md).")  # fmt: skip
@click.option("--overload-every", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="S",
              help="Seconds between overload phases, each at the end of its period (0: none): the load runs calm, "
              "then past capacity, again and again.")  # fmt: skip
@click.option("--overload-seconds", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              metavar="S", help="How long each overload phase lasts.")  # fmt: skip
@click.option("--overload-factor", type=click.FloatRange(min=1, min_open=True), default=2.0, show_default=True,
              metavar="X", help="The rate during an overload phase, as a multiple of --rate.")  # fmt: skip
@proxy_options(prefix="For a proxy: ")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True)
@click.option("--max-connections", type=click.IntRange(1), default=512, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True, help="Same seed, same schedule and lengths.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def load(
    url: str,
    model: str | None,
    rate: float,
    duration: float,
    arrival: str,
    prompt_tokens: tuple[int, ...],
    output_tokens: tuple[int, ...],
    stream_share: float,
    interactive_share: float,
    overload_every: float,
    overload_seconds: float,
    overload_factor: float,
    api_key_env: str | None,
    text_prompts: bool,
    timeout: float,
    max_connections: int,
    seed: int,
    as_json: bool,
) -> None:
    """Send an open-loop load and report TTFT, ITL and E2E at P50/P90/P99, and throughput.

    Requests leave on their schedule whether or not the server keeps up, as
    users arrive. Prompts are token-id lists and `ignore_eos` holds outputs to
    their length, so the same run works against vLLM (with or without a
    tokenizer) and against `batchlens simulate`.

    A request turned away at the door (a 503 from admission's cap, a 429
    from a gateway) is counted as refused, apart from the errors: that is
    the server working as set. The exit code is 1 when a request failed
    (a timeout, a reset, any other status), 0 otherwise.

    \b
    Examples:
      batchlens load --url http://127.0.0.1:8000 --rate 8 --duration 60 --arrival bursty
      batchlens load --url http://127.0.0.1:8000 --rate 2.5 --duration 900 --overload-every 300  # 60 s at 2x
    """
    import asyncio

    from batchlens.load.plan import LoadSpec, format_report, schedule

    spec = LoadSpec(
        rate=rate, duration=duration, arrival=arrival, prompt_tokens=prompt_tokens,
        output_tokens=output_tokens, stream_share=stream_share, interactive_share=interactive_share, seed=seed,
        overload_every=overload_every, overload_seconds=overload_seconds, overload_factor=overload_factor,
    )  # fmt: skip
    if overload_every and overload_seconds > overload_every:
        raise click.BadParameter(f"{overload_seconds:g} s is longer than --overload-every {overload_every:g} s",
                                 param_hint="--overload-seconds")  # fmt: skip
    planned, how = schedule(spec), proxy_via(api_key_env, text_prompts)
    try:
        used, tally, wall, interrupted = asyncio.run(
            until_signalled(url.rstrip("/"), planned, model=model, timeout=timeout, max_connections=max_connections,
                            via=how)
        )  # fmt: skip
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load {mask_url(url)}: {exc}") from None
    rep = {"url": mask_url(url), "model": used, **tally.report(wall)}
    if interrupted:
        rep["interrupted"] = interrupted
    said = f" (stopped by {interrupted}: what finished, before)" if interrupted else ""
    click.echo(json.dumps(rep, indent=2) if as_json else f"{rep['url']} ({used}){said}\n" + format_report(rep))
    if rep["errors"]:
        sys.exit(1)


async def until_signalled(url: str, planned, **options):
    """:func:`run`, ended early by SIGINT or SIGTERM (Ctrl-C, or the demo stopping): the report of what finished
    is still printed. Returns run's three and the signal's name, or "" when the schedule ran out."""
    import asyncio
    import signal

    from batchlens.load.client import run

    stop, said = asyncio.Event(), []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda sig=sig: (said.append(sig.name), stop.set()))
    try:
        used, tally, wall = await run(url, planned, stop=stop, **options)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return used, tally, wall, said[0] if said else ""
