"""A fast reader for the Prometheus text exposition format (version 0.0.4).

The exporter passes every vLLM sample through with one added label, so it must
read each engine's exposition on every tick. vLLM's expositions keep the same
series from one scrape to the next and only the values change. The reader
therefore caches each distinct series text ("name{labels}"), validated, with its
re-labelled output form, and on a warm tick does little more than split lines,
look up a dict and call ``float``. Labels are decoded only when asked for: the
exporter needs them for a handful of series, and the cache stays small.

Families are grouped exactly as ``prometheus_client.parser`` groups them (it is
the oracle in the property tests): a ``# HELP`` or ``# TYPE`` line opens a family,
samples whose names the family's type allows join it, and any other sample
becomes a family of its own with no declared type (a histogram's ``_created``
written inside the histogram, for example).
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_INFINITIES = (math.inf, -math.inf)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|\Z)', re.DOTALL)
_LABEL_ESCAPE = re.compile(r'\\[\\n"]')
_HELP_ESCAPE = re.compile(r"\\[\\n]")
_UNESCAPE = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}

# Sample names that belong to a family of each type (see the module docstring).
_SUFFIXES = {
    "histogram": ("_count", "_sum", "_bucket"),
    "summary": ("_count", "_sum", ""),
}


class ParseError(ValueError):
    """The exposition is not valid text format; names the line that is not."""

    def __init__(self, lineno: int, line: str, why: str):
        self.lineno = lineno
        shown = line if len(line) <= 120 else line[:117] + "..."
        super().__init__(f"line {lineno}: {why}: {shown!r}")


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def unescape_label_value(value: str) -> str:
    return _LABEL_ESCAPE.sub(lambda m: _UNESCAPE[m.group(0)], value) if "\\" in value else value


@dataclass(frozen=True, slots=True)
class Series:
    """One distinct series as it appears on the wire, validated once and cached."""

    name: str
    #: The sample line up to its closing brace, ``name{labels`` (or ``name`` and a newline, where the line has
    #: no labels): the same object as the cache's key.
    key: str
    #: The series text with the reader's extra labels added; what the exporter emits.
    exported: str
    _labels: tuple[tuple[str, str], ...] | None = field(default=None, compare=False, repr=False)

    @property
    def labels(self) -> tuple[tuple[str, str], ...]:
        """The target's own labels, decoded on first use (the text was validated when first seen)."""
        if self._labels is None:
            _, brace, inner = self.key.partition("{")
            object.__setattr__(self, "_labels", _parse_labels(inner, 0, self.key) if brace else ())
        return self._labels  # type: ignore[return-value]


#: A sample is ``(series, value, line)``: ``line`` is the sample as the reader
#: exports it, ``series.exported`` followed by the value and optional timestamp
#: exactly as on the wire. Plain tuples, because a real vLLM exposition holds
#: hundreds of them and they are built every tick.
Sample = tuple[Series, float, str]


@dataclass(slots=True)
class Family:
    name: str
    #: counter, gauge, histogram, summary or untyped; None when no ``# TYPE`` line declared it.
    type: str | None = None
    #: The help text as on the wire (still escaped); None when there was no ``# HELP`` line.
    help_raw: str | None = None
    samples: list[Sample] = field(default_factory=list)
    #: The ``# HELP``/``# TYPE`` lines that introduced the family, as on the wire.
    header: str = ""

    @property
    def help(self) -> str:
        raw = self.help_raw or ""
        return _HELP_ESCAPE.sub(lambda m: _UNESCAPE[m.group(0)], raw) if "\\" in raw else raw


def sample_timestamp_ms(sample: Sample) -> int | None:
    """The sample's timestamp in milliseconds, if the exposition gave one."""
    parts = sample[2][len(sample[0].exported) :].split()
    return int(parts[1]) if len(parts) == 2 else None


#: A parsed ``# HELP``/``# TYPE`` line: (kind, family name, help text or type,
#: names the type allows, the line as it goes on the wire).
_Meta = tuple[str, str, str, frozenset[str], str]
_COMMENT: _Meta = ("", "", "", frozenset(), "")


@functools.lru_cache(maxsize=4096)  # shared by every engine's reader: they all serve the same families
def _allowed_names(name: str, typ: str | None) -> frozenset[str]:
    return frozenset(name + suffix for suffix in _SUFFIXES.get(typ or "", ("",)))


