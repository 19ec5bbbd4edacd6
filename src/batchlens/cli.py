"""The ``batchlens`` command line."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any

import click
import yaml

from batchlens import __version__
from batchlens.admin_api import TOKEN_ENV
from batchlens.clikit import (
    HttpUrl,
    config_option,
    duration,
    min_gain_option,
    prometheus_option,
    prometheus_timeout_option,
    range_option,
    slo_option,
    token_counts,
    writable_folder,
)
from batchlens.clikit import load as load_or_fail
from batchlens.config import ConfigError, masked_dump, parse_engine_flag, parse_listen
from batchlens.load.plan import ARRIVALS
from batchlens.simulator.profiles import DEFAULT_GPU, DEFAULT_MODEL, GPUS, MODELS


def _flags(section: str, **values: Any) -> dict[str, Any]:
    """Config overrides from a command's flags: the ones given, under their config section."""
    given = {key: value for key, value in values.items() if value is not None}
    return {section: given} if given else {}


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


@main.command()
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

    overrides = _flags("exporter", listen=listen, interval_seconds=interval, timeout_seconds=timeout)
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


@main.command()
@config_option
@click.option("--listen", metavar="HOST:PORT", help="Where to serve the webhook [default: 127.0.0.1:9401].")
@click.option("--alertmanager", "alertmanager_url", metavar="URL", help="Alertmanager to page through (API v2).")
@click.option("--state", "state_path", metavar="PATH", help="SQLite state file [default: batchlens-state.sqlite].")
@click.option("--dry-run", is_flag=True, default=None, help="Decide and log, but never change a batch limit.")
def remediate(
    config_path: str | None, listen: str | None, alertmanager_url: str | None, state_path: str | None,
    dry_run: bool | None,
) -> None:  # fmt: skip
    """Run the P99 breaker: Alertmanager webhook in, batch limit changes out.

    When VllmP99LatencyBreaker fires for an engine, the hook halves its batch
    limit through the batchlens admin API; each later notification outside the
    cooldown is another strike, and the last strike sets the cold-start limit
    and pages on-call. When the alert resolves, the limit grows back step by
    step. State survives restarts (SQLite); every action is appended to
    STATE.actions.jsonl. The webhook needs the bearer token from the variable
    remediate.webhook_token_env names (BATCHLENS_WEBHOOK_TOKEN by default).

    \b
    Alertmanager receiver:
      webhook_configs:
        - url: http://127.0.0.1:9401/alertmanager
          http_config: {authorization: {credentials_file: /etc/batchlens/webhook-token}}
    """
    from batchlens.remediation.server import serve
    from batchlens.remediation.store import StoreError

    overrides = _flags("remediate", listen=listen, alertmanager_url=alertmanager_url, state_path=state_path)
    if dry_run:
        overrides["breaker"] = {"dry_run": True}
    config = load_or_fail(config_path, overrides)
    if not config.engines:
        raise click.ClickException("no engines configured: the hook needs engines: in the config file")
    try:
        serve(config)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {config.remediate.listen}: {exc.strerror or exc}") from None


@main.command()
@click.option("--listen", default="127.0.0.1:8000", show_default=True, help="HOST:PORT to serve on.")
@click.option("--gpu", "gpu_name", type=click.Choice(sorted(GPUS)), default=DEFAULT_GPU, show_default=True)
@click.option("--model", "model_profile", type=click.Choice(sorted(MODELS)), default=DEFAULT_MODEL, show_default=True)
@click.option("--served-model-name", default="deepseek-sim", show_default=True, help="The model name clients use.")
@click.option("--max-num-seqs", type=click.IntRange(1), default=256, show_default=True, help="Batch capacity.")
@click.option("--max-num-batched-tokens", type=click.IntRange(1), default=8192, show_default=True)
@click.option("--max-model-len", type=click.IntRange(2), default=8192, show_default=True)
@click.option("--block-size", type=click.IntRange(1), default=16, show_default=True)
@click.option(
    "--speed", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
    help="Simulated seconds per wall-clock second: 10 runs ten times faster (for tests and demos).",
)  # fmt: skip
@click.option(
    "--admin-token-env", default=TOKEN_ENV, show_default=True,
    help="Env variable holding the admin API token; without one the admin API answers 503.",
)  # fmt: skip
def simulate(
    listen: str,
    gpu_name: str,
    model_profile: str,
    served_model_name: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    block_size: int,
    speed: float,
    admin_token_env: str,
) -> None:
    """Serve a simulated vLLM: the OpenAI API, vLLM's /metrics and the batchlens admin API.

    The engine is modelled (continuous batching, chunked prefill, paged KV
    cache, bandwidth-bound steps) for a GPU and model profile, so dashboards,
    alerts and remediation can be tried without a GPU. GET /batchlens/v1/sim/gpu
    gives what NVML would say about the simulated GPU.

    \b
    Example:
      BATCHLENS_ADMIN_TOKEN=s3cret batchlens simulate --gpu h100 --max-num-seqs 64 --speed 10
    """
    from batchlens.simulator.engine import Engine
    from batchlens.simulator.server import Simulator, admin_token, serve

    try:
        host, port = parse_listen(listen)
        engine = Engine(
            GPUS[gpu_name], MODELS[model_profile], max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
        )  # fmt: skip
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    simulator = Simulator(
        engine, model_name=served_model_name, max_model_len=max_model_len, speed=speed,
        admin_token=admin_token(os.environ, admin_token_env),
    )  # fmt: skip
    try:
        serve(simulator, host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}: {exc.strerror or exc}") from None


