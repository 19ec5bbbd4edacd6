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

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from batchlens.quantiles import poisson_quantile

#: How far back the rates look (seconds of the API server's clock).
HORIZON_SECONDS = 30.0
#: Fewer first tokens than this in the horizon: no prefill rate (the door is open).
MIN_PREFILLS = 8
#: How sure the door must be that a request waiting for a slot would miss before it refuses it, where the latest
#: its slot frees does not already admit it. On benchmarks/controller.py's 15 runs and the 4 near-cliff ones, 0.8
#: refused the ramp's marginal requests (5.9% of its sheds false on the article's profile), 0.9 let in requests
#: that then missed (5.2% false on the published ramp, and 1.95 good requests/s where 0.85 served 2.23 past the
#: conversation trace's cliff); 0.85 kept every run under 5% (docs/admission.md).
CONFIDENCE = 0.85
#: A request waiting for a slot is judged against its bound and this share of it more. When a slot frees is
#: random (it comes as requests finish), where a prefill's error runs one way: the prompts that arrive after a
#: request can only lengthen the step it shares with them. Judged at the bound itself, 6.9% of the published
#: profile's bursty load's sheds were false, all of them slot waits; the prefill's sheds need no margin (a quarter
#: of the TTFT on them cost that load 1.5% of its goodput, and the published phase, ramp and overload 2-29%).
SLOT_MARGIN = 0.25
#: How quickly the learned time a decode step takes follows the batch (seconds): the step lengthens as a burst fills
#: the batch, within seconds, where the rates above look back half a minute.
DECODE_TIME_CONSTANT = 2.0
#: The most requests one second look refuses: each refusal means judging the queue again. With 1,000 requests in
#: prefill, all late, looking until none is took 12 ms of the API server's loop; 16 at most, 0.35 ms, as long as
#: a look that refuses none. The rest are judged at the next look (the plugin's next tick, 25 ms later), their
#: waits only longer.
LOOK_MOST = 16
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
    #: When its slot frees at the latest: the requests holding the slots have this long to their last token (the
    #: output tokens each has left, at the decode step's learned time). None: not known.
    slot_seconds: float | None = None


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
        self._decode = [0.0, 0.0]  # output tokens, and request-seconds decoding, decayed by DECODE_TIME_CONSTANT

    def observe(self, now: float, seconds: float, *, busy: bool, full: bool, prefilled_tokens: int = 0,
                prefills: int = 0, finishes: int = 0, in_prefill: tuple[int, int] = (0, 0),
                slots_added: int = 0, decoded: tuple[int, float] = (0, 0.0)) -> None:  # fmt: skip
        """``in_prefill``: (prompt tokens, requests) still in prefill now, which bound :attr:`partial_tokens`;
        ``slots_added``: how far the batch limit rose since the last look (the controller's growth frees slots as
        finishes do: on the Azure code trace, where the law grows a slot a tick, a quarter of the slot test's sheds
        were false without it); ``decoded``: output tokens that requests decoding all along got, and the seconds
        they were decoding (summed over the requests)."""
        # Only a step with no prompt in it: a request waiting for a slot waits through steps that admit no prompt.
        self._decoded(seconds, *(decoded if not busy else (0, 0.0)))
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

    def _decoded(self, seconds: float, tokens: int, request_seconds: float) -> None:
        decay = math.exp(-seconds / DECODE_TIME_CONSTANT)  # sums, not a mean of steps: a long step weighs its tokens
        self._decode = [self._decode[0] * decay + tokens, self._decode[1] * decay + request_seconds]

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
    def decode_seconds_per_token(self) -> float | None:
        """Seconds between two output tokens of a decoding request in a step of decodes alone, lately; None: none
        seen."""
        tokens, seconds = self._decode
        return seconds / tokens if tokens > 0.5 and seconds > 0 else None

    @property
    def finishes_per_second(self) -> float | None:
        """Requests finished per second while the batch was at its limit (a slot frees as one finishes)."""
        _, full, _, _, finishes = self._sums
        return finishes / full if full > 0 and finishes > 0 else None


class Seen(NamedTuple):
    """What the API server has of one unfinished request."""

    prompt_tokens: int
    in_prefill: bool  # no first token yet
    generated: int = 0  # output tokens so far
    max_tokens: int | None = None  # None: not known (nor, then, when it ends at the latest)

    @property
    def tokens_left(self) -> int | None:
        """Output tokens it has left at most: it ends at its max_tokens, or sooner (a stop)."""
        return None if self.max_tokens is None else max(self.max_tokens - self.generated, 0)


