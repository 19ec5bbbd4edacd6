"""Which pods are engines, and what each is called. Pure: the pods come in as lightkube objects.

An engine is a running pod with an IP, named ``<namespace>/<pod>`` (the ``vllm_instance``
label), reached on its IP at the configured port, and labelled with its ``namespace``
and ``pod`` too. The rest is counted by reason, never dropped in silence.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from batchlens.config import Engine, Kubernetes


def engines_of(pods: Iterable, settings: Kubernetes) -> tuple[list[Engine], Counter[str]]:
    """The engines among ``pods`` (lightkube ``Pod`` objects), sorted by name, and the pods skipped by reason."""
    engines: list[Engine] = []
    skipped: Counter[str] = Counter()
    for pod in pods:
        meta, status = pod.metadata, pod.status
        if meta.deletionTimestamp is not None:
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
                    admin_token_env=settings.admin_token_env,
                    labels={"namespace": meta.namespace, "pod": meta.name},
                )
            )
    return sorted(engines, key=lambda e: e.name), skipped
