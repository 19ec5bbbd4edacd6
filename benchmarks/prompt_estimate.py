"""The per-request door's prompt estimate (batchlens.prompt_size) against real tokenizers.

    python benchmarks/prompt_estimate.py [--size 400]

The door judges a request before vLLM tokenizes it, so it estimates a text prompt: 4 ASCII characters a token,
a token for every other character. Here that estimate is set beside the token count of two real BPE
tokenizers, cl100k_base and o200k_base (tiktoken, with the encodings the LiteLLM proxy's environment ships:
`make litellm-env`, nothing fetched), on chunks of --size characters of English prose (this repository's
docs/) and code (its src/), and on the sentences and paragraphs of Chinese prose (below, written for this
benchmark). It prints per kind and tokenizer the ratio estimate / true: its median and its P10 and P90, beside
the same for the old rule (4 characters a token, whatever the script), which counted a Chinese prompt at about
a third of its tokens or less. A ratio under 1 is a prompt counted short: the door then predicts it sooner than
it comes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from batchlens.prompt_size import CHARS_PER_TOKEN, prompt_tokens  # noqa: E402
from harness.litellm import litellm_venv  # noqa: E402

CHINESE = """\
当我们把批处理大小调大时，吞吐量确实上升了，但是第九十九百分位的延迟却突然变得很差。很多团队在生产环境里部署大模型服务时都遇到过这个问题，却很难说清楚原因。
原因往往在于显存带宽：每一步解码都要把模型权重和所有请求的键值缓存读一遍。批次越大，每一步读的数据越多，单个请求等待下一个词元的时间也就越长。
另一个原因是预填充。一个很长的提示词进入批次时，它的预填充会占用整整一步甚至好几步，正在解码的请求只能等它结束。突发流量到来时，这种等待会叠加起来。
所以我们需要在入口处判断每一个请求：如果预计它的首个词元会超时，就尽早拒绝它，让客户端去找另一台还有余量的引擎，而不是让它在队列里白白等待。
监控面板应该同时显示吞吐量、延迟、显存带宽利用率和键值缓存块的使用率，这样值班的工程师在凌晨三点也能一眼看出问题出在哪里。
"""

#: Counts each text's tokens under each encoding, in the LiteLLM environment (which has tiktoken and, in its
#: package, the encodings' files: TIKTOKEN_CACHE_DIR points tiktoken at them, so nothing is downloaded).
COUNT = """
import importlib.util, json, os, sys
package = os.path.dirname(importlib.util.find_spec("litellm").origin)
os.environ["TIKTOKEN_CACHE_DIR"] = os.path.join(package, "litellm_core_utils", "tokenizers")
import tiktoken
texts = json.load(sys.stdin)
print(json.dumps({name: [len(tiktoken.get_encoding(name).encode(t)) for t in texts]
                  for name in ("cl100k_base", "o200k_base")}))
"""


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text) - size + 1, size)]


def corpus(size: int) -> dict[str, list[str]]:
    def files(pattern: str) -> str:
        return "\n".join(path.read_text(encoding="utf-8") for path in sorted(ROOT.glob(pattern)))

    return {
        "English prose (docs/)": chunks(files("docs/*.md"), size),
        "code (src/)": chunks(files("src/batchlens/**/*.py"), size),
        # Its sentences and paragraphs (the paragraphs are shorter than a chunk of the others).
        "Chinese prose": [*(s + "。" for s in CHINESE.replace("\n", "").split("。") if s), *CHINESE.splitlines()],
    }


def spread(ratios: list[float]) -> str:
    deciles = statistics.quantiles(ratios, n=10)
    return f"{statistics.median(ratios):6.2f} {deciles[0]:5.2f} {deciles[-1]:5.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=400, help="characters a chunk (default 400)")
    args = parser.parse_args()
    python = litellm_venv() / "bin" / "python"
    if not python.exists():
        sys.exit(f"no LiteLLM environment at {python.parent.parent}: run `make litellm-env` first")
    kinds = corpus(args.size)
    texts = [text for chunked in kinds.values() for text in chunked]
    done = subprocess.run([str(python), "-c", COUNT], input=json.dumps(texts), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"counting with tiktoken failed: {done.stderr[-2000:]}")
    counts = json.loads(done.stdout)
    print(f"the prompt estimate / a real tokenizer's count, on chunks of {args.size} characters "
          "(median, P10, P90; under 1: counted short)")  # fmt: skip
    print(f"{'text':24} {'tokenizer':12} {'n':>5} {'estimate':>18} {'4 chars a token':>18}")
    start = 0
    for kind, chunked in kinds.items():
        for name, true in counts.items():
            got = true[start : start + len(chunked)]
            now = [prompt_tokens(json.dumps({"prompt": t}).encode()) / n for t, n in zip(chunked, got, strict=True)]
            old = [-(-len(t) // CHARS_PER_TOKEN) / n for t, n in zip(chunked, got, strict=True)]
            print(f"{kind:24} {name:12} {len(chunked):5d} {spread(now):>18} {spread(old):>18}")
        start += len(chunked)
    return 0


if __name__ == "__main__":
    sys.exit(main())