class ExpositionReader:
    """Reads successive expositions of one target, caching its series.

    ``extra_labels`` are added to every series' ``exported`` form, replacing a
    label of the same name that the target already set. The cache is dropped
    when it grows past twice the size of the latest exposition, so it follows the
    target's own cardinality and never grows without bound.
    """

    def __init__(self, extra_labels: Mapping[str, str] | None = None):
        self._extra = dict(extra_labels or {})
        self._extra_text = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in self._extra.items())
        # Keyed by the line's text: series text for samples, the whole line for comments.
        self._cache: dict[str, Series | _Meta] = {}

    def parse(self, text: str) -> list[Family]:
        # The hot loop of the exporter: locals over attributes, no per-line calls we can avoid.
        families: list[Family] = []
        current: Family | None = None
        allowed: frozenset[str] = frozenset()
        append = None
        cache = self._cache
        lines = text.split("\n")
        ascii_text = text.isascii()  # one check for the whole text: then no line's value needs its own
        infinities = _INFINITIES
        blank = 0  # the cache's bound counts lines that are not blank: blank ones must not raise it
        for lineno, line in enumerate(lines, 1):
            line = line.strip()
            if not line:
                blank += 1
                continue
            if line[0] == "#":
                meta = cache.get(line) or self._parse_meta(line, lineno)
                if meta is _COMMENT:
                    continue
                kind, name, payload, type_allowed, wire = meta
                if current is None or name != current.name:
                    current = Family(name, None, None, [], wire)
                    families.append(current)
                    append = current.samples.append
                    allowed = type_allowed if kind == "TYPE" else frozenset((name,))
                elif (current.help_raw if kind == "HELP" else current.type) is None:
                    current.header += wire  # the family's other line
                else:  # a repeat replaces its kind's line, as its payload does: appended, 20,000 took 11 s
                    current.header = _replaced(current.header, kind, wire)
                if kind == "HELP":
                    current.help_raw = payload
                else:
                    current.type, allowed = payload, type_allowed
                continue

            key, brace, rest = line.rpartition("}")
            if not brace:
                split = line.split(None, 1)
                if len(split) != 2:
                    raise ParseError(lineno, line, "sample without a value")
                if "{" in split[0]:
                    raise ParseError(lineno, line, "unbalanced braces")
                # Cached apart from every braced key (no line holds a newline), so that "foo} 1" never finds the
                # series of "foo 1", nor "foo{a="b" 1" that of "foo{a="b"} 1".
                key, rest = split[0] + "\n", " " + split[1]
            series = cache.get(key) or self._parse_series(key, brace, lineno, line)
            if not ascii_text and not rest.isascii():  # Python reads "١٢" and a no-break space; Prometheus does
                raise ParseError(lineno, line, "invalid value or timestamp")  # not, and the whole scrape fails
            try:
                if "_" in rest:
                    raise ValueError
                value = float(rest)
            except ValueError:
                value = _value_with_timestamp(rest, lineno, line)
            if value in infinities and "inf" not in rest.lower():  # 1e9999: Go's ParseFloat says out of range
                raise ParseError(lineno, line, "value out of range")

            if series.name in allowed:
                append((series, value, series.exported + rest))  # type: ignore[misc]
            else:
                families.append(Family(series.name, samples=[(series, value, series.exported + rest)]))
                current, allowed = None, frozenset()
        if len(cache) > 2 * (len(lines) - blank) + 64:
            # Series came and went; start over so the cache follows the target's cardinality.
            self._cache = {}
        return families

    def _parse_meta(self, line: str, lineno: int) -> _Meta:
        # Interned, here and in _parse_series: every engine of a fleet sends the same text, and each
        # reader's cache would otherwise hold its own copy of it.
        line = sys.intern(line)
        parts = [sys.intern(part) for part in line.split(None, 3)]
        if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
            meta: _Meta = _COMMENT
        else:
            kind, name = parts[1], parts[2]
            if not _METRIC_NAME.match(name):
                raise ParseError(lineno, line, "invalid metric name")
            if kind == "HELP":
                meta = (kind, name, parts[3] if len(parts) == 4 else "", frozenset(), sys.intern(line + "\n"))
            elif len(parts) < 4:
                raise ParseError(lineno, line, "TYPE line without a type")
            else:
                meta = (kind, name, parts[3], _allowed_names(name, parts[3]), sys.intern(line + "\n"))
        self._cache[line] = meta
        return meta

    def _parse_series(self, key: str, brace: str, lineno: int, line: str) -> Series:
        """``key`` is the sample line up to its closing brace (excluded), or its name alone."""
        if not brace:
            name, inner = key[:-1], None  # less the newline it is cached under
        elif "{" not in key:
            raise ParseError(lineno, line, "unbalanced braces")
        else:
            name, _, inner = key.partition("{")
            name = name.rstrip()
        if not _METRIC_NAME.match(name):
            raise ParseError(lineno, line, "invalid metric name")
        labels = _parse_labels(inner, lineno, line) if inner is not None else ()
        key = sys.intern(key)
        series = self._cache[key] = Series(sys.intern(name), key, self._export(name, inner, labels))
        return series

    def _export(self, name: str, inner: str | None, labels: tuple[tuple[str, str], ...]) -> str:
        if not self._extra:
            return f"{name}{{{inner}}}" if inner is not None else name
        if any(k in self._extra for k, _ in labels):
            # Rare: the target already sets one of our labels. Rebuild without it.
            kept = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels if k not in self._extra)
            inner = kept
        if inner and inner.strip():
            return f"{name}{{{self._extra_text},{inner}}}"
        return f"{name}{{{self._extra_text}}}"


def _replaced(header: str, kind: str, wire: str) -> str:
    """A family's header (a HELP and a TYPE line at most) with its ``kind`` line replaced by ``wire``."""
    return "".join(wire if line.split(None, 2)[1] == kind else line for line in header.splitlines(keepends=True))


def _parse_labels(inner: str, lineno: int, line: str) -> tuple[tuple[str, str], ...]:
    labels: list[tuple[str, str]] = []
    seen: set[str] = set()
    pos, end = 0, len(inner)
    while pos < end:
        m = _LABEL.match(inner, pos)
        if m is None:
            if inner[pos:].strip():
                raise ParseError(lineno, line, "invalid labels")
            break
        key = m.group(1)
        if key in seen:
            raise ParseError(lineno, line, f"duplicate label {key!r}")
        seen.add(key)
        labels.append((key, unescape_label_value(m.group(2))))
        pos = m.end()
    return tuple(labels)


def _value_with_timestamp(rest: str, lineno: int, line: str) -> float:
    parts = rest.split()
    try:
        if len(parts) != 2 or "_" in rest:
            raise ValueError
        int(parts[1])
        return float(parts[0])
    except ValueError:
        raise ParseError(lineno, line, "invalid value or timestamp") from None
