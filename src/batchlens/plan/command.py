"""`batchlens plan`: the click wiring. The work is in fleet.py, search.py and output.py."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import click

from batchlens.clikit import config_option, load, writable_folder
from batchlens.config.plan import BALANCERS
from batchlens.replay.options import read_requests, slo_of, slo_options, trace_options
from batchlens.simulator.profiles import GPUS, MODELS

DEFAULT_GPUS = ("a100-80g", "h100")
DEFAULT_MODELS = ("dense-7b",)


def parse_prices(values: tuple[str, ...]) -> dict[str, float]:
    """--price GPU=USD, repeatable: USD per GPU-hour of one of the simulator's GPUs."""
    prices = {}
    for value in values:
        gpu, sep, usd = value.partition("=")
        gpu = gpu.strip()
        try:
            price = float(usd) if sep else math.nan
        except ValueError:
            price = math.nan
        if gpu not in GPUS or not (math.isfinite(price) and price >= 0):
            raise click.BadParameter(f"expected GPU=USD per GPU-hour, GPU one of {', '.join(sorted(GPUS))} and USD "
                                     f"a number of 0 or more, got {value!r}", param_hint="--price")  # fmt: skip
        prices[gpu] = price
    return prices


@click.command()
@trace_options("Plan for")
@click.option("--gpu", "gpus", type=click.Choice(sorted(GPUS)), multiple=True, metavar="NAME",
              help=f"A GPU profile to size with, repeatable: {', '.join(sorted(GPUS))} [default: "
              f"{', '.join(DEFAULT_GPUS)}].")  # fmt: skip
@click.option("--model-profile", "models", type=click.Choice(sorted(MODELS)), multiple=True, metavar="NAME",
              help=f"A model profile, repeatable; each with each --gpu it fits: {', '.join(sorted(MODELS))} "
              f"[default: {', '.join(DEFAULT_MODELS)}].")  # fmt: skip
@click.option("--policy", default="adaptive+admit", show_default=True, metavar="POLICY",
              help="Each replica's batch-limit policy, as batchlens replay's: adaptive+admit (the controller's "
              "limit and door), adaptive, admit, default or static:N.")  # fmt: skip
@click.option("--balancer", type=click.Choice(BALANCERS),
              help="How requests are spread over replicas: least-loaded (fewest queued + running; ties in turn) or "
              "round-robin [default: plan.balancer, least-loaded].")  # fmt: skip
@click.option("--price", "prices", multiple=True, metavar="GPU=USD",
              help="USD per GPU-hour of a GPU, repeatable [default: plan.gpu_hour_price].")  # fmt: skip
@click.option("--max-replicas", type=click.IntRange(1, 1024), metavar="N",
              help="The most replicas tried per profile [default: plan.max_replicas, 64].")  # fmt: skip
@click.option("--max-num-seqs", type=click.IntRange(1), default=256, show_default=True,
              help="Each engine's capacity (vLLM's --max-num-seqs).")  # fmt: skip
@click.option("--max-model-len", type=click.IntRange(2), default=8192, show_default=True,
              help="Longer requests are refused at arrival, as vLLM does (not good).")  # fmt: skip
@slo_options
@click.option("--whole", is_flag=True,
              help="Replay every fleet to the end of the trace, even one already sure to miss the SLO (slower; "
              "by default it stops there, and its row says where).")  # fmt: skip
@click.option("--autoscale", is_flag=True,
              help="Also replay, for each profile, a fleet whose replicas follow batchlens:desired_replicas (the "
              "thresholds' scale_* settings), from one replica, against the fewest fixed replicas that meet the SLO: "
              "attainment, shed share and GPU-hours of each.")  # fmt: skip
@click.option(
    "--startup-seconds",
    type=click.FloatRange(0),
    default=120.0,
    show_default=True,
    help="With --autoscale: from a replica asked for to it serving (scheduling, image, weights, warm-up).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--out", type=click.Path(file_okay=False), metavar="DIR", help="Write plan.csv and plan.png here.")
