"""The simulator's engine model and its vLLM metrics. Pure: simulated time, no servers.

The fidelity tests compare the simulator's families with a real vLLM 0.32:
the captured exposition always, and the live CPU server under the `vllm` marker.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchlens.simulator.dialect import DEFAULT_VLLM_VERSION, DIALECTS, dialect
from batchlens.simulator.engine import Engine, SimRequest
from batchlens.simulator.profiles import DEFAULT_GPU, DEFAULT_MODEL, GPUS, MODELS, PUBLISHED
from batchlens.simulator.vllm_metrics import VllmMetrics
from batchlens.simulator.workload import closed_loop, drain
from harness.vllm import VllmServer, release_of

LIMITS = (1, 2, 4, 8, 16, 32)
# The families dashboards, rules and the exporter read: none may drift from vLLM's.
CORE = frozenset((
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:request_success", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:iteration_tokens_total", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
))  # fmt: skip
CACHE_LABELS_USED = {"block_size", "num_gpu_blocks", "engine", "gpu_memory_utilization"}


def engine(**kwargs) -> Engine:
    return Engine(GPUS[DEFAULT_GPU], MODELS[DEFAULT_MODEL], **{"max_num_seqs": 32, **kwargs})


@pytest.fixture(scope="module")
def sweep():
    runs = {}
    for limit in LIMITS:
        e = engine()
        e.set_limit(limit)
        runs[limit] = closed_loop(e, concurrency=limit, requests=200)
    return runs


def test_the_articles_curve_gains_shrink_past_batch_eight(sweep) -> None:
    throughput = {b: run.output_tokens_per_second for b, run in sweep.items()}
    assert throughput[8] / throughput[1] >= 3, throughput
    assert throughput[16] / throughput[8] <= 1.3, throughput


def test_p99_kv_usage_and_bandwidth_rise_with_the_batch(sweep) -> None:
    runs = [sweep[b] for b in LIMITS]
    for smaller, larger in itertools.pairwise(runs):
        assert larger.p99_e2e_seconds > smaller.p99_e2e_seconds, (smaller, larger)
        assert larger.mean_kv_usage > smaller.mean_kv_usage, (smaller, larger)
        assert larger.mean_bandwidth_ratio > smaller.mean_bandwidth_ratio, (smaller, larger)
    assert all(0 < run.mean_bandwidth_ratio <= GPUS[DEFAULT_GPU].bandwidth_efficiency for run in runs)


def test_the_admission_limit_caps_the_running_batch_at_every_step() -> None:
    e = engine()
    e.set_limit(3)
    for i in range(10):
        e.add(SimRequest(f"r{i}", 100, 20, 0.0))
    for step in drain(e):
        assert len(e.running) <= 3
        assert len(step.produced) <= 3
    with pytest.raises(ValueError, match=r"1\.\.32"):
        e.set_limit(33)


def prompt_tokens_counted(metrics: VllmMetrics) -> float:
    [family] = [f for f in text_string_to_metric_families(metrics.render().decode()) if f.name == "vllm:prompt_tokens"]
    return family.samples[0].value


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget_and_counted_at_its_first_token() -> None:
    e = engine(max_num_batched_tokens=512)
    metrics = VllmMetrics(e, "x")
    e.add(SimRequest("long", 2000, 4, 0.0))
    steps, counted = [], []
    for step in drain(e):
        metrics.observe_step(step)
        steps.append(step)
        counted.append(prompt_tokens_counted(metrics))
    assert [s.prefill_tokens for s in steps[:4]] == [512, 512, 512, 464]
    assert [len(s.produced) for s in steps] == [0, 0, 0, 1, 1, 1, 1]
    assert counted == [0, 0, 0, 2000, 2000, 2000, 2000], "vLLM counts a prompt whole, with its first token"


def test_a_burst_past_the_token_budget_waits_in_the_queue_as_vllm_keeps_it() -> None:
    """vLLM's scheduler takes a waiting request only while the step has tokens left for its prefill, so a
    prefill backlog shows in num_requests_waiting under a limit that does not bind (the door reads its drain
    rate from such windows)."""
    e = engine(max_num_batched_tokens=1000)
    for i in range(6):
        e.add(SimRequest(f"r{i}", 400, 4, 0.0))
    first = e.step(0.0)
    assert first.prefill_tokens == 1000
    assert len(e.running) == 3 and len(e.waiting) == 3, "the third takes the step's last 200 tokens; three wait"
    e.step(first.duration)  # two decode tokens and the third's last 200 leave 798: the fourth and 398 of the fifth
    assert len(e.running) == 5 and len(e.waiting) == 1


def test_a_waiting_request_is_let_in_only_where_the_cache_holds_its_whole_prompt() -> None:
    """vLLM 0.32's scheduler_reserve_full_isl: a first chunk that fits is not enough."""
    e = engine(num_gpu_blocks=40, block_size=16, max_num_batched_tokens=256)  # 640 tokens of cache
    e.add(SimRequest("first", 400, 50, 0.0))
    e.step(0.0)  # its first 256 tokens, 16 blocks
    e.add(SimRequest("second", 300, 50, 0.0))  # 19 blocks; its first chunk, 112 tokens, would take 7
    e.step(1.0)  # the first's last 144 tokens: 25 blocks held, 15 free
    assert [r.id for r in e.waiting] == ["second"] and e.waiting[0].blocks == 0 and e.free_blocks == 15
    assert e.preemptions == 0