@main.command()
@click.option(
    "--url",
    required=True,
    type=HttpUrl("http://127.0.0.1:8000", strip=("/v1",)),
    metavar="URL",
    help="Base URL of an OpenAI-compatible server (vLLM, batchlens simulate); a trailing /v1 is fine.",
)
@click.option("--model", default=None, help="Model name; default: the first one /v1/models lists.")
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

    \b
    Example:
      batchlens load --url http://127.0.0.1:8000 --rate 8 --duration 60 --arrival bursty
    """
    import asyncio

    from batchlens.load.client import run
    from batchlens.load.plan import LoadSpec, format_report, plan, report

    spec = LoadSpec(
        rate=rate, duration=duration, arrival=arrival, prompt_tokens=prompt_tokens,
        output_tokens=output_tokens, stream_share=stream_share, seed=seed,
    )  # fmt: skip
    planned = plan(spec)
    try:
        used, results, wall = asyncio.run(
            run(url.rstrip("/"), planned, model=model, timeout=timeout, max_connections=max_connections)
        )
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load {url}: {exc}") from None
    rep = {"url": url, "model": used, **report(results, wall)}
    click.echo(json.dumps(rep, indent=2) if as_json else f"{url} ({used})\n" + format_report(rep))
    if rep["succeeded"] < rep["requests"]:
        sys.exit(1)


@main.command()
@config_option
@click.option("--root", type=click.Path(file_okay=False),
              help="Folder that receives alerts/, dashboards/ and provisioning/ [default: the batchlens checkout "
              "around the current folder].")  # fmt: skip
@click.option("--check", is_flag=True, help="Write nothing; fail if a generated file is missing or stale.")
def build(config_path: str | None, root: str | None, check: bool) -> None:
    """Generate the rules (alerts/), the dashboards (dashboards/) and the stack's provisioning (provisioning/).

    Rules and dashboards come from the code and the config's thresholds, so an
    alert and the line on its panel always agree. In a checkout the files are
    committed, so `docker compose up` needs no build step; CI runs `batchlens
    build --check` to catch a file that no longer matches the code. From an
    installed batchlens, `--root DIR` writes the same files anywhere: load them
    into your own Prometheus, Alertmanager and Grafana.
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
    try:
        stale = write(config, Path(root), check=check)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"cannot write under {root}: {exc.strerror or exc}") from None
    if stale:
        raise click.ClickException(f"stale generated files (run `batchlens build`): {', '.join(stale)}")
    click.echo(f"{len(artifacts(config))} files under {root}: {'up to date' if check else 'written'}")


@main.command()
@config_option
@prometheus_option
@range_option
@prometheus_timeout_option
@click.option("--out", type=click.Path(file_okay=False), default="batchlens-report", show_default=True,
              help="Folder for report.png and report.html.")  # fmt: skip
