"""`make mutants`' table: mutmut's results per module, read from `mutmut results --all true` on standard input.

Each input line is ``<module>.<mangled function>__mutmut_<n>: <status>``; "other" counts every status but killed,
survived and timeout (no tests, suspicious, not checked, segfault, ...).
"""

from __future__ import annotations

import sys
from collections import Counter

COLUMNS = ("killed", "survived", "timeout")


def table(lines: list[str]) -> str:
    counts: dict[str, Counter[str]] = {}
    for line in lines:
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            module = name.rsplit(".", 1)[0]
            counts.setdefault(module, Counter())[status if status in COLUMNS else "other"] += 1
    total = sum(counts.values(), Counter())
    rows = [(m, counts[m]) for m in sorted(counts)] + [("total", total)]
    header = ("module", "mutants", *COLUMNS, "other")
    cells = [header] + [(m, str(c.total()), *(str(c[k]) for k in (*COLUMNS, "other"))) for m, c in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in cells
    )


if __name__ == "__main__":
    print(table(sys.stdin.readlines()))
