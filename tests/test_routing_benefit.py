"""What routing is worth: the same mixed load through the real LiteLLM proxy, routed by role and as one pool.

Real: the LiteLLM proxy (1.106.12) and the plugin from the built wheel, the exporter, `batchlens replay --url`
measuring every request at the client. Fake: the four engines are batchlens simulators (no GPU here), one per
role at different batch limits; each counts its requests and preemptions as vLLM does.

The load mixes the article's classes: a bursty main load, short interactive requests (the trace's "class",
sent in the routing header), prompts over 2048 tokens, and the quiet gaps that make an arrival cold. The pool
is the same four engines with every role "main": LiteLLM spreads all traffic over them (least busy).
"""

from __future__ import annotations

import json

import pytest
import yaml

from batchlens.config import load_config
from batchlens.routing.proxy_config import litellm_config
from harness.exporter import ExporterProcess, parse_samples, pick, scraped_sum
from harness.litellm import MASTER_KEY, LitellmProxy
from harness.replay import replay, write_mixed_trace
from harness.simulator import SIM_TOKEN, SimulatorProcess

pytestmark = [pytest.mark.litellm, pytest.mark.slow]
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


def run(tmp_path, litellm_env, trace, routed: bool) -> tuple[dict, dict[str, SimulatorProcess]]:
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
        done = replay(trace, proxy.url, "--served-model", "deepseek-sim", "--api-key-env", "PROXY_KEY",
                      "--text-prompts", "--slo-ttft", "0.5", "--slo-tpot", "0.1", timeout=SECONDS + 240,
                      env={"PROXY_KEY": MASTER_KEY})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
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


def test_routing_halves_the_interactive_tail_and_keeps_long_prompts_off_main(tmp_path, litellm_env, capsys) -> None:
    trace = tmp_path / "mixed.jsonl"
    counts = write_mixed_trace(trace, SECONDS, STREAMS)
    longs = sum(json.loads(line)["prompt_tokens"] in LONG_PROMPTS for line in trace.read_text().splitlines())
    routed, _ = run(tmp_path, litellm_env, trace, routed=True)
    pooled, _ = run(tmp_path, litellm_env, trace, routed=False)
    interactive = {name: next(c for c in f["classes"] if c["policy"] == "interactive") for name, f in
                   (("routed", routed), ("pooled", pooled))}  # fmt: skip
    print(json.dumps({"counts": counts, "long": longs, "routed": routed, "pooled": pooled}, indent=1))
    for figures in (routed, pooled):
        assert figures["sent"] == sum(counts.values()) and figures["stopped"] is None
        assert figures["policies"][0]["refused"] == 0
    assert interactive["routed"]["requests"] == counts["interactive"]
    # Every class reached its engine: the engines' own counters agree with the plugin's decisions, and the
    # long engine served every long prompt (and the warm-up's two) and nothing else.
    by_role: dict[str, float] = {}
    for key, n in routed["decisions"].items():
        by_role[key.split("/")[1]] = by_role.get(key.split("/")[1], 0) + n
    assert {ENGINES[name][0]: n for name, n in routed["served"].items() if n} == by_role
    assert routed["served"]["long"] == routed["long_prompts"]["long"] == longs + 2
    # Long prompts never reach main, so they cost it no preemption; in the pool they went everywhere.
    assert routed["long_prompts"]["main"] == 0 and routed["preemptions"]["main"] == 0
    assert pooled["long_prompts"]["main"] + pooled["long_prompts"]["fast"] > 0
    ratio = interactive["routed"]["p99_ttft_s"] / interactive["pooled"]["p99_ttft_s"]
    with capsys.disabled():  # the figures, in every run's log (docs/routing.md quotes them)
        print(f"\nrouting benefit: interactive P99 TTFT routed {interactive['routed']['p99_ttft_s']:.2f} s, "
              f"one pool {interactive['pooled']['p99_ttft_s']:.2f} s, ratio {ratio:.3f}; long prompts on main "
              f"{routed['long_prompts']['main']:.0f} routed, {pooled['long_prompts']['main']:.0f} pooled")  # fmt: skip
    assert ratio <= 0.5, interactive
