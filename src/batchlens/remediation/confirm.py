"""Whether Prometheus itself shows an alert firing: the hook acts only on a breach it can see (docs/security.md).

Alertmanager's API takes alerts from anyone who can reach it, and forwards them with the receiver's token, so a
delivery proves only that someone posted it. The alert's own series proves more: Prometheus writes
``ALERTS{alertname, alertstate="firing", <the alert's labels>}`` for as long as a rule it evaluates fires, and
nobody can post into it. So before a firing delivery acts, the hook asks for that series for the engine; before
a resolution starts recovery, it asks that the series be gone.

It asks the same series what ails an engine's GPUs: a P99 breach while one of them is lost, reports Xids or
slows itself down (gpu_faults.GPU_FAULT_ALERTS, pending or firing) is the GPU's, and a smaller batch does not
mend it.

The query names the alert and the engine (``vllm_instance``, which holds the namespace of a discovered pod).
The ``cluster`` label is an external label, which Prometheus adds only to what leaves it: a series without one
is this Prometheus' own; one with another cluster's (a Thanos querier above several) confirms nothing here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from batchlens.gpu_faults import GPU_FAULT_ALERTS
from batchlens.prometheus_api import Prometheus

#: At most this long per question: the engine's pass waits for the answer, and a hanging Prometheus must not
#: hold its deliveries for longer than a breaker decision is worth.
TIMEOUT_SECONDS = 5.0


def alert_series(alertname: str, instance: str) -> str:
    """The PromQL selector of the alert's firing series for one engine."""
    return f'ALERTS{{alertname={_quoted(alertname)},alertstate="firing",vllm_instance={_quoted(instance)}}}'


def gpu_fault_series(instance: str | None = None) -> str:
    """The PromQL selector of the GPU alerts firing or pending (a GPU lost a minute ago is already one), for one
    engine or, with None, for every engine."""
    engine = "" if instance is None else f",vllm_instance={_quoted(instance)}"
    return f'ALERTS{{alertname=~"{"|".join(GPU_FAULT_ALERTS)}",alertstate=~"pending|firing"{engine}}}'


def fault_text(series: Sequence[Mapping[str, str]]) -> str:
    """What the GPU alerts say, for a page: each GPU, where it is, and what it has (sorted, one per GPU)."""
    by_gpu: dict[tuple[str, str, str], list[str]] = {}
    for labels in series:
        what = labels.get("alertname", "").removeprefix("BatchlensGpu")
        detail = labels.get("xid") or labels.get("reason")
        where = (labels.get("gpu", "?"), labels.get("uuid", ""), labels.get("instance", ""))
        by_gpu.setdefault(where, []).append(f"{what} {detail}" if detail else what)
    return "; ".join(f"GPU {gpu} ({uuid}) on {node or 'its node'}: {', '.join(sorted(set(faults)))}"
                     for (gpu, uuid, node), faults in sorted(by_gpu.items()))  # fmt: skip


def _quoted(value: str) -> str:
    # A PromQL string takes Go's escapes, which JSON's are (\" \\ \n \u00XX); non-ASCII goes as it is.
    return json.dumps(value, ensure_ascii=False)


def firing_here(series: Sequence[Mapping[str, str]], cluster: str) -> bool:
    """Whether any of the alert's series is this cluster's: with no cluster label, or with ``cluster`` as its own."""
    return any(not cluster or labels.get("cluster", cluster) == cluster for labels in series)


@dataclass
class Confirmer:
    """Asks one Prometheus whether an alert fires for an engine now. Raises PrometheusError when it cannot tell."""

    session: aiohttp.ClientSession
    url: str
    cluster: str = ""
    timeout: float = TIMEOUT_SECONDS

    async def firing(self, alertname: str, instance: str) -> bool:
        found = await Prometheus(self.session, self.url, self.timeout).vector(alert_series(alertname, instance))
        return firing_here([labels for labels, _value in found], self.cluster)

    async def gpu_faults(self, instance: str | None = None) -> dict[str, list[dict[str, str]]]:
        """The GPU alerts firing or pending here, by engine: for ``instance``, or for every engine."""
        found = await Prometheus(self.session, self.url, self.timeout).vector(gpu_fault_series(instance))
        faults: dict[str, list[dict[str, str]]] = {}
        for labels, _value in found:
            if firing_here([labels], self.cluster) and labels.get("vllm_instance"):
                faults.setdefault(labels["vllm_instance"], []).append(dict(labels))
        return faults
