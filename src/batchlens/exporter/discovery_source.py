"""Kubernetes discovery as an exporter source: up while the API server answers, its errors counted, the engines
it found handed to the exporter, which starts and stops their samplers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from batchlens.config import Engine
from batchlens.discovery.kubernetes import DiscoveryError, PodLister
from batchlens.exporter import families as fam
from batchlens.exporter.sampler import SourceError
from batchlens.exporter.snapshot import Reading


class DiscoverySource:
    """A source like the others: up while the API answers, its errors counted, its count of engines exported.

    Each successful sample hands the engine set to ``on_engines``, which starts and stops their samplers.
    """

    kind = "kubernetes"
    labels: tuple[tuple[str, str], ...] = ()

    def __init__(self, lister: PodLister, on_engines: Callable[[Sequence[Engine]], None]):
        self._lister = lister
        self._on_engines = on_engines

    async def sample(self) -> Reading:
        try:
            found = await self._lister.engines()
        except DiscoveryError as exc:
            raise SourceError(exc.reason, str(exc)) from None
        engines, skipped = found.engines, found.skipped
        self._on_engines(engines)
        per_namespace = Counter(engine.labels["namespace"] for engine in engines)
        metric = fam.gauge(
            "batchlens_discovered_engines",
            "vLLM pods found through the Kubernetes API and sampled as engines, by namespace.",
            [({"namespace": ns}, n) for ns, n in sorted(per_namespace.items())],
        )
        soft = tuple(
            (f"pod_{reason}", f"{n} selected pod(s) not sampled: {reason.replace('_', ' ')}")
            for reason, n in sorted(skipped.items())
        ) + tuple(
            (f"token_{exc.reason}", f"{exc}: its engines are sampled without a token")
            for _, exc in sorted(found.token_errors.items())
        )
        return Reading(metrics=(metric,), soft_errors=soft)
