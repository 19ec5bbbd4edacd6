"""`batchlens replay`: the click wiring. The work is in traces.py, simulated.py, live.py and output.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from batchlens.clikit import HttpUrl, config_option, load, renamed_option, writable_folder
from batchlens.load.options import proxy_options, proxy_via
from batchlens.masking import mask_url
from batchlens.replay.options import read_requests, slo_of, slo_options, trace_options
from batchlens.simulator.profiles import DEFAULT_GPU, DEFAULT_MODEL, GPUS, MODELS


@click.command()
@trace_options("Replay")
@click.option("--simulated", is_flag=True,
              help="Replay on the simulator's engine model, in simulated time (deterministic, fast).")  # fmt: skip
@click.option("--url", type=HttpUrl("http://127.0.0.1:8000", strip=("/v1",)),
              help="Or replay in real time against this server (vLLM, batchlens simulate), streaming every "
              "request; its batch limit is whatever steers it (batchlens remediate with control.enabled).")  # fmt: skip
@renamed_option("--served-model-name", "--served-model", "served_model", metavar="NAME",
                help="With --url: the model name to ask for, as vLLM's --served-model-name [default: the first "
                "listed].")  # fmt: skip
@proxy_options(prefix="With --url: ")
@click.option("--gpu", "gpu_name", type=click.Choice(sorted(GPUS)), default=DEFAULT_GPU, show_default=True,
              help="--simulated: the simulated GPU's profile (docs/simulator.md).")  # fmt: skip
@renamed_option("--model-profile", "--model", "model_profile", type=click.Choice(sorted(MODELS)), default=DEFAULT_MODEL,
                show_default=True, help="--simulated: the simulated model's profile (docs/simulator.md).")  # fmt: skip
@click.option("--max-num-seqs", type=click.IntRange(1), default=256, show_default=True,
              help="The engine's capacity, and the limit of the default policy.")  # fmt: skip
@click.option("--max-model-len", type=click.IntRange(2), default=8192, show_default=True,
              help="Longer requests are refused at arrival, as vLLM does (not good).")  # fmt: skip
@click.option("--policy", "policies", multiple=True, default=("default",), show_default=True, metavar="POLICY",
              help="default (the limit is the capacity, vLLM as shipped), static:N, breaker (today's hook, driven "
              "by its alert), adaptive (the controller's law on the engine's own metrics), pid (the article's "
              "PID, every 30 s, for comparison), admit (the default limit with the controller's queued-token cap "
              "at vLLM's door: sheds count as not good), adaptive+admit (both knobs), predict or adaptive+predict "
              "(the plugin's per-request door in front of the cap); repeatable.")  # fmt: skip
@click.option("--oracle", is_flag=True, help="Also sweep static limits and report the best one for this trace.")
@slo_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--out", type=click.Path(file_okay=False), metavar="DIR", help="Write replay.csv and replay.png here.")
@config_option
def replay(
    trace: str, fmt: str, start: float, duration: float | None, rate_scale: float, simulated: bool,
    url: str | None, served_model: str | None, api_key_env: str | None, text_prompts: bool, gpu_name: str,
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
    --url replays the trace against a running server instead, in real time
    (or faster with --rate-scale), and measures every request at the client.
    An engine that stops answering ends the run: the figures then cover what
    was sent, it says so, and the exit code is 1. A JSONL trace's "class"
    goes out in the routing header (routing.latency_header), and each class
    is judged alone too: replayed through the LiteLLM proxy, that shows what
    routing gives each class (docs/routing.md).

    \b
    Examples:
      batchlens replay azure_conv_2023.csv --format azure --duration 600 --simulated \\
          --policy default --policy static:32 --oracle --out replay-out
      batchlens replay trace.jsonl --url http://127.0.0.1:8000 --duration 300
    """
    from batchlens.replay.output import rows, table, write_csv, write_png
    from batchlens.replay.policy_names import parse_policy
    from batchlens.replay.simulated import oracle as find_oracle
    from batchlens.replay.simulated import replay as run_replay
    from batchlens.simulator.engine import Engine

    if simulated and url is not None:
        raise click.UsageError("give --simulated or --url, not both: the engine model in simulated time, or a server")
    if not simulated and url is None:
        raise click.UsageError("give --simulated (the engine model, simulated time) or --url URL (a server, real time)")
    if simulated and (served_model or api_key_env or text_prompts):
        given = [f for f, v in (("--served-model-name", served_model), ("--api-key-env", api_key_env),
                                ("--text-prompts", text_prompts)) if v]  # fmt: skip
        raise click.UsageError(f"{', '.join(given)} need --url: the engine model of --simulated serves no model names")
    if url is not None and (oracle or set(policies) != {"default"}):
        raise click.UsageError(
            "--url replays against the engine as it runs, steered by whatever steers it (batchlens remediate "
            "with control.enabled, or its own setting): --policy and --oracle need --simulated"
        )
    config = load(config_path, {})
    slo = slo_of(config, slo_ttft, slo_tpot)
    try:
        chosen = [parse_policy(p, slo, config.thresholds, config.control) for p in policies]
        for policy in chosen:
            policy.initial(max_num_seqs)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None
    folder = writable_folder(out, "--out") if out else None
    requests = read_requests(trace, fmt, start, duration, rate_scale)

    if url is not None:
        via = proxy_via(api_key_env, text_prompts, config.routing.latency_header)
        _replay_live(url, served_model, requests, slo, as_json, folder, trace, via)
        return

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


def _replay_live(url, served_model, requests, slo, as_json: bool, folder: Path | None, trace: str, via) -> None:
    import asyncio
    from dataclasses import asdict

    from batchlens.replay.live import replay_live
    from batchlens.replay.output import rows, table, write_csv, write_png

    with click.progressbar(length=len(requests), label=f"replaying {len(requests)} requests against {mask_url(url)}",
                           file=sys.stderr) as bar:  # fmt: skip
        try:
            live = asyncio.run(replay_live(url, requests, slo, model=served_model, on_done=lambda _r: bar.update(1),
                                           via=via))  # fmt: skip
        except ValueError as exc:  # nobody answered before the first request: nothing was sent
            raise click.ClickException(f"{exc}: nothing was replayed") from None
    if as_json:
        click.echo(json.dumps({"slo": {"ttft_s": slo.ttft_seconds, "tpot_s": slo.tpot_seconds}, "url": mask_url(url),
                               "requests": len(requests), "sent": live.sent, "stopped": live.stopped or None,
                               "accounting": {k: asdict(v) for k, v in live.accounting.items()},
                               "policies": rows([live.run]), "classes": rows(list(live.classes.values()))},
                              indent=2))  # fmt: skip
    else:
        click.echo(table([live.run], None, slo))
        click.echo(live.accounting["total"].summary())
        if live.classes:
            click.echo("\nBy class:\n" + table(list(live.classes.values()), None, slo))
            for name in live.classes:
                click.echo(f"{name}: {live.accounting[name].summary()}")
    if folder:
        write_csv([live.run], None, folder / "replay.csv")
        write_png([live.run], None, requests, folder / "replay.png", title=Path(trace).name)
        click.echo(f"wrote {folder / 'replay.csv'} and {folder / 'replay.png'}", err=as_json)
    if live.stopped:
        click.echo(f"Error: {live.stopped}", err=True)
        raise SystemExit(1)
