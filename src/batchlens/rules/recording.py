"""Recording rules, named ``level:metric:operation`` as in the monitoring mixins. Pure.

Every rule aggregates by ``vllm_instance`` and ``model_name`` (plus ``engine``
where a rule serves the per-engine breaker), so that dashboards and alerts
read one consistent label set. ``cluster`` and ``namespace`` pass through
where the series have them: a ruler above several clusters must keep them
apart, and the Prometheus Operator routes an alert by its namespace label.
Queries name vLLM 0.32's real series: counters end in ``_total`` and ``le`` bounds are the strings vLLM writes ("0.5").
Renamed metrics are read under both names with ``or``.
"""

from __future__ import annotations

from batchlens.config import Thresholds

WHERE = "cluster, namespace"
BY = f"{WHERE}, vllm_instance, model_name"
BY_ENGINE = f"{BY}, engine"
LEVEL = "vllm_instance_model_name"
LEVEL_ENGINE = "vllm_instance_model_name_engine"
WINDOWS = ("1m", "5m")
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))

#: latency name -> the vLLM histogram(s) behind it, newest name first (vLLM 0.10 renamed the ITL one).
LATENCIES: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "queue": ("vllm:request_queue_time_seconds",),
}
#: The bucket bounds of each latency histogram in vLLM 0.32: a breaker threshold must be one of them.
BUCKETS: dict[str, tuple[float, ...]] = {
    "ttft": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0),
    "itl": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "e2e": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0),
}  # fmt: skip
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def either(*queries: str) -> str:
    """The first query that has data: a metric read under its new and its old name."""
    return " or ".join(f"({q})" if len(queries) > 1 else q for q in queries)


def le(seconds: float) -> str:
    """A bucket bound as vLLM's prometheus_client writes it: 0.5 -> "0.5", 1 -> "1.0"."""
    return repr(float(seconds))


def slow_ratio_name(latency: str, window: str = "1m") -> str:
    return f"{LEVEL_ENGINE}:{LATENCIES[latency][0].replace(':', '_')}:slow_ratio{window}"


def _slow_ratio(latency: str, threshold: float, window: str) -> str:
    if threshold not in BUCKETS[latency]:
        raise ValueError(
            f"thresholds.p99_seconds={threshold} is not a bucket bound of vLLM's {latency} histogram, so no "
            f"query can count the requests slower than it exactly; pick one of {BUCKETS[latency]}"
        )
    parts = []
    for name in LATENCIES[latency]:
        fast = f'sum by ({BY_ENGINE}) (rate({name}_bucket{{le="{le(threshold)}"}}[{window}]))'
        total = f"sum by ({BY_ENGINE}) (rate({name}_count[{window}]))"
        parts.append(f"1 - {fast} / {total}")
    return either(*parts)


#: Windows of the latency SLO burn-rate alerts (the SRE workbook's multiwindow, multi-burn-rate scheme).
SLO_WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
#: vLLM's prompt-length bucket bounds nearest the article's 256/512/1024/2048 buckets.
PROMPT_LENGTH_BOUNDS = ("200.0", "500.0", "1000.0", "2000.0", "+Inf")


def slo_ratio_name(latency: str, window: str) -> str:
    return f"{LEVEL}:{LATENCIES[latency][0].replace(':', '_')}:slow_ratio{window}"


