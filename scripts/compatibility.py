"""Write the matrix table of docs/compatibility.md from the rows `make vllm-matrix` measured.

    python scripts/compatibility.py          # rewrite the table between the markers
    python scripts/compatibility.py --check  # exit 1 when the table is not what the rows say

Each row is tests/data/releases/<release>.json, written by tests/test_vllm_matrix.py. The prose around the
table is written by hand; only the part between the markers is generated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from batchlens.vllm_releases import RELEASES  # noqa: E402  (the one table, read from the checkout)

ROWS = ROOT / "tests" / "data" / "releases"
DOC = ROOT / "docs" / "compatibility.md"
START, END = "<!-- matrix:start (scripts/compatibility.py) -->", "<!-- matrix:end -->"


def _version(row: dict) -> list[int]:
    return [int(n) for n in row["release"].split(".")]


def _yes(flag: bool | None) -> str:
    return "yes" if flag else "**no**"


def _door(row: dict) -> str:
    """Who refused the third request, and how (rows from before the matrix checked the door say so)."""
    check = row.get("door_check")
    if check is None:
        return "not measured"
    who = {"vllm": "vLLM's own caps", "plugin": "the plugin's door"}.get(row.get("door"), "no door")
    passed = check["status"] == 503 and check["retry_after"] >= 1 and check["counted"] == 1
    status, retry, counted = check["status"], check["retry_after"], check["counted"]
    return f"{_yes(passed)}: {who}, {status}, Retry-After {retry}, {counted:.0f} counted"


def table(rows: list[dict]) -> str:
    head = (
        "| vLLM | checked on | admission | admin API route | PUT under load (limit 4, 12 requests) "
        "| preempted | exporter pass-through | rules with data | alerts with data "
        "| queued cap of 2 under 2 requests |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in sorted(rows, key=_version):
        static = row["static"]
        if "info" not in row:  # no CPU build: the internals check on the wheel's source only
            route = "endpoint plugin" if static["endpoint_plugins"] else "`--middleware`"
            mechanism = f"`{static['mechanism']}`" if static["mechanism"] else f"refused: {static['refusal']}"
            lines.append(f"| {row['release']} | {row['run']} | {mechanism} | {route} |" + " n/a |" * 6)
            continue
        cover = row["coverage"]
        rules = f"{cover['rules'] - len(cover['empty_rules'])}/{cover['rules']}"
        alerts = f"{cover['alerts'] - len(cover['empty_alerts'])}/{cover['alerts']}"
        put = (
            f"{_yes(row['put_took_effect'])}: running {row['running_before_put']:.0f} → "
            f"at most {row['running_after_put_max']:.0f}, {row['waiting_after_put_max']:.0f} waiting"
        )
        passthrough = f"{_yes(row['passthrough_equal'])}, {row['samples']} samples equal"
        route = "endpoint plugin" if row["api_route"] == "endpoint plugin" else "`--middleware`"
        lines.append(
            f"| {row['release']} | {row['run']} | `{row['mechanism']}` | {route} | {put} | {row['preemptions']:.0f} "
            f"| {passthrough} | {rules} | {alerts} | {_door(row)} |"
        )
    return head + "\n".join(lines) + "\n"


def rendered(doc: str, rows: list[dict]) -> str:
    before, rest = doc.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table(rows)}{END}{after}"


def main(argv: list[str]) -> int:
    rows = [json.loads(p.read_text()) for p in sorted(ROWS.glob("*.json"))]
    listed = {release.version for release in RELEASES}
    if {row["release"] for row in rows} != listed:
        print(f"the matrix's rows ({', '.join(sorted(row['release'] for row in rows))}) are not the releases "
              f"src/batchlens/vllm_releases.py lists ({', '.join(sorted(listed))})", file=sys.stderr)  # fmt: skip
        return 1
    doc = DOC.read_text()
    new = rendered(doc, rows)
    if argv == ["--check"]:
        if new != doc:
            print(f"{DOC.relative_to(ROOT)} is stale: run `python scripts/compatibility.py`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print(f"wrote the table of {len(rows)} releases into {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