@dataclass(frozen=True)
class Backlog:
    """What the API server has of the requests ahead of a new one: each request's prompt still in prefill (counted
    whole, as vLLM's queued caps count it), and how many are past their first token; and where their max_tokens
    are known, the output tokens each has left (decoding ones, fewest first; the prefilling ones in arrival order,
    which is the order the engine gives them slots)."""

    prefilling_tokens: int
    prefilling: int
    decoding: int
    decoding_left: tuple[int, ...] | None = None
    prefilling_left: tuple[int, ...] | None = None

    @classmethod
    def of(cls, states: Iterable[Seen | tuple]) -> Backlog:
        """From each unfinished request's :class:`Seen` (or its first fields), in arrival order."""
        tokens = 0
        decoding_left: list[int | None] = []
        prefilling_left: list[int | None] = []
        for state in states:
            seen = Seen(*state)
            if seen.in_prefill:
                tokens += seen.prompt_tokens
                prefilling_left.append(seen.tokens_left)
            else:
                decoding_left.append(seen.tokens_left)
        known = None not in decoding_left and None not in prefilling_left
        return cls(tokens, len(prefilling_left), len(decoding_left), tuple(sorted(decoding_left)) if known else None,
                   tuple(prefilling_left) if known else None)  # fmt: skip

    def slot_tokens(self, limit: int) -> int | None:
        """Output tokens (decode steps) until a request arriving now has a slot at the latest: the slots are held by
        every decoding request and the oldest prefilling ones, each until its max_tokens; as one frees, the oldest
        request waiting takes it (and holds it to its own max_tokens) while fewer than ``limit`` run. 0: room now;
        None: not known."""
        if self.decoding_left is None or self.prefilling_left is None or limit < 1:
            return None
        holding = max(limit - self.decoding, 0)
        running = [*self.decoding_left, *self.prefilling_left[:holding]]
        waiting = deque(self.prefilling_left[holding:])
        heapq.heapify(running)
        now = 0
        while len(running) >= limit or waiting:
            if len(running) < limit:
                heapq.heappush(running, now + waiting.popleft())
                continue
            now = heapq.heappop(running)
        return now

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
    step, tokens = rates.decode_seconds_per_token, backlog.slot_tokens(limit) if needed else None
    latest = None if step is None or tokens is None else tokens * step
    # The expected slot is the finishes' (the latest is a bound: requests that stop early free their slots sooner).
    wait = needed / finishes if finishes is not None else None if latest is None else latest + prefill - own
    expected = prefill if not needed or wait is None else max(prefill, wait + own)
    return Prediction(expected, prefill, own, needed, finishes, latest)


def refuses(prediction: Prediction | None, budget_seconds: float, confidence: float = CONFIDENCE) -> bool:
    """Whether the door refuses: only a request that would miss ``budget_seconds`` (its TTFT and the margin over
    it, less what it has waited; a slot wait, SLOT_MARGIN of it more) with ``confidence``. The prefill ahead
    drains at a steady rate, and its estimate is close (docs/admission.md measures it); a slot comes as running
    requests finish, which they do at random: the request is refused only where the finishes it needs pass the
    ``confidence`` quantile of how many come (Poisson) in the time the prefill ahead and its own leave it, as the
    queued-token cap's spread does (control/admission.py). Unknown rates: admitted."""
    if prediction is None:
        return False
    if prediction.slots_needed:
        budget_seconds *= 1 + SLOT_MARGIN
    latest = prediction.slot_seconds
    if prediction.slots_needed and latest is not None and latest + prediction.prefill_seconds <= budget_seconds:
        # Its slot frees in time even if every request ahead runs to its max_tokens, and the prompts ahead, which
        # take the slots that free before it, lengthen the steps until then by no more than their prefill.
        return False
    if not prediction.slots_needed or prediction.finishes_per_second is None:
        return prediction.prefill_seconds > budget_seconds
    # Waiting for a slot, the prompts ahead are waiting for theirs too: the prefill rate of such a time is the rate
    # slots free, and only the finishes say when its own comes.
    left = budget_seconds - prediction.prefill_seconds
    return left <= 0 or prediction.slots_needed > poisson_quantile(prediction.finishes_per_second * left, confidence)


