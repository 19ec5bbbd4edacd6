"""Alert rules: the article's three thresholds (DESIGN.md names them) and the source watchdog. Pure."""

from __future__ import annotations

from batchlens.config import Thresholds
from batchlens.rules.recording import LEVEL_ENGINE, slow_ratio_name

RUNBOOKS = "docs/runbooks"  # each alert has docs/runbooks/<AlertName>.md
DASHBOARD = "/d/batchlens-overview/batchlens?var-vllm_instance={{ $labels.vllm_instance }}"  # Grafana-relative


def _alert(name: str, expr: str, duration: str, severity: str, summary: str, description: str) -> dict:
    rule = {"alert": name, "expr": expr}
    if duration != "0s":
        rule["for"] = duration
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {
        "summary": summary,
        "description": description,
        "runbook_url": f"{RUNBOOKS}/{name}.md",
        "dashboard_url": DASHBOARD,
    }
    return rule


def alert_rules(thresholds: Thresholds) -> list[dict]:
    bandwidth = thresholds.bandwidth_ratio
    kv = thresholds.kv_blocks_ratio
    latency = thresholds.p99_latency
    slow = slow_ratio_name(latency, thresholds.p99_window)
    return [
        _alert(
            "VllmGpuMemoryBandwidthHigh",
            f"vllm_instance_model_name_gpu:batchlens_gpu_memory_bandwidth:ratio > {bandwidth}",
            thresholds.bandwidth_for,
            "warning",
            "GPU {{ $labels.gpu }} of {{ $labels.vllm_instance }} is memory-bandwidth bound",
            f"Memory busy or DRAM bandwidth ratio {{{{ $value | humanizePercentage }}}} has stayed above "
            f"{bandwidth:.0%} for {thresholds.bandwidth_for}: a larger batch will add latency, not throughput.",
        ),
        _alert(
            "VllmKvCacheBlocksHigh",
            f"{LEVEL_ENGINE}:vllm_kv_cache_usage:ratio > {kv}",
            "2m",
            "warning",
            "KV cache of {{ $labels.vllm_instance }} engine {{ $labels.engine }} is nearly full",
            f"{{{{ $value | humanizePercentage }}}} of the KV blocks are in use (threshold {kv:.0%}); "
            "preemptions and queueing follow when it fills.",
        ),
        _alert(
            "VllmP99LatencyBreaker",
            f"{slow} > 0.01",
            "0s",
            "critical",
            f"P99 {latency.upper()} of {{{{ $labels.vllm_instance }}}} engine {{{{ $labels.engine }}}} is over "
            f"{thresholds.p99_seconds:g}s",
            f"{{{{ $value | humanizePercentage }}}} of requests took longer than {thresholds.p99_seconds:g}s "
            f"({latency}) over the last {thresholds.p99_window}, so P99 is above it. The remediation hook halves "
            "the batch limit.",
        ),
        _alert(
            "BatchlensSourceDown",
            'batchlens_source_up{gpu=""} == 0',
            "2m",
            "warning",
            "batchlens cannot read {{ $labels.source }} {{ $labels.vllm_instance }}",
            "The exporter's last samples of this source failed; see batchlens_source_errors_total for the reason.",
        ),
    ]