def test_a_full_kv_cache_preempts_the_newest_request_which_recomputes_and_finishes() -> None:
    e = engine(num_gpu_blocks=40, block_size=16)  # 640 tokens of cache for 4 requests of ~300
    requests = [SimRequest(f"r{i}", 200, 100, 0.0) for i in range(4)]
    metrics = VllmMetrics(e, "x")
    for r in requests:
        e.add(r)
    for step in drain(e):
        metrics.observe_step(step)
        assert e.free_blocks >= 0
    assert e.preemptions > 0 and sum(r.preemptions for r in requests) == e.preemptions
    # vLLM 0.32 counts a prompt once ("not post-preemption repeat prefills"): the door's prefill estimate and
    # the law's prefill share read this counter, and a recompute is no prompt drained from the queue.
    assert prompt_tokens_counted(metrics) == 4 * 200
    assert all(r.generated == 100 and r.finish_reason == "length" for r in requests)
    assert e.free_blocks == e.num_gpu_blocks  # every block came back


def test_a_model_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        Engine(GPUS["t4"], MODELS["dense-67b"])


def _shapes(text: str) -> dict[str, tuple[str, frozenset[str], tuple[str, ...]]]:
    """family -> (type, label names without le, bucket bounds as the text says them)."""
    shapes = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        buckets = tuple(dict.fromkeys(s.labels["le"] for s in family.samples if "le" in s.labels))
        shapes[family.name] = (family.type, labels, buckets)
    return shapes


def simulated_exposition(vllm_version: str = DEFAULT_VLLM_VERSION) -> str:
    e = engine()
    metrics = VllmMetrics(e, "deepseek-sim", vllm_version=vllm_version)
    for i in range(6):
        e.add(SimRequest(f"r{i}", 300, 20, 0.0))
    for step in drain(e):
        metrics.observe_step(step)
    return metrics.render().decode()


def check_fidelity(real_text: str, vllm_version: str = DEFAULT_VLLM_VERSION) -> None:
    real, ours = _shapes(real_text), _shapes(simulated_exposition(vllm_version))
    for name in CORE | dialect(vllm_version):
        assert name in real, f"{name} is not in the real exposition: the CORE list is out of date"
        assert ours.get(name) == real[name], f"{name}: simulator {ours.get(name)} != vLLM {real[name]}"
    cache = "vllm:cache_config_info"
    assert CACHE_LABELS_USED <= ours[cache][1] <= real[cache][1], (ours[cache][1], real[cache][1])


def test_the_simulators_families_match_a_captured_vllm(vllm_exposition: str) -> None:
    check_fidelity(vllm_exposition)


def test_the_simulator_speaks_each_releases_dialect(release_capture: Path) -> None:
    """With --vllm-version, the simulator's families match that release's capture, deprecated twins included."""
    version = release_of(release_capture)
    real = release_capture.read_text()
    check_fidelity(real, version)
    # A deprecated name the release does not have is not invented either.
    for name in DIALECTS[0][1] - dialect(version):
        assert name not in _shapes(real) and name not in _shapes(simulated_exposition(version)), (version, name)