def recording_rules(thresholds: Thresholds) -> list[dict]:
    rules: list[dict] = []

    def record(name: str, expr: str) -> None:
        rules.append({"record": name, "expr": expr})

    for metric in ("request_success", "prompt_tokens", "generation_tokens", "num_preemptions"):
        record(f"{LEVEL}:vllm_{metric}:rate1m", f"sum by ({BY}) (rate(vllm:{metric}_total[1m]))")
    for names in LATENCIES.values():
        for window in WINDOWS:
            for label, q in QUANTILES:
                expr = either(
                    *(f"histogram_quantile({q}, sum by ({BY}, le) (rate({n}_bucket[{window}])))" for n in names)
                )
                record(f"{LEVEL}:{names[0].replace(':', '_')}:{label}_{window}", expr)
    threshold, window = thresholds.p99_seconds, thresholds.p99_window
    _slow_ratio(thresholds.p99_latency, threshold, window)  # the breaker's latency must have the bound
    for latency in ("ttft", "e2e", "itl"):
        if threshold in BUCKETS[latency]:
            record(slow_ratio_name(latency, window), _slow_ratio(latency, threshold, window))
    for slo_window in SLO_WINDOWS:
        by_instance = _slow_ratio(thresholds.p99_latency, threshold, slo_window).replace(BY_ENGINE, BY)
        record(slo_ratio_name(thresholds.p99_latency, slo_window), by_instance)
    record(
        f"{LEVEL}:vllm_prefix_cache_hit:ratio5m",
        f"sum by ({BY}) (rate(vllm:prefix_cache_hits_total[5m]))"
        f" / sum by ({BY}) (rate(vllm:prefix_cache_queries_total[5m]))",
    )
    bounds = "|".join(b.replace("+", "[+]") for b in PROMPT_LENGTH_BOUNDS)  # a regex without escapes
    record(
        f"{LEVEL}_le:vllm_request_prompt_tokens:ratio5m",
        f'sum by ({BY}, le) (rate(vllm:request_prompt_tokens_bucket{{le=~"{bounds}"}}[5m])) '
        f"/ ignoring (le) group_left sum by ({BY}) (rate(vllm:request_prompt_tokens_count[5m]))",
    )
    record(f"{LEVEL}:vllm_num_requests_running:sum", f"sum by ({BY}) (vllm:num_requests_running)")
    record(f"{LEVEL}:vllm_num_requests_waiting:sum", f"sum by ({BY}) (vllm:num_requests_waiting)")
    # Efficiency divides a 1m rate by the batch over the same minute (an instant would swing between 0 and
    # the limit as requests finish), and skips minutes with nothing running (x/0 is +Inf in PromQL).
    record(f"{LEVEL}:vllm_num_requests_running:avg1m", f"sum by ({BY}) (avg_over_time(vllm:num_requests_running[1m]))")
    record(
        f"{LEVEL}:vllm_batch_efficiency:ratio1m",
        f"{LEVEL}:vllm_generation_tokens:rate1m / ({LEVEL}:vllm_num_requests_running:avg1m > 0)",
    )
    record(f"{LEVEL_ENGINE}:vllm_kv_cache_usage:ratio", either(*(f"max by ({BY_ENGINE}) ({m})" for m in KV_USAGE)))
    # Data parallelism: vLLM's `engine` label is the DP rank. The ranks of a DP+EP deployment step in lock step,
    # so the rank with the largest batch sets every rank's step time: each rank's batch over the mean of its
    # engine's ranks, where there are two or more (a straggler reads above 1).
    running = f"{LEVEL_ENGINE}:vllm_num_requests_running:avg1m"
    record(running, f"sum by ({BY_ENGINE}) (avg_over_time(vllm:num_requests_running[1m]))")
    record(
        f"{LEVEL_ENGINE}:vllm_dp_rank_load:ratio1m",
        f"({running} / on ({BY}) group_left avg by ({BY}) ({running})) and on ({BY}) (count by ({BY}) ({running}) > 1)",
    )
    # GPU series carry vllm_instance and model_name once mapped to an engine: join on them, skip the unmapped.
    record(
        "vllm_instance_model_name_gpu:batchlens_gpu_sm_busy:ratio",
        f'max by ({BY}, gpu) (batchlens_gpu_sm_busy_ratio{{vllm_instance!=""}})',
    )
    record(
        f"{LEVEL}:batchlens_gpu_memory_busy:max",
        f'max by ({BY}) (batchlens_gpu_memory_busy_ratio{{vllm_instance!=""}})',
    )
    record(
        "vllm_instance_model_name_gpu:batchlens_gpu_memory_bandwidth:ratio",
        f"max by ({BY}, gpu) ("
        '{__name__=~"batchlens_gpu_memory_busy_ratio|batchlens_gpu_dram_bandwidth_ratio", vllm_instance!=""})',
    )
    # Operating points: the same measures labelled with the batch limit in force, so a dashboard table and
    # `batchlens report` can average them per limit (count_values turns the limit into a label).
    record(f"{LEVEL}:batchlens_batch_limit:max", f"max by ({BY}) (batchlens_batch_limit)")
    limit_label = f'count_values by ({BY}) ("batch_limit", {LEVEL}:batchlens_batch_limit:max)'
    for measure in operating_point_measures(thresholds):
        record(
            measure.replace(f"{LEVEL}:", f"{LEVEL}_batch_limit:"),
            f"{measure} * on ({BY}) group_left (batch_limit) {limit_label}",
        )
    # Burstiness: the coefficient of variation of the completion rate over 30 s slices. vLLM counts no
    # arrivals; in a steady state completions follow them, a few seconds late.
    rate30s = f"sum by ({BY}) (rate(vllm:request_success_total[30s]))"
    record(
        f"{LEVEL}:vllm_request_success:cv5m",
        f"stddev_over_time({rate30s}[5m:10s]) / avg_over_time({rate30s}[5m:10s])",
    )
    # Admission (docs/admission.md): the share of arrivals vLLM's queued caps refused, over those it refused and
    # those it served (vLLM counts no admissions; over 5 minutes completions stand in for them).
    record(f"{LEVEL}_reason:vllm_admission_rejections:rate1m",
           f"sum by ({BY}, reason) (rate(vllm:admission_rejections_total[1m]))")  # fmt: skip
    shed = f"sum by ({BY}) (rate(vllm:admission_rejections_total[5m]))"
    record(
        f"{LEVEL}:vllm_admission_rejections:ratio5m",
        f"{shed} / ({shed} + sum by ({BY}) (rate(vllm:request_success_total[5m])))",
    )
    # Each door class's refused share of what reached the door (the plugin counts both, by priority_class).
    record(
        f"{LEVEL}_class:batchlens_door_refusals:ratio5m",
        f"sum by ({BY}, priority_class) (rate(batchlens_door_refusals_total[5m]))"
        f" / sum by ({BY}, priority_class) (rate(batchlens_door_requests_total[5m]))",
    )
    rules += routing_rules()
    rules += scaling_rules(thresholds)
    return rules


