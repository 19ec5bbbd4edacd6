"""`batchlens demo`: the click wiring. The work is in this package's __init__."""

from __future__ import annotations

import click

from batchlens.clikit import load as load_or_fail
from batchlens.clikit import writable_folder
from batchlens.simulator.dialect import DEFAULT_VLLM_VERSION, dialect

# The default load's overload phase, in simulated seconds: past capacity often enough to be seen in a few minutes.
OVERLOAD_EVERY, OVERLOAD_SECONDS, OVERLOAD_FACTOR = 300.0, 60.0, 2.0


@click.command()
@click.option("--run-dir", type=click.Path(file_okay=False), default=".demo", show_default=True,
              help="Folder for logs, data, tokens and the rendered configs.")  # fmt: skip
@click.option("--port-offset", type=click.IntRange(0, 50000), default=0, show_default=True,
              help="Add this to every port (8000, 8001, 4000, 9090, 9093, 9400, 9401, 9402, 3000) to run beside "
                   "others.")  # fmt: skip
@click.option("--speed", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="The simulator's speed (simulated seconds per second).")  # fmt: skip
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=2.5, show_default=True,
              help="Requests per second of the load generator (bursty arrivals).")  # fmt: skip
@click.option("--max-num-seqs", type=click.IntRange(1), default=64, show_default=True,
              help="The simulated engine's batch capacity.")  # fmt: skip
@click.option("--overload-every", type=click.FloatRange(min=0), default=OVERLOAD_EVERY, show_default=True,
              metavar="S", help=f"Every S simulated seconds the load runs at {OVERLOAD_FACTOR:g}x --rate for its "
              f"last {OVERLOAD_SECONDS:g} s, past the engine's capacity (0: never).")  # fmt: skip
@click.option(
    "--steer/--no-steer",
    default=True,
    show_default=True,
    help="Run the adaptive controller in the hook (the batch limit and the door's queued-token cap); --no-steer "
    "leaves the breaker alone, to compare.",
)
@click.option("--vllm-version", default=DEFAULT_VLLM_VERSION, show_default=True,
              help="The vLLM release whose metric names the simulator speaks (0.10 to 0.33; 0.10 and 0.11 add "
                   "the deprecated ones), to see the stack on an older release's series.")  # fmt: skip
@click.option("--litellm", default="auto", show_default=True, metavar="auto|off|PATH",
              help="Route through a LiteLLM proxy with the batchlens plugin (docs/routing.md): a second simulator "
              "takes the interactive class and the load goes through the proxy. auto: the proxy `make "
              "litellm-env` built, else `litellm` on the PATH, else none; off: none; or the path of a `litellm` "
              "whose environment has batchlens installed.")  # fmt: skip
def demo(
    run_dir: str,
    port_offset: int,
    speed: float,
    rate: float,
    max_num_seqs: int,
    overload_every: float,
    steer: bool,
    vllm_version: str,
    litellm: str,
) -> None:
    """Run the whole stack natively, without Docker, until Ctrl-C.

    The simulator (a vLLM stand-in with a simulated A100) under bursty load with
    periodic overload phases, the
    exporter, the remediation hook, Prometheus with the rules, Alertmanager with
    the routing, and Grafana with the dashboards when grafana-server is
    installed, and the LiteLLM proxy routing in front of the engines when it is
    found (--litellm). Everything lives in --run-dir; the URLs are printed once all is
    up. Prometheus and Alertmanager come from the Debian packages prometheus and
    prometheus-alertmanager; a missing one is reported and the rest starts.
    Without Grafana, the report page (batchlens report --watch) shows the view.

    \b
    Examples:
      batchlens demo                               # what `make demo` runs, after setting the machine up
      batchlens demo --port-offset 100 --no-steer  # beside another stack, the breaker alone
    """
    from pathlib import Path

    from batchlens.demo import Demo, run

    writable_folder(run_dir, "--run-dir")
    try:
        dialect(vllm_version)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--vllm-version") from None
    try:
        run(Demo(Path(run_dir), offset=port_offset, speed=speed, rate=rate, max_num_seqs=max_num_seqs, steer=steer,
                 vllm_version=vllm_version, config=load_or_fail(None, {}), litellm=litellm,
                 overload=(overload_every, OVERLOAD_SECONDS, OVERLOAD_FACTOR) if overload_every else None))  # fmt: skip
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
