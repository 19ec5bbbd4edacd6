"""What routing is worth: the same mixed load through the real LiteLLM proxy, routed by role and as one pool.

    python benchmarks/routing.py [--seconds 75]

Real: the LiteLLM proxy (make litellm-env) and the plugin from a wheel built here, the exporter, and
`batchlens replay --url` measuring every request at the client. The four engines are batchlens simulators
(no GPU here), one per role at different batch limits; each counts its requests and preemptions as vLLM does.

The load mixes the article's classes: a bursty main load, short interactive requests (the trace's "class",
sent in the routing header), prompts over 2048 tokens, and the quiet gaps that make an arrival cold. The pool
is the same four engines with every role "main": LiteLLM spreads all traffic over them (least busy).

It prints the interactive P99 TTFT routed and pooled and their ratio (the target: 0.5 or less), and where
the long prompts went. It exits 1 when routing did not do its job (a class on the wrong engine, a request
lost): that is a fault, not a figure. tests/test_routing_proxy.py checks the same paths functionally.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from batchlens.config import load_config  # noqa: E402
from batchlens.routing.proxy_config import litellm_config  # noqa: E402
from harness.exporter import ExporterProcess, parse_samples, pick, scraped_sum  # noqa: E402
from harness.litellm import MASTER_KEY, LitellmProxy, install_batchlens  # noqa: E402
from harness.replay import replay, write_mixed_trace  # noqa: E402
from harness.simulator import SIM_TOKEN, SimulatorProcess  # noqa: E402
from harness.wheel import build_distributions  # noqa: E402

SECONDS = 75
#: The engines run at a twentieth of real time, so that they, not the proxy (Python, on the same two cores as
#: everything else), are what the load contends for: each streamed token costs the proxy CPU, and with faster
#: engines its event loop's lag (seconds, measured at a tenth) hid the engines' queues.
SPEED = 0.05
LONG_PROMPTS = (3000, 5000)
#: A bursty main load whose answers take seconds (about 15 in flight on average, 30 and more in a burst: main's
#: 32 slots hold it, routed); interactive requests, short and steady; now and then a prompt over 2048 tokens.
STREAMS = (
    {"class": "", "rate": 2.5, "cv": 2.0, "prompts": (256, 512, 1024), "outputs": (16, 32)},
    {"class": "interactive", "rate": 1.2, "cv": 1.0, "prompts": (64, 128), "outputs": (2, 4)},
    {"class": "", "rate": 0.1, "cv": 1.0, "prompts": LONG_PROMPTS, "outputs": (8,)},
)
#: engine -> (its role when routed, its batch capacity)
ENGINES = {"main": ("main", 32), "fast": ("interactive", 4), "long": ("long", 4), "cold": ("cold", 2)}


def long_prompts(engine: SimulatorProcess) -> float:
    """Prompts over 2000 tokens the engine served, from its own histogram (vLLM's buckets stop at 2000 here)."""
    histogram = "vllm:request_prompt_tokens"
    return scraped_sum(engine.url, histogram + "_count") - scraped_sum(engine.url, histogram + "_bucket", le="2000.0")


def run(
    tmp_path: Path, litellm_env: dict[str, str], trace: Path, routed: bool, seconds: float
) -> tuple[dict, dict[str, SimulatorProcess]]:
    folder = tmp_path / ("routed" if routed else "pooled")
    folder.mkdir()
    engines = {n: SimulatorProcess(folder, speed=SPEED, args=("--max-num-seqs", str(cap), "--max-model-len", "16384"))
               for n, (_, cap) in ENGINES.items()}  # fmt: skip
    listed = [{"name": n, "url": e.url, "role": ENGINES[n][0] if routed else "main"} for n, e in engines.items()]
    exporter = ExporterProcess(folder, [f"{n}={e.url}" for n, e in engines.items()], interval=0.5,
                               env={"BATCHLENS_ADMIN_TOKEN": SIM_TOKEN})  # fmt: skip
    path = folder / "batchlens.yaml"
    path.write_text(yaml.safe_dump({"engines": listed, "routing": {"model": "deepseek-sim",
                                                                   "exporter_url": exporter.url}}))  # fmt: skip
    proxy = LitellmProxy(folder, litellm_config(load_config(path, environ={})), path, litellm_env)
    try:
        # The proxy's first requests load its token counter and open its clients (seconds): not the load's.
        for _ in range(2):
            proxy.complete(" the" * 64, headers={"x-batchlens-latency-class": "interactive"})
            proxy.complete(" the" * 3000)
            proxy.complete(" the" * 64)
        done = replay(trace, proxy.url, "--served-model-name", "deepseek-sim", "--api-key-env", "PROXY_KEY",
                      "--text-prompts", "--slo-ttft", "0.5", "--slo-tpot", "0.1", timeout=seconds + 240,
                      env={"PROXY_KEY": MASTER_KEY})  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"replay through the proxy failed: {done.stderr[-3000:]}")
        figures = json.loads(done.stdout)
        figures["served"] = {n: scraped_sum(e.url, "vllm:request_success_total") for n, e in engines.items()}
        figures["preemptions"] = {n: scraped_sum(e.url, "vllm:num_preemptions_total") for n, e in engines.items()}
        figures["long_prompts"] = {n: long_prompts(e) for n, e in engines.items()}
        figures["decisions"] = {
            "/".join(dict(k)[n] for n in ("wanted", "role", "fallback")): v
            for k, v in pick(parse_samples(proxy.metrics()), "batchlens_routing_decisions_total").items() if v
        }  # fmt: skip
        return figures, engines
    finally:
        proxy.stop()
        exporter.stop()
        for engine in engines.values():
            engine.stop()


