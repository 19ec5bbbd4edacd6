"""What the per-request door's second look is worth on a load, against the door at arrival alone and an exact one.

    python benchmarks/queued_refusal.py [--profile published] [--workload bursty] [--limit 192]
                                        [--seconds 300] [--seed 1]

The door (predicted_ttft.py) judges a request at its arrival, from the prompts ahead of it. On the published
profile's bursty load the requests it admits that then miss their TTFT come in cohorts: a burst arrives during
one long step, and all of it waits for the next, which takes every prompt the budget holds
(max_num_batched_tokens) and gives their first tokens together at its end. The first of the cohort is judged
with nobody behind it; the prompts that arrive after it lengthen its step and make it miss, while each of
them, judged in turn, still makes it. Refusing those later ones at arrival would refuse requests that would
have made it (false sheds).

So the door looks again before each step (live: on each tick of the plugin's sampler, vllm_plugin/second_look.py):
each request still in prefill whose first token, with the queue as it then stands and no more arrivals, would
come past its TTFT is refused (its client answered the door's 503), the earliest first, one at a time
(predicted_ttft.late_in_queue). This compares, on the static limit with the door (`predict`) and on
`adaptive+predict`:
- the door at arrival alone (no second look);
- the second look as shipped: its estimate from what the API server has (the prompts in prefill in arrival order,
  the slots, the step's token budget and the door's learned time of a step);
- the second look by the simulator's own engine run ahead, exact as no estimate from the API server is: the most
  such a door could give.
Per run: the goodput, its ratio to the static limit alone (the best static limit on the default load), the
sheds, how many of them were refused while queued, and the share of the sheds that would have been good had they
been let in or left queued (estimated as benchmarks/controller.py does, on a sample).
"""

from __future__ import annotations

import argparse
import copy
import math

from batchlens.config import Control
from batchlens.control.steering import door_settings
from batchlens.replay.policies import Admitting, Predicting, Static
from batchlens.replay.simulated import Replica, Run, replay
from batchlens.simulator.engine import Engine
from controller import ceiling, engine_of, policy, slo_of
from fixed_cap import chosen_trace, load_arguments


class Exact(Replica):
    """A replica whose door's second look knows, by the engine's exact look-ahead, when each request in prefill
    would get its first token: it refuses the earliest that would miss, then looks again, until none would."""

    def rejudge(self) -> None:
        while queued := self.engine.awaiting_first_token:
            firsts = first_tokens(self.engine, self.now)
            late = [r for r in queued if firsts.get(r.id, math.inf) - r.arrival > self.policy.bound]
            if not late:
                return
            self.refuse_queued(min(late, key=lambda r: r.arrival))


def first_tokens(engine: Engine, now: float) -> dict[str, float]:
    """When each request of ``engine`` still in prefill gets its first token, if no more arrive (by id)."""
    shadow = copy.deepcopy(engine)  # the look-ahead must not touch the real requests
    pending = {r.id for r in shadow.awaiting_first_token}
    got: dict[str, float] = {}
    t = now
    while pending - got.keys():
        step = shadow.step(t)
        if step.duration <= 0:
            break
        t += step.duration
        got.update((r.id, t) for r in step.produced if r.id in pending and r.id not in got)
    return got


def predicting(name: str, limit: int, profile: str, second_look: bool) -> Predicting:
    """``predict`` (the per-request door and its backstop cap on a static ``limit``) or ``adaptive+predict``."""
    slo = slo_of(profile)
    if name == "predict":
        door = Control().model_copy(update={"admission": True, "admission_predict": True})
        made = Predicting(slo, Admitting(slo, Static(limit), door_settings(door, slo.ttft_seconds)),
                          door.admission_predict_margin)  # fmt: skip
    else:
        made = policy(name, slo)
    made.second_look = second_look
    return made


#: (label, whether the door looks again, the replica that does)
LOOKS = (("at arrival alone", False, Replica), ("second look", True, Replica), ("second look, exact", True, Exact))


def main() -> None:
    parser = load_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args()
    trace, slo = chosen_trace(parser, args), slo_of(args.profile)
    alone = replay(trace, engine_of(args.profile), Static(args.limit), slo).judgement.goodput_rps
    print(f"{args.profile} {args.workload}: {len(trace)} requests, static:{args.limit} alone {alone:.3f} good "
          f"requests/s; every request good would be {ceiling(trace):.3f}")  # fmt: skip
    print(f"{'run':42} {'goodput':>8} {'/static':>7} {'shed':>5} {'queued':>6} {'false':>6}")
    ratios = {}
    for name in ("predict", "adaptive+predict"):
        for look, second_look, replica in LOOKS:
            made = predicting(name, args.limit, args.profile, second_look)
            run: Run = replay(trace, engine_of(args.profile), made, slo, replica_type=replica)
            label = (f"{name} (static:{args.limit})" if name == "predict" else name) + f", {look}"
            ratios[label] = ratio = run.judgement.goodput_rps / alone
            false = (run.false_sheds or 0) / run.shed if run.shed else 0.0
            print(f"{label:42} {run.judgement.goodput_rps:8.3f} {ratio:7.3f} {run.shed:5d} {run.refused_queued:6d} "
                  f"{false:6.1%}", flush=True)  # fmt: skip
    print(f"queued_refusal adaptive+predict/static at arrival alone {ratios['adaptive+predict, at arrival alone']:.3f}"
          f", with the second look {ratios['adaptive+predict, second look']:.3f}, exact "
          f"{ratios['adaptive+predict, second look, exact']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
