"""KV cache and scheduler: where the batch's memory goes, and what the scheduler does about it."""

from __future__ import annotations

from batchlens.config import Thresholds
from batchlens.dashboards.kit import SEL, dashboard, place, timeseries
from batchlens.rules.alerts import STRAGGLER
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
                    (timeseries("Data-parallel ranks: batch",
                                (f"{LEVEL}_engine:vllm_num_requests_running:avg1m{{{SEL}}}",
                                 "{{vllm_instance}} rank {{engine}}"),
                                description="Each DP rank's running batch, side by side (vLLM's engine label is the "
                                "rank). The ranks of a DP+EP deployment step in lock step: the largest sets every "
                                "rank's step time."), 12),
                    (timeseries("Data-parallel ranks: load against the mean",
                                (f"{LEVEL}_engine:vllm_dp_rank_load:ratio1m{{{SEL}}}",
                                 "{{vllm_instance}} rank {{engine}}"),
                                threshold=STRAGGLER,
                                description="Each rank's batch over its engine's mean. Past the line (for 10 "
                                "minutes, at 8 requests or more) VllmDpRankStraggler fires. Empty for an engine of "
                                "one rank."), 12),
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
        "KV blocks, the running batch against its limit, its data-parallel ranks side by side, and the cost of a big "
        "batch: efficiency, preemptions.",
        panels,
    )
