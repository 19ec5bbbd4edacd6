"""A request's TTFT, predicted at the door from what the API server sees, and the rates it learns online. Pure.

The queued-token cap (control/admission.py) judges the backlog, not the request: it refuses the tail of a burst
whose every request, admitted alone, would have made it, and lets in a long prompt that will miss. The door here
judges each request by its own fate:

    TTFT ≈ (prompt tokens ahead still to prefill + its own prompt) / prefill rate

and, where the batch is at its limit, no sooner than the finishes it must wait for to get a slot:

    TTFT ≈ (requests ahead of it past the limit + 1) / finish rate + its own prompt / prefill rate

What it reads is what vLLM's API server has of every request (its output processor's states): the prompt's
length, whether its first token has come, when it arrived. A prompt in prefill is counted whole, as vLLM's queued
caps count it, less what the engine has prefilled of the oldest since the last first token came
(:meth:`Backlog.ahead`): the engine prefills oldest first.

Both rates are learned from the engine's own recent history, no model file: the prefill rate is the prompt tokens
whose first token came, over the time anything was in prefill (:class:`Rates`). Measured so, it holds the chunk
that the running batch's decodes take from each step, the step's own length and the mix of the moment: an engine
with one short prompt at a time gets a rate that predicts that prompt's whole TTFT. With too little history the
door knows nothing, and refuses nothing (it fails open, as the cap does).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from batchlens.quantiles import poisson_quantile

#: How far back the rates look (seconds of the API server's clock).
HORIZON_SECONDS = 30.0
#: Fewer first tokens than this in the horizon: no prefill rate (the door is open).
MIN_PREFILLS = 8
#: How sure the door must be that a request waiting for a slot would miss before it refuses it. Lower than the
#: cap's 0.95: at 0.9 or 0.95 the door let in, past the conversation trace's cliff, requests that then missed and
#: held slots that others could have used (1.66 good requests/s at x1.2 where the cap alone served 2.43); at 0.8
#: it served 2.28 with 1.9% of its sheds false, at 0.5 3.61 with 12.5% (docs/admission.md).
CONFIDENCE = 0.8
#: The queued-token cap behind the per-request door is this multiple of the cap alone: a backstop against a
#: backlog the door cannot see (a rate not learned yet), not the judge. At 1 it refused, at the conversation
#: trace's cliff, the marginal requests that the door had judged would make it (a third of its sheds false).
BACKSTOP = 1.5


@dataclass(frozen=True)
class Prediction:
    """A request's TTFT as predicted at the door, and what it rests on."""

    ttft_seconds: float  # the expected TTFT: the later of its prefill's end and its slot (plus its own prefill)
    prefill_seconds: float  # the prompt tokens ahead and its own, at the prefill rate
    own_seconds: float  # its own prompt alone
    slots_needed: int  # finishes it waits for before it has a slot (0: the batch has room)
    finishes_per_second: float | None


@dataclass
class _Window:
    at: float
    busy_seconds: float  # of the time since the previous one, how long something was in prefill
    full_seconds: float  # ... and how long the batch was at its limit
    prefilled_tokens: int  # prompt tokens whose first token came
    prefills: int
    finishes: int


