"""Recorded workloads: the public Azure and BurstGPT traces, and our own JSONL. Pure but for reading the file.

Every format becomes the same list of :class:`TraceRequest` (seconds from the
trace's first arrival, prompt tokens, output tokens), in arrival order. A bad
line stops the read with its line number and what was wrong: a replay judged
on a silently half-read trace would judge nothing.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

FORMATS = ("azure", "burstgpt", "jsonl")
MIN_RATE_SCALE, MAX_RATE_SCALE = 0.001, 1000.0  # a thousand times slower or faster: beyond, a replay means nothing
MAX_LINE_BYTES = 64 * 1024  # no trace line is longer; a longer one is not a trace
MAX_TOKENS = 10_000_000  # no request is longer; a larger count is a broken column
MAX_SPAN = 366 * 86400.0  # no replayable trace spans more than a year: a larger time is a broken column


class TraceError(ValueError):
    """The trace cannot be replayed: the message names the file, the line and what was wrong."""


@dataclass(frozen=True)
class TraceRequest:
    t: float  # seconds after the trace's first arrival
    prompt_tokens: int
    output_tokens: int
    latency_class: str = ""  # a JSONL trace's "class" (sent as the routing header); empty: none


def _tokens(value: object, what: str) -> int:
    try:
        number = float(str(value))
    except ValueError:
        raise ValueError(f"{what} is not a number: {value!r}") from None
    if not number.is_integer() or not 0 <= number <= MAX_TOKENS:
        raise ValueError(f"{what} {value!r} is not a token count (a whole number, 0..{MAX_TOKENS})")
    return int(number)


def _azure_time(value: str) -> float:
    """Azure's ``2023-11-16 18:15:46.6805900`` (seven fractional digits, more than Python parses)."""
    head, _, fraction = value.strip().partition(".")
    try:
        stamp = datetime.fromisoformat(head).timestamp()
    except ValueError:
        raise ValueError(f"TIMESTAMP is not a date and time: {value!r}") from None
    return stamp + (float(f"0.{fraction}") if fraction.isdigit() else 0.0)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        with path.open("rb") as raw:
            for number, line in enumerate(raw, 1):
                if len(line) > MAX_LINE_BYTES:
                    raise TraceError(f"{path}:{number}: a line of {len(line)} bytes: not a trace line")
                # utf-8-sig on the first line: a spreadsheet's CSV starts with a byte-order mark.
                yield number, line.decode("utf-8-sig" if number == 1 else "utf-8", errors="replace")
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None


def _csv_rows(path: Path, columns: dict[str, str]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV whose header names ``columns`` (our name -> the file's)."""
    lines = _lines(path)
    first = next(((number, line) for number, line in lines if line.strip()), None)
    if first is None:
        raise TraceError(f"{path}: empty: no header, no requests")
    number, header = first[0], next(csv.reader([first[1]]))
    missing = [name for name in columns.values() if name not in header]
    if missing:
        raise TraceError(f"{path}:{number}: the header lacks {', '.join(missing)} (it has {', '.join(header)})")
    index = {ours: header.index(theirs) for ours, theirs in columns.items()}
    for number, line in lines:
        if not line.strip():
            continue
        row = next(csv.reader(io.StringIO(line)))
        if len(row) < len(header):
            raise TraceError(f"{path}:{number}: {len(row)} columns where the header has {len(header)}")
        yield number, {ours: row[i] for ours, i in index.items()}


def _parse(path: Path, fmt: str) -> Iterator[tuple[int, float, int, int, str]]:
    if fmt == "azure":
        cols = {"t": "TIMESTAMP", "prompt": "ContextTokens", "output": "GeneratedTokens"}
        for number, row in _csv_rows(path, cols):
            yield number, *_fields(path, number, lambda r=row: (_azure_time(r["t"]), r["prompt"], r["output"], ""))
    elif fmt == "burstgpt":
        cols = {"t": "Timestamp", "prompt": "Request tokens", "output": "Response tokens"}
        for number, row in _csv_rows(path, cols):
            yield number, *_fields(path, number, lambda r=row: (float(r["t"]), r["prompt"], r["output"], ""))
    elif fmt == "jsonl":
        for number, line in _lines(path):
            if line.strip():
                yield number, *_fields(path, number, lambda line=line: _jsonl(line))
    else:
        raise TraceError(f"unknown trace format {fmt!r}: one of {', '.join(FORMATS)}")


def _jsonl(line: str) -> tuple[float, object, object, str]:
    try:
        item = json.loads(line)
    except ValueError as exc:
        csv = "," in line and not line.lstrip().startswith(("{", "["))  # a CSV's line, read as the default format
        raise ValueError(f"not JSON: {exc}" + (" (a CSV? --format azure or burstgpt reads the public traces)"
                                               if csv else "")) from None  # fmt: skip
    if not isinstance(item, dict) or not {"t", "prompt_tokens", "output_tokens"} <= item.keys():
        raise ValueError('expected {"t": seconds, "prompt_tokens": N, "output_tokens": N} (and "class", optional)')
    if isinstance(item["t"], bool) or not isinstance(item["t"], int | float):
        raise ValueError(f"t is not a number of seconds: {item['t']!r}")
    latency_class = item.get("class", "")
    if not isinstance(latency_class, str) or len(latency_class) > 64:
        raise ValueError(f"class is not a short name: {latency_class!r}")
    return float(item["t"]), item["prompt_tokens"], item["output_tokens"], latency_class


def _fields(path: Path, number: int, read) -> tuple[float, int, int, str]:
    try:
        t, prompt, output, latency_class = read()
        if not math.isfinite(t):
            raise ValueError(f"the time {t!r} is not a number of seconds")
        return t, _tokens(prompt, "the prompt length"), _tokens(output, "the output length"), latency_class
    except ValueError as exc:
        raise TraceError(f"{path}:{number}: {exc}") from None


def read_trace(path: Path, fmt: str) -> list[TraceRequest]:
    """The trace's requests in arrival order, times from its first arrival. Unsorted or empty traces are refused."""
    out: list[TraceRequest] = []
    first = previous = None
    for number, t, prompt, output, latency_class in _parse(path, fmt):
        if previous is not None and t < previous:
            raise TraceError(f"{path}:{number}: time goes back ({t:g} after {previous:g}): sort the trace by time")
        if first is None:
            first = t
        previous = t
        if t - first > MAX_SPAN:
            raise TraceError(f"{path}:{number}: {t - first:g} s after the first request: a trace spans a year at "
                             "most (is this column in seconds?)")  # fmt: skip
        if output == 0 and fmt == "jsonl":
            raise TraceError(f"{path}:{number}: output_tokens 0: a request generates at least one token")
        if output == 0:
            continue  # a failed request in a CSV recording (BurstGPT logs them): nothing to generate
        out.append(TraceRequest(t - first, max(prompt, 1), output, latency_class))
    if not out:
        raise TraceError(f"{path}: no requests to replay")
    return out


def select(trace: Iterable[TraceRequest], *, start: float = 0.0, duration: float | None = None,
           rate_scale: float = 1.0) -> list[TraceRequest]:  # fmt: skip
    """The slice [start, start + duration) of the trace, from 0, with the gaps divided by ``rate_scale``."""
    if not MIN_RATE_SCALE <= rate_scale <= MAX_RATE_SCALE:
        raise ValueError(f"the rate scale must be in {MIN_RATE_SCALE:g}..{MAX_RATE_SCALE:g}, got {rate_scale:g}")
    end = math.inf if duration is None else start + duration
    return [replace(r, t=(r.t - start) / rate_scale) for r in trace if start <= r.t < end]
