"""Pure merge logic: derived KV/batch metrics and rendering a snapshot. No servers, no fakes.

Input is the real vLLM 0.32 exposition in tests/data, edited where a case needs it, and each release's
capture in tests/data/releases.
"""

from __future__ import annotations

import re
from pathlib import Path

from batchlens.admin_api import BatchState, combine
from batchlens.exporter.derive import batch_metrics, kv_block_metrics
from batchlens.exporter.parser import ExpositionReader
from batchlens.exporter.render import family_blocks, render
from batchlens.exporter.snapshot import Reading, SnapshotStore, SourceState
from harness.exporter import one, parse_samples, pick


def _num_gpu_blocks(text: str) -> int:
    return int(re.search(r'num_gpu_blocks="(\d+)"', text).group(1))


def _with_usage(text: str, usage: str) -> str:
    return re.sub(r"(vllm:kv_cache_usage_perc\{[^}]*\}) \S+", rf"\1 {usage}", text)


def _state(name: str, text: str, *, up: bool = True, admin: BatchState | None = None) -> SourceState:
    base = {"vllm_instance": name}
    families = ExpositionReader(base).parse(text)
    metrics = kv_block_metrics(families, base) + (batch_metrics(admin, families, base) if admin else [])
    reading = Reading(blocks=family_blocks(families), metrics=tuple(metrics))
    return SourceState("vllm", (("vllm_instance", name),), up, reading if up else None, 1.0, 0.01, {})


def test_kv_blocks_come_from_cache_config_and_usage(vllm_exposition: str) -> None:
    total = _num_gpu_blocks(vllm_exposition)
    text = _with_usage(vllm_exposition, "0.25")
    out = parse_samples(render(_snapshot(_state("a", text))).decode())
    labels = {"vllm_instance": "a", "engine": "0"}
    assert one(out, "batchlens_kv_blocks_total", **labels) == total
    assert one(out, "batchlens_kv_blocks_used", **labels) == round(total * 0.25)
    model = re.search(r'vllm:kv_cache_usage_perc\{[^}]*model_name="([^"]*)"', text).group(1)
    assert one(out, "batchlens_kv_blocks_used", model_name=model) == round(total * 0.25)


def test_kv_usage_falls_back_to_the_pre_0_10_name(vllm_exposition: str) -> None:
    text = _with_usage(vllm_exposition, "0.5").replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    base = {"vllm_instance": "old"}
    used = kv_block_metrics(ExpositionReader(base).parse(text), base)[1]
    assert [s.value for s in used.samples] == [round(_num_gpu_blocks(text) * 0.5)]


def test_every_release_gives_kv_blocks_and_a_batch_limit_per_engine(release_capture: Path) -> None:
    """On each release's own capture (under load, so blocks are in use): the derived gauges and their labels."""
    release_exposition = release_capture.read_text()
    total = _num_gpu_blocks(release_exposition)
    src = parse_samples(release_exposition)
    usage = pick(src, "vllm:kv_cache_usage_perc") or pick(src, "vllm:gpu_cache_usage_perc")
    state = BatchState(max_num_seqs=32, max_num_active_seqs=4, num_running=4, num_waiting=8)
    out = parse_samples(render(_snapshot(_state("r", release_exposition, admin=state))).decode())
    engine = {"vllm_instance": "r", "engine": "0"}
    assert one(out, "batchlens_kv_blocks_total", **engine) == total
    assert one(out, "batchlens_kv_blocks_used", **engine) == round(total * next(iter(usage.values()))) > 0
    model = dict(next(iter(pick(src, "vllm:num_requests_running"))))["model_name"]
    assert one(out, "batchlens_batch_limit", **engine, model_name=model) == 4
    assert one(out, "batchlens_batch_capacity", **engine, model_name=model) == 32


def test_no_cache_config_means_no_kv_metrics() -> None:
    text = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    assert kv_block_metrics(ExpositionReader().parse(text), {}) == []


def test_batch_limit_is_labelled_like_the_engine(vllm_exposition: str) -> None:
    state = BatchState(max_num_seqs=32, max_num_active_seqs=8, num_running=3, num_waiting=0)
    out = parse_samples(render(_snapshot(_state("a", vllm_exposition, admin=state))).decode())
    assert one(out, "batchlens_batch_limit", vllm_instance="a", engine="0") == 8
    assert one(out, "batchlens_batch_capacity", vllm_instance="a", engine="0") == 32


