"""Render a snapshot as one Prometheus text exposition. Pure: no I/O, no waiting.

Passed-through families are already rendered per source; here they are only
grouped, so that a family served by several engines appears once with one
header, as the text format requires. Derived and status families go through
prometheus_client's own renderer.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from batchlens import __version__
from batchlens.config import Engine
from batchlens.exporter import families as fam
from batchlens.exporter.parser import Family
from batchlens.exporter.snapshot import FamilyBlock, Snapshot, SourceState


def family_blocks(families: Iterable[Family]) -> tuple[FamilyBlock, ...]:
    """Render parsed families for pass-through, one block per family name.

    A target may split a family (samples the family's type does not allow each
    come out of the parser as a family of their own); they are joined here.
    """
    blocks = (FamilyBlock(f.name, f.header, _sample_lines(f)) for f in families)
    return tuple(FamilyBlock(name, parts[0], "".join(parts[1:])) for name, parts in _grouped(blocks).items())


def _sample_lines(family: Family) -> str:
    lines = [line for _, _, line in family.samples]
    return "\n".join(lines) + "\n" if lines else ""


def _grouped(blocks: Iterable[FamilyBlock]) -> dict[str, list[str]]:
    """name -> [header, body, body, ...] in first-seen order, joined once by the caller.

    The first non-empty header wins: with several engines, its type is the family's type.
    """
    grouped: dict[str, list[str]] = {}
    for name, header, body in blocks:
        entry = grouped.get(name)
        if entry is None:
            grouped[name] = [header, body]
        else:
            entry[0] = entry[0] or header
            entry.append(body)
    return grouped


def _passthrough(states: Iterable[SourceState], ours: frozenset[str] = frozenset()) -> str:
    """Every source's blocks, one header per family across sources, less any family named as one of ``ours``: an
    engine serving ``batchlens_source_up`` would spoof the exporter's own series, and give it a second header."""
    blocks = (block for state in states if state.reading for block in state.reading.blocks if block.name not in ours)
    return "".join([part for parts in _grouped(blocks).values() for part in parts])


def _merge_by_name(metrics: Iterable[Metric]) -> Iterator[Metric]:
    merged: dict[str, Metric] = {}
    for metric in metrics:
        into = merged.get(metric.name)
        if into is None:
            into = merged[metric.name] = Metric(metric.name, metric.documentation, metric.type)
        into.samples.extend(metric.samples)
    yield from merged.values()


def source_up(samples: Iterable[fam.LabeledValue]) -> Metric:
    """``batchlens_source_up``. A source may add its own, finer series (one per GPU, say)."""
    return fam.gauge(
        "batchlens_source_up", "1 when the last sample of the source succeeded, 0 when it failed.", samples
    )


def _status_metrics(states: Iterable[SourceState]) -> Iterator[Metric]:
    states = list(states)

    def labels(state: SourceState, **extra: str) -> dict[str, str]:
        return {"source": state.source, **dict(state.labels), **extra}

    yield source_up([(labels(s), 1.0 if s.up else 0.0) for s in states])
    yield fam.gauge(
        "batchlens_source_last_success_timestamp_seconds",
        "Unix time at which the last successful sample of the source started: its data is at least this fresh.",
        [(labels(s), s.last_success) for s in states if s.last_success is not None],
    )
    yield fam.gauge(
        "batchlens_source_scrape_duration_seconds",
        "How long the last sample of the source took, successful or not.",
        [(labels(s), s.duration_seconds) for s in states],
    )
    yield fam.counter(
        "batchlens_source_errors_total",
        "Failed samples of the source (and non-fatal failures such as an admin API refusing the token), by reason.",
        [(labels(s, reason=reason), n) for s in states for reason, n in sorted(s.errors.items())],
    )


class SnapshotCollector:
    """The prometheus_client Collector protocol over one snapshot."""

    def __init__(self, snapshot: Snapshot, static: tuple[Metric, ...] = ()):
        self._snapshot = snapshot
        self._static = static

    def collect(self) -> Iterator[Metric]:
        yield fam.info("batchlens_exporter_build_info", "The batchlens exporter's version.", {"version": __version__})
        yield from self._static
        readings = (m for s in self._snapshot.states if s.reading for m in s.reading.metrics)
        yield from _merge_by_name(itertools.chain(_status_metrics(self._snapshot.states), readings))


def render(snapshot: Snapshot, static: tuple[Metric, ...] = ()) -> bytes:
    """The exposition: passed-through families, then ours; ``static`` holds what the config alone says."""
    families = list(SnapshotCollector(snapshot, static).collect())
    # A counter's family is named without _total, an info's without _info; a histogram's samples add suffixes.
    ours = frozenset(f.name + suffix for f in families for suffix in _SUFFIXES)
    return _passthrough(snapshot.states, ours).encode() + generate_latest(_Collected(families))  # type: ignore[arg-type]


_SUFFIXES = ("", "_total", "_info", "_bucket", "_count", "_sum", "_created")


class _Collected:
    """Families already collected, as the Collector protocol hands them to prometheus_client's renderer."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def engine_roles(engines: Iterable[Engine]) -> tuple[Metric, ...]:
    """``batchlens_engine_role``: an info series per role of each configured engine, up or down.

    As kube-state-metrics labels pods: rules join on ``vllm_instance`` to select a role's engines, while the
    engines' own series keep their labels. From the config, so an engine that is down keeps its roles.
    """
    samples = [({**e.series_labels, **e.labels, "role": role}, 1) for e in engines for role in e.role]
    if not samples:
        return ()
    return (fam.gauge("batchlens_engine_role", "1 for each role the router gives the engine (docs/routing.md).",
                      samples),)  # fmt: skip
