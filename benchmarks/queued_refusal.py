"""What the per-request door leaves on a load, and what a door that judged the queued requests again would give.

    python benchmarks/queued_refusal.py [--profile published] [--workload bursty] [--limit 192]
                                        [--seconds 300] [--seed 1]

The door (predicted_ttft.py) judges a request once, at its arrival, from the prompts ahead of it. On the
published profile's bursty load the requests it admits that then miss their TTFT come in cohorts: a burst
arrives during one long step, and all of it waits for the next, which takes every prompt the budget holds
(max_num_batched_tokens) and gives their first tokens together at its end. The first of the cohort is judged
with nobody behind it and a short step ahead; the prompts that arrive after it lengthen its step and make it
miss, while each of them, judged in turn, still makes it. Refusing those later ones would refuse requests
that would have made it (false sheds); the requests that miss are the early ones, judged too soon.

So this asks what a door that judges the queued requests again, before each step, would be worth: each request
still waiting whose first token, with the queue as it then stands and no more arrivals, comes past its TTFT is
refused (its client answered 503, as at the door). The look-ahead here is the simulator's own engine run ahead,
exact as no estimate from the API server is: an upper bound on such a door. Each refusal is judged as the
door's are (false: it would have met the SLO had it stayed, the others refused with it, later arrivals through
the cap).

It prints the static limit alone, the door on that limit (`predict`), `adaptive+predict` as
benchmarks/controller.py runs it, and both with the queued requests re-judged; per run the goodput, its ratio
to the static limit alone (the best static limit on the default load), the sheds at arrival with their false
share, and the queued requests refused with theirs.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import math
from collections.abc import Sequence
from functools import partial

from batchlens.config import Control
from batchlens.control.steering import door_settings
from batchlens.replay.policies import Admitting, Predicting, Static
from batchlens.replay.simulated import Replica, Run, cap_of, replay, served_in_time
from batchlens.replay.traces import TraceRequest
from batchlens.simulator.engine import Engine, SimRequest
from controller import ceiling, engine_of, policy, slo_of
from fixed_cap import chosen_trace, load_arguments


class Rejudging(Replica):
    """A replica whose door also refuses, before each step, the waiting requests that would now miss their TTFT
    (by the engine's exact look-ahead), and counts those refusals and how many of them were false. ``trace``: the
    arrivals, for the counterfactual's later ones."""

    def __init__(self, *args, trace: Sequence[TraceRequest], **kwargs):
        super().__init__(*args, **kwargs)
        self.arrivals = [SimRequest(f"later-{i}", t.prompt_tokens, t.output_tokens, t.t) for i, t in enumerate(trace)]
        self.refused_queued, self.refused_queued_false = 0, 0

    def look_ahead(self, engine: Engine, now: float) -> dict[str, float] | None:
        """When each request in prefill gets its first token, by id (one missing: never); None: not known."""
        return first_tokens(engine, now)

    def step(self) -> None:
        self._rejudge()
        super().step()

    def result(self, requests, seconds) -> Run:
        run = super().result(requests, seconds)  # the door's false sheds estimated over its own sheds alone
        run.shed += self.refused_queued
        run.decisions.update(refused_queued=self.refused_queued, refused_queued_false=self.refused_queued_false)
        return run

    def _rejudge(self) -> None:
        """One at a time, the waiting request that would miss by the most (the earliest to arrive of those that
        would miss), until none would: each refusal shortens the step the rest share, which may save them."""
        engine, slo = self.engine, self.slo
        while True:
            waiting = [r for r in engine.waiting if r.computed == 0 and r.first_token_at is None]
            if not waiting:
                return
            if (firsts := self.look_ahead(engine, self.now)) is None:
                return
            late = [r for r in waiting if firsts.get(r.id, math.inf) - r.arrival > slo.ttft_seconds]
            if not late:
                return
            request = min(late, key=lambda r: r.arrival)
            later = self.arrivals[bisect.bisect_right(self.arrivals, self.now, key=lambda r: r.arrival) :]
            shadow = copy.deepcopy(engine)
            mine = next(r for r in shadow.waiting if r.id == request.id)
            self.refused_queued_false += served_in_time(shadow, mine, later, self.now, cap_of(self.policy), slo,
                                                        self.max_model_len)  # fmt: skip
            engine.waiting.remove(request)
            request.finish_reason = "shed"
            self.bad += 1
            self.in_prefill[0] -= request.prompt_tokens
            self.in_prefill[1] -= 1
            self.refused_queued += 1


class Estimating(Rejudging):
    """Re-judges by what the API server has: the prompts in prefill in arrival order, the step's token budget, and
    the door's learned time of a step (its fit of a lone prompt: a step's time plus a time per prompt token)."""

    def look_ahead(self, engine: Engine, now: float) -> dict[str, float] | None:
        lone = self.policy.rates.lone
        if lone is None:
            return None  # the door knows nothing yet: it refuses nothing
        step, per_token = lone
        budget = engine.max_num_batched_tokens - (engine.unfinished - self.in_prefill[1])  # decodes take a token
        left = [[r.id, r.prompt_tokens] for r in (*engine.running, *engine.waiting) if r.first_token_at is None]
        if left:
            left[0][1] = max(left[0][1] - self.policy.rates.partial_tokens, 1)
        got, t = {}, now
        while left and budget > 0:
            room, done = budget, []
            while left and room > 0:
                take = min(left[0][1], room)
                left[0][1] -= take
                room -= take
                if left[0][1] <= 0:
                    done.append(left.pop(0)[0])
            t += step + per_token * (budget - room)
            got.update(dict.fromkeys(done, t))
        return None if left else got  # no room for a prefill this step: not known


def first_tokens(engine: Engine, now: float) -> dict[str, float]:
    """When each request of ``engine`` still in prefill gets its first token, if no more arrive (by id)."""
    shadow = copy.deepcopy(engine)
    pending = {r.id for r in (*shadow.running, *shadow.waiting) if r.first_token_at is None}
    got: dict[str, float] = {}
    t = now
    while pending - got.keys():
        step = shadow.step(t)
        if step.duration <= 0:
            break
        t += step.duration
        got.update((r.id, t) for r in step.produced if r.id in pending and r.id not in got)
    return got


def predicting_static(limit: int, profile: str) -> Predicting:
    """The per-request door (and its backstop cap) on a static limit: `predict` at ``limit``."""
    slo = slo_of(profile)
    door = Control().model_copy(update={"admission": True, "admission_predict": True})
    admitting = Admitting(slo, Static(limit), door_settings(door, slo.ttft_seconds))
    return Predicting(slo, admitting, door.admission_predict_margin)


#: (policy, how its queued requests are re-judged: None, not at all)
RUNS = tuple((name, how) for how in (None, Rejudging, Estimating) for name in ("predict", "adaptive+predict"))


def main() -> None:
    parser = load_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args()
    trace, slo = chosen_trace(parser, args), slo_of(args.profile)
    alone = replay(trace, engine_of(args.profile), Static(args.limit), slo).judgement.goodput_rps
    print(f"{args.profile} {args.workload}: {len(trace)} requests, static:{args.limit} alone {alone:.3f} good "
          f"requests/s; every request good would be {ceiling(trace):.3f}")  # fmt: skip
    print(f"{'run':44} {'goodput':>8} {'/static':>7} {'shed':>5} {'false':>6} {'queued refused':>14} {'false':>6}")
    best = {}
    for name, rejudged in RUNS:
        made = predicting_static(args.limit, args.profile) if name == "predict" else policy(name, slo)
        replica = rejudged and partial(rejudged, trace=trace)
        run: Run = replay(trace, engine_of(args.profile), made, slo, replica_type=replica)
        queued = run.decisions.get("refused_queued", 0)
        at_door = run.shed - queued
        false = (run.false_sheds or 0) / at_door if at_door else 0.0
        label = f"{name} (static:{args.limit})" if name == "predict" else name
        label += {None: "", Rejudging: ", re-judged (exact)", Estimating: ", re-judged (estimated)"}[rejudged]
        ratio = run.judgement.goodput_rps / alone
        best[label] = ratio
        queued_false = run.decisions.get("refused_queued_false", 0) / queued if queued else 0.0
        print(f"{label:44} {run.judgement.goodput_rps:8.3f} {ratio:7.3f} {at_door:5d} {false:6.1%} "
              f"{queued if rejudged else '-':>14} {queued_false if rejudged else 0:6.1%}", flush=True)  # fmt: skip
    print(f"queued_refusal adaptive+predict/static {best['adaptive+predict']:.3f}, re-judged exactly "
          f"{best['adaptive+predict, re-judged (exact)']:.3f}, by estimate "
          f"{best['adaptive+predict, re-judged (estimated)']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