def faults(routed: dict, pooled: dict, counts: dict[str, int], longs: int) -> list[str]:
    """What would make the figures meaningless: requests lost, or a class on an engine not its own."""
    found = []
    for name, figures in (("routed", routed), ("pooled", pooled)):
        if figures["sent"] != sum(counts.values()) or figures["stopped"] is not None:
            found.append(f"{name}: sent {figures['sent']} of {sum(counts.values())}, stopped {figures['stopped']}")
        if figures["policies"][0]["refused"]:
            found.append(f"{name}: {figures['policies'][0]['refused']} refused")
        total = figures["accounting"]["total"]
        if total["answered"] != total["sent"]:  # a request lost, refused or failed: each by its reason
            found.append(f"{name}: answered {total['answered']} of {total['sent']}: refused {total['refused']}, "
                         f"failed {total['failed']}")  # fmt: skip
    by_role: dict[str, float] = {}
    for key, n in routed["decisions"].items():
        by_role[key.split("/")[1]] = by_role.get(key.split("/")[1], 0) + n
    if {ENGINES[name][0]: n for name, n in routed["served"].items() if n} != by_role:
        found.append(f"the engines served {routed['served']}, the plugin decided {routed['decisions']}")
    if not routed["served"]["long"] == routed["long_prompts"]["long"] == longs + 2:  # + the warm-up's two
        found.append(f"the long engine served {routed['served']['long']}, {longs + 2} long prompts were sent")
    if routed["long_prompts"]["main"]:
        found.append(f"{routed['long_prompts']['main']:.0f} long prompt(s) reached main")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=SECONDS, help="length of the mixed trace")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchlens-bench-routing-") as tmp:
        folder = Path(tmp)
        wheel = build_distributions(folder / "dist").wheel
        litellm_env = install_batchlens(wheel, folder / "site")
        trace = folder / "mixed.jsonl"
        counts = write_mixed_trace(trace, args.seconds, STREAMS)
        longs = sum(json.loads(line)["prompt_tokens"] in LONG_PROMPTS for line in trace.read_text().splitlines())
        routed, _ = run(folder, litellm_env, trace, routed=True, seconds=args.seconds)
        pooled, _ = run(folder, litellm_env, trace, routed=False, seconds=args.seconds)
    interactive = {name: next(c for c in f["classes"] if c["policy"] == "interactive") for name, f in
                   (("routed", routed), ("pooled", pooled))}  # fmt: skip
    print(f"requests per class: {counts}; long prompts: {longs}")
    for name, figures in (("routed", routed), ("pooled", pooled)):
        total = figures["accounting"]["total"]
        print(f"{name:>7}: sent {total['sent']}, answered {total['answered']}, refused {total['refused']}, "
              f"failed {total['failed']}")  # fmt: skip
        print(f"{name:>7}: served {figures['served']}, long prompts {figures['long_prompts']}, "
              f"preemptions {figures['preemptions']}")  # fmt: skip
    ratio = interactive["routed"]["p99_ttft_s"] / interactive["pooled"]["p99_ttft_s"]
    n = interactive["routed"]["requests"]
    # Nearest rank: over 100 requests or fewer the P99 is the slowest one, and the ratio compares two requests.
    print(f"routing benefit: interactive P99 TTFT routed {interactive['routed']['p99_ttft_s']:.2f} s, one pool "
          f"{interactive['pooled']['p99_ttft_s']:.2f} s, P50 {interactive['routed']['p50_ttft_s']:.2f} s / "
          f"{interactive['pooled']['p50_ttft_s']:.2f} s, over {n} interactive requests"
          + (" (at 100 or fewer the P99 is the slowest: run --seconds 120 or more for a P99 proper)" if n <= 100
             else ""))  # fmt: skip
    print(
        f"ratio routed/pooled interactive P99 TTFT {ratio:.3f} (target <= 0.5: {'met' if ratio <= 0.5 else 'MISSED'})"
    )
    problems = faults(routed, pooled, counts, longs)
    for problem in problems:
        print(f"FAULT: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