class Rates:
    """The engine's prefill and finish rates, from what the API server saw of its requests over HORIZON_SECONDS.

    :meth:`observe` is called with each change seen (the replay: every step; the plugin: every arrival and every
    tick of its sampler): how long since the previous one, whether something was in prefill all that time and
    whether the batch was at its limit, and what came of it.

    A lone prompt's own time is affine, not proportional: its first token comes at the end of a step, and a step
    of one short prompt costs about what a long one's chunk does (the weights are read either way). So the busy
    periods of one prompt alone (prompt tokens, seconds) are fitted by least squares, ``seconds ≈ step +
    tokens × per_token``, for a request's own prefill (:attr:`lone`). Proportional alone, a rate learned on chat
    prompts took a lone 5,000-token prompt for 0.6 s where it took 0.45, and refused it."""

    def __init__(self, horizon_seconds: float = HORIZON_SECONDS, min_prefills: int = MIN_PREFILLS):
        self.horizon_seconds, self.min_prefills = horizon_seconds, min_prefills
        self._windows: deque[_Window] = deque()
        self._sums = [0.0, 0.0, 0, 0, 0]  # busy, full, tokens, prefills, finishes over the windows held
        self._lone: deque[tuple[float, int, float]] = deque()  # (when, prompt tokens, seconds) of lone periods
        self._period = [0.0, 0, 0]  # the busy period in course: seconds, tokens, prefills
        #: Prompt tokens of the requests still in prefill that the engine has prefilled already, as far as the
        #: rate says: what it did while anything was in prefill, less the prompts whose first token came. The API
        #: server sees no chunk; the bounds (none below 0, never a whole prompt) keep the rate's error from adding up.
        self.partial_tokens = 0.0

    def observe(self, now: float, seconds: float, *, busy: bool, full: bool, prefilled_tokens: int = 0,
                prefills: int = 0, finishes: int = 0, in_prefill: tuple[int, int] = (0, 0),
                slots_added: int = 0) -> None:  # fmt: skip
        """``in_prefill``: (prompt tokens, requests) still in prefill now, which bound :attr:`partial_tokens`;
        ``slots_added``: how far the batch limit rose since the last look (the controller's growth frees slots as
        finishes do: on the Azure code trace, where the law grows a slot a tick, a quarter of the slot test's sheds
        were false without it)."""
        finishes += slots_added
        # Finishes free slots only where the batch was full: else they say nothing of how soon one frees.
        window = _Window(now, seconds if busy else 0.0, seconds if full else 0.0, prefilled_tokens, prefills,
                         finishes if full else 0)  # fmt: skip
        if window.busy_seconds or window.full_seconds or prefills or finishes:
            self._windows.append(window)
            self._add(window, 1)
        tokens, requests = in_prefill
        period = self._period
        period[0], period[1], period[2] = (
            period[0] + window.busy_seconds,
            period[1] + prefilled_tokens,
            period[2] + prefills,
        )
        if not requests:  # the busy period is over: one prompt alone in it measures the step and the rate
            if period[2] == 1 and period[0] > 0:
                self._lone.append((now, period[1], period[0]))
            self._period = [0.0, 0, 0]
        self._forget(now)
        rate = self.prefill_tokens_per_second or 0.0
        # Each prompt still in prefill may be done but for its last token (whose step brings its first token).
        self.partial_tokens = min(max(self.partial_tokens + rate * window.busy_seconds - prefilled_tokens, 0.0),
                                  max(tokens - requests, 0))  # fmt: skip

    def _add(self, w: _Window, sign: int) -> None:
        for i, value in enumerate((w.busy_seconds, w.full_seconds, w.prefilled_tokens, w.prefills, w.finishes)):
            self._sums[i] += sign * value

    def _forget(self, now: float) -> None:
        while self._windows and self._windows[0].at < now - self.horizon_seconds:
            self._add(self._windows.popleft(), -1)
        while self._lone and self._lone[0][0] < now - self.horizon_seconds:
            self._lone.popleft()

    @property
    def prefill_tokens_per_second(self) -> float | None:
        """Prompt tokens prefilled per second of prefill; None: too few first tokens to say."""
        busy, _, tokens, prefills, _ = self._sums
        return tokens / busy if prefills >= self.min_prefills and busy > 0 and tokens > 0 else None

    @property
    def lone(self) -> tuple[float, float] | None:
        """(step seconds, seconds per token) of a prompt prefilled alone, fitted; None: too few, or too alike."""
        points = self._lone
        if len(points) < self.min_prefills:
            return None
        n = len(points)
        mean_x = sum(x for _, x, _ in points) / n
        mean_y = sum(y for _, _, y in points) / n
        sxx = sum((x - mean_x) ** 2 for _, x, _ in points)
        if sxx <= 0:
            return None
        per_token = sum((x - mean_x) * (y - mean_y) for _, x, y in points) / sxx
        step = mean_y - per_token * mean_x
        return (step, per_token) if per_token > 0 and step >= 0 else None

    @property
    def finishes_per_second(self) -> float | None:
        """Requests finished per second while the batch was at its limit (a slot frees as one finishes)."""
        _, full, _, _, finishes = self._sums
        return finishes / full if full > 0 and finishes > 0 else None