def report(config_path: str | None, prometheus_url: str, range_: str, timeout: float, out: str) -> None:
    """Write the batch efficiency trend report: a PNG and an HTML page.

    It shows what the overview dashboard shows, without Grafana: the operating
    points (throughput against P99, colored by GPU memory busy), the batch
    efficiency decay (tokens/s per running sequence against the batch), KV
    blocks and GPU memory busy over time, and a table of averages per batch
    limit. The thresholds and the P99 latency come from the config.

    --range is how far back it may look: on a young deployment the report
    starts where the data starts, and its step follows the span it covers
    (about 600 points), so a short history is drawn in detail. It needs
    batchlens' recording rules (alerts/batchlens.rules.yml) in Prometheus.
    """
    import asyncio
    import time

    import aiohttp

    from batchlens.prometheus_api import Prometheus, PrometheusError, step_for
    from batchlens.report.data import available, fetch
    from batchlens.report.render import write

    config = load_or_fail(config_path, {})
    seconds = duration(range_, "--range")
    folder = writable_folder(out, "--out")

    async def load():
        async with aiohttp.ClientSession() as session:
            prometheus = Prometheus(session, prometheus_url, timeout)
            start, end = await available(prometheus, config.thresholds, seconds, time.time())
            return await fetch(prometheus, config.thresholds, start, end, step_for(end - start, REPORT_POINTS))

    try:
        data = asyncio.run(load())
    except PrometheusError as exc:
        raise click.ClickException(str(exc)) from None
    png, page = write(data, folder)
    click.echo(f"wrote {png} and {page} ({sum(len(p) for p in data.points.values())} points over "
               f"{data.end - data.start:.0f} s, {len(data.points)} engines)")  # fmt: skip


REPORT_POINTS = 600


@main.command()
@click.option("--run-dir", type=click.Path(file_okay=False), default=".demo", show_default=True,
              help="Folder for logs, data, tokens and the rendered configs.")  # fmt: skip
@click.option("--port-offset", type=click.IntRange(0, 50000), default=0, show_default=True,
              help="Add this to every port (8000, 9090, 9093, 9400, 9401, 3000) to run beside others.")  # fmt: skip
@click.option("--speed", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="The simulator's speed (simulated seconds per second).")  # fmt: skip
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=2.5, show_default=True,
              help="Requests per second of the load generator (bursty arrivals).")  # fmt: skip
@click.option("--max-num-seqs", type=click.IntRange(1), default=64, show_default=True,
              help="The simulated engine's batch capacity.")  # fmt: skip
@click.option(
    "--steer/--no-steer",
    default=True,
    show_default=True,
    help="Run the adaptive controller in the hook; --no-steer leaves the breaker alone, to compare.",
)
def demo(run_dir: str, port_offset: int, speed: float, rate: float, max_num_seqs: int, steer: bool) -> None:
    """Run the whole stack natively, without Docker, until Ctrl-C.

    The simulator (a vLLM stand-in with a simulated A100) under bursty load, the
    exporter, the remediation hook, Prometheus with the rules, Alertmanager with
    the routing, and Grafana with the dashboards when grafana-server is
    installed. Everything lives in --run-dir; the URLs are printed once all is
    up. Prometheus and Alertmanager come from the Debian packages prometheus and
    prometheus-alertmanager; a missing one is reported and the rest starts.
    """
    from pathlib import Path

    from batchlens.demo import Demo, run

    writable_folder(run_dir, "--run-dir")
    try:
        run(Demo(Path(run_dir), offset=port_offset, speed=speed, rate=rate, max_num_seqs=max_num_seqs, steer=steer,
                 config=load_or_fail(None, {})))  # fmt: skip
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
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


@main.command()
@config_option
@click.option(
    "--engine",
    "engine_url",
    required=True,
    type=HttpUrl("http://127.0.0.1:8000"),
    metavar="URL",
    help="Base URL of the vLLM server (or `batchlens simulate`) with the batchlens admin API.",
)
@click.option(
    "--limits",
    default="1,2,4,8,16,32,64",
    show_default=True,
    callback=token_counts,
    help="The batch limits to visit, in order (each at most the engine's max_num_seqs).",
)
@click.option("--settle", type=click.FloatRange(min=0), default=5.0, show_default=True, metavar="SECONDS",
              help="Time at each limit before measuring, for the batch to fill.")  # fmt: skip
@click.option("--measure", type=click.FloatRange(min=1), default=20.0, show_default=True, metavar="SECONDS",
              help="Time measured at each limit.")  # fmt: skip