#: The scaling signal's public series (docs/scaling.md), per deployment (vllm_instance) and per role: what an
#: autoscaler (KEDA, an HPA through prometheus-adapter) reads. Named outside level:metric:operation on purpose.
DESIRED_REPLICAS = "batchlens:desired_replicas"
CURRENT_REPLICAS = "batchlens:current_replicas"
ARRIVALS = f"{LEVEL}:batchlens_arrivals:rate1m"
#: A deployment saturated: its queue held a request on average over the minute, or its door refused one.
SATURATED_QUEUE = 1


def scaling_rules(thresholds: Thresholds) -> list[dict]:
    """``batchlens:desired_replicas``: the arrivals (admitted plus shed) with headroom over what a replica (a server
    of the deployment) was measured to serve at saturation, stabilised (docs/scaling.md)."""
    rules: list[dict] = []

    def record(name: str, expr: str) -> None:
        rules.append({"record": name, "expr": expr})

    # vLLM counts no arrivals. By conservation, what arrived is what finished, what the door refused, and what
    # the engines hold more of than a minute ago (a queue that grows is demand the completions cannot show).
    served = f"sum by ({BY}) (rate(vllm:request_success_total[1m]))"
    shed = f"sum by ({BY}) (rate(vllm:admission_rejections_total[1m]))"
    held = (f"sum by ({BY}) (deriv(vllm:num_requests_waiting[1m]))"
            f" + sum by ({BY}) (deriv(vllm:num_requests_running[1m]))")  # fmt: skip
    record(ARRIVALS, f"clamp_min({served} + ({shed} or 0 * {served}) + (({held}) or 0 * {served}), 0)")
    # A replica is a server of the deployment (the `server` label; one where the deployment has none).
    record(CURRENT_REPLICAS, f"count by ({BY}) (count by ({BY}, server) (vllm:num_requests_running))")
    # What a replica served in the minutes the deployment was saturated (its queue held a request all minute, or
    # its door refused one) is what it can serve: its goodput capacity, for the batch limit and the door keep what
    # it admits within the SLO, and the wait that makes queued requests late is what more replicas take away.
    # The capacity is the best of the last hour's, or else the last one measured, kept until the next.
    saturated = (f"(sum by ({BY}) (avg_over_time(vllm:num_requests_waiting[1m])) >= {SATURATED_QUEUE})"
                 f" or ({shed} > 0)")  # fmt: skip
    # A minute in which servers came or went measures nothing: its rates are the old count's, divided by the new.
    stable = f"{CURRENT_REPLICAS} == {CURRENT_REPLICAS} offset 1m"
    at_saturation = f"{LEVEL}:batchlens_replica_served_saturated:rate1m"
    record(at_saturation, f"({served} / {CURRENT_REPLICAS}) and on ({BY}) ({saturated}) and ({stable})")
    capacity = f"{LEVEL}:batchlens_replica_capacity:max1h"
    record(capacity, f"max_over_time({at_saturation}[1h]) or last_over_time({capacity}[1d])")
    # Per role (docs/routing.md): the role's arrivals over the mean capacity of its deployments' replicas. An engine
    # may have several roles: each role's info series takes the engine's value.
    role = f"max by ({WHERE}, vllm_instance, role) (batchlens_engine_role)"

    def per_role(how: str, series: str) -> str:
        return f"{how} by ({WHERE}, role) ({role} * on ({WHERE}, vllm_instance) group_left {series})"

    deployments = f'{CURRENT_REPLICAS}{{vllm_instance!=""}}'
    record(CURRENT_REPLICAS, per_role("sum", deployments))
    headroom = f"{1 + thresholds.scale_headroom:g}"
    wanted = f"{LEVEL}:batchlens_desired_replicas:raw"
    record(wanted, f"clamp_min(ceil({ARRIVALS} * {headroom} / ({capacity} > 0)), 1)")
    record(
        "role:batchlens_desired_replicas:raw",
        f"clamp_min(ceil({per_role('sum', ARRIVALS)} * {headroom} / ({per_role('avg', capacity)} > 0)), 1)",
    )
    # Up once every evaluation of the short window wants more, and the window is full (a burst shorter than it, or
    # a first measure, never scales); down to the most any evaluation of the long window wanted (HPA's stabilisation
    # window); else, and until a capacity is measured, where it is.
    up, down = thresholds.scale_up_window, thresholds.scale_down_window
    for raw, level in ((wanted, 'vllm_instance!=""'), ("role:batchlens_desired_replicas:raw", 'role!=""')):
        current = f"{CURRENT_REPLICAS}{{{level}}}"
        record(
            DESIRED_REPLICAS,
            f"(min_over_time({raw}[{up}]) > {current} and {raw} offset {up})"
            f" or (max_over_time({raw}[{down}]) < {current}) or {current}",
        )
    return rules


