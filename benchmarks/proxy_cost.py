"""What the LiteLLM proxy costs, with the batchlens routing plugin and without it, on the same traces.

    python benchmarks/proxy_cost.py [--seconds 20] [--rates 2,4,8,12,16,24] [--outputs 16]

Real: the LiteLLM proxy (make litellm-env) with the plugin from a wheel built here, one batchlens simulator
behind it (max_num_seqs 256 at twenty times real time, so that the engine never queues and what is measured
is the proxy), and `batchlens replay --url` measuring every request at the client, streamed as a chat client
streams. At each rate the same Poisson trace of short text prompts (64-512 tokens, --outputs out: each
streamed token is a chunk the proxy relays) goes three ways:

- ``direct``: straight to the engine (the baseline of the added latency);
- ``litellm``: through the proxy, with batchlens's generated config less the plugin (LiteLLM alone);
- ``batchlens``: through the proxy with the plugin, as `batchlens build` writes it.

It prints, per rate and way: requests answered of sent, P50 and P99 TTFT, the latency the proxy adds to them
(against ``direct`` at that rate), and the proxy's CPU: seconds per request (its process tree, user and
system) and the share of one core it used. Then the rate each way saturates at on this machine: the lowest
rate at which the proxy's P50 TTFT passes twice its lightest rate's, or a request went unanswered. Last,
the plugin's own hook, timed in the LiteLLM environment's Python (no server): microseconds per request, and
its share of the proxy's CPU per request. Ratios are within one run; these machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from batchlens.config import load_config  # noqa: E402
from batchlens.routing.proxy_config import PLUGIN, litellm_config  # noqa: E402
from harness.litellm import MASTER_KEY, LitellmProxy, install_batchlens, litellm_venv  # noqa: E402
from harness.replay import replay, write_trace  # noqa: E402
from harness.simulator import SimulatorProcess  # noqa: E402
from harness.wheel import build_distributions  # noqa: E402

MODEL = "deepseek-sim"
PROMPTS = (64, 128, 256, 512)
WAYS = ("direct", "litellm", "batchlens")
SATURATED = 2.0  # P50 TTFT over this many times its lightest rate's: the proxy's loop queues requests

# The plugin's hook on one request, in the LiteLLM environment: what it adds to LiteLLM's own work.
HOOK_TIMING = """
import asyncio, json, sys, time
from batchlens.routing.litellm_proxy import routing as plugin  # the instance LiteLLM's config names
class Key:  # LiteLLM's UserAPIKeyAuth for the master key, as the hook reads it
    user_role, key_alias, team_id, team_alias, metadata, team_metadata = "proxy_admin", None, None, None, {}, {}
prompt = " the" * int(sys.argv[1])
async def main(n):
    for _ in range(50):  # warm: the tokenizer's first load, the signal reader's start
        await plugin.async_pre_call_hook(Key(), None, {"model": "m", "prompt": prompt}, "text_completion")
    started = time.process_time()
    for _ in range(n):
        data = {"model": "m", "prompt": prompt, "proxy_server_request": {"headers": {"user-agent": "bench"}}}
        await plugin.async_pre_call_hook(Key(), None, data, "text_completion")
    return (time.process_time() - started) / n
print(json.dumps({"seconds_per_call": asyncio.run(main(2000))}))
"""


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process and its children."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def measure(trace: Path, url: str, proxy: LitellmProxy | None, seconds: float) -> dict:
    """One replay of ``trace`` at ``url``: its JSON run and accounting, and the proxy's CPU over it."""
    auth = ("--api-key-env", "PROXY_KEY") if proxy else ()
    before, started = (cpu_seconds(proxy.process.pid) if proxy else 0.0), time.monotonic()
    done = replay(trace, url, "--served-model-name", MODEL, "--text-prompts", *auth, timeout=seconds + 240,
                  env={"PROXY_KEY": MASTER_KEY})  # fmt: skip
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"replay at {url} failed: {done.stderr[-3000:]}")
    figures = json.loads(done.stdout)
    [run] = figures["policies"]
    total = figures["accounting"]["total"]
    cpu = cpu_seconds(proxy.process.pid) - before if proxy else 0.0
    return {"sent": total["sent"], "answered": total["answered"], "p50": run["p50_ttft_s"], "p99": run["p99_ttft_s"],
            "cpu_per_request": cpu / max(total["answered"], 1), "cores": cpu / wall}  # fmt: skip


def start_proxy(folder: Path, litellm_env: dict[str, str], engine: SimulatorProcess, plugin: bool) -> LitellmProxy:
    folder.mkdir()
    path = folder / "batchlens.yaml"
    # No exporter: the plugin then routes by role alone, and its signal reader retries in the background, as it
    # does whenever the exporter is away. The routing work per request is the same.
    path.write_text(yaml.safe_dump({"engines": [{"name": "main", "url": engine.url, "role": ["main"]}],
                                    "routing": {"model": MODEL, "exporter_url": "http://127.0.0.1:9"}}))  # fmt: skip
    proxy_config = litellm_config(load_config(path, environ={}))
    if not plugin:
        callbacks = proxy_config["litellm_settings"]["callbacks"]
        proxy_config["litellm_settings"]["callbacks"] = [c for c in callbacks if c != PLUGIN]
        # Without the plugin nothing tags a request: let LiteLLM pick among the engines as it would alone.
        proxy_config["router_settings"]["enable_tag_filtering"] = False
    proxy = LitellmProxy(folder, proxy_config, path, litellm_env)
    for _ in range(3):  # its first requests load the token counter and open its clients: not the load's
        proxy.complete(" the" * 64)
    return proxy


