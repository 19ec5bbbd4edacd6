"""Leader election on a Kubernetes Lease (coordination.k8s.io/v1): two or more hooks, one of them acting.

lightkube, the client batchlens already uses for discovery, has no elector; this follows client-go's
(k8s.io/client-go/tools/leaderelection) with its rules and its defaults:

- Every ``retry_period_seconds`` each hook reads the Lease. Its holder renews it (a replace that carries the
  resourceVersion it read, so of two writers one gets 409 and loses). Another takes it over only once the
  record has not changed for the holder's ``leaseDurationSeconds`` by its *own* clock: no two clocks are
  compared. A Lease with no holder (released at a leader's shutdown) is taken at once.
- A leader that could not renew for ``renew_deadline_seconds``, shorter than the Lease's duration, stops
  acting before anyone may take over.
- Fencing: before every act on an engine the hook asks :meth:`LeaseElector.holds`, which reads the Lease
  again. A deposed leader (a pause, a partition) acts on nothing, whatever it still believes.

The state each decision needs (the breakers' strikes and targets, the controllers' steering) is kept by the
leader in a ConfigMap beside the Lease (:class:`StateMirror`), written before the act it leads to, and read by
the next leader when it takes over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx2

from batchlens.admin_auth import POD_NAMESPACE_ENV
from batchlens.config import Kubernetes, LeaderElection
from batchlens.discovery.kubernetes import api_client, status_message

log = logging.getLogger("batchlens.remediation")
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class Holding:
    """A Lease as read: its holder, its duration, its transitions, and the version the read saw."""

    holder: str
    duration: float
    transitions: int
    version: str


def claim(seen: Holding | None, me: str, unchanged_for: float) -> tuple[str, int] | None:
    """What this hook writes at a round: ("create" | "renew" | "take", the transitions to write), or None where
    another holds the Lease. ``unchanged_for``: seconds, by this hook's clock, since it first saw ``seen``'s
    version (the holder renews it each round, so a version that stands still is a holder gone)."""
    if seen is None:
        return "create", 0
    if seen.holder == me:
        return "renew", seen.transitions
    if not seen.holder or unchanged_for >= seen.duration:
        return "take", seen.transitions + 1
    return None


def identity(settings: LeaderElection, environ=os.environ) -> str:
    return environ.get(settings.identity_env) or socket.gethostname()


def namespace(settings: LeaderElection, environ=os.environ) -> str:
    """The Lease's namespace: the config's, or the pod's own (BATCHLENS_POD_NAMESPACE, or the service account's)."""
    if settings.namespace:
        return settings.namespace
    if environ.get(POD_NAMESPACE_ENV):
        return environ[POD_NAMESPACE_ENV]
    try:
        return NAMESPACE_FILE.read_text().strip()
    except OSError:
        raise RuntimeError(
            "remediate.leader_election: no namespace for the Lease (not in a pod): set leader_election.namespace"
        ) from None


class LeaseElector:
    """Holds or watches the Lease; :attr:`leading` is True while this hook may act."""

    def __init__(self, settings: LeaderElection, kube: Kubernetes, me: str, ns: str,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        from lightkube.models.coordination_v1 import LeaseSpec
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.coordination_v1 import Lease

        self._lease, self._spec, self._meta = Lease, LeaseSpec, ObjectMeta
        self.settings, self.me, self.namespace = settings, me, ns
        self._client = api_client(kube)
        self._clock = clock
        self._renewed_at = -math.inf  # when this hook last renewed (its clock)
        self._seen: tuple[str, float] | None = None  # (version, when first seen) of the record another holds
        self.holder = ""  # who holds the Lease, as last read

    @property
    def leading(self) -> bool:
        return self._clock() - self._renewed_at < self.settings.renew_deadline_seconds

    async def round(self) -> bool:
        """One try to acquire or renew; whether this hook leads after it. API errors are a failed try."""
        try:
            found = await self._read()
            seen = None if found is None else _holding(found)
            now = self._clock()
            if seen is not None and (self._seen is None or self._seen[0] != seen.version):
                self._seen = (seen.version, now)
            self.holder = seen.holder if seen is not None else ""
            unchanged = now - self._seen[1] if self._seen is not None else 0.0
            wanted = claim(seen, self.me, unchanged)
            if wanted is None:
                return self.leading
            await self._write(found, *wanted)
        except httpx2.HTTPStatusError as exc:  # 409: another wrote first; it leads this round
            if exc.response.status_code != 409:
                log.warning("leader election: the Lease %s/%s: %s", self.namespace, self.settings.lease_name,
                            status_message(exc))  # fmt: skip
            return self.leading
        except (httpx2.HTTPError, OSError) as exc:  # no answer
            log.warning("leader election: the API server did not answer: %s", exc)
            return self.leading
        self._renewed_at, self.holder = self._clock(), self.me
        return True

    async def holds(self) -> bool:
        """Fencing, before an act: this hook leads by its own clock and the Lease, read now, names it."""
        if not self.leading:
            return False
        try:
            found = await self._read()
        except (httpx2.HTTPError, OSError):
            return False  # unsure is not leading: the act waits for the next round
        return found is not None and found.spec.holderIdentity == self.me

    async def release(self) -> None:
        """At shutdown: give the Lease up, so that a standby takes over at its next round, not after a duration."""
        if not self.leading:
            return
        try:
            found = await self._read()
            if found is not None and found.spec.holderIdentity == self.me:
                found.spec.holderIdentity = None
                await self._client.replace(found)
                log.info("leader election: released the Lease %s/%s", self.namespace, self.settings.lease_name)
        except (httpx2.HTTPError, OSError) as exc:
            log.warning("leader election: could not release the Lease (a standby takes over once it expires): %s",
                        exc)  # fmt: skip
        self._renewed_at = -math.inf

    async def aclose(self) -> None:
        await self._client.close()

    async def _read(self):
        try:
            return await self._client.get(self._lease, self.settings.lease_name, namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:  # lightkube's ApiError is one
            if exc.response.status_code == 404:
                return None
            raise

    async def _write(self, found, how: str, transitions: int) -> None:
        now = datetime.now(UTC)
        duration = math.ceil(self.settings.lease_duration_seconds)
        if found is None:
            meta = self._meta(name=self.settings.lease_name, namespace=self.namespace)
            spec = self._spec(holderIdentity=self.me, leaseDurationSeconds=duration, acquireTime=now, renewTime=now,
                              leaseTransitions=transitions)  # fmt: skip
            await self._client.create(self._lease(metadata=meta, spec=spec))
        else:
            spec = found.spec
            if how == "take":
                spec.acquireTime = now
                log.warning("leader election: took the Lease %s/%s over from %s: this hook acts now",
                            self.namespace, self.settings.lease_name, spec.holderIdentity or "nobody")  # fmt: skip
            spec.holderIdentity, spec.leaseDurationSeconds, spec.renewTime = self.me, duration, now
            spec.leaseTransitions = transitions
            await self._client.replace(found)  # carries the version read: a write since then answers 409


def _holding(lease) -> Holding:
    spec = lease.spec
    return Holding(spec.holderIdentity or "", float(spec.leaseDurationSeconds or 0), spec.leaseTransitions or 0,
                   lease.metadata.resourceVersion or "")  # fmt: skip


class StateMirror:
    """The state a decision needs, in a ConfigMap the leader writes and its successor reads: each section (the
    breakers' states, the controllers') a JSON object of engine -> state under its own key."""

    def __init__(self, settings: LeaderElection, kube: Kubernetes, ns: str):
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.core_v1 import ConfigMap

        self._config_map, self._meta = ConfigMap, ObjectMeta
        self.name, self.namespace = settings.state_config_map, ns
        self._client = api_client(kube)
        self._lock = asyncio.Lock()  # one write at a time: each carries the version the last one left

    async def load(self) -> dict[str, dict[str, dict]]:
        """Every section, {} where there is no ConfigMap yet (the first leader)."""
        found = await self._get()
        data = {} if found is None else (found.data or {})
        return {key: json.loads(value) for key, value in data.items()}

    async def save(self, section: str, states: dict[str, dict]) -> None:
        """Replace one section (raises httpx2.HTTPError where the API server refuses or does not answer)."""
        async with self._lock:
            found = await self._get()
            text = json.dumps(states, sort_keys=True, separators=(",", ":"))
            if found is None:
                meta = self._meta(name=self.name, namespace=self.namespace,
                                  labels={"app.kubernetes.io/managed-by": "batchlens"})  # fmt: skip
                await self._client.create(self._config_map(metadata=meta, data={section: text}))
                return
            found.data = {**(found.data or {}), section: text}
            await self._client.replace(found)

    async def aclose(self) -> None:
        await self._client.close()

    async def _get(self):
        try:
            return await self._client.get(self._config_map, self.name, namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:
            if exc.response.status_code == 404:
                return None
            raise


class Leadership:
    """A hook of several: its elector, and the state it keeps for the next leader (the Remediator's view)."""

    def __init__(self, settings: LeaderElection, kube: Kubernetes, environ=os.environ):
        ns = namespace(settings, environ)
        self.elector = LeaseElector(settings, kube, identity(settings, environ), ns)
        self.mirror = StateMirror(settings, kube, ns)
        self._kept: dict[str, dict] = {}  # section -> what was last written, so that an unchanged one is not
        self._failing = ""

    async def keep(self, section: str, states: dict[str, dict]) -> None:
        """Write ``section`` for the next leader, while this hook leads; a failure is logged, once per kind."""
        if not self.elector.leading or self._kept.get(section) == states:
            return
        try:
            await self.mirror.save(section, states)
        except (httpx2.HTTPError, OSError) as exc:
            why = status_message(exc) if isinstance(exc, httpx2.HTTPStatusError) else str(exc)
            if why != self._failing:
                log.error("leader election: cannot keep the %s' state in the ConfigMap %s/%s (%s): a successor "
                          "would start from older state", section, self.mirror.namespace, self.mirror.name,
                          why)  # fmt: skip
                self._failing = why
            return
        self._kept[section], self._failing = states, ""

    async def saved(self) -> dict[str, dict[str, dict]] | None:
        """The state the last leader kept, or None where it cannot be read (logged): then not acting is safer."""
        try:
            return await self.mirror.load()
        except (httpx2.HTTPError, OSError, ValueError) as exc:
            why = status_message(exc) if isinstance(exc, httpx2.HTTPStatusError) else str(exc)
            log.error("leader election: leading, but the state the last leader kept in %s/%s cannot be read (%s): "
                      "not acting until it can", self.mirror.namespace, self.mirror.name, why)  # fmt: skip
            return None

    async def aclose(self) -> None:
        await self.elector.aclose()
        await self.mirror.aclose()