#: The routing plugin's series (on the LiteLLM proxy's /metrics) are per proxy, not per engine: by the role a
#: request wanted and the role it got.
ROUTED = f"{WHERE}, wanted"


def routing_rules() -> list[dict]:
    """P99 TTFT per class at the proxy, and the decisions and fallbacks the router made (docs/routing.md)."""
    decisions = "batchlens_routing_decisions_total"
    rules = [
        {"record": f"wanted:batchlens_routing_time_to_first_token_seconds:p99_{window}",
         "expr": f"histogram_quantile(0.99, sum by ({ROUTED}, le) "
                 f"(rate(batchlens_routing_time_to_first_token_seconds_bucket[{window}])))"}
        for window in WINDOWS
    ]  # fmt: skip
    rules.append({"record": "wanted_role:batchlens_routing_decisions:rate1m",
                  "expr": f"sum by ({ROUTED}, role) (rate({decisions}[1m]))"})  # fmt: skip
    # A role no engine has (fallback="no_engine") is a fact of the config, not a fallback: it stays out, or a
    # role nobody deployed would read as 100% fallback.
    rules.append({"record": "wanted:batchlens_routing_fallback:ratio5m",
                  "expr": f'sum by ({ROUTED}) (rate({decisions}{{fallback!~"|no_engine"}}[5m])) '
                          f"/ sum by ({ROUTED}) (rate({decisions}[5m]))"})  # fmt: skip
    return rules


def p99_name(thresholds: Thresholds, window: str = "1m") -> str:
    """The P99 recording rule of the latency the breaker watches."""
    return f"{LEVEL}:{LATENCIES[thresholds.p99_latency][0].replace(':', '_')}:p99_{window}"


def operating_point_measures(thresholds: Thresholds) -> tuple[str, str, str]:
    """Throughput, P99 and GPU memory busy: the three axes of an operating point."""
    return (f"{LEVEL}:vllm_generation_tokens:rate1m", p99_name(thresholds), f"{LEVEL}:batchlens_gpu_memory_busy:max")
