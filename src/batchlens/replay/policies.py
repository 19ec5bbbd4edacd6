"""Batch-limit policies a replay can run: how the engine's admission limit is chosen, tick by tick. Pure.

``default`` is vLLM as shipped: the limit is the capacity (max_num_seqs) and
never moves. ``static:N`` holds N. A policy sees only what it could see live
(:class:`Signals`), never the simulator's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Signals:
    """What a policy sees at a tick: the engine's gauges, as its /metrics would show them."""

    now: float
    limit: int
    capacity: int
    running: int
    waiting: int
    kv_usage: float


class Policy(Protocol):
    name: str

    def initial(self, capacity: int) -> int:
        """The limit the run starts with."""

    def decide(self, signals: Signals) -> int:
        """The limit from this tick on."""


@dataclass(frozen=True)
class Static:
    """A fixed limit; ``None`` is the capacity, which is vLLM's default."""

    limit: int | None = None

    @property
    def name(self) -> str:
        return "default" if self.limit is None else f"static:{self.limit}"

    def initial(self, capacity: int) -> int:
        if self.limit is not None and self.limit > capacity:
            raise ValueError(f"{self.name} is above the engine's capacity (max_num_seqs {capacity})")
        return capacity if self.limit is None else self.limit

    def decide(self, signals: Signals) -> int:
        return signals.limit


POLICIES = ("default", "static:N")


def parse_policy(text: str) -> Policy:
    """``default`` or ``static:N``; ValueError naming what exists otherwise."""
    name, _, arg = text.strip().partition(":")
    if name == "default" and not arg:
        return Static()
    if name == "static":
        try:
            limit = int(arg)
        except ValueError:
            limit = 0
        if limit < 1:
            raise ValueError(f"static:N takes a batch limit N of 1 or more, got {text!r}")
        return Static(limit)
    raise ValueError(f"unknown policy {text!r}: one of {', '.join(POLICIES)}")


def oracle_limits(capacity: int) -> list[int]:
    """The static limits an oracle sweep tries first: powers of two up to the capacity, and the capacity."""
    limits, limit = [], 1
    while limit < capacity:
        limits.append(limit)
        limit *= 2
    return [*limits, capacity]
