"""`batchlens simulate`: the click wiring. The work is in engine.py and server.py."""

from __future__ import annotations

import os

import click

from batchlens.admin_api import TOKEN_ENV
from batchlens.clikit import renamed_option
from batchlens.config import ConfigError, parse_listen
from batchlens.simulator.dialect import DEFAULT_VLLM_VERSION, dialect
from batchlens.simulator.profiles import DEFAULT_GPU, DEFAULT_MODEL, GPUS, MODELS


@click.command()
@click.option("--listen", default="127.0.0.1:8000", show_default=True, help="HOST:PORT to serve on.")
@click.option("--gpu", "gpu_name", type=click.Choice(sorted(GPUS)), default=DEFAULT_GPU, show_default=True,
              help="The simulated GPU's profile: its bandwidth, compute and memory (docs/simulator.md).")  # fmt: skip
@renamed_option("--model-profile", "--model", "model_profile", type=click.Choice(sorted(MODELS)), default=DEFAULT_MODEL,
                show_default=True, help="The simulated model's profile: its size and shape (docs/simulator.md); not "
                "the name clients ask for, which is --served-model-name.")  # fmt: skip
@click.option("--served-model-name", default="deepseek-sim", show_default=True,
              help="The model name clients ask for, as vLLM's own flag sets it.")  # fmt: skip
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
@click.option(
    "--admin-port", type=click.IntRange(1, 65535), metavar="PORT",
    help="Serve the admin API on this port of --listen's host alone, as the plugin does with BATCHLENS_ADMIN_PORT.",
)  # fmt: skip
@click.option(
    "--vllm-version", default=DEFAULT_VLLM_VERSION, show_default=True,
    help="Speak this vLLM release's metric dialect (0.10 to 0.33): 0.10 also exposes the deprecated "
    "gpu_cache_usage_perc, gpu_prefix_cache_* and time_per_output_token_seconds, 0.11 the last of them.",
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
    admin_port: int | None,
    vllm_version: str,
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
        dialect(vllm_version)
        engine = Engine(
            GPUS[gpu_name], MODELS[model_profile], max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
        )  # fmt: skip
        room = engine.num_gpu_blocks * block_size
        if room < max_model_len:  # as vLLM refuses to start: a request that long would wait forever
            raise ValueError(
                f"--max-model-len {max_model_len} is larger than the {room} tokens the KV cache of {model_profile} "
                f"on {gpu_name} holds: lower --max-model-len, or pick a larger --gpu"
            )
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    simulator = Simulator(
        engine, model_name=served_model_name, max_model_len=max_model_len, speed=speed,
        admin_token=admin_token(os.environ, admin_token_env), vllm_version=vllm_version,
    )  # fmt: skip
    try:
        serve(simulator, host, port, admin_port)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {listen}: {exc.strerror or exc}") from None
