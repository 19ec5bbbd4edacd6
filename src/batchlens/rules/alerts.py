"""Alert rules: the article's three thresholds (docs/architecture.md names them) and the source watchdog. Pure."""

from __future__ import annotations

from batchlens.config import Links, Thresholds
from batchlens.gpu_faults import THROTTLE_REASONS, critical_pattern
from batchlens.rules.recording import (
    CURRENT_REPLICAS,
    DESIRED_REPLICAS,
    LEVEL,
    LEVEL_ENGINE,
    WHERE,
    slo_ratio_name,
    slow_ratio_name,
)

BUDGET = 0.01  # the P99 SLO: at most 1% of requests slower than the breaker's threshold
SHED_SHARE = 0.05  # refused at the door past this share for 5 minutes: missing capacity, a page
# A DP rank running this many times its engine's mean batch, at this batch or more (a few requests more on an
# idle rank are noise, not a straggler), for 10 minutes.
STRAGGLER, STRAGGLER_BATCH = 1.5, 8

REPLICAS_SHORT_FOR = "15m"  # the scaling signal above the replicas serving this long: the autoscaler is not following
XID_WINDOW = "1h"  # an Xid pages for this long after it, whether or not the exporter restarted since

RUNBOOKS = "docs/runbooks"  # each alert has docs/runbooks/<AlertName>.md
# An empty var-cluster (no cluster label) matches the series without one, as the label does in PromQL.
DASHBOARD = (
    "/d/batchlens-overview/batchlens?var-cluster={{ $labels.cluster }}&var-vllm_instance={{ $labels.vllm_instance }}"
)


def _alert(links: Links, name: str, expr: str, duration: str, severity: str, summary: str, description: str) -> dict:
    rule = {"alert": name, "expr": expr}
    if duration not in ("0s", "0m", "0"):
        rule["for"] = duration
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {
        "summary": summary,
        "description": description,
        "runbook_url": f"{links.runbook_url or RUNBOOKS}/{name}.md",
        "dashboard_url": links.grafana_url + DASHBOARD,
    }
    return rule


def _burn(latency: str, pairs: tuple[tuple[str, str, float], ...]) -> str:
    """Multiwindow burn rate: each (long, short, factor) fires when both windows burn factor x the 1% budget."""
    clauses = []
    for long, short, factor in pairs:
        rate = f"{factor * BUDGET:g}"
        clauses.append(f"({slo_ratio_name(latency, long)} > {rate} and {slo_ratio_name(latency, short)} > {rate})")
    return " or ".join(clauses)


