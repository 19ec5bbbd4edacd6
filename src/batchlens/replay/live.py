"""Replay a trace against a running server (vLLM or `batchlens simulate`) in real time, streaming every request.

Each request leaves at its trace time (compressed by --rate-scale upstream)
and streams, so that TTFT and TPOT are measured at the client, exactly. The
engine's batch limit is whatever steers it while the replay runs: the
controller in `batchlens remediate`, a static setting, or vLLM's default.

An engine that dies mid-replay does not make the replay hang or lie. After
``DEAD_AFTER`` requests in a row fail to connect (or time out), nothing more is
sent; the run is judged on what was sent, and says where and why it stopped.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from batchlens.goodput import Outcome, Slo, judge
from batchlens.load.client import DIRECT, Via, connector, first_model, send
from batchlens.load.plan import REFUSALS, Planned, Result
from batchlens.replay.simulated import Run
from batchlens.replay.traces import TraceRequest

DEAD_AFTER = 5  # requests in a row that found nobody (connect error or timeout): the engine is gone
DEAD_REASONS = ("connect", "timeout")


@dataclass(frozen=True)
class Accounting:
    """Every request sent, and what came of it: answered, refused at the door, or failed, by reason."""

    sent: int
    answered: int
    refused: dict[str, int]  # by HTTP status: http_503, http_429
    failed: dict[str, int]  # by reason: http_<status>, timeout, connect, reset, disconnected, protocol, abandoned

    @classmethod
    def of(cls, results: Sequence[Result]) -> Accounting:
        refused = Counter(r.error for r in results if not r.ok and r.error in REFUSALS)
        failed = Counter(r.error or "unknown" for r in results if not r.ok and r.error not in REFUSALS)
        return cls(
            len(results), sum(r.ok for r in results), dict(sorted(refused.items())), dict(sorted(failed.items()))
        )

    def summary(self) -> str:
        def listed(counts: dict[str, int]) -> str:
            return f" ({', '.join(f'{k} {v}' for k, v in counts.items())})" if counts else ""

        return (f"sent {self.sent}: answered {self.answered}, refused {sum(self.refused.values())}"
                f"{listed(self.refused)}, failed {sum(self.failed.values())}{listed(self.failed)}")  # fmt: skip


@dataclass(frozen=True)
class LiveRun:
    run: Run
    sent: int
    stopped: str = ""  # why the replay stopped before the end of the trace; empty when it ran through
    classes: dict[str, Run] = field(default_factory=dict)  # each latency class of the trace judged alone
    accounting: dict[str, Accounting] = field(default_factory=dict)  # "total", and each latency class


async def _until_done_or_dead(tasks: list[asyncio.Task], dead: asyncio.Task) -> None:
    """Every request done, or the engine found dead, whichever comes first."""
    everything = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
    await asyncio.wait([everything, dead], return_when=asyncio.FIRST_COMPLETED)


def outcome(result: Result) -> Outcome:
    if not result.ok or result.ttft is None:
        return Outcome(None, None, 0)
    return Outcome(result.ttft, result.e2e, result.output_tokens)


async def replay_live(
    url: str,
    trace: Sequence[TraceRequest],
    slo: Slo,
    *,
    model: str | None = None,
    timeout: float = 300.0,
    max_connections: int = 1024,
    on_done: Callable[[Result], None] = lambda _r: None,
    via: Via = DIRECT,
) -> LiveRun:
    """Send ``trace`` to ``url`` on its schedule; ValueError (before anything is sent) when nobody answers."""
    async with aiohttp.ClientSession(connector=connector(max_connections)) as session:
        model = model or await first_model(session, url, min(timeout, 10), via)
        loop = asyncio.get_running_loop()
        start, dead = loop.time(), asyncio.Event()
        results: list[Result] = []
        streak, stopped = [0], [""]

        async def at_its_time(request: TraceRequest) -> None:
            await asyncio.sleep(max(0.0, start + request.t - loop.time()))
            if dead.is_set():
                return
            planned = Planned(request.t, request.prompt_tokens, request.output_tokens, stream=True,
                              latency_class=request.latency_class)  # fmt: skip
            try:
                result = await send(session, url, model, planned, timeout, via)
            except asyncio.CancelledError:  # in flight when the engine was found dead: sent, and not good
                results.append(Result(planned, False, "abandoned"))
                raise
            results.append(result)
            on_done(result)
            streak[0] = streak[0] + 1 if result.error in DEAD_REASONS else 0
            if streak[0] >= DEAD_AFTER and not dead.is_set():
                stopped[0] = (
                    f"stopped {loop.time() - start:.1f} s in: the engine stopped answering ({DEAD_AFTER} requests in "
                    f"a row: {result.error}); the figures cover the {len(results)} requests sent"
                )
                dead.set()

        tasks = [asyncio.create_task(at_its_time(r)) for r in trace]
        watch = asyncio.create_task(dead.wait())
        await _until_done_or_dead(tasks, watch)
        for task in (*tasks, watch):  # after a death, requests still streaming would only time out
            task.cancel()
        await asyncio.gather(*tasks, watch, return_exceptions=True)
        seconds = loop.time() - start
    judgement = judge([outcome(r) for r in results], seconds, slo)
    classes = sorted({r.planned.latency_class for r in results} - {""})
    of_class = {c: [r for r in results if r.planned.latency_class == c] for c in classes}
    by_class = {
        c: Run(c, judge([outcome(r) for r in rs], seconds, slo), [], refused=None) for c, rs in of_class.items()
    }
    accounting = {"total": Accounting.of(results), **{c: Accounting.of(rs) for c, rs in of_class.items()}}
    return LiveRun(Run("live", judgement, [], refused=None), sent=len(results), stopped=stopped[0], classes=by_class,
                   accounting=accounting)  # fmt: skip
