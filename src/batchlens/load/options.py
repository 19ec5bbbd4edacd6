"""The command-line options for sending load through a proxy, shared by `batchlens load` and `batchlens replay`."""

from __future__ import annotations

import os

import click

from batchlens.load.client import Via


def proxy_options(prefix: str = ""):
    """--api-key-env and --text-prompts: for sending through a proxy such as LiteLLM (docs/routing.md).

    ``prefix`` opens each help text ("With --url: "); the texts go on in lower case.
    """

    def decorate(command):
        command = click.option(
            "--text-prompts", is_flag=True,
            help=f"{prefix}send each prompt as text of as many tokens (for a proxy such as LiteLLM, whose "
            "completions route takes no token ids) instead of token ids.",
        )(command)  # fmt: skip
        return click.option(
            "--api-key-env", metavar="VAR",
            help=f"{prefix}the environment variable holding the server's key (a LiteLLM proxy's), sent as a "
            "Bearer token. The key itself never goes on the command line.",
        )(command)  # fmt: skip

    return decorate


def proxy_via(api_key_env: str | None, text: bool, class_header: str | None = None):
    """How a load reaches the server (load/client.py's Via): the key read from ``api_key_env``, now."""
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise click.BadParameter(f"{api_key_env} is not set in the environment", param_hint="--api-key-env")
    return Via(text=text, api_key=key, **({"class_header": class_header} if class_header else {}))
