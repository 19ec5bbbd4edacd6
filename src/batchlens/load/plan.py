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

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

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
    if spec.rate <= 0 or spec.duration <= 0:
        raise ValueError("rate and duration must be positive")
    if spec.arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {spec.arrival!r}")
    if spec.overload_every and not (0 < spec.overload_seconds <= spec.overload_every and spec.overload_factor > 1):
        raise ValueError("an overload phase needs 0 < overload_seconds <= overload_every and overload_factor > 1")
    rng = random.Random(spec.seed)
    period = spec.burst_seconds * spec.burst_factor  # a burst, then quiet: the mean rate is spec.rate
    out: list[Planned] = []
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
            return sorted(out + _overload(spec), key=lambda p: p.at) if spec.overload_every else out
        out.append(_draw(spec, rng, t))


def _draw(spec: LoadSpec, rng: random.Random, at: float) -> Planned:
    return Planned(
        at=at,
        prompt_tokens=rng.choice(list(spec.prompt_tokens)),
        max_tokens=rng.choice(list(spec.output_tokens)),
        stream=rng.random() < spec.stream_share,
        # Drawn only when asked for, so that a seed's schedule stays what it was without classes.
        latency_class=spec.latency_class if spec.interactive_share and rng.random() < spec.interactive_share else "",
    )


def _overload(spec: LoadSpec) -> list[Planned]:
    """The extra arrivals of the overload phases: Poisson, only inside each period's last overload_seconds."""
    rng = random.Random(f"overload-{spec.seed}")
    calm = spec.overload_every - spec.overload_seconds
    out: list[Planned] = []
    t = 0.0
    while True:
        t += rng.expovariate(spec.rate * (spec.overload_factor - 1))
        if t % spec.overload_every < calm:  # in the calm part: draw on from the phase's start (memoryless)
            t = math.floor(t / spec.overload_every) * spec.overload_every + calm
            continue
        if t >= spec.duration:
            return out
        out.append(_draw(spec, rng, t))


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


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def report(results: Sequence[Result], wall_seconds: float) -> dict:
    """Latency percentiles and throughput of the answered requests; the others by status: ``refused`` (turned
    away at the door, REFUSALS) apart from ``errors`` (failed)."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    refused: dict[str, int] = {}
    reasons: dict[str, str] = {}  # error -> the first reason given for it
    for r in results:
        if not r.ok:
            counts = refused if r.error in REFUSALS else errors
            counts[r.error] = counts.get(r.error, 0) + 1
            if r.reason:
                reasons.setdefault(r.error, r.reason)

    def summary(values: list[float]) -> dict[str, float | None]:
        return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}

    return {
        "requests": len(results),
        "succeeded": len(ok),
        "refused": refused,
        "errors": errors,
        "error_reasons": reasons,
        "seconds": wall_seconds,
        "requests_per_second": len(ok) / wall_seconds if wall_seconds else 0.0,
        "output_tokens_per_second": sum(r.output_tokens for r in ok) / wall_seconds if wall_seconds else 0.0,
        "ttft_seconds": summary([r.ttft for r in ok if r.ttft is not None]),
        "itl_seconds": summary([gap for r in ok for gap in r.itl]),
        "e2e_seconds": summary([r.e2e for r in ok]),
    }


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
