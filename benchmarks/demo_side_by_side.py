"""The demo, live, side by side: the controller with the door (the default) against the breaker alone.

    python benchmarks/demo_side_by_side.py [--minutes 10]

Real: two `batchlens demo --litellm off` stacks at once (the second with --no-steer, 100 ports up), each with
its simulator at speed 1, its load (bursty 2.5 requests/s, 2x for the last 60 s of every 300: the overload
phases), exporter, hook, Prometheus and Alertmanager. After --minutes (plus 30 s of start), it asks each
stack's own Prometheus about the last --minutes and prints them side by side:

- requests finished, and refused at the door (503) with their share of the door's arrivals;
- the shares of TTFT within 0.5 s and of token gaps within 0.1 s (the SLO), from vLLM's histograms;
- goodput, estimated: finished x both shares / seconds (live, no request's own timings are kept). It takes
  the two shares as independent and the gaps' share per token, not per request's TPOT: where misses of both
  kinds fall in the same overload phases it reads low, most for the stack with more misses, so the ratio
  between the two stacks is a rough figure, not an exact one;
- the P99 TTFT of the admitted (the refused never start), from the buckets;
- the hook's decisions by kind and its pages (since it started), the lowest limit, and the alerts that fired.

False sheds cannot be measured live (their counterfactual exists only in replay: benchmarks/controller.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCHLENS = str(Path(sys.executable).parent / "batchlens")
STACKS = {"controller + door": (0, ()), "breaker only": (100, ("--no-steer",))}
PROMETHEUS_PORT = 9090
#: The controller's decisions that move a limit (steady, idle and drain ticks do not).
MOVING = ("pace_over", "kv_ceiling", "keep_up", "past_peak", "slow_start", "headroom")


def query(prometheus: str, expr: str) -> list[dict]:
    url = f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.load(reply)["data"]["result"]


def scalar(prometheus: str, expr: str) -> float:
    found = query(prometheus, expr)
    return float(found[0]["value"][1]) if found else float("nan")


def by_label(prometheus: str, expr: str, label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in query(prometheus, expr)}


def figures(prometheus: str, minutes: int) -> dict:
    w = f"[{minutes}m]"

    def share(histogram: str, le: str) -> float:
        return scalar(prometheus, f'sum(increase({histogram}_bucket{{le="{le}"}}{w})) / '
                                  f"sum(increase({histogram}_count{w}))")  # fmt: skip

    finished = scalar(prometheus, f"sum(increase(vllm:request_success_total{w}))")
    ttft, itl = share("vllm:time_to_first_token_seconds", "0.5"), share("vllm:inter_token_latency_seconds", "0.1")
    shed = scalar(prometheus, f"sum(increase(vllm:admission_rejections_total{w})) or vector(0)")
    arrived = scalar(prometheus, f"sum(increase(batchlens_door_requests_total{w}))")
    # The hook's counters since it started (increase() misses a series' first count: a counter born at 1).
    actions = by_label(prometheus, "sum by (action) (batchlens_remediation_actions_total) > 0", "action")
    pages = by_label(prometheus, "sum by (reason) (batchlens_remediation_pages_total) > 0", "reason")
    moving = "|".join(sorted(MOVING))
    moved = f'sum by (reason) (batchlens_controller_decisions_total{{reason=~"{moving}"}}) > 0'
    moves = by_label(prometheus, moved, "reason")
    p99 = f"histogram_quantile(0.99, sum by (le) (increase(vllm:time_to_first_token_seconds_bucket{w})))"
    fired = f'max by (alertname) (max_over_time(ALERTS{{alertstate="firing"}}{w}))'
    return {
        "finished": finished,
        "shed": shed,
        "shed_share": shed / arrived if arrived else float("nan"),
        "ttft_share": ttft,
        "itl_share": itl,
        "goodput": finished * ttft * itl / (minutes * 60),
        "p99_ttft": scalar(prometheus, p99),
        "lowest_limit": scalar(prometheus, f"min(min_over_time(batchlens_batch_limit{w}))"),
        "actions": {k: round(v) for k, v in actions.items()},
        "pages": {k: round(v) for k, v in pages.items()},
        "moves": {k: round(v) for k, v in moves.items()},
        "alerts": sorted(by_label(prometheus, fired, "alertname")),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=int, default=10, help="how long to watch, after 30 s of start")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="batchlens-bench-demo-") as tmp:
        demos = {}
        try:
            for name, (offset, flags) in STACKS.items():
                run = Path(tmp) / str(offset)
                log = open(Path(tmp) / f"demo-{offset}.log", "wb")  # noqa: SIM115 - the process outlives the block
                demos[name] = subprocess.Popen([BATCHLENS, "demo", "--run-dir", str(run), "--litellm", "off",
                                                "--port-offset", str(offset), *flags],
                                               stdout=log, stderr=subprocess.STDOUT, process_group=0)  # fmt: skip
            time.sleep(30 + args.minutes * 60)
            for name, demo in demos.items():
                if demo.poll() is not None:
                    raise SystemExit(f"the {name} demo exited with {demo.returncode}: see its log")
                results[name] = figures(f"http://127.0.0.1:{PROMETHEUS_PORT + STACKS[name][0]}", args.minutes)
        finally:
            for demo in demos.values():
                if demo.poll() is None:
                    os.killpg(demo.pid, signal.SIGINT)
            for demo in demos.values():
                demo.wait(timeout=60)
    report(results, args.minutes)
    return 0


def counts(found: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(found.items())) or "none"


ROWS = (
    ("requests finished", lambda f: f"{f['finished']:.0f}"),
    ("refused at the door (503)", lambda f: f"{f['shed']:.0f} ({f['shed_share']:.0%} of arrivals)"),
    ("TTFT <= 0.5 s, of those served", lambda f: f"{f['ttft_share']:.1%}"),
    ("token gaps <= 0.1 s", lambda f: f"{f['itl_share']:.1%}"),
    ("goodput, estimated (good requests/s)", lambda f: f"{f['goodput']:.2f}"),
    ("P99 TTFT of the admitted", lambda f: f"{f['p99_ttft']:.1f} s"),
    ("the hook's actions (since its start)", lambda f: counts(f["actions"])),
    ("the controller's moves (since its start)", lambda f: counts(f["moves"])),
    ("pages (since its start)", lambda f: counts(f["pages"])),
    ("the lowest limit", lambda f: f"{f['lowest_limit']:.0f}"),
    ("alerts fired", lambda f: ", ".join(f["alerts"]) or "none"),
)


def report(results: dict[str, dict], minutes: int) -> None:
    names = list(results)
    print(f"the last {minutes} minutes of each demo (default load, overload phases), SLO TTFT 0.5 s, TPOT 0.1 s")
    print("| | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, cell in ROWS:
        print(f"| {label} | " + " | ".join(cell(results[n]) for n in names) + " |")
    a, b = (results[n]["goodput"] for n in names)
    print(f"goodput {names[0]} / {names[1]}: {a / b if b else float('inf'):.2f}")


if __name__ == "__main__":
    sys.exit(main())