@config_option
def plan(
    trace: str, fmt: str, start: float, duration: float | None, rate_scale: float, gpus: tuple[str, ...],
    models: tuple[str, ...], policy: str, balancer: str | None, prices: tuple[str, ...], max_replicas: int | None,
    max_num_seqs: int, max_model_len: int, slo_ttft: float | None, slo_tpot: float | None, whole: bool,
    autoscale: bool, startup_seconds: float, as_json: bool, out: str | None, config_path: str | None,
) -> None:  # fmt: skip
    """Size a fleet for a trace: how many replicas of which GPU and model profile serve it within the SLO.

    For each profile (each --gpu with each --model-profile it fits), the trace
    is replayed on fleets of simulated engines in simulated time, each engine
    under --policy, behind the balancer. The search starts at a lower bound
    (the trace's tokens per second over what one replica serves flat out),
    grows until a fleet meets the SLO, bisects back to the fewest that do, and
    replays one fewer too. Each fleet's row: goodput, shed share, P99 TTFT and
    TPOT, SLO attainment, GPU-hours (replicas x GPUs per replica x the trace's
    hours) and the cost per million good tokens (plan.gpu_hour_price or
    --price); the cheapest that meets the SLO is marked. A fleet meets the SLO
    when at least plan.target_attainment of the requests are good and at most
    plan.max_shed_share are shed. See docs/scaling.md.

    \b
    Examples:
      batchlens plan AzureLLMInferenceTrace_code.csv --format azure --duration 3600 --out plan-out
      batchlens plan trace.jsonl --gpu h100 --gpu h200 --price h100=2.5 --price h200=3.5 --policy static:64
    """
    from batchlens.plan.output import rows, table, write_csv, write_png
    from batchlens.plan.search import Profile, Rule, mark_cheapest, plan_profile
    from batchlens.replay.policy_names import parse_policy

    config = load(config_path, {})
    slo = slo_of(config, slo_ttft, slo_tpot)
    try:
        parse_policy(policy, slo, config.thresholds, config.control).initial(max_num_seqs)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None
    if policy == "breaker":
        raise click.BadParameter("the breaker is driven by its alert, one engine at a time: not a fleet's policy",
                                 param_hint="--policy")  # fmt: skip
    price_of = {**config.plan.gpu_hour_price, **parse_prices(prices)}
    profiles = [Profile(g, m) for g in gpus or DEFAULT_GPUS for m in models or DEFAULT_MODELS]
    unpriced = sorted({p.gpu for p in profiles} - price_of.keys())
    if unpriced:
        raise click.BadParameter(f"no price per GPU-hour for {', '.join(unpriced)}: give --price "
                                 f"{unpriced[0]}=USD or set plan.gpu_hour_price.{unpriced[0]}",
                                 param_hint="--price")  # fmt: skip
    folder = writable_folder(out, "--out") if out else None
    requests = read_requests(trace, fmt, start, duration, rate_scale)
    seconds = duration / rate_scale if duration is not None else requests[-1].t
    if seconds <= 0:
        raise click.ClickException(f"{trace}: all {len(requests)} requests arrive at once: a trace to plan for spans "
                                   "some time (give --duration)")  # fmt: skip
    rule = Rule(config.plan.target_attainment, config.plan.max_shed_share)
    balancer = balancer or config.plan.balancer
    most = max_replicas or config.plan.max_replicas
    began, points, skipped = time.monotonic(), [], []
    click.echo(f"planning for {len(requests)} requests over {seconds / 3600:.2f} h, {len(profiles)} profile(s)",
               err=True)  # fmt: skip

    def said(found) -> None:
        click.echo(f"  {found.profile} x {found.replicas}: attained {found.slo_attainment:.2%}, shed "
                   f"{found.shed_share:.2%}, {'meets' if found.meets else 'misses'} the SLO"
                   f"{f' (stopped at {found.stopped_at:.0f} s)' if found.stopped_at is not None else ''} "
                   f"[{time.monotonic() - began:.0f} s]", err=True)  # fmt: skip

    for profile in profiles:
        try:
            bound, found = plan_profile(
                requests, profile, lambda: parse_policy(policy, slo, config.thresholds, config.control), slo, rule,
                seconds=seconds, price=price_of[profile.gpu], balancer_name=balancer, max_replicas=most,
                max_num_seqs=max_num_seqs, max_model_len=max_model_len, on_point=said, whole=whole,
            )  # fmt: skip
        except ValueError as exc:  # the model does not fit the GPU
            skipped.append(f"{profile.name}: {exc}")
            click.echo(f"  {profile.name} skipped: {exc}", err=True)
            continue
        click.echo(f"  {profile.name}: lower bound {bound} replica(s)", err=True)
        points += found
    if not points:
        raise click.ClickException("no profile fits: " + "; ".join(skipped))
    points = mark_cheapest(points)
    scaled = []
    if autoscale:
        from batchlens.plan.autoscale import compare_autoscaled

        for profile in profiles:
            fixed = [p for p in points if p.profile == profile.name and p.meets]
            if fixed:
                scaled.append(compare_autoscaled(
                    requests, profile, min(fixed, key=lambda p: p.replicas), lambda: parse_policy(
                        policy, slo, config.thresholds, config.control), slo, config.thresholds,
                    startup_seconds=startup_seconds, balancer_name=balancer, max_replicas=most,
                    max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                ))  # fmt: skip
    took = time.monotonic() - began
    if as_json:
        click.echo(json.dumps({"slo": {"ttft_s": slo.ttft_seconds, "tpot_s": slo.tpot_seconds},
                               "meets": {"target_attainment": rule.target_attainment,
                                         "max_shed_share": rule.max_shed_share},
                               "policy": policy, "balancer": balancer, "requests": len(requests),
                               "trace_seconds": seconds, "skipped": skipped, "seconds_taken": round(took, 1),
                               "points": rows(points), "autoscaled": [s.row() for s in scaled]},
                              indent=2))  # fmt: skip
    else:
        click.echo(table(points, slo, rule, policy=policy, balancer=balancer))
        for compared in scaled:
            click.echo(compared.said())
        for line in skipped:
            click.echo(f"skipped {line}")
        click.echo(f"planned in {took:.0f} s")
    if folder:
        write_csv(points, folder / "plan.csv")
        write_png(points, folder / "plan.png", title=Path(trace).name)
        click.echo(f"wrote {folder / 'plan.csv'} and {folder / 'plan.png'}", err=as_json)
