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
    """A header of titles, then one line per row, each followed by its mark (if any): right-aligned to ``width``."""
    lines = ["  ".join(f"{title:>{width}}" for _, title, _ in columns)]
    for i, row in enumerate(rows):
        mark = marks[i] if i < len(marks) else ""
        lines.append("  ".join(f"{cell(fmt, row[key]):>{width}}" for key, _, fmt in columns) + mark)
    return lines