@pytest.mark.vllm
def test_the_simulators_families_match_a_live_vllm(vllm_server: VllmServer) -> None:
    vllm_server.complete(max_tokens=4)
    check_fidelity(vllm_server.metrics_text())


def test_simulated_metrics_count_what_the_engine_did() -> None:
    text = simulated_exposition()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    base = (("engine", "0"), ("model_name", "deepseek-sim"))
    assert samples[("vllm:request_success_total", tuple(sorted((*base, ("finished_reason", "length")))))] == 6
    assert samples[("vllm:generation_tokens_total", base)] == 6 * 20
    assert samples[("vllm:prompt_tokens_total", base)] == 6 * 300
    assert samples[("vllm:time_to_first_token_seconds_count", base)] == 6
    assert samples[("vllm:inter_token_latency_seconds_count", base)] == 6 * 19
    assert samples[("vllm:num_requests_running", base)] == 0


def test_the_published_profile_reproduces_its_measurement_and_keeps_rising_with_the_batch() -> None:
    def rate(concurrency: int) -> float:
        engine = Engine(GPUS["a100-40g"], MODELS["llama-3.1-8b"], max_num_seqs=256)
        run = closed_loop(engine, concurrency, 20 * concurrency, prompt_tokens=(PUBLISHED["prompt"],),
                          output_tokens=(PUBLISHED["output"],))  # fmt: skip
        return run.output_tokens_per_second

    one, eight = rate(1), rate(8)
    assert one == pytest.approx(PUBLISHED["concurrency_1_tokens_per_second"], rel=0.1)
    assert eight / one == pytest.approx(PUBLISHED["concurrency_8_speedup"], rel=0.1)
    assert one < eight < rate(32) < rate(128), "no throughput wall before KV binds, unlike the article's profile"


def decode_step(gpu: str, model: str, batch: int, context: int) -> float:
    """One decode step's seconds at ``batch`` running requests of ``context`` cached tokens each."""
    engine = Engine(GPUS[gpu], MODELS[model], max_num_seqs=1024)
    kv = engine.kv_bytes_read(batch * context, batch)
    return engine.step_seconds(batch, 0, kv, engine.model.weights_read(batch))


def test_the_deepseek_profiles_hold_their_calibration_and_the_recipes_trade_offs() -> None:
    """DP8+EP on H200 decodes ~2.2k tokens/s a GPU at 256 a rank (vLLM's published wide-EP figure, the profile's
    anchor, profiles.py); prefill ~6k tokens/s a GPU; TP8+EP is the faster at batch 1 and DP8+EP per GPU at high
    load, as vLLM's recipe says; 99 GB of weights a GPU do not fit an 80 GB H100, where DP16+EP does."""
    assert 256 / decode_step("h200", "deepseek-v3-dp8ep", 256, 2000) == pytest.approx(2200, rel=0.05)
    engine = Engine(GPUS["h200"], MODELS["deepseek-v3-dp8ep"])
    assert 8192 / engine.step_seconds(1, 8192, 0, engine.model.weights_read(8192)) == pytest.approx(6000, rel=0.05)
    model = MODELS["deepseek-v3-dp8ep"]
    assert model.weights_read(1) < model.weights_read(8) < model.weights_read(64) <= model.resident_bytes
    assert model.weights_read(64) > 0.99 * model.resident_bytes  # 512 tokens over 8 ranks reach every expert
    tp_batch1, dp_batch1 = (decode_step("h200", f"deepseek-v3-{m}", 1, 2000) for m in ("tp8ep", "dp8ep"))
    assert tp_batch1 < dp_batch1
    tp_per_gpu = 256 / decode_step("h200", "deepseek-v3-tp8ep", 256, 2000) / 8  # one engine over 8 GPUs
    assert tp_per_gpu < 256 / decode_step("h200", "deepseek-v3-dp8ep", 256, 2000)
    with pytest.raises(ValueError, match="does not fit"):
        Engine(GPUS["h100"], MODELS["deepseek-v3-dp8ep"])
    assert Engine(GPUS["h100"], MODELS["deepseek-v3-dp16ep"]).num_gpu_blocks > 0