@dataclass(frozen=True)
class Backlog:
    """What the API server has of the requests ahead of a new one: each request's prompt still in prefill (counted
    whole, as vLLM's queued caps count it), and how many are past their first token."""

    prefilling_tokens: int
    prefilling: int
    decoding: int

    @classmethod
    def of(cls, states: Iterable[tuple[int, bool]]) -> Backlog:
        """From each unfinished request's (prompt tokens, still in prefill)."""
        tokens = prefilling = decoding = 0
        for prompt, in_prefill in states:
            if in_prefill:
                tokens, prefilling = tokens + prompt, prefilling + 1
            else:
                decoding += 1
        return cls(tokens, prefilling, decoding)

    @property
    def unfinished(self) -> int:
        return self.prefilling + self.decoding


def predict(backlog: Backlog, prompt_tokens: int, rates: Rates, limit: int | None) -> Prediction | None:
    """The TTFT of a request of ``prompt_tokens`` arriving now; None: the rates are not known yet (admit).
    ``limit``: the engine's batch limit, where the API server knows it (the plugin sets it); None: no slot wait."""
    rate = rates.prefill_tokens_per_second
    if rate is None:
        return None
    lone = rates.lone
    own = prompt_tokens / rate if lone is None else lone[0] + prompt_tokens * lone[1]
    prefill = max(backlog.prefilling_tokens - rates.partial_tokens, 0.0) / rate + own
    finishes = rates.finishes_per_second
    needed = backlog.unfinished - limit + 1 if limit is not None and backlog.unfinished >= limit else 0
    expected = prefill if not needed or finishes is None else max(prefill, needed / finishes + own)
    return Prediction(expected, prefill, own, needed, finishes)


def refuses(prediction: Prediction | None, budget_seconds: float, confidence: float = CONFIDENCE) -> bool:
    """Whether the door refuses: only a request that would miss ``budget_seconds`` (its TTFT and the margin over
    it, less what it has waited) with ``confidence``. The prefill ahead drains at a steady rate, and its estimate
    is close (docs/admission.md measures it); a slot comes as running requests finish, which they do at random:
    the request is refused only where the finishes it needs pass the ``confidence`` quantile of how many come
    (Poisson) in the time its own prefill leaves it, as the queued-token cap's spread does (control/admission.py).
    Unknown rates: admitted."""
    if prediction is None:
        return False
    if not prediction.slots_needed or prediction.finishes_per_second is None:
        return prediction.prefill_seconds > budget_seconds
    # Waiting for a slot, the prompts ahead are waiting for theirs too: the prefill rate of such a time is the rate
    # slots free, and only the finishes say when its own comes.
    left = budget_seconds - prediction.own_seconds
    return left <= 0 or prediction.slots_needed > poisson_quantile(prediction.finishes_per_second * left, confidence)


class Watch:
    """The API server's requests, sampled: what changed since the last look, into :class:`Rates`.

    The plugin cannot see the engine's steps; it sees its requests' states. Each :meth:`sample` takes every
    unfinished request's (id -> prompt tokens, still in prefill); one in prefill at the last look and not now got
    its first token (or was aborted: rare, and a prompt's worth of error), one gone has finished."""

    def __init__(self, rates: Rates | None = None):
        self.rates = rates or Rates()
        self._limit: int | None = None
        self._at: float | None = None
        self._prefilling: dict[str, int] = {}
        self._unfinished: set[str] = set()

    def sample(self, now: float, states: Mapping[str, tuple[int, bool]], limit: int | None = None) -> Backlog:
        backlog = Backlog.of(states.values())
        prefilling = {rid: prompt for rid, (prompt, in_prefill) in states.items() if in_prefill}
        if self._at is not None and now >= self._at:
            done = [prompt for rid, prompt in self._prefilling.items() if rid not in prefilling]
            finishes = sum(rid not in states for rid in self._unfinished)
            full = limit is not None and len(self._unfinished) >= limit
            # In prefill, but not prefilling, where every slot holds a request past its first token.
            busy = bool(self._prefilling) and (limit is None or len(self._unfinished) - len(self._prefilling) < limit)
            self.rates.observe(now, now - self._at, busy=busy, full=full,
                               prefilled_tokens=sum(done), prefills=len(done), finishes=finishes,
                               in_prefill=(backlog.prefilling_tokens, backlog.prefilling),
                               slots_added=max(0, (limit or 0) - (self._limit or limit or 0)))  # fmt: skip
        self._at, self._prefilling, self._unfinished, self._limit = now, prefilling, set(states), limit
        return backlog
