"""Which pods are engines, and what each is called. Pure: the pods come in as lightkube objects.

A label proves nothing on a shared cluster: anyone who may create a pod may set it. So a pod
is an engine only when it also sits in a namespace the config lists and serves the admin API
with that namespace's token: its ``BATCHLENS_ADMIN_TOKEN`` comes from the Secret
``admin_token_secret`` (key ``admin_token_key``) of its own namespace. The token then goes
only to a pod whose author could already read it; a pod that merely wears the label gets
nothing, not even a scrape, and is counted.

An engine is a running pod with an IP, named ``<namespace>/<pod>`` (the ``vllm_instance``
label), reached on its IP at the configured port, and labelled with its ``namespace``
and ``pod`` too. The rest is counted by reason, never dropped in silence. Pods of one data-parallel
deployment (a LeaderWorkerSet's, by default) are the servers of one engine: ``deployment`` names it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from batchlens.admin_api import TOKEN_ENV
from batchlens.config import LWS_GROUP, Engine, Kubernetes


def holds_admin_token(pod, settings: Kubernetes) -> bool:
    """Whether a container of ``pod`` takes ``BATCHLENS_ADMIN_TOKEN`` from the configured Secret and key."""
    for container in pod.spec.containers if pod.spec else ():
        for env in container.env or ():
            ref = env.valueFrom.secretKeyRef if env.name == TOKEN_ENV and env.valueFrom else None
            if ref is not None and ref.name == settings.admin_token_secret and ref.key == settings.admin_token_key:
                return True
    return False


def deployment_of(meta, settings: Kubernetes) -> str:
    """The data-parallel deployment a pod is a server of (``kubernetes.deployment_label``), or "": none."""
    labels = meta.labels or {}
    name = labels.get(settings.deployment_label, "") if settings.deployment_label else ""
    if not name:
        return ""
    group = labels.get(LWS_GROUP, "")
    return f"{meta.namespace}/{name}" + (f"-{group}" if group else "")


def engines_of(pods: Iterable, settings: Kubernetes) -> tuple[list[Engine], Counter[str]]:
    """The engines among ``pods`` (lightkube ``Pod`` objects), sorted by name, and the pods skipped by reason."""
    engines: list[Engine] = []
    skipped: Counter[str] = Counter()
    for pod in pods:
        meta, status = pod.metadata, pod.status
        if meta.namespace not in settings.namespaces:
            skipped["namespace_not_listed"] += 1  # the API was asked per namespace: this is defence in depth
        elif not holds_admin_token(pod, settings):
            skipped["no_admin_token_secret"] += 1
        elif meta.deletionTimestamp is not None:
            skipped["terminating"] += 1
        elif status is None or not status.podIP:
            skipped["no_ip"] += 1  # scheduled but not started: it has nothing to scrape yet
        elif status.phase != "Running":
            skipped["not_running"] += 1
        else:
            host = f"[{status.podIP}]" if ":" in status.podIP else status.podIP
            engines.append(
                Engine(
                    name=f"{meta.namespace}/{meta.name}",
                    url=f"http://{host}:{settings.port}",
                    admin_port=settings.admin_port,
                    admin_auth=settings.admin_auth,
                    pod=f"{meta.namespace}/{meta.name}",
                    labels={"namespace": meta.namespace, "pod": meta.name},
                    deployment=deployment_of(meta, settings),
                )
            )
    return sorted(engines, key=lambda e: e.name), skipped
