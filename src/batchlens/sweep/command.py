"""`batchlens sweep`: the click wiring. The work is in run.py, knee.py and output.py."""

from __future__ import annotations

import math
import os
import sys

import click

from batchlens.admin_api import TOKEN_ENV
from batchlens.clikit import HttpUrl, config_option, slo_option, token_counts, writable_folder
from batchlens.clikit import load as load_or_fail
from batchlens.sweep.options import min_gain_option


@click.command()
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
@click.option("--admin-port", type=click.IntRange(1, 65535), metavar="PORT",
              help="The admin API's own port on the engine's host (vLLM run with BATCHLENS_ADMIN_PORT).")  # fmt: skip
@click.option(
    "--admin-token-env", default=TOKEN_ENV, show_default=True, help="Env variable holding the engine's admin API token."
)
@click.option("--admin-auth", type=click.Choice(["signed", "bearer"]), default="signed", show_default=True,
              help="Sign each admin call with the token (it never goes on the wire), or send it as a bearer token "
                   "to a plugin from before signed calls.")  # fmt: skip
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="batchlens-sweep",
    show_default=True,
    help="Folder for sweep.csv and sweep.png.",
)
@click.option("--seed", type=int, default=1, show_default=True, help="Same seed, same load at each step.")
def sweep(
    config_path: str | None, engine_url: str, limits: tuple[int, ...], settle: float, measure: float,
    load_factor: float, prompt_tokens: tuple[int, ...], output_tokens: tuple[int, ...], latency: str | None,
    slo: float | None, min_gain: float, exporter_url: str | None, vllm_instance: str | None, admin_port: int | None,
    admin_token_env: str, admin_auth: str, out: str, seed: int,
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

    from batchlens.config import Engine
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
                admin_url=Engine(url=engine_url, admin_port=admin_port).admin_url, signed=admin_auth == "signed",
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