def alert_rules(thresholds: Thresholds, links: Links | None = None) -> list[dict]:
    """The alerts; ``links`` makes their runbook and dashboard URLs absolute."""
    links = links or Links()
    bandwidth = thresholds.bandwidth_ratio
    kv = thresholds.kv_blocks_ratio
    latency = thresholds.p99_latency
    slow = slow_ratio_name(latency, thresholds.p99_window)
    return [
        _alert(
            links,
            "VllmGpuMemoryBandwidthHigh",
            f"vllm_instance_model_name_gpu:batchlens_gpu_memory_bandwidth:ratio > {bandwidth}",
            thresholds.bandwidth_for,
            "warning",
            "GPU {{ $labels.gpu }} of {{ $labels.vllm_instance }} is memory-bandwidth bound",
            f"Memory busy or DRAM bandwidth ratio {{{{ $value | humanizePercentage }}}} has stayed above "
            f"{bandwidth:.0%} for {thresholds.bandwidth_for}: a larger batch will add latency, not throughput.",
        ),
        _alert(
            links,
            "VllmKvCacheBlocksHigh",
            f"{LEVEL_ENGINE}:vllm_kv_cache_usage:ratio > {kv}",
            thresholds.kv_blocks_for,
            "warning",
            "KV cache of {{ $labels.vllm_instance }} engine {{ $labels.engine }} is nearly full",
            f"{{{{ $value | humanizePercentage }}}} of the KV blocks are in use (threshold {kv:.0%}); "
            "preemptions and queueing follow when it fills.",
        ),
        _alert(
            links,
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
            links,
            "VllmLatencySloBurnFast",
            _burn(latency, (("1h", "5m", 14.4), ("6h", "30m", 6))),
            "2m",
            "critical",
            f"{{{{ $labels.vllm_instance }}}} burns its {latency.upper()} error budget fast",
            f"Requests slower than {thresholds.p99_seconds:g}s are eating the 1% error budget at 14.4x (1h) or 6x "
            "(6h) the sustainable rate: at this pace a 30-day budget is gone within days.",
        ),
        _alert(
            links,
            "VllmLatencySloBurnSlow",
            _burn(latency, (("1d", "2h", 3), ("3d", "6h", 1))),
            "15m",
            "warning",
            f"{{{{ $labels.vllm_instance }}}} burns its {latency.upper()} error budget steadily",
            f"Requests slower than {thresholds.p99_seconds:g}s exceed the 1% budget at 3x (1d) or 1x (3d) the "
            "sustainable rate: plan capacity or a smaller batch limit.",
        ),
        _alert(
            links,
            "VllmRequestsQueueing",
            f"{LEVEL}:vllm_num_requests_waiting:sum > 0 and deriv({LEVEL}:vllm_num_requests_waiting:sum[10m]) > 0",
            "10m",
            "warning",
            "Requests keep piling up in the queue of {{ $labels.vllm_instance }}",
            '{{ $value | printf "%.0f" }} requests are waiting and the queue has grown for 10 minutes: '
            "demand exceeds capacity at the current batch limit.",
        ),
        _alert(
            links,
            "VllmPreemptionsRising",
            f"{LEVEL}:vllm_num_preemptions:rate1m > 0",
            "5m",
            "warning",
            "{{ $labels.vllm_instance }} keeps preempting requests",
            '{{ $value | printf "%.2f" }} preemptions per second for 5 minutes: the KV cache is too small for '
            "the batch, and preempted requests recompute their prompts.",
        ),
        _alert(
            links,
            "VllmDpRankStraggler",
            f"{LEVEL_ENGINE}:vllm_dp_rank_load:ratio1m > {STRAGGLER} and {LEVEL_ENGINE}:vllm_num_requests_running:avg1m"
            f" >= {STRAGGLER_BATCH}",
            "10m",
            "warning",
            "DP rank {{ $labels.engine }} of {{ $labels.vllm_instance }} carries more than its share of the batch",
            'Rank {{ $labels.engine }} has run {{ $value | printf "%.1f" }}x its engine\'s mean batch for 10 '
            "minutes. The ranks of a DP+EP deployment step in lock step: this one sets every rank's step time.",
        ),
        _alert(
            links,
            "VllmBreakerColdStart",
            f'max by ({WHERE}, vllm_instance) (batchlens_breaker_state{{state="cold_start"}}) == 1',
            "15m",
            "critical",
            "{{ $labels.vllm_instance }} has been in cold-start mode for 15 minutes",
            "The remediation hook cut the batch limit to the cold-start limit after repeated P99 breaches, and the "
            "breaker has not recovered: the engine serves one request at a time. A human is needed.",
        ),
        _alert(
            links,
            "VllmAdmissionShedding",
            f"{LEVEL}_class:batchlens_door_refusals:ratio5m > {SHED_SHARE}",
            "5m",
            "critical",
            "{{ $labels.vllm_instance }} refuses {{ $value | humanizePercentage }} of its "
            "{{ $labels.priority_class }} requests at the door",
            f"For 5 minutes more than {SHED_SHARE:.0%} of the {{{{ $labels.priority_class }}}} requests reaching "
            "this engine were refused with a 503 by its queued-token or queued-request cap "
            "(batchlens_door_refusals_total). The ones admitted meet their TTFT; the rest needed capacity that is "
            "not there. This is a capacity page: no batch limit or cap brings the refused share back.",
        ),
        _alert(
            links,
            "VllmPriorityInversion",
            f"({LEVEL}:vllm_num_requests_waiting:sum > 0)"
            f" and on ({WHERE}, vllm_instance) ({LEVEL}:vllm_num_requests_running:sum"
            f" >= {LEVEL}:batchlens_batch_limit:max)"
            f' and on ({WHERE}, vllm_instance) (batchlens_engine_role{{role="interactive"}} == 1)',
            "1m",
            "warning",
            "Interactive requests wait behind a full batch on {{ $labels.vllm_instance }}",
            '{{ $value | printf "%.0f" }} requests have waited for a minute on an engine that serves the '
            "interactive class, while its running batch is at the batch limit. vLLM does not preempt for "
            "priority when the limit binds, so a priority does not help: the interactive class needs room.",
        ),
        _alert(
            links,
            "BatchlensReplicasShort",
            f"{DESIRED_REPLICAS} > {CURRENT_REPLICAS}",
            REPLICAS_SHORT_FOR,
            "warning",
            "{{ with $labels.vllm_instance }}{{ . }}{{ else }}Role {{ $labels.role }}{{ end }} wants "
            '{{ $value | printf "%.0f" }} replicas and has fewer',
            f"For {REPLICAS_SHORT_FOR} {DESIRED_REPLICAS} (its arrivals with headroom over what a replica served "
            f"at saturation) has stayed above {CURRENT_REPLICAS}, the servers serving: the autoscaler does "
            "not follow (off, at its maximum, or its new pods wait for GPUs). Requests are shed or queue meanwhile.",
        ),
        _alert(
            links,
            "BatchlensRouterDown",
            'batchlens_source_up{source="litellm"} == 0',
            "1m",
            "critical",
            "The LiteLLM proxy in front of the engines does not answer",
            "The exporter has not reached the proxy's liveness route for a minute (routing.proxy_url): clients "
            "get nothing while every engine looks idle and healthy.",
        ),
        *gpu_alerts(links),
        _alert(
            links,
            "BatchlensSourceDown",
            'batchlens_source_up{gpu="", source!="litellm"} == 0',
            "2m",
            "warning",
            "batchlens cannot read {{ $labels.source }} {{ $labels.vllm_instance }}",
            "The exporter's last samples of this source failed; see batchlens_source_errors_total for the reason.",
        ),
    ]