@click.option("--load-factor", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Closed-loop clients per unit of limit: 1 fills the batch and queues nothing.")  # fmt: skip
@click.option("--prompt-tokens", default="512", show_default=True, callback=token_counts,
              help="Prompt lengths to draw from.")  # fmt: skip
@click.option("--output-tokens", default="128", show_default=True, callback=token_counts,
              help="Output lengths to draw from.")  # fmt: skip
@click.option(
    "--latency",
    type=click.Choice(["ttft", "itl", "e2e"]),
    default=None,
    help="The latency the SLO is about [default: thresholds.p99_latency].",
)
@slo_option
@min_gain_option
@click.option(
    "--exporter",
    "exporter_url",
    type=HttpUrl("http://127.0.0.1:9400"),
    metavar="URL",
    help="The batchlens exporter watching the engine's GPUs, for memory busy and DRAM bandwidth.",
)
@click.option("--vllm-instance", metavar="NAME", help="The engine's vllm_instance label at --exporter.")
@click.option(
    "--admin-token-env", default=TOKEN_ENV, show_default=True, help="Env variable holding the engine's admin API token."
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="batchlens-sweep",
    show_default=True,
    help="Folder for sweep.csv and sweep.png.",
)
@click.option("--seed", type=int, default=1, show_default=True)
def sweep(
    config_path: str | None, engine_url: str, limits: tuple[int, ...], settle: float, measure: float,
    load_factor: float, prompt_tokens: tuple[int, ...], output_tokens: tuple[int, ...], latency: str | None,
    slo: float | None, min_gain: float, exporter_url: str | None, vllm_instance: str | None, admin_token_env: str,
    out: str, seed: int,
) -> None:  # fmt: skip
    """Find the batch-size knee of a running engine: throughput and P99 against the batch limit.

    For each limit, the admin API sets it, a fixed closed-loop load fills the
    batch, and the step records throughput (the engine's own token counter),
    P99 TTFT and E2E (the clients'), KV usage and, with --exporter, GPU memory
    busy and DRAM bandwidth. The knee is the largest limit whose throughput gain
    per doubling stays at or above --min-gain with P99 within the SLO. Prints a
    table and writes sweep.csv and sweep.png. The engine's limit is restored
    afterwards. Do not sweep an engine that serves users.

    \b
    Example:
      BATCHLENS_ADMIN_TOKEN=s3cret batchlens sweep --engine http://127.0.0.1:8000 \\
          --exporter http://127.0.0.1:9400 --vllm-instance deepseek-a
    """

    import aiohttp

    from batchlens.remediation.admin_client import AdminCallError
    from batchlens.stopping import Stopped, run_stoppable
    from batchlens.sweep.knee import Point, find_knee
    from batchlens.sweep.output import table, write_csv, write_png
    from batchlens.sweep.run import Sweep, SweepError, SweepSpec

    config = load_or_fail(config_path, {})
    latency = latency or config.thresholds.p99_latency
    slo = slo or config.thresholds.p99_seconds
    spec = SweepSpec(
        limits=limits, settle_seconds=settle, measure_seconds=measure, load_factor=load_factor,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, seed=seed,
    )  # fmt: skip
    folder = writable_folder(out, "--out")  # before the sweep, not after it
    total = math.ceil(spec.settle_seconds) + math.ceil(spec.measure_seconds)

    async def run(bar) -> list:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await Sweep(
                session, engine_url, os.environ.get(admin_token_env) or None, spec, exporter_url=exporter_url,
                vllm_instance=vllm_instance, on_second=lambda: bar.update(1),
            ).run()  # fmt: skip

    label = f"sweeping {len(spec.limits)} limits"
    try:
        with click.progressbar(length=total * len(spec.limits), label=label, file=sys.stderr) as bar:
            steps = run_stoppable(run(bar))
    except Stopped as exc:
        click.echo(f"\nsweep {exc}: see the log above for the batch limit it put back", err=True)
        sys.exit(exc.exit_code)
    except (SweepError, AdminCallError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    except (OSError, aiohttp.ClientError, TimeoutError) as exc:
        raise click.ClickException(f"cannot sweep {engine_url}: {exc or type(exc).__name__}") from None
    knee = find_knee([Point(s.limit, s.throughput, getattr(s, f"{latency}_p99")) for s in steps], slo=slo,
                     min_gain=min_gain)  # fmt: skip
    write_csv(steps, knee, folder / "sweep.csv")
    write_png(steps, knee, folder / "sweep.png", slo=slo, latency=latency.upper(), title=engine_url)
    click.echo(table(steps, knee))
    click.echo(f"knee judged on P99 {latency.upper()} against {slo:g}s")
    click.echo(f"wrote {folder / 'sweep.csv'} and {folder / 'sweep.png'}")


@main.command("lint-config")
@click.argument("path", type=click.Path(dir_okay=False, exists=True))
@click.option("--max-batch", type=click.IntRange(1), metavar="N",
              help="The largest batch you intend to run: max_num_seqs must be at least twice it.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def lint_config(path: str, max_batch: int | None, as_json: bool) -> None:
    """Check a vLLM engine config: YAML (the article's template, or vLLM's --config file) or a `vllm serve` line.

    Unknown and obsolete keys are errors, with what to use instead (max_paddings,
    speculative_decoding, ...); so are settings vLLM 0.32 refuses to start with.
    Settings that work but waste or limit are warnings. Exit code: 0 clean, 1 any
    error, 3 warnings only. Arguments come from vLLM itself when it imports here,
    else from a table made from vLLM 0.32.

    \b
    Example:
      batchlens lint-config engine.yaml --max-batch 32
      echo "vllm serve m --max-num-seqs 16 --block-size 24" > cmd.txt && batchlens lint-config cmd.txt
    """
    from pathlib import Path

    from batchlens.lint import lint, read, vllm_arguments

    arguments = vllm_arguments()
    try:
        root, settings = read(Path(path), arguments)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    findings = lint(settings, arguments, root=root, max_batch=max_batch)
    if as_json:
        click.echo(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            click.echo(f"{f.level.upper():<8} {f.key}: {f.message}")
        errors = sum(f.level == "error" for f in findings)
        click.echo(f"{path}: {errors} error(s), {len(findings) - errors} warning(s)")
    if any(f.level == "error" for f in findings):
        sys.exit(1)
    if findings:
        sys.exit(3)


@main.command()
@config_option
@click.option("--sample-seconds", type=click.FloatRange(0, 60), default=2.0, show_default=True,
              help="How long to sample each GPU's memory busy ratio.")  # fmt: skip
@click.option("--host-root", type=click.Path(file_okay=False, exists=True), default="/", show_default=True,
              help="Read /proc and /sys under this folder: /host when doctor runs in a container with the "
              "host's root mounted there.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the outcomes as JSON.")
def doctor(config_path: str | None, sample_seconds: float, host_root: str, as_json: bool) -> None:
    """Check this host for vLLM: GPUs, links, kernel settings, CPU affinity.

    \b
    gpu.driver            the driver and the CUDA version it supports
    gpu.topology          NVLink state and GPU pairs across sockets (nvidia-smi topo -m)
    gpu.pcie_link         PCIe generation and width against their maximum
    gpu.memory_bandwidth  a short sample of memory busy (and GPM DRAM bandwidth)
    host.transparent_hugepage, host.numa_balancing, host.zone_reclaim_mode
    host.cpu_affinity     vLLM processes against their GPU's NUMA node

    Each check says PASS, WARN, FAIL or SKIP, what it found, why it matters and
    what to do. Without a GPU the GPU checks SKIP. Exit code: 1 on any FAIL,
    3 on WARNs only, 0 otherwise (SKIPs included), for CI.
    """
    from pathlib import Path

    from batchlens.doctor import checks, probe

    config = load_or_fail(config_path, {})
    nvml = probe.read_nvml(sample_seconds=sample_seconds, root=Path(host_root))
    outcomes = checks.run_all(
        probe.read_host(Path(host_root)),
        nvml,
        probe.vllm_processes(nvml.gpu_pids),
        warn_bandwidth=config.thresholds.bandwidth_ratio,
    )
    if as_json:
        click.echo(json.dumps([o.to_dict() for o in outcomes], indent=2))
    else:
        for o in outcomes:
            click.echo(f"{o.status:<5} {o.check:<26} {o.found}")
            for label, text in (("why", o.why), ("fix", o.fix)):
                if text and o.status in (checks.WARN, checks.FAIL):
                    click.echo(f"{'':32}{label}: {text}")
        counts = {s: sum(o.status == s for o in outcomes) for s in checks.STATUSES}
        click.echo(", ".join(f"{n} {s}" for s, n in counts.items()))
    sys.exit(checks.exit_code(outcomes))


@main.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@config_option
@click.option("--format", "fmt", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True)
def config_show(config_path: str | None, fmt: str) -> None:
    """Print the effective configuration (file + env + defaults), secrets masked.

    Token values never appear: the `secrets` section only says whether each
    token variable is set.
    """
    data = masked_dump(load_or_fail(config_path, {}))
    if fmt == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(yaml.safe_dump(data, sort_keys=False), nl=False)


# Commands whose wiring lives in their own package (clikit holds what they share).
from batchlens.replay.command import replay  # noqa: E402 - assembled after the group exists

main.add_command(replay)