class Watch:
    """The API server's requests, sampled: what changed since the last look, into :class:`Rates`.

    The plugin cannot see the engine's steps; it sees its requests' states. Each :meth:`sample` takes every
    unfinished request's :class:`Seen` by id; one in prefill at the last look and not now got its first token (or
    was aborted: rare, and a prompt's worth of error), one gone has finished, and one decoding at both looks tells
    how many tokens a request gets in that time."""

    def __init__(self, rates: Rates | None = None):
        self.rates = rates or Rates()
        self._limit: int | None = None
        self._at: float | None = None
        self._prefilling: dict[str, int] = {}
        self._decoding: dict[str, int] = {}  # id -> output tokens so far
        self._unfinished: set[str] = set()

    def sample(self, now: float, states: Mapping[str, Seen | tuple], limit: int | None = None) -> Backlog:
        seen = {rid: Seen(*state) for rid, state in states.items()}
        backlog = Backlog.of(seen.values())
        prefilling = {rid: s.prompt_tokens for rid, s in seen.items() if s.in_prefill}
        decoding = {rid: s.generated for rid, s in seen.items() if not s.in_prefill}
        if self._at is not None and now >= self._at:
            done = [prompt for rid, prompt in self._prefilling.items() if rid not in prefilling]
            finishes = sum(rid not in states for rid in self._unfinished)
            full = limit is not None and len(self._unfinished) >= limit
            # In prefill, but not prefilling, where every slot holds a request past its first token.
            busy = bool(self._prefilling) and (limit is None or len(self._unfinished) - len(self._prefilling) < limit)
            both = [rid for rid in decoding if rid in self._decoding]
            tokens = sum(max(decoding[rid] - self._decoding[rid], 0) for rid in both)
            self.rates.observe(now, now - self._at, busy=busy, full=full,
                               prefilled_tokens=sum(done), prefills=len(done), finishes=finishes,
                               in_prefill=(backlog.prefilling_tokens, backlog.prefilling),
                               slots_added=max(0, (limit or 0) - (self._limit or limit or 0)),
                               decoded=(tokens, len(both) * (now - self._at)))  # fmt: skip
        self._at, self._prefilling, self._unfinished, self._limit = now, prefilling, set(states), limit
        self._decoding = decoding
        return backlog


def first_token_seconds(prompts: Sequence[int], slotted: int, done_tokens: float, step_tokens: int,
                        lone: tuple[float, float]) -> Iterator[float]:  # fmt: skip
    """When each request in prefill gets its first token, in seconds from now, if no more arrive: ``prompts`` in
    arrival order (the order the engine prefills and gives slots in), the first ``slotted`` of them holding a slot.

    Each step prefills up to ``step_tokens`` of the prompts in order and takes the lone fit's time, ``step +
    tokens × per_token`` (:attr:`Rates.lone`); ``done_tokens`` of the oldest are prefilled already. The requests
    that hold a slot share their steps, so one gets its first token at the end of the step that reaches it, which
    the prompts behind it fill. One that waits for a slot gets it no sooner than if it had one and nobody behind it
    shared its step: that bound, a lower one, is its time (where a request shares its steps with the prompts behind
    it, the door's estimate at arrival cannot see them: docs/admission.md, "The second look")."""
    step, per_token = lone
    budget = max(step_tokens, 1)
    shared = max(sum(prompts[:slotted]) - done_tokens, 1.0)  # what the slotted requests' steps prefill in all
    ahead = -done_tokens  # prompt tokens to prefill up to and including each request
    for i, prompt in enumerate(prompts):  # lazily: a look stops at the first request that would miss
        ahead += prompt
        tokens = max(ahead, 1.0)
        steps = math.ceil(tokens / budget)
        yield steps * step + per_token * (min(shared, steps * budget) if i < slotted else tokens)


def late_in_queue(prompts: Sequence[int], waited: Sequence[float | None], decoding: int, limit: int | None,
                  step_tokens: int, rates: Rates, budget_seconds: float) -> list[int]:  # fmt: skip
    """Which of the requests in prefill the door refuses now, judged again: the indices (into ``prompts``, in
    arrival order) of those whose first token, with the queue as it stands, would come past ``budget_seconds``
    after their arrival. ``waited``: how long each has waited (None: not the door's to refuse, as one whose answer
    has begun). ``decoding``: requests past their first token, which hold slots and take a token of each step;
    ``limit``: the batch's slots (None: not known, and then each request is judged by its lower bound, as if it
    waited for a slot: a door that does not know the slots refuses only what misses whoever has one).

    One at a time, the earliest to arrive first: it misses by the most, and refusing it shortens the steps of
    those behind it, which may then make it; LOOK_MOST at a time. Unknown rates, or decodes that fill the step (an
    API server's share of it, where the shares run uneven): none (the door fails open)."""
    rate = rates.prefill_tokens_per_second
    if rate is None or step_tokens <= decoding:  # nor when the decodes fill a step: when a prompt gets in is unknown
        return []
    lone = rates.lone or (0.0, 1 / rate)  # as :func:`predict` takes a prompt's own time without the fit
    left = list(range(len(prompts)))
    refused: list[int] = []
    while len(refused) < LOOK_MOST:
        slotted = 0 if limit is None else min(max(limit - decoding, 0), len(left))
        times = first_token_seconds([prompts[i] for i in left], slotted, rates.partial_tokens,
                                    step_tokens - decoding, lone)  # fmt: skip
        over = (i for i, t in zip(left, times, strict=True) if waited[i] is not None and waited[i] + t > budget_seconds)
        late = next(over, None)
        if late is None:
            break
        refused.append(late)
        left.remove(late)
    return refused
