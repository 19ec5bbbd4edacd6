"""The exporter's snapshot: the latest state of every source, immutable.

Samplers publish a new :class:`SourceState` after each tick; ``/metrics`` reads
one :class:`Snapshot` and renders it. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from prometheus_client.metrics_core import Metric

#: Identifies a source: its kind ("vllm", "host", "nvml") and its labels.
SourceKey = tuple[str, tuple[tuple[str, str], ...]]


class FamilyBlock(NamedTuple):
    """One metric family passed through from a target, already rendered with our labels.

    A tuple, not a dataclass: an engine yields a hundred of these every tick.
    """

    name: str
    header: str  # its "# HELP" / "# TYPE" lines, possibly empty
    body: str  # its sample lines, each ending in a newline


@dataclass(frozen=True, slots=True)
class Reading:
    """What one successful sample of a source produced."""

    blocks: tuple[FamilyBlock, ...] = ()
    metrics: tuple[Metric, ...] = ()
    #: Failures that did not make the source down (an admin API refusing our
    #: token, say), as (reason, message); each is counted in batchlens_source_errors_total.
    soft_errors: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class SourceState:
    source: str
    labels: tuple[tuple[str, str], ...]
    up: bool
    #: The latest successful reading, or None while the source is down: a down
    #: source's series are dropped, never frozen at stale values.
    reading: Reading | None
    last_success: float | None  # unix time at which the last successful sample started
    duration_seconds: float  # how long the last sample took
    errors: Mapping[str, int] = field(default_factory=dict)  # reason -> count, monotonic

    @property
    def key(self) -> SourceKey:
        return (self.source, self.labels)


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    states: tuple[SourceState, ...]


class SnapshotStore:
    """Holds the latest state per source. Written from one event loop and read from the HTTP server's threads: each
    change swaps in a new mapping before the version moves, so a reader never sees one half made."""

    def __init__(self) -> None:
        self._states: Mapping[SourceKey, SourceState] = MappingProxyType({})
        self._version = 0

    def publish(self, state: SourceState) -> None:
        states = dict(self._states)
        states[state.key] = state
        self._states = MappingProxyType(states)
        self._version += 1

    def forget(self, key: SourceKey) -> None:
        """Drop a source that is gone (a discovered engine whose pod went away)."""
        if key in self._states:
            states = dict(self._states)
            del states[key]
            self._states = MappingProxyType(states)
            self._version += 1

    def snapshot(self) -> Snapshot:
        return Snapshot(self._version, tuple(self._states.values()))
