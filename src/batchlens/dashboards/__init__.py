"""Grafana dashboards built with Grafana's own SDK: one module per dashboard, shared parts in ``kit``."""

from __future__ import annotations

import json

from batchlens.config import Thresholds
from batchlens.dashboards.breaker import breaker
from batchlens.dashboards.gpu import gpu
from batchlens.dashboards.kv_cache import kv_cache
from batchlens.dashboards.overview import overview
from batchlens.dashboards.workload import workload

BUILDERS = {"overview": overview, "kv-cache": kv_cache, "gpu": gpu, "workload": workload, "breaker": breaker}


def dashboards(thresholds: Thresholds) -> dict[str, str]:
    """file name (under dashboards/) -> its JSON."""
    return {
        f"batchlens-{name}.json": json.dumps(build(thresholds), indent=2, sort_keys=True) + "\n"
        for name, build in BUILDERS.items()
    }
