"""`batchlens replay`: the click wiring. The work is in traces.py, simulated.py and output.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from batchlens.clikit import config_option, load, writable_folder
from batchlens.replay.traces import FORMATS
from batchlens.simulator.profiles import DEFAULT_GPU, DEFAULT_MODEL, GPUS, MODELS


@click.command()
@click.argument("trace", type=click.Path(dir_okay=False, exists=True))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="jsonl", show_default=True,
              help="azure: TIMESTAMP,ContextTokens,GeneratedTokens; burstgpt: its CSV; jsonl: one "
              '{"t": s, "prompt_tokens": N, "output_tokens": N} per line.')  # fmt: skip
@click.option("--start", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="SECONDS",
              help="Skip this much of the trace.")  # fmt: skip
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
              help="Replay this much of the trace [default: all of it].")  # fmt: skip
@click.option("--rate-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="X times the request rate, same shape: the gaps between arrivals divided by X.")  # fmt: skip
@click.option("--simulated", is_flag=True, required=True,
              help="Replay on the simulator's engine model, in simulated time (deterministic, fast).")  # fmt: skip
@click.option("--gpu", "gpu_name", type=click.Choice(sorted(GPUS)), default=DEFAULT_GPU, show_default=True)
@click.option("--model", "model_profile", type=click.Choice(sorted(MODELS)), default=DEFAULT_MODEL, show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(1), default=256, show_default=True,
              help="The engine's capacity, and the limit of the default policy.")  # fmt: skip
@click.option("--max-model-len", type=click.IntRange(2), default=8192, show_default=True,
              help="Longer requests are refused at arrival, as vLLM does (not good).")  # fmt: skip
@click.option("--policy", "policies", multiple=True, default=("default",), show_default=True, metavar="POLICY",
              help="default (the limit is the capacity, vLLM as shipped), static:N, breaker (today's hook, driven "
              "by its alert), adaptive (the controller's law on the engine's own metrics), or pid (the article's "
              "PID, every 30 s, for comparison); repeatable.")  # fmt: skip
@click.option("--oracle", is_flag=True, help="Also sweep static limits and report the best one for this trace.")
@click.option(
    "--slo-ttft", type=float, metavar="SECONDS", help="Good requests' TTFT bound [default: slo.ttft_seconds]."
)
@click.option(
    "--slo-tpot", type=float, metavar="SECONDS", help="Good requests' TPOT bound [default: slo.tpot_seconds]."
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--out", type=click.Path(file_okay=False), metavar="DIR", help="Write replay.csv and replay.png here.")
@config_option
def replay(
    trace: str, fmt: str, start: float, duration: float | None, rate_scale: float, simulated: bool, gpu_name: str,
    model_profile: str, max_num_seqs: int, max_model_len: int, policies: tuple[str, ...], oracle: bool,
    slo_ttft: float | None, slo_tpot: float | None, as_json: bool, out: str | None, config_path: str | None,
) -> None:  # fmt: skip
    """Replay a recorded workload under batch-limit policies, and judge each by goodput.

    A request is good when it completed with TTFT and TPOT within the SLO (the
    config's slo: section, whose TTFT follows thresholds.p99_seconds); goodput
    is good requests per second over the whole run, drain included, as vLLM's
    `bench serve --goodput` counts it. Each policy runs on the same trace and
    the same engine model. --oracle adds the best static limit for this trace:
    the strongest fixed setting, which nobody could pick without seeing the
    whole trace first.

    \b
    Example:
      batchlens replay azure_conv_2023.csv --format azure --duration 600 --simulated \\
          --policy default --policy static:32 --oracle --out replay-out
    """
    from batchlens.goodput import Slo
    from batchlens.replay.output import rows, table, write_csv, write_png
    from batchlens.replay.policies import parse_policy
    from batchlens.replay.simulated import oracle as find_oracle
    from batchlens.replay.simulated import replay as run_replay
    from batchlens.replay.traces import TraceError, read_trace, select
    from batchlens.simulator.engine import Engine

    config = load(config_path, {})
    try:
        slo = Slo(slo_ttft if slo_ttft is not None else config.slo.ttft_seconds,
                  slo_tpot if slo_tpot is not None else config.slo.tpot_seconds)  # fmt: skip
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--slo-ttft/--slo-tpot") from None
    try:
        chosen = [parse_policy(p, slo, config.thresholds) for p in policies]
        for policy in chosen:
            policy.initial(max_num_seqs)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None
    folder = writable_folder(out, "--out") if out else None
    try:
        requests = select(read_trace(Path(trace), fmt), start=start, duration=duration, rate_scale=rate_scale)
    except TraceError as exc:
        raise click.ClickException(str(exc)) from None
    if not requests:
        raise click.ClickException(f"{trace}: no request between {start:g} s and {start + (duration or 0):g} s")

    def engine() -> Engine:
        return Engine(GPUS[gpu_name], MODELS[model_profile], max_num_seqs=max_num_seqs)

    span = requests[-1].t
    runs, best = [], None
    with click.progressbar(length=max(int(span), 1) * len(chosen), label=f"replaying {len(requests)} requests",
                           file=sys.stderr) as bar:  # fmt: skip
        for policy in chosen:
            done = [0]

            def progress(now: float, done=done) -> None:
                step = min(int(now), int(span)) - done[0]
                if step > 0:
                    bar.update(step)
                    done[0] += step

            runs.append(run_replay(requests, engine(), policy, slo, max_model_len=max_model_len, on_progress=progress))
    if oracle:
        with click.progressbar(length=1, label="oracle: sweeping static limits", file=sys.stderr) as bar:
            best, _ = find_oracle(requests, engine, slo, max_model_len=max_model_len)
            bar.update(1)
    if as_json:
        click.echo(json.dumps({"slo": {"ttft_s": slo.ttft_seconds, "tpot_s": slo.tpot_seconds},
                               "requests": len(requests), "policies": rows(runs),
                               **({"oracle": rows([best])[0]} if best else {})}, indent=2))  # fmt: skip
    else:
        click.echo(table(runs, best, slo))
    if folder:
        write_csv(runs, best, folder / "replay.csv")
        write_png(runs, best, requests, folder / "replay.png", title=Path(trace).name)
        click.echo(f"wrote {folder / 'replay.csv'} and {folder / 'replay.png'}", err=as_json)
