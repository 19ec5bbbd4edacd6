"""KV cache and scheduler: where the batch's memory goes, and what the scheduler does about it."""

from __future__ import annotations

from batchlens.config import Thresholds
from batchlens.dashboards.kit import SEL, dashboard, place, timeseries
from batchlens.rules.recording import LEVEL

BY = "cluster, vllm_instance"


def kv_cache(thresholds: Thresholds) -> dict:
    blocks = f"sum by ({BY}) (batchlens_kv_blocks_{{kind}}{{{{{SEL}}}}})"
    panels = place(
        [
            (
                8,
                [
                    (timeseries("KV blocks used and total",
                                (blocks.format(kind="used"), "{{vllm_instance}} used"),
                                (blocks.format(kind="total"), "{{vllm_instance}} total"),
                                description="Paged-attention blocks allocated, against the blocks the GPU holds."), 12),
                    (timeseries("KV cache usage", (f"{LEVEL}_engine:vllm_kv_cache_usage:ratio{{{SEL}}}",
                                                   "{{vllm_instance}} engine {{engine}}"),
                                unit="percentunit", threshold=thresholds.kv_blocks_ratio,
                                description="Past the line new requests start to wait for blocks, then preempt."), 12),
                ],
            ),
            (
                8,
                [
                    (timeseries("Running and waiting",
                                (f"{LEVEL}:vllm_num_requests_running:sum{{{SEL}}}", "{{vllm_instance}} running"),
                                (f"{LEVEL}:vllm_num_requests_waiting:sum{{{SEL}}}", "{{vllm_instance}} waiting")), 12),
                    (timeseries("Batch limit and capacity",
                                (f"max by ({BY}) (batchlens_batch_limit{{{SEL}}})", "{{vllm_instance}} limit"),
                                (f"max by ({BY}) (batchlens_batch_capacity{{{SEL}}})", "{{vllm_instance}} capacity"),
                                description="The admission limit (max_num_active_seqs) against max_num_seqs."), 12),
                ],
            ),
            (
                8,
                [
                    (timeseries("Batch efficiency (tokens/s per running sequence)",
                                (f"{LEVEL}:vllm_batch_efficiency:ratio1m{{{SEL}}}", "{{vllm_instance}}"),
                                description="Falls as the batch grows: each sequence gets a smaller share of the "
                                "GPU's memory bandwidth. A steep fall means the batch is past its knee."), 8),
                    (timeseries("Preemptions per second",
                                (f"{LEVEL}:vllm_num_preemptions:rate1m{{{SEL}}}", "{{vllm_instance}}")), 8),
                    (timeseries("Prefix cache hit ratio",
                                (f"{LEVEL}:vllm_prefix_cache_hit:ratio5m{{{SEL}}}", "{{vllm_instance}}"),
                                unit="percentunit"), 8),
                ],
            ),
            (
                8,
                [
                    (timeseries("Queue time",
                                (f"{LEVEL}:vllm_request_queue_time_seconds:p50_1m{{{SEL}}}", "{{vllm_instance}} P50"),
                                (f"{LEVEL}:vllm_request_queue_time_seconds:p99_1m{{{SEL}}}", "{{vllm_instance}} P99"),
                                unit="s", description="Time requests wait before their first scheduling."), 24),
                ],
            ),
        ]
    )  # fmt: skip
    return dashboard(
        "kv_cache",
        "KV cache and scheduler",
        "KV blocks, the running batch against its limit, and the cost of a big batch: efficiency, preemptions.",
        panels,
    )
