"""`batchlens lint-config` on the article's template, a corrected one, and `vllm serve` command lines.

Without vLLM importable (the test venv), arguments come from the built-in table; the `vllm` test checks that
table against the real vLLM 0.32.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from batchlens.lint import TABLE, lint, parse_command_line, read, vllm_arguments
from harness.exporter import BATCHLENS
from harness.vllm import vllm_python

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
ARGS = vllm_arguments()


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([BATCHLENS, "lint-config", *argv], capture_output=True, text=True, timeout=60)


def findings(path: Path, max_batch: int | None = None) -> list[tuple[str, str]]:
    root, settings = read(path, ARGS)
    return [(f.level, f.key) for f in lint(settings, ARGS, root=root, max_batch=max_batch)]


def test_the_articles_template_gets_exactly_its_four_errors() -> None:
    assert findings(DATA / "article-engine-config.yaml", max_batch=32) == [
        ("error", "engine_config.max_paddings"),
        ("error", "engine_config.speculative_decoding"),
        ("error", "engine_config.speculative_decoding.enabled"),
        ("error", "engine_config.speculative_decoding.n_parallel"),
    ]
    done = cli(str(DATA / "article-engine-config.yaml"))
    assert done.returncode == 1 and "speculative_config" in done.stdout and "4 error(s), 0 warning(s)" in done.stdout


def test_the_corrected_template_gets_none() -> None:
    assert findings(DATA / "good-engine-config.yaml", max_batch=32) == []
    done = cli(str(DATA / "good-engine-config.yaml"), "--max-batch", "32")
    assert done.returncode == 0, done.stdout


def test_a_serve_command_line_is_checked_flag_by_flag(tmp_path) -> None:
    cmd = tmp_path / "serve.sh"
    cmd.write_text(
        "vllm serve deepseek-ai/deepseek-llm-7b-chat \\\n  --max-num-seqs 16 --max-paddings 256 --block-size=24 \\\n"
        "  --max-num-batched-tokens 4096 --max-model-len 8192 --no-enable-chunked-prefill --max-num-seq 8\n"
    )
    root, settings = read(cmd, ARGS)
    assert settings["model"] == "deepseek-ai/deepseek-llm-7b-chat" and settings["enable_chunked_prefill"] is False
    got = lint(settings, ARGS, root=root, max_batch=16)
    assert [(f.level, f.key) for f in got] == [
        ("error", "max_paddings"),
        ("error", "max_num_seq"),
        ("warning", "block_size"),
        ("warning", "max_num_seqs"),
        ("error", "max_num_batched_tokens"),
    ]
    assert "did you mean max_num_seqs?" in got[1].message and "at least 32" in got[3].message
    done = cli(str(cmd), "--max-batch", "16", "--json")
    assert done.returncode == 1 and [f["key"] for f in json.loads(done.stdout)] == [f.key for f in got]


@pytest.mark.parametrize(
    ("line", "key", "said"),
    [
        ("vllm serve m --max-num-seqs abc", "max_num_seqs", "must be an integer, not 'abc'"),
        ("vllm serve m --kv-cache-dtype fp9", "kv_cache_dtype", "did you mean fp8?"),
        ("vllm serve m --gpu-memory-utilization 1.5", "gpu_memory_utilization", "must be (0, 1]"),
        ("vllm serve m --gpu-memory-utilization 0", "gpu_memory_utilization", "must be (0, 1]"),
        ("vllm serve m --max-num-seqs -4", "max_num_seqs", "-4 is out of range: must be >= 1"),
        ("vllm serve m --enforce-eager maybe", "enforce_eager", "must be true or false"),
    ],
)
def test_values_vllm_refuses_are_errors_with_why(tmp_path, line: str, key: str, said: str) -> None:
    """Types, choices and ranges come from the argument table (made from vLLM's own parser)."""
    cmd = tmp_path / "serve.sh"
    cmd.write_text(line + "\n")
    root, settings = read(cmd, ARGS)
    [finding] = lint(settings, ARGS, root=root)
    assert (finding.level, finding.key) == ("error", key) and said in finding.message, finding


def test_a_python_launcher_and_malformed_yaml_are_read_as_written(tmp_path) -> None:
    settings = parse_command_line("python -m vllm.entrypoints.openai.api_server --model m --max-num-seqs 8", ARGS)
    assert settings == {"model": "m", "max_num_seqs": 8}
    assert lint(settings, ARGS) == []
    broken = tmp_path / "engine.yaml"
    broken.write_text("engine_config:\n  max_num_seqs: 8\n bad: [\n")
    done = cli(str(broken))
    assert done.returncode == 1 and "not valid YAML: line 3, column 2" in done.stderr, done.stderr


def test_warnings_alone_exit_3_and_vllms_own_refusals_are_errors(tmp_path) -> None:
    warn = tmp_path / "warn.yaml"
    warn.write_text("max_num_seqs: 16\nmax_num_batched_tokens: 1000000\nmax_model_len: 2048\n")
    assert cli(str(warn)).returncode == 3
    assert parse_command_line("--max-num-seqs 64 --max-num-batched-tokens 32", ARGS) == {
        "max_num_seqs": 64, "max_num_batched_tokens": 32}  # fmt: skip
    bad = lint({"max_num_seqs": 64, "max_num_batched_tokens": 32, "block_size": 0}, ARGS)
    assert [(f.level, f.key) for f in bad] == [("error", "block_size"), ("error", "max_num_batched_tokens")]


def test_a_file_that_is_no_config_is_a_clear_error(tmp_path) -> None:
    junk = tmp_path / "notes.txt"
    junk.write_text("just some notes\n")
    done = cli(str(junk))
    assert done.returncode == 1 and "neither a YAML mapping" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.vllm
def test_the_built_in_table_is_what_vllm_0_32_itself_says() -> None:
    done = subprocess.run([str(vllm_python()), str(ROOT / "scripts" / "vllm_args.py")], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == json.loads(TABLE.read_text())