def hook_seconds(litellm_env: dict[str, str], folder: Path, engine: SimulatorProcess, prompt: int) -> float:
    config = folder / "hook.yaml"
    config.write_text(yaml.safe_dump({"engines": [{"name": "main", "url": engine.url, "role": ["main"]}],
                                      "routing": {"model": MODEL, "exporter_url": "http://127.0.0.1:9"}}))  # fmt: skip
    done = subprocess.run([str(litellm_venv() / "bin" / "python"), "-c", HOOK_TIMING, str(prompt)],
                          capture_output=True, text=True, timeout=300,
                          env={**litellm_env, "BATCHLENS_CONFIG": str(config), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                               "PATH": "/usr/bin:/bin"})  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"timing the plugin's hook failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds_per_call"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20, help="length of each rate's trace")
    parser.add_argument("--rates", default="2,4,8,12,16,24", help="requests/s, comma-separated")
    parser.add_argument("--outputs", type=int, default=16, help="output tokens per request, each streamed")
    args = parser.parse_args()
    rates = sorted(float(r) for r in args.rates.split(","))
    results: dict[str, dict[float, dict]] = {way: {} for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="batchlens-bench-proxy-") as tmp:
        folder = Path(tmp)
        wheel = build_distributions(folder / "dist").wheel
        litellm_env = install_batchlens(wheel, folder / "site")
        engine = SimulatorProcess(folder, args=("--max-num-seqs", "256", "--served-model-name", MODEL))
        proxies = {}
        try:
            hook = hook_seconds(litellm_env, folder, engine, prompt=256)
            proxies = {way: start_proxy(folder / way, litellm_env, engine, plugin=way == "batchlens")
                       for way in WAYS[1:]}  # fmt: skip
            for rate in rates:
                trace = folder / f"poisson-{rate:g}.jsonl"
                write_trace(trace, args.seconds, rate, prompts=PROMPTS, outputs=(args.outputs,), seed=7)
                for way in WAYS:
                    proxy = proxies.get(way)
                    results[way][rate] = measure(trace, proxy.url if proxy else engine.url, proxy, args.seconds)
                    print(f"{rate:g} requests/s, {way}: {results[way][rate]}", file=sys.stderr, flush=True)
        finally:
            for proxy in proxies.values():
                proxy.stop()
            engine.stop()
    report(results, rates, hook)
    return 0


def report(results: dict[str, dict[float, dict]], rates: list[float], hook: float) -> None:
    print(f"{'rate':>5} {'way':>9} {'answered':>9} {'P50 TTFT':>9} {'P99 TTFT':>9} {'+P50 ms':>8} {'+P99 ms':>8} "
          f"{'CPU ms/req':>10} {'cores':>6}")  # fmt: skip
    for rate in rates:
        direct = results["direct"][rate]
        for way in WAYS:
            r = results[way][rate]
            added = (f"{(r['p50'] - direct['p50']) * 1e3:8.1f} {(r['p99'] - direct['p99']) * 1e3:8.1f}"
                     if way != "direct" else f"{'':8} {'':8}")  # fmt: skip
            print(f"{rate:5g} {way:>9} {r['answered']:4d}/{r['sent']:<4d} {r['p50']:9.3f} {r['p99']:9.3f} {added} "
                  f"{r['cpu_per_request'] * 1e3:10.1f} {r['cores']:6.2f}")  # fmt: skip
    for way in WAYS[1:]:
        light = results[way][rates[0]]["p50"]
        over = [r for r in rates if results[way][r]["p50"] > SATURATED * light
                or results[way][r]["answered"] < results[way][r]["sent"]]  # fmt: skip
        cpu = sorted(results[way][r]["cpu_per_request"] for r in rates)[len(rates) // 2]
        print(f"{way}: CPU per request (median over rates) {cpu * 1e3:.1f} ms, one core's worth at "
              f"{1 / cpu:.1f} requests/s; saturated (P50 TTFT over {SATURATED:g}x its lightest, or a request lost) "
              f"{f'at {over[0]:g} requests/s' if over else f'at no rate tried (up to {rates[-1]:g})'}")  # fmt: skip
    plugin = sorted(results["batchlens"][r]["cpu_per_request"] for r in rates)[len(rates) // 2]
    alone = sorted(results["litellm"][r]["cpu_per_request"] for r in rates)[len(rates) // 2]
    print(
        f"the plugin's hook in-process: {hook * 1e6:.0f} us per request (256-token text prompt), "
        f"{hook / plugin:.1%} of the proxy's CPU per request with it"
    )
    print(f"proxy CPU per request with/without the plugin {plugin / alone:.2f}")


if __name__ == "__main__":
    sys.exit(main())
