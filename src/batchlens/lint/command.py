"""`batchlens lint-config`: the click wiring. The work is in this package."""

from __future__ import annotations

import json
import sys

import click


@click.command("lint-config")
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
    Examples:
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
