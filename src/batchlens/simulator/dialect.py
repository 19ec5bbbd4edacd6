"""Which of vLLM's metric names each release exposes, as the matrix captured them (vllm_releases.py). Pure.

vLLM renames a metric by exposing the new name beside the old one, marked
DEPRECATED, for a few releases, then dropping the old one. The simulator
speaks a chosen release's dialect (``batchlens simulate --vllm-version``), so
demos and tests can show the older names, which the rules and the exporter
read as well.
"""

from __future__ import annotations

from batchlens.vllm_releases import DEFAULT, QUEUED_CAPS, RELEASES, TPOT, supported

DEFAULT_VLLM_VERSION = DEFAULT
SUPPORTED_SERIES = supported()  # the vLLM releases batchlens supports (docs/compatibility.md)
# The deprecated names a release still exposes beside the new ones, as captured from it: (first release, names).
# A release between two captured ones speaks like the older of the two.
DIALECTS = tuple((release.series, release.deprecated) for release in RELEASES if release.cpu_build)
__all__ = ["DEFAULT_VLLM_VERSION", "QUEUED_CAPS", "SUPPORTED_SERIES", "TPOT", "dialect", "series_of"]


def series_of(vllm_version: str) -> tuple[int, int]:
    """(major, minor) of a release batchlens supports; ValueError for any other."""
    try:
        series = tuple(int(part) for part in vllm_version.split(".")[:2])
    except ValueError:
        raise ValueError(f"{vllm_version!r} is not a vLLM version (e.g. 0.10.2)") from None
    low, high = SUPPORTED_SERIES
    if len(series) != 2 or not low <= series <= high:
        raise ValueError(f"vLLM {vllm_version} is outside the releases batchlens supports "
                         f"({low[0]}.{low[1]} to {high[0]}.{high[1]})")  # fmt: skip
    return series[0], series[1]


def dialect(vllm_version: str) -> frozenset[str]:
    """The deprecated names ``vllm_version`` exposes too; ValueError for a release batchlens does not support."""
    series = series_of(vllm_version)
    return next(names for first, names in reversed(DIALECTS) if series >= first)
