"""`batchlens plan` on an hour of a code trace: its table and PNG, how long it took, and a check that the replica
count it chose, replayed again, meets the SLO while one fewer does not.

    python benchmarks/plan_fleet.py [TRACE --format azure] [--duration 3600] [--rate-scale X] [--out plan-out] \
        [--policy P] [--gpu NAME ...] [--model-profile NAME ...]

TRACE: the Azure code trace (AzureLLMInferenceTrace_code.csv, https://github.com/Azure/AzurePublicDataset; not
part of batchlens). Without it, a synthetic stand-in is written to OUT/synthetic_code.csv in Azure's format:
batchlens' own load generator (load/plan.py), bursty arrivals at 5.4 requests/s (the code trace's mean over
its hour), long prompts and short answers in the code trace's proportions (prompts of 0.5k to 6k tokens, a
median near 2k; answers of 4 to 256 tokens, a median of 16).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

from batchlens.config import load_config
from batchlens.goodput import Slo
from batchlens.load.plan import LoadSpec, schedule
from batchlens.plan.fleet import replay_fleet
from batchlens.plan.search import Profile, Rule
from batchlens.replay.policy_names import parse_policy
from batchlens.replay.traces import read_trace, select

PROMPTS = (512, 768, 1024, 1536, 1792, 2048, 2048, 2304, 2560, 3072, 4096, 6144)
OUTPUTS = (4, 8, 8, 12, 16, 16, 16, 24, 32, 64, 128, 256)


def synthetic_code_trace(path: Path, seconds: float, rate: float = 5.4) -> int:
    spec = LoadSpec(rate=rate, duration=seconds, arrival="bursty", prompt_tokens=PROMPTS, output_tokens=OUTPUTS,
                    burst_seconds=5.0, burst_factor=2.0, seed=61)  # fmt: skip
    epoch = datetime(2023, 11, 16, 18, 0, 0)
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        rows = [[(epoch + timedelta(seconds=p.at)).strftime("%Y-%m-%d %H:%M:%S.%f") + "0", p.prompt_tokens,
                  p.max_tokens] for p in schedule(spec)]  # fmt: skip
        writer.writerows(rows)
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", nargs="?")
    parser.add_argument("--format", default="azure")
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--out", default="plan-out")
    parser.add_argument("--policy", default="adaptive+admit")
    parser.add_argument("--gpu", action="append", default=[])
    parser.add_argument("--model-profile", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = args.trace
    if trace is None:
        trace = str(out / "synthetic_code.csv")
        print(f"no trace given: wrote {synthetic_code_trace(Path(trace), args.duration)} synthetic requests to {trace}")
    requests = select(read_trace(Path(trace), args.format), duration=args.duration, rate_scale=args.rate_scale)
    gpus = [a for g in args.gpu or ("a100-80g", "h100") for a in ("--gpu", g)]
    gpus += [a for m in args.model_profile for a in ("--model-profile", m)]
    command = [sys.executable, "-m", "batchlens", "plan", trace, "--format", args.format, "--duration",
               str(args.duration), "--rate-scale", str(args.rate_scale), "--policy", args.policy, *gpus,
               "--out", str(out)]  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    took = time.monotonic() - began
    (out / "plan.txt").write_text(done.stdout)
    print(done.stdout)
    with (out / "plan.csv").open() as rows:
        points = list(csv.DictReader(rows))
    print(f"plan took {took:.0f} s on {len(requests)} requests over {args.duration / 3600:.2f} h")
    config = load_config(None)
    slo = Slo(config.slo.ttft_seconds, config.slo.tpot_seconds)
    rule = Rule(config.plan.target_attainment, config.plan.max_shed_share)
    for name in dict.fromkeys(p["profile"] for p in points):  # each profile's fewest that meet, and one fewer
        meeting = [int(p["replicas"]) for p in points if p["profile"] == name and p["meets"] == "True"]
        if not meeting:
            print(f"check: {name}: no count tried meets the SLO")
            continue
        cheapest = any(p["cheapest"] == "True" for p in points if p["profile"] == name)
        gpu, model = name.split("/")
        for n in (min(meeting), min(meeting) - 1):
            if n < 1:
                print(f"check: {name}: one fewer is none at all")
                continue
            fleet = replay_fleet(requests, Profile(gpu, model).engine, lambda: parse_policy(args.policy, slo), slo,
                                 n, balancer_name=config.plan.balancer)  # fmt: skip
            j = fleet.judgement
            verdict = "meets" if rule.meets(j.slo_attainment, fleet.shed_share) else "misses"
            print(
                f"check: {n} x {name}{' (the cheapest)' if cheapest and n == min(meeting) else ''} replayed "
                f"again: attained {j.slo_attainment:.2%}, shed {fleet.shed_share:.2%}: {verdict} the SLO"
            )


if __name__ == "__main__":
    main()
