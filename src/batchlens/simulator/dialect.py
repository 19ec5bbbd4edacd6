"""Which of vLLM's metric names each release exposes, as the matrix captured them (tests/data/releases). Pure.

vLLM renames a metric by exposing the new name beside the old one, marked
DEPRECATED, for a few releases, then dropping the old one. The simulator
speaks a chosen release's dialect (``batchlens simulate --vllm-version``), so
demos and tests can show the older names, which the rules and the exporter
read as well.
"""

from __future__ import annotations

DEFAULT_VLLM_VERSION = "0.32.0"
SUPPORTED_SERIES = ((0, 10), (0, 33))  # the vLLM releases batchlens supports (docs/compatibility.md)
# The deprecated names a release still exposes beside the new ones, as captured from it: (first release, names).
# A release between two captured ones speaks like the older of the two.
OLD_NAMES = "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"
TPOT = "vllm:time_per_output_token_seconds"  # renamed inter_token_latency_seconds in 0.10, gone by 0.25
DIALECTS = (((0, 10), frozenset({*OLD_NAMES, TPOT})), ((0, 11), frozenset({TPOT})), ((0, 25), frozenset()))


QUEUED_CAPS = (0, 29)  # the first release with --max-num-queued-tokens and -reqs (vLLM PR #49445)


def series_of(vllm_version: str) -> tuple[int, int]:
    """(major, minor) of a release batchlens supports; ValueError for any other."""
    try:
        series = tuple(int(part) for part in vllm_version.split(".")[:2])
    except ValueError:
        raise ValueError(f"{vllm_version!r} is not a vLLM version (e.g. 0.10.2)") from None
    low, high = SUPPORTED_SERIES
    if len(series) != 2 or not low <= series <= high:
        raise ValueError(f"vLLM {vllm_version} is outside the releases batchlens supports (0.10 to 0.33)")
    return series[0], series[1]


def dialect(vllm_version: str) -> frozenset[str]:
    """The deprecated names ``vllm_version`` exposes too; ValueError for a release batchlens does not support."""
    series = series_of(vllm_version)
    return next(names for first, names in reversed(DIALECTS) if series >= first)