def gpu_alerts(links: Links) -> list[dict]:
    """A GPU that fails: lost, its driver gone, a critical Xid, its memory failing, slowing itself down."""
    where = "GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on {{ $labels.instance }}"
    serving = (" {{ with $labels.vllm_instance }}It serves {{ . }}: the ranks of a DP+EP engine step in lock step, so"
               " one GPU stalls them all.{{ end }}")  # fmt: skip
    critical = f'batchlens_gpu_xid_errors_total{{xid=~"{critical_pattern()}"}}'
    return [
        _alert(
            links,
            "BatchlensGpuLost",
            'batchlens_source_up{source="nvml", gpu!=""} == 0',
            "1m",
            "critical",
            f"{where} is lost",
            "NVML answers GpuIsLost (or an unknown error) for this GPU: it fell off the bus, or the driver cannot "
            f"reach it. Its series are gone and its engine cannot use it.{serving}",
        ),
        _alert(
            links,
            "BatchlensGpuDriverGone",
            "batchlens_pci_nvidia_gpus > 0 and batchlens_nvml_driver_present == 0",
            "2m",
            "critical",
            "The NVIDIA driver on {{ $labels.instance }} is gone",
            '{{ $value | printf "%.0f" }} NVIDIA GPUs are on the PCI bus and no driver answers NVML: it was '
            "unloaded, crashed, or its container stopped. Every GPU of this node is out of service. A CPU node "
            "(no NVIDIA GPU on its bus) never fires this.",
        ),
        _alert(
            links,
            "BatchlensGpuXidCritical",
            # A series appears with its first Xid, and increase() sees no rise from nothing: so also a count that
            # was not there an hour ago.
            f"increase({critical}[{XID_WINDOW}]) > 0 or ({critical} > 0 unless {critical} offset {XID_WINDOW})",
            "0s",
            "critical",
            f"{where} reported Xid {{{{ $labels.xid }}}}",
            f"The driver reported a critical Xid within the last {XID_WINDOW} (48: double-bit ECC; 63/64: row "
            f"remapping; 74: NVLink; 79: fallen off the bus; 94/95: ECC; 119/120: GSP). The GPU needs a reset "
            f"or a replacement, not a smaller batch.{serving}",
        ),
        _alert(
            links,
            "BatchlensGpuEccUncorrectable",
            f'increase(batchlens_gpu_ecc_errors_total{{type="uncorrected"}}[{XID_WINDOW}]) > 0',
            "0s",
            "critical",
            f"{where} has uncorrectable ECC errors",
            f'{{{{ $value | printf "%.0f" }}}} uncorrectable memory errors within the last {XID_WINDOW}: data in '
            f"device memory was lost, and the processes that held it may have failed.{serving}",
        ),
        _alert(
            links,
            "BatchlensGpuRowRemapPending",
            "batchlens_gpu_row_remapping_pending == 1",
            "5m",
            "warning",
            f"{where} waits for a reset to remap a memory row",
            "A failing memory row is marked for remapping, which takes effect at the GPU's next reset. Until "
            "then the row can fail again: drain the node and reset the GPU at the next quiet hour.",
        ),
        _alert(
            links,
            "BatchlensGpuRowRemapFailed",
            "batchlens_gpu_row_remapping_failed == 1",
            "0s",
            "critical",
            f"{where} could not remap a memory row",
            f"The GPU has no spare row left for a failing one: its memory faults will now surface as "
            f"uncorrectable errors. Drain the node and replace the GPU (an RMA).{serving}",
        ),
        _alert(
            links,
            "BatchlensGpuThrottled",
            f'batchlens_gpu_clock_event_active{{reason=~"{THROTTLE_REASONS}"}} == 1',
            "2m",
            "warning",
            f"{where} holds its clocks down: {{{{ $labels.reason }}}}",
            "The GPU has slowed itself for two minutes to protect itself (heat, power, a hardware signal), not "
            "for a power cap it was given. Every step of its engine is slower: look at cooling and power before "
            f"the batch.{serving}",
        ),
    ]
