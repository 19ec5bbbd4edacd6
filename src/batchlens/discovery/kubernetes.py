"""The vLLM pods, listed through the Kubernetes API with lightkube, for the exporter and the hook alike.

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

Each engine's admin token is the one its own pod holds (discovery/pods.py says why that
proves it is an engine): read from the Secret in the pod's namespace at every poll, so a
rotated Secret reaches batchlens within one interval, and one namespace's token never
reaches another namespace's pods. A Secret that cannot be read leaves its engines sampled
without a token (their admin calls answer 401), counted as ``token_<reason>``.

The same Secret may hold the namespace's webhook token (``webhook_token_key``): the one its
tenant's AlertmanagerConfig sends, which acts on that namespace's engines only.

``helm template`` (and so every GitOps render) cannot keep a random token: it has no cluster
to look one up in, so each render would make a new one. The chart then renders the Secrets
without their tokens and marked ``batchlens.io/fill-tokens``, and the hook writes each
missing one once, at start (:meth:`PodLister.fill`). A Secret without the mark is never
written, so a user's own Secret is never touched.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import os
import secrets
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from batchlens.config import Engine, Kubernetes, SecretToFill
from batchlens.discovery.pods import engines_of

log = logging.getLogger("batchlens.discovery")

FILL_ANNOTATION = "batchlens.io/fill-tokens"  # "true": the chart left this Secret's tokens to the hook


class DiscoveryError(Exception):
    """A failed call to the API server. ``reason`` is a short, bounded label value (``forbidden``, ``timeout``...);
    the exporter counts it as its source's error, the hook as its own."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Discovered:
    """One poll's engines (each with its pod's token), the pods skipped by reason, and the unreadable Secrets."""

    engines: list[Engine]
    skipped: Counter[str] = field(default_factory=Counter)
    token_errors: dict[str, DiscoveryError] = field(default_factory=dict)  # namespace -> why its Secret is unread
    webhook_tokens: dict[str, str] = field(default_factory=dict)  # namespace -> its tenant's webhook token


