"""The sampler loop against scripted sources (our own Source protocol; no I/O).

The scripted source stands in for a vLLM or host source at the Source boundary.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import time
import weakref

import pytest

from batchlens.exporter.sampler import Sampler, SourceError
from batchlens.exporter.snapshot import Reading, SnapshotStore


class Scripted:
    kind = "vllm"
    labels = (("vllm_instance", "s"),)

    def __init__(self, *steps):
        self.steps = list(steps)

    async def sample(self) -> Reading:
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        if step == "hang":
            await asyncio.sleep(3600)
        return step


def _run(sampler: Sampler, ticks: int):
    async def go():
        return [await sampler.tick() for _ in range(ticks)]

    return asyncio.run(go())


def test_failures_are_counted_by_reason_and_drop_the_reading(caplog) -> None:
    ok = Reading(soft_errors=(("admin_http_401", "admin API refused the token"),))
    src = Scripted(ok, SourceError("timeout", "t/o"), SourceError("timeout", "t/o"), SourceError("http_500", "500"), ok)
    store = SnapshotStore()
    with caplog.at_level(logging.INFO, "batchlens.exporter"):
        states = _run(Sampler(src, store, interval=1, deadline=5), 5)
    assert [s.up for s in states] == [True, False, False, False, True]
    assert [s.reading is not None for s in states] == [True, False, False, False, True]
    assert states[-1].errors == {"timeout": 2, "http_500": 1, "admin_http_401": 2}
    assert states[-1].last_success is not None and states[2].last_success == states[0].last_success
    # One line per change, not per tick: down, reason changed, recovered, and the soft error once.
    messages = [r.getMessage() for r in caplog.records]
    assert sum("reason=timeout" in m for m in messages) == 1
    assert sum("still down, now" in m and "http_500" in m for m in messages) == 1
    assert sum("recovered after 3 failed samples" in m for m in messages) == 1
    assert sum("admin API refused the token" in m for m in messages) == 1
    assert store.snapshot().states == (states[-1],)


def test_a_hanging_source_is_cut_off_at_the_deadline() -> None:
    states = _run(Sampler(Scripted("hang"), SnapshotStore(), interval=1, deadline=0.2), 1)
    assert not states[0].up and states[0].errors == {"deadline": 1}


def test_a_bug_in_a_source_is_logged_once_and_the_loop_survives(caplog) -> None:
    src = Scripted(KeyError("boom"), KeyError("boom"), Reading())
    with caplog.at_level(logging.ERROR, "batchlens.exporter"):
        states = _run(Sampler(src, SnapshotStore(), interval=1, deadline=5), 3)
    assert [s.up for s in states] == [False, False, True]
    assert states[-1].errors == {"internal": 2}
    assert len([r for r in caplog.records if r.exc_info]) == 1


def test_run_keeps_its_schedule_and_never_bursts_after_an_overrun() -> None:
    """Ticks every interval from the start (not every interval after a sample), and a sample that overruns its
    slot is followed by the next at once, then on schedule again: never two to catch up."""
    interval, starts = 0.1, []

    class Timed(Scripted):
        async def sample(self) -> Reading:
            starts.append(time.monotonic())
            await asyncio.sleep(0.05 if len(starts) != 3 else 0.25)  # the third overruns two slots
            return Reading()

    async def go():
        task = asyncio.create_task(Sampler(Timed(), SnapshotStore(), interval=interval, deadline=1).run())
        await asyncio.sleep(0.95)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 0, 0.1, 0.2 (overruns to 0.45), 0.45 at once, then 0.55, 0.65, ... 0.85: nine starts in 0.95 s.
    assert len(starts) in (8, 9, 10), gaps
    assert all(interval * 0.7 < g < interval * 1.3 for g in gaps[:2] + gaps[3:]), gaps
    assert gaps[2] == pytest.approx(0.25, abs=0.05), "after the overrun, the next sample starts at once"


def test_a_failed_sample_frees_what_it_held_without_waiting_for_the_gc() -> None:
    """A refused 8 MiB body must not live on in a traceback cycle until the next full GC."""

    class Body:
        pass

    refs = []

    class HoldsABody:
        kind, labels = "vllm", ()

        async def sample(self) -> Reading:
            body = Body()
            refs.append(weakref.ref(body))
            raise SourceError("too_large", "refused")

    gc.disable()
    try:
        _run(Sampler(HoldsABody(), SnapshotStore(), interval=1, deadline=5), 1)
        assert refs[0]() is None
    finally:
        gc.enable()


def test_a_cancel_that_races_a_finished_sample_still_stops_the_loop() -> None:
    """The exporter's shutdown cancels every sampler; a sample that fails in the same loop turn
    (NVML absent, say) must not swallow that cancel and keep the process alive."""

    class InstantFailure:
        kind, labels = "nvml", ()

        async def sample(self) -> Reading:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            loop.call_soon(done.set_exception, SourceError("library_not_found", "no NVML"))
            return await done

    async def cancel_after(turns: int) -> bool:
        task = asyncio.create_task(Sampler(InstantFailure(), SnapshotStore(), interval=60, deadline=5).run())
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(task), 1)
        except asyncio.CancelledError:
            return True
        except TimeoutError:
            task.cancel()  # a second cancel reaches the sleep; the first was lost
            return False
        return False

    async def go():
        return [await cancel_after(turns) for turns in range(8)]

    assert asyncio.run(go()) == [True] * 8