def test_with_data_parallelism_each_engine_gets_its_own_limit(vllm_exposition: str) -> None:
    running = re.search(r"^vllm:num_requests_running\{.*$", vllm_exposition, re.M).group(0)
    two_engines = vllm_exposition.replace(running, running + "\n" + running.replace('engine="0"', 'engine="1"'))
    state = combine(
        [
            {"engine": 0, "max_num_seqs": 32, "max_num_active_seqs": 8, "num_running": 3, "num_waiting": 0},
            {"engine": 1, "max_num_seqs": 32, "max_num_active_seqs": 4, "num_running": 4, "num_waiting": 2},
        ]
    )
    out = parse_samples(render(_snapshot(_state("a", two_engines, admin=state))).decode())
    assert one(out, "batchlens_batch_limit", vllm_instance="a", engine="0") == 8
    assert one(out, "batchlens_batch_limit", vllm_instance="a", engine="1") == 4


def _snapshot(*states: SourceState):
    store = SnapshotStore()
    for s in states:
        store.publish(s)
    return store.snapshot()


def test_two_engines_render_one_family_with_one_header(vllm_exposition: str) -> None:
    body = render(_snapshot(_state("a", vllm_exposition), _state("b", vllm_exposition))).decode()
    assert body.count("# TYPE vllm:num_requests_running gauge\n") == 1
    assert body.count("# TYPE batchlens_kv_blocks_total gauge\n") == 1
    out = parse_samples(body)  # prometheus_client accepts the merged exposition
    src = parse_samples(vllm_exposition)
    for name in ("a", "b"):
        mine = {(n, lbl - {("vllm_instance", name)}) for (n, lbl) in out if ("vllm_instance", name) in lbl}
        assert set(src) <= mine, f"engine {name} lost samples"
    assert len(pick(out, "vllm:num_requests_running")) == 2


def test_a_family_several_engines_serve_takes_the_first_header_given_and_their_samples_in_order() -> None:
    """An engine may serve a family without a header (untyped), or with its own HELP: the first header seen is the
    family's, once, and every engine's samples follow it in the snapshot's order."""
    bare, b, c = (
        "foo 1\n",
        "# HELP foo from b\n# TYPE foo gauge\nfoo 2\n",
        "# HELP foo from c\n# TYPE foo gauge\nfoo 3\n",
    )
    body = render(_snapshot(_state("a", bare), _state("b", b), _state("c", c))).decode()
    samples = 'foo{vllm_instance="a"} 1\nfoo{vllm_instance="b"} 2\nfoo{vllm_instance="c"} 3\n'
    assert body.startswith("# HELP foo from b\n# TYPE foo gauge\n" + samples), body


def test_a_down_source_has_no_series_but_its_status(vllm_exposition: str) -> None:
    down = _state("b", vllm_exposition, up=False)
    down = SourceState(down.source, down.labels, False, None, 1.0, 3.0, {"timeout": 2})
    out = parse_samples(render(_snapshot(_state("a", vllm_exposition), down)).decode())
    assert not pick(out, "vllm:num_requests_running", vllm_instance="b")
    assert pick(out, "vllm:num_requests_running", vllm_instance="a")
    assert one(out, "batchlens_source_up", vllm_instance="b") == 0
    assert one(out, "batchlens_source_up", vllm_instance="a") == 1
    assert one(out, "batchlens_source_errors_total", vllm_instance="b", reason="timeout") == 2


def test_an_engine_cannot_serve_the_exporters_own_families(vllm_exposition: str) -> None:
    """A family an engine serves under one of the exporter's names would spoof it (an up of 1 for a dead GPU) and
    give the exposition a second header, which strict parsers refuse."""
    spoof = '# TYPE batchlens_source_up gauge\nbatchlens_source_up{source="nvml"} 1\n'
    body = render(_snapshot(_state("a", vllm_exposition + spoof))).decode()
    assert body.count("# TYPE batchlens_source_up gauge") == 1
    out = parse_samples(body)
    assert not pick(out, "batchlens_source_up", source="nvml") and pick(out, "vllm:num_requests_running")


def test_an_infinite_kv_usage_or_an_odd_digit_of_blocks_gives_no_count_and_no_error(vllm_exposition: str) -> None:
    base = {"vllm_instance": "a"}
    infinite = kv_block_metrics(ExpositionReader(base).parse(_with_usage(vllm_exposition, "+Inf")), base)
    assert [m.name for m in infinite] == ["batchlens_kv_blocks_total", "batchlens_kv_blocks_used"]
    assert infinite[1].samples == []
    odd = re.sub(r'num_gpu_blocks="\d+"', 'num_gpu_blocks="\u00b2"', vllm_exposition)
    assert kv_block_metrics(ExpositionReader(base).parse(odd), base) == []
