"""The vLLM pods, listed through the Kubernetes API with lightkube, as an exporter source.

lightkube, not kubernetes-asyncio or kr8s: it is async like the rest of batchlens, small
(about 4 MB with its typed models, against tens for kubernetes-asyncio's generated client),
typed (a Pod is a dataclass, so a renamed field fails loudly, unlike kr8s' dict-like
objects), and it reads in-cluster service accounts and kubeconfig files alike. It is the
``batchlens[kubernetes]`` extra, imported only when discovery is on.

Listing is a poll (every ``kubernetes.interval_seconds``), not a watch: an engine that
appears is sampled within one interval, and a poll needs no resume logic after an API
server restart. Each failure maps to a bounded reason (``forbidden``, ``unauthorized``,
``http_<code>``, ``connect``, ``timeout``); the last engine set is kept while the API is
unreachable, so a control-plane blip does not drop every engine's series.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from batchlens.config import Engine, Kubernetes
from batchlens.discovery.pods import engines_of
from batchlens.exporter import families as fam
from batchlens.exporter.sampler import SourceError
from batchlens.exporter.snapshot import Reading

log = logging.getLogger("batchlens.discovery")


class PodLister:
    """Lists the pods the settings select, on one node or every node."""

    def __init__(self, settings: Kubernetes, node: str = ""):
        try:
            import httpx2
            from lightkube import AsyncClient, KubeConfig
            from lightkube.core.exceptions import ConfigError
            from lightkube.resources.core_v1 import Pod
        except ImportError as exc:
            raise RuntimeError(
                f"kubernetes.discover is on, but {exc.name} is not installed: pip install 'batchlens[kubernetes]'"
            ) from None
        self._httpx, self._pod = httpx2, Pod
        self.settings, self.node = settings, node
        try:
            config = _anonymous(KubeConfig, settings.api_url) if settings.api_url else KubeConfig.from_env()
        except ConfigError as exc:
            raise RuntimeError(f"kubernetes.discover: no API server to ask ({exc}); set kubernetes.api_url") from None
        self._client = AsyncClient(config, timeout=httpx2.Timeout(settings.timeout_seconds), trust_env=False)

    async def pods(self) -> list:
        fields = {"spec.nodeName": self.node} if self.node else None
        found = []
        try:
            for namespace in self.settings.namespaces or ["*"]:
                async for pod in self._client.list(
                    self._pod, namespace=namespace, labels=dict(self.settings.selector), fields=fields
                ):
                    found.append(pod)
        except self._httpx.HTTPStatusError as exc:  # lightkube's ApiError is one, with the API's Status
            code = exc.response.status_code
            reason = {401: "unauthorized", 403: "forbidden"}.get(code, f"http_{code}")
            hint = " (the chart's ClusterRole grants list on pods)" if code == 403 else ""
            raise SourceError(reason, f"listing pods: HTTP {code}: {_status_message(exc)}{hint}") from None
        except self._httpx.TimeoutException:
            raise SourceError("timeout", f"listing pods took over {self.settings.timeout_seconds:g}s") from None
        except self._httpx.TransportError as exc:
            raise SourceError("connect", f"cannot reach the API server: {exc}") from None
        return found

    async def aclose(self) -> None:
        await self._client.close()


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
        engines, skipped = engines_of(await self._lister.pods(), self._lister.settings)
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
        )
        return Reading(metrics=(metric,), soft_errors=soft)


def _status_message(exc) -> str:
    """The API server's own words (its Status message), else the HTTP error."""
    try:
        return str(exc.response.json().get("message") or exc)
    except ValueError:
        return str(exc)


def _anonymous(kube_config, url: str):
    """A kubeconfig for ``url`` with no credentials (an API proxy, ``kubectl proxy``, a test's fake)."""
    return kube_config.from_dict(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "api", "cluster": {"server": url}}],
            "users": [{"name": "anonymous", "user": {}}],
            "contexts": [{"name": "api", "context": {"cluster": "api", "user": "anonymous"}}],
            "current-context": "api",
        }
    )


def node_name(settings: Kubernetes, environ: Mapping[str, str] | None = None) -> str:
    """The node whose pods this exporter reads: the DaemonSet gives it in ``settings.node_name_env``."""
    environ = os.environ if environ is None else environ
    return environ.get(settings.node_name_env, "") if settings.node_name_env else ""
