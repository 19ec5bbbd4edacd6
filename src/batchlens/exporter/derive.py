"""Derive batchlens' KV-block and batch view from a vLLM exposition. Pure.

vLLM reports KV usage as a fraction and the block count only as a label of
``vllm:cache_config_info``; it reports no batch limit at all. The exporter turns
these into plain gauges with one consistent label set:
``{vllm_instance, model_name, engine}``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from prometheus_client.metrics_core import Metric

from batchlens.admin_api import BatchState
from batchlens.exporter import families as fam
from batchlens.exporter.parser import Family

CACHE_CONFIG = "vllm:cache_config_info"
# vLLM 0.10 renamed gpu_cache_usage_perc to kv_cache_usage_perc; read either.
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = "vllm:num_requests_running"


def _labelled_values(families: Iterable[Family], name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample named ``name``; labels are decoded only for these."""
    return [(dict(s[0].labels), s[1]) for f in families if f.name == name for s in f.samples if s[0].name == name]


def _engine_labels(base: Mapping[str, str], model_name: str, engine: str) -> dict[str, str]:
    return {**base, "model_name": model_name, "engine": engine}


def engines_seen(families: list[Family]) -> list[tuple[str, str]]:
    """The (model_name, engine) pairs the exposition reports, from its running gauge."""
    pairs = {(lbl.get("model_name", ""), lbl.get("engine", "")) for lbl, _ in _labelled_values(families, RUNNING)}
    return sorted(pairs)


def kv_block_metrics(families: list[Family], base: Mapping[str, str]) -> list[Metric]:
    """``batchlens_kv_blocks_total`` and ``_used`` per engine.

    vLLM computes the usage fraction as used/total blocks, so total x fraction,
    rounded, is the used block count.
    """
    totals: dict[str, int] = {}
    for labels, _ in _labelled_values(families, CACHE_CONFIG):
        blocks = labels.get("num_gpu_blocks", "")
        if blocks.isascii() and blocks.isdigit():  # "²" is a digit to isdigit(), and not to int()
            totals[labels.get("engine", "")] = int(blocks)
    usage: dict[str, tuple[str, float]] = {}
    for name in KV_USAGE:
        for labels, value in _labelled_values(families, name):
            usage.setdefault(labels.get("engine", ""), (labels.get("model_name", ""), value))
        if usage:
            break

    total_samples, used_samples = [], []
    for engine, blocks in sorted(totals.items()):
        model_name, ratio = usage.get(engine, ("", None))
        labels = _engine_labels(base, model_name, engine)
        total_samples.append((labels, blocks))
        if ratio is not None and math.isfinite(ratio):  # NaN (no blocks yet) gives no used count, nor does Inf
            used_samples.append((labels, round(blocks * ratio)))
    if not total_samples:
        return []
    return [
        fam.gauge(
            "batchlens_kv_blocks_total",
            "KV cache blocks the engine allocated (num_gpu_blocks of vllm:cache_config_info).",
            total_samples,
        ),
        fam.gauge(
            "batchlens_kv_blocks_used",
            "KV cache blocks in use: num_gpu_blocks x vllm:kv_cache_usage_perc.",
            used_samples,
        ),
    ]


def batch_metrics(state: BatchState, families: list[Family], base: Mapping[str, str]) -> list[Metric]:
    """``batchlens_batch_limit`` and ``batchlens_batch_capacity`` from the admin API.

    With data parallelism the admin API reports each engine core, numbered as
    vLLM's ``engine`` label numbers them; an engine it does not list gets the
    server-wide values.
    """
    per_engine = {str(e.engine): e for e in state.engines}
    pairs = engines_seen(families) or [("", "")]
    limits, capacities = [], []
    for model_name, engine in pairs:
        labels = _engine_labels(base, model_name, engine)
        own = per_engine.get(engine, state)
        limits.append((labels, own.max_num_active_seqs))
        capacities.append((labels, own.max_num_seqs))
    return [
        fam.gauge(
            "batchlens_batch_limit",
            "Admission limit into the running batch (max_num_active_seqs), from the batchlens admin API.",
            limits,
        ),
        fam.gauge(
            "batchlens_batch_capacity",
            "The engine's batch capacity (max_num_seqs), from the batchlens admin API.",
            capacities,
        ),
    ]
