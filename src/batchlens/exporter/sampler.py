"""The background loop that samples one source and publishes its state.

One sampler per source, each on its own schedule, so a slow engine delays
nobody else. A sample that fails is counted by reason and logged once per
change (down, reason changed, recovered), not on every tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Protocol

from batchlens.exporter.snapshot import Reading, SnapshotStore, SourceState

log = logging.getLogger("batchlens.exporter")


class SourceError(Exception):
    """A failed sample. ``reason`` is a short, bounded label value (``timeout``, ``http_500``...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Source(Protocol):
    kind: str  # "vllm", "host", "nvml"
    labels: tuple[tuple[str, str], ...]

    async def sample(self) -> Reading: ...


def _drop_tracebacks(exc: BaseException | None) -> None:
    """Free a failed sample's frames now.

    A traceback holds every frame the error passed through, and with them the
    response body (up to exporter.max_response_bytes). asyncio's tasks make that
    a reference cycle, which only the cyclic GC would free, long after; an engine
    that keeps failing would keep megabytes alive.
    """
    while exc is not None:
        exc.__traceback__ = None
        exc = exc.__context__


def describe(source: Source) -> str:
    """``vllm[serving/vllm-0]``: the kind and the first label's value (the engine), for logs."""
    return f"{source.kind}[{source.labels[0][1]}]" if source.labels else source.kind


class Sampler:
    def __init__(self, source: Source, store: SnapshotStore, interval: float, deadline: float):
        self.source = source
        self._store = store
        self._interval = interval
        # A hard bound on one sample, over the source's own timeouts: nothing a
        # source does can stall its loop for longer.
        self._deadline = deadline
        self._errors: Counter[str] = Counter()
        self._reading: Reading | None = None
        self._last_success: float | None = None
        self._failing: str | None = None  # the reason of the current failure streak
        self._streak = 0
        self._soft_active: set[str] = set()

    async def run(self) -> None:
        next_tick = time.monotonic()
        while True:
            await self.tick()
            next_tick += self._interval
            now = time.monotonic()
            if next_tick < now:  # overran: start again now, do not burst to catch up
                next_tick = now
            await asyncio.sleep(next_tick - now)

    async def tick(self) -> SourceState:
        started, started_at = time.monotonic(), time.time()
        try:
            # Not asyncio.wait_for: on 3.11 it swallows a cancel that races a sample that
            # just finished, and the exporter then never stops.
            async with asyncio.timeout(self._deadline):
                reading = await self.source.sample()
        except SourceError as exc:
            self._fail(exc.reason, str(exc))
            _drop_tracebacks(exc)
        except TimeoutError as exc:
            self._fail("deadline", f"sample did not finish within {self._deadline:.1f}s")
            _drop_tracebacks(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, not a bad upstream: keep serving, say so loudly once
            if self._failing != "internal":
                log.exception("%s: unexpected error while sampling", describe(self.source))
            self._fail("internal", repr(exc))
            _drop_tracebacks(exc)
        else:
            self._succeed(reading, started_at)
        duration = time.monotonic() - started
        log.debug("%s: sample %s in %.3fs", describe(self.source), "failed" if self._failing else "done", duration)
        state = SourceState(
            source=self.source.kind,
            labels=self.source.labels,
            up=self._failing is None,
            reading=self._reading,
            last_success=self._last_success,
            duration_seconds=duration,
            errors=dict(self._errors),
        )
        self._store.publish(state)
        return state

    def _succeed(self, reading: Reading, started_at: float) -> None:
        if self._failing is not None:
            log.info("%s: recovered after %d failed samples", describe(self.source), self._streak)
        self._failing, self._streak = None, 0
        # The start, not the end: the data is at least this fresh.
        self._reading, self._last_success = reading, started_at
        active = {}
        for reason, message in reading.soft_errors:
            self._errors[reason] += 1
            active[reason] = message
        for reason in active.keys() - self._soft_active:
            log.warning(
                "%s: %s [reason=%s; logged again only when it clears]", describe(self.source), active[reason], reason
            )
        for reason in self._soft_active - active.keys():
            log.info("%s: %s cleared", describe(self.source), reason)
        self._soft_active = set(active)

    def _fail(self, reason: str, message: str) -> None:
        self._errors[reason] += 1
        self._streak += 1
        if self._failing != reason:
            verb = "down" if self._failing is None else "still down, now"
            log.warning("%s: %s: %s [reason=%s]", describe(self.source), verb, message, reason)
        self._failing = reason
        self._reading = None
