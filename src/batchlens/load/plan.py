"""What a load run sends and what it reports. Pure: no clock, no network.

Arrivals are open-loop: requests go out on their schedule whether or not the
server keeps up, as users arrive, so a slow server shows as latency rather
than as a politely lower load.

- ``poisson``: exponential gaps at ``rate`` requests per second.
- ``bursty``: a Poisson process that alternates ``burst_seconds`` at
  ``burst_factor`` x the rate with a quiet spell, so that the mean is still ``rate``.
- ``steady``: evenly spaced, 1/rate apart: a scheduled feed, whose
  inter-arrival times do not vary at all.

An overload phase (``overload_every`` > 0) lays a second Poisson stream of
(``overload_factor`` - 1) x the rate over the last ``overload_seconds`` of every
``overload_every``: the load runs calm first, then past capacity for a while, on
any arrival pattern. Its own random stream leaves the base schedule of a seed
as it was.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from batchlens.quantiles import percentile

ARTICLE_PROMPT_TOKENS = (256, 512, 1024, 2048)
ARRIVALS = ("poisson", "bursty", "steady")


@dataclass(frozen=True)
class LoadSpec:
    rate: float  # mean requests per second
    duration: float  # seconds during which requests are sent
    arrival: str = "poisson"  # poisson | bursty | steady
    prompt_tokens: Sequence[int] = ARTICLE_PROMPT_TOKENS
    output_tokens: Sequence[int] = (128,)
    stream_share: float = 0.5
    interactive_share: float = 0.0  # of requests sent in the latency class below (the routing header)
    latency_class: str = "interactive"
    burst_seconds: float = 2.0
    burst_factor: float = 3.0
    seed: int = 1
    overload_every: float = 0.0  # seconds between overload phases; 0: none
    overload_seconds: float = 60.0  # the length of each, at the end of its period
    overload_factor: float = 2.0  # the rate during a phase, as a multiple of ``rate``


@dataclass(frozen=True)
class Planned:
    at: float  # seconds after the start
    prompt_tokens: int
    max_tokens: int
    stream: bool
    latency_class: str = ""  # sent in the routing header (docs/routing.md); empty: no header


def plan(spec: LoadSpec) -> list[Planned]:
    """The whole schedule at once (for a test, or a short run)."""
    return list(schedule(spec))


def schedule(spec: LoadSpec) -> Iterator[Planned]:
    """The schedule, one request at a time, in the order they leave: a day-long run holds none it has not sent
    (planned whole up front, the demo's day at 2.5 requests/s held 216,000, and half a gigabyte)."""
    if spec.rate <= 0 or spec.duration <= 0:
        raise ValueError("rate and duration must be positive")
    if spec.arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {spec.arrival!r}")
    if spec.overload_every and not (0 < spec.overload_seconds <= spec.overload_every and spec.overload_factor > 1):
        raise ValueError("an overload phase needs 0 < overload_seconds <= overload_every and overload_factor > 1")
    base = _arrivals(spec)
    return heapq.merge(base, _overload(spec), key=lambda p: p.at) if spec.overload_every else base


def _arrivals(spec: LoadSpec) -> Iterator[Planned]:
    rng = random.Random(spec.seed)
    period = spec.burst_seconds * spec.burst_factor  # a burst, then quiet: the mean rate is spec.rate
    t = 0.0
    while True:
        if spec.arrival == "poisson":
            t += rng.expovariate(spec.rate)
        elif spec.arrival == "steady":
            t += 1 / spec.rate
        else:
            t += rng.expovariate(spec.rate * spec.burst_factor)
            if t % period >= spec.burst_seconds:  # landed in the quiet spell: skip to the next burst
                t = (math.floor(t / period) + 1) * period
        if t >= spec.duration:
            return
        yield _draw(spec, rng, t)


def _draw(spec: LoadSpec, rng: random.Random, at: float) -> Planned:
    return Planned(
        at=at,
        prompt_tokens=rng.choice(list(spec.prompt_tokens)),
        max_tokens=rng.choice(list(spec.output_tokens)),
        stream=rng.random() < spec.stream_share,
        # Drawn only when asked for, so that a seed's schedule stays what it was without classes.
        latency_class=spec.latency_class if spec.interactive_share and rng.random() < spec.interactive_share else "",
    )


def _overload(spec: LoadSpec) -> Iterator[Planned]:
    """The extra arrivals of the overload phases: Poisson, only inside each period's last overload_seconds."""
    rng = random.Random(f"overload-{spec.seed}")
    calm = spec.overload_every - spec.overload_seconds
    t = 0.0
    while True:
        t += rng.expovariate(spec.rate * (spec.overload_factor - 1))
        if t % spec.overload_every < calm:  # in the calm part: draw on from the phase's start (memoryless)
            t = math.floor(t / spec.overload_every) * spec.overload_every + calm
            continue
        if t >= spec.duration:
            return
        yield _draw(spec, rng, t)


#: Answers that turn a request away at the door (admission's 503, a gateway's 429): the server working as set,
#: so counted apart from failures.
REFUSALS = ("http_503", "http_429")


@dataclass
class Result:
    planned: Planned
    ok: bool
    error: str = ""
    e2e: float = 0.0
    ttft: float | None = None  # streamed requests only
    itl: tuple[float, ...] = ()  # gaps between streamed tokens
    output_tokens: int = 0
    reason: str = ""  # a failed request: what the server said, if anything


#: The most latencies a run keeps per measure: a uniform sample of them past this (exact below it), so that a
#: day-long run's memory stays flat. Percentiles of 100,000 draws are within a fraction of a percent.
SAMPLE_SIZE = 100_000


class Reservoir:
    """A uniform sample of at most ``size`` values from a stream of any length (Vitter's algorithm R)."""

    def __init__(self, size: int = SAMPLE_SIZE, seed: int = 0):
        self.size, self.seen, self.values = size, 0, []
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        elif (k := self._rng.randrange(self.seen)) < self.size:
            self.values[k] = value


class Tally:
    """What a run's results add up to, as each comes: counts, tokens, and samples of each latency."""

    def __init__(self, sample_size: int = SAMPLE_SIZE):
        self.requests = self.succeeded = self.output_tokens = 0
        self.errors: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.reasons: dict[str, str] = {}  # error -> the first reason given for it
        self.ttft, self.itl, self.e2e = (Reservoir(sample_size, seed) for seed in range(3))

    def add(self, r: Result) -> None:
        self.requests += 1
        if not r.ok:
            counts = self.refused if r.error in REFUSALS else self.errors
            counts[r.error] = counts.get(r.error, 0) + 1
            if r.reason:
                self.reasons.setdefault(r.error, r.reason)
            return
        self.succeeded += 1
        self.output_tokens += r.output_tokens
        self.e2e.add(r.e2e)
        if r.ttft is not None:
            self.ttft.add(r.ttft)
        for gap in r.itl:
            self.itl.add(gap)

    def report(self, wall_seconds: float) -> dict:
        """Latency percentiles and throughput of the answered requests; the others by status: ``refused``
        (turned away at the door, REFUSALS) apart from ``errors`` (failed)."""

        def summary(sample: Reservoir) -> dict[str, float | None]:
            return {f"p{q}": percentile(sample.values, q) for q in (50, 90, 99)}

        return {
            "requests": self.requests,
            "succeeded": self.succeeded,
            "refused": self.refused,
            "errors": self.errors,
            "error_reasons": self.reasons,
            "seconds": wall_seconds,
            "requests_per_second": self.succeeded / wall_seconds if wall_seconds else 0.0,
            "output_tokens_per_second": self.output_tokens / wall_seconds if wall_seconds else 0.0,
            "ttft_seconds": summary(self.ttft),
            "itl_seconds": summary(self.itl),
            "e2e_seconds": summary(self.e2e),
        }


def report(results: Iterable[Result], wall_seconds: float) -> dict:
    """:meth:`Tally.report` of ``results``."""
    tally = Tally()
    for r in results:
        tally.add(r)
    return tally.report(wall_seconds)


def format_report(rep: dict) -> str:
    lines = [
        f"requests {rep['requests']}, succeeded {rep['succeeded']}, refused {rep['refused'] or 'none'}, "
        f"errors {rep['errors'] or 'none'}",
        *(f"  {error}: {reason}" for error, reason in rep["error_reasons"].items()),
        f"throughput {rep['requests_per_second']:.2f} req/s, {rep['output_tokens_per_second']:.1f} output tokens/s "
        f"over {rep['seconds']:.1f}s",
        f"{'latency (s)':12} {'p50':>9} {'p90':>9} {'p99':>9}",
    ]
    for name in ("ttft", "itl", "e2e"):
        cells = [rep[f"{name}_seconds"][p] for p in ("p50", "p90", "p99")]
        lines.append(f"{name.upper():12} " + " ".join(f"{c:>9.4f}" if c is not None else f"{'-':>9}" for c in cells))
    return "\n".join(lines)