class PodLister:
    """Lists the pods the settings select, on one node or every node.

    ``tokens``: read each namespace's Secret for its engines' tokens (the remediation service). The exporter only
    reads, which the admin API takes with no credential, so it lists pods and holds no token, nor any right to
    a Secret (docs/security.md, "Least privilege").
    """

    def __init__(self, settings: Kubernetes, node: str = "", *, tokens: bool = True):
        try:
            import httpx2
            from lightkube.resources.core_v1 import Pod, Secret
            from lightkube.types import PatchType
        except ImportError as exc:
            raise RuntimeError(
                f"kubernetes.discover is on, but {exc.name} is not installed: pip install 'batchlens[kubernetes]'"
            ) from None
        self._httpx, self._pod, self._secret, self._merge = httpx2, Pod, Secret, PatchType.MERGE
        self.settings, self.node, self.tokens = settings, node, tokens
        self._client = api_client(settings)
        if settings.api_server_cidrs == []:
            log.warning(
                "the NetworkPolicy lets this pod reach the API server's ports on ANY address "
                "(kubernetes.api_server_cidrs is empty): set the chart's networkPolicy.apiServer.cidrs to the API "
                "server's endpoints, from kubectl get endpoints kubernetes -n default -o "
                "jsonpath='{.subsets[*].addresses[*].ip}' (docs/kubernetes.md)"
            )

    async def engines(self) -> Discovered:
        """The engines among the selected pods of the listed namespaces, each with its own pod's token."""
        engines, skipped = engines_of(await self.pods(), self.settings)
        tokens: dict[str, str] = {}
        webhook_tokens: dict[str, str] = {}
        errors: dict[str, DiscoveryError] = {}
        for namespace in sorted({e.labels["namespace"] for e in engines} if self.tokens else ()):
            try:
                tokens[namespace], webhook = await self._tokens(namespace)
            except DiscoveryError as exc:
                errors[namespace] = exc
                continue
            if webhook:
                webhook_tokens[namespace] = webhook
        secret = self.settings.admin_token_secret
        with_tokens = [
            e.with_admin_token(tokens.get(ns), f"the Secret {ns}/{secret}" if self.tokens else "no token (reads need "
                               "none; a plugin from before open reads answers 401: upgrade the engine)")
            for e in engines
            for ns in [e.labels["namespace"]]
        ]  # fmt: skip
        return Discovered(with_tokens, skipped, errors, webhook_tokens)

    async def pods(self) -> list:
        fields = {"spec.nodeName": self.node} if self.node else None
        found = []
        for namespace in self.settings.namespaces:
            with self._api_errors(f"listing pods in {namespace}"):
                labels = dict(self.settings.selector)
                found += [
                    pod async for pod in self._client.list(self._pod, namespace=namespace, labels=labels, fields=fields)
                ]
        return found

    async def _tokens(self, namespace: str) -> tuple[str, str]:
        """The namespace's admin token, and its webhook token ("" where the Secret has none)."""
        name, key = self.settings.admin_token_secret, self.settings.admin_token_key
        what = f"reading the Secret {namespace}/{name}"
        with self._api_errors(what):
            secret = await self._client.get(self._secret, name, namespace=namespace)
        data = secret.data or {}
        if not data.get(key):
            raise DiscoveryError("no_key", f"{what}: it has no key {key!r}")

        def decoded(k: str) -> str:
            try:
                return base64.b64decode(data.get(k) or "", validate=True).decode().strip()
            except (binascii.Error, UnicodeDecodeError):
                raise DiscoveryError("invalid", f"{what}: key {k!r} is not base64 UTF-8") from None

        return decoded(key), decoded(self.settings.webhook_token_key)

    async def fill(self, wanted: SecretToFill) -> list[str]:
        """Write a new token into each key of ``wanted`` that is empty, once; the keys written.

        Only into a Secret marked FILL_ANNOTATION. The write names the version read, so two writers (a
        restart racing its predecessor) cannot both win: the second gets 409 and keeps what the first wrote.
        """
        what = f"the Secret {wanted.namespace}/{wanted.name}"
        with self._api_errors(f"reading {what}"):
            secret = await self._client.get(self._secret, wanted.name, namespace=wanted.namespace)
        data, meta = secret.data or {}, secret.metadata
        missing = [key for key in wanted.keys if not data.get(key)]
        if not missing:
            return []
        if (meta.annotations or {}).get(FILL_ANNOTATION) != "true":
            said = f"{what} has no {', '.join(missing)}, and no {FILL_ANNOTATION} mark to let batchlens write one"
            raise DiscoveryError("not_marked", said + ": give the token there yourself")
        fresh = {key: base64.b64encode(secrets.token_urlsafe(30).encode()).decode() for key in missing}
        patch = {"metadata": {"resourceVersion": meta.resourceVersion}, "data": fresh}
        try:
            with self._api_errors(f"writing {what}"):
                await self._client.patch(self._secret, wanted.name, patch, namespace=wanted.namespace,
                                         patch_type=self._merge)  # fmt: skip
        except DiscoveryError as exc:
            if exc.reason != "http_409":
                raise
            return []  # another writer filled it first: its tokens stand
        return missing

    @contextlib.contextmanager
    def _api_errors(self, what: str) -> Iterator[None]:
        """Every failure of an API call as a DiscoveryError with a bounded reason and the API server's words."""
        try:
            yield
        except self._httpx.HTTPStatusError as exc:  # lightkube's ApiError is one, with the API's Status
            code = exc.response.status_code
            reason = {401: "unauthorized", 403: "forbidden", 404: "not_found"}.get(code, f"http_{code}")
            hint = " (the chart's Role in that namespace grants it)" if code == 403 else ""
            raise DiscoveryError(reason, f"{what}: HTTP {code}: {status_message(exc)}{hint}") from None
        except self._httpx.TimeoutException:
            raise DiscoveryError("timeout", f"{what} took over {self.settings.timeout_seconds:g}s") from None
        except self._httpx.TransportError as exc:
            raise DiscoveryError("connect", f"{what}: cannot reach the API server: {exc}") from None

    async def aclose(self) -> None:
        await self._client.close()


def status_message(exc) -> str:
    """The API server's own words (its Status message), else the HTTP error."""
    try:
        return str(exc.response.json().get("message") or exc)
    except ValueError:
        return str(exc)


def api_client(settings: Kubernetes):
    """A lightkube client of the API server ``settings`` name: kubernetes.api_url, or the service account's (the
    kubeconfig's outside a pod). RuntimeError where there is none, or where lightkube is not installed."""
    try:
        import httpx2
        from lightkube import AsyncClient, KubeConfig
        from lightkube.core.exceptions import ConfigError
    except ImportError as exc:
        raise RuntimeError(f"{exc.name} is not installed: pip install 'batchlens[kubernetes]'") from None
    try:
        config = _anonymous(KubeConfig, settings.api_url) if settings.api_url else KubeConfig.from_env()
    except ConfigError as exc:
        raise RuntimeError(f"no Kubernetes API server to ask ({exc}); set kubernetes.api_url") from None
    return AsyncClient(config, timeout=httpx2.Timeout(settings.timeout_seconds), trust_env=False)


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


async def fill_tokens(settings: Kubernetes) -> list[str]:
    """Each Secret of ``settings.fill_secrets`` given its missing tokens; what was written, as "ns/name key"."""
    lister = PodLister(settings)
    written: list[str] = []
    try:
        for wanted in settings.fill_secrets:
            try:
                keys = await lister.fill(wanted)
            except DiscoveryError as exc:
                log.error("tokens: %s [reason=%s]", exc, exc.reason)
                continue
            for key in keys:
                log.warning("tokens: wrote a new %s into the Secret %s/%s, which was rendered without one "
                            "(helm template or GitOps); it is kept from now on",
                            key, wanted.namespace, wanted.name)  # fmt: skip
            written += [f"{wanted.namespace}/{wanted.name} {key}" for key in keys]
    finally:
        await lister.aclose()
    return written
