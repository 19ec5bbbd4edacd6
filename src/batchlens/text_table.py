"""Fixed-width text tables for the commands that print results (sweep, replay). Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

#: (row key, column title, format of a value)
Column = tuple[str, str, str]


def cell(fmt: str, value: object) -> str:
    """A value in its column's format; unknown (None or NaN) as "-"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def text_table(columns: Sequence[Column], rows: Sequence[dict], *, width: int, marks: Sequence[str] = ()) -> list[str]:
    """A header of titles, then one line per row, each followed by its mark (if any): right-aligned to ``width``,
    or to a column's widest cell where that is wider (a policy named ``adaptive+admit`` pushed the rest aside)."""
    cells = [[cell(fmt, row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max([width, len(title), *(len(line[c]) for line in cells)]) for c, (_, title, _) in enumerate(columns)]
    lines = ["  ".join(f"{title:>{w}}" for (_, title, _), w in zip(columns, widths, strict=True))]
    for i, line in enumerate(cells):
        mark = marks[i] if i < len(marks) else ""
        lines.append("  ".join(f"{text:>{w}}" for text, w in zip(line, widths, strict=True)) + mark)
    return lines
