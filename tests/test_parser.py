"""The exposition parser, checked against prometheus_client's parser as the oracle.

No fakes: the inputs are generated expositions (hypothesis), a real vLLM 0.32
exposition captured into tests/data, and (marker vllm) one the test captures
from a live vLLM itself.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from batchlens.exporter.parser import (
    ExpositionReader,
    Family,
    ParseError,
    escape_label_value,
    sample_timestamp_ms,
    unescape_label_value,
)

# --- the comparison -------------------------------------------------------------------------------


def _ours(families: list[Family]) -> list[tuple]:
    """Our families in prometheus_client's shape (its parser renames counters, see build_metric)."""
    out = []
    for f in families:
        typ = "unknown" if f.type in (None, "untyped") else f.type
        name, samples = f.name, [(s[0].name, dict(s[0].labels), s[1], sample_timestamp_ms(s)) for s in f.samples]
        if typ == "counter":
            if name.endswith("_total"):
                name = name[: -len("_total")]
            else:
                samples = [(n + "_total", *rest) for n, *rest in samples]
        out.append((name, typ, f.help, samples))
    return out


def _oracle(text: str) -> list[tuple]:
    return [
        (
            m.name,
            m.type,
            m.documentation,
            [
                (s.name, s.labels, s.value, None if s.timestamp is None else round(s.timestamp * 1000))
                for s in m.samples
            ],
        )
        for m in text_string_to_metric_families(text)
    ]


def _same_value(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_same_families(ours: list[tuple], oracle: list[tuple]) -> None:
    assert [f[:3] for f in ours] == [f[:3] for f in oracle]
    for mine, theirs in zip(ours, oracle, strict=True):
        assert len(mine[3]) == len(theirs[3]), mine[0]
        for (n1, l1, v1, t1), (n2, l2, v2, t2) in zip(mine[3], theirs[3], strict=True):
            assert (n1, l1, t1) == (n2, l2, t2)
            assert _same_value(v1, v2), (n1, l1, v1, v2)


def assert_matches_oracle(text: str) -> list[Family]:
    families = ExpositionReader().parse(text)
    assert_same_families(_ours(families), _oracle(text))
    return families


# --- generated expositions -------------------------------------------------------------------------

names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True)
label_names = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,8}", fullmatch=True)
# Any text, including quotes, backslashes, newlines, braces and commas; the generator escapes it.
label_values = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
help_texts = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs", "Zs", "Zl", "Zp", "Cc")) | st.sampled_from(' \\\n"'),
    max_size=20,
)
values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(lambda v: repr(v).replace("inf", "Inf").replace("nan", "NaN")),
    st.integers(-(2**53), 2**53).map(str),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e+06", "1.5E-3", "0.0", "-0.0"]),
)
timestamps = st.none() | st.integers(0, 2**42)


@st.composite
def label_sets(draw, extra: dict[str, str] | None = None):
    keys = draw(st.lists(label_names.filter(lambda k: k != "le" and k != "quantile"), max_size=3, unique=True))
    labels = {k: draw(label_values) for k in keys}
    labels.update(extra or {})
    return labels


def sample_line(draw, name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
    series = f"{name}{{{inner}}}" if labels or draw(st.booleans()) else name
    ts = draw(timestamps)
    return f"{series} {draw(values)}" + (f" {ts}" if ts is not None else "")


@st.composite
def family_lines(draw) -> list[str]:
    kind = draw(st.sampled_from(["counter", "gauge", "histogram", "summary", "untyped", "headerless", "comment"]))
    name = draw(names)
    if kind == "comment":
        return [draw(st.sampled_from(["# just a comment", "#", "# ", "# HELPING hand"]))]
    lines = []
    help_line = f"# HELP {name} " + draw(help_texts).replace("\\", "\\\\").replace("\n", "\\n")
    if kind != "headerless":
        order = draw(st.sampled_from(["help+type", "type+help", "type", "help"]))
        type_line = f"# TYPE {name} {kind}"
        lines += {"help+type": [help_line, type_line], "type+help": [type_line, help_line],
                  "type": [type_line], "help": [help_line]}[order]  # fmt: skip
    for _ in range(draw(st.integers(0, 3))):
        labels = draw(label_sets())
        if kind == "histogram":
            for le in ("0.5", "1.0", "+Inf"):
                lines.append(sample_line(draw, name + "_bucket", {**labels, "le": le}))
            lines += [sample_line(draw, name + "_sum", labels), sample_line(draw, name + "_count", labels)]
            if draw(st.booleans()):  # prometheus_client's _created, inside the family: a family of its own
                lines.append(sample_line(draw, name + "_created", labels))
        elif kind == "summary":
            lines += [sample_line(draw, name, {**labels, "quantile": "0.99"}), sample_line(draw, name + "_sum", labels)]
        elif kind == "counter" and draw(st.booleans()):
            lines += [sample_line(draw, name, labels), sample_line(draw, name + "_created", labels)]  # vLLM's way
        else:
            lines.append(sample_line(draw, name, labels))
    return lines


@st.composite
def expositions(draw) -> str:
    lines = [ln for fam in draw(st.lists(family_lines(), max_size=6)) for ln in fam]
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), "")
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    return ending.join(lines) + (ending if lines and draw(st.booleans()) else "")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expositions())
def test_generated_expositions_match_prometheus_client(text: str) -> None:
    assert_matches_oracle(text)


@settings(max_examples=100, deadline=None)
@given(expositions())
def test_reparsing_with_a_warm_cache_gives_the_same_families(text: str) -> None:
    reader = ExpositionReader({"vllm_instance": "a"})
    first = _ours(reader.parse(text))
    assert_same_families(_ours(reader.parse(text)), first)


# --- real vLLM expositions -------------------------------------------------------------------------


def test_captured_vllm_exposition_matches_prometheus_client(vllm_exposition: str) -> None:
    families = assert_matches_oracle(vllm_exposition)
    by_name = {f.name: f for f in families}
    assert by_name["vllm:e2e_request_latency_seconds"].type == "histogram"
    # vLLM 0.32 (prometheus_client) writes each _created series as a gauge family of its own.
    assert by_name["vllm:request_success_created"].type == "gauge"
    assert all(f.type is not None for f in families)


def test_every_releases_exposition_matches_prometheus_client(release_capture: Path) -> None:
    """vLLM 0.10 to 0.32, each captured under load: the names, labels and types moved between them."""
    release_exposition = release_capture.read_text()
    families = assert_matches_oracle(release_exposition)
    assert {"vllm:num_requests_running", "vllm:cache_config_info"} <= {f.name for f in families}


@pytest.mark.vllm
def test_live_vllm_exposition_matches_prometheus_client(vllm_server) -> None:
    vllm_server.load(requests=4, concurrency=4)
    text = vllm_server.metrics_text()
    families = assert_matches_oracle(text)
    assert sum(len(f.samples) for f in families) > 300, "a real vLLM 0.32 exposes hundreds of samples"


# --- relabelling, errors and the cache -------------------------------------------------------------


def test_extra_labels_are_added_and_samples_pass_through_unchanged() -> None:
    text = 'a{x="1\\"q"} 1.0\nb 2e+06 1700000000000\nc{} NaN\nd{vllm_instance="theirs",y="2"} +Inf\n'
    families = ExpositionReader({"vllm_instance": 'we"ird'}).parse(text)
    lines = [s[2] for f in families for s in f.samples]
    assert lines == [
        'a{vllm_instance="we\\"ird",x="1\\"q"} 1.0',
        'b{vllm_instance="we\\"ird"} 2e+06 1700000000000',
        'c{vllm_instance="we\\"ird"} NaN',
        'd{vllm_instance="we\\"ird",y="2"} +Inf',  # ours replaces the target's label of the same name
    ]
    reparsed = _oracle("\n".join(lines) + "\n")
    assert [s[1]["vllm_instance"] for f in reparsed for s in f[3]] == ['we"ird'] * 4


@pytest.mark.parametrize(
    ("text", "lineno", "why"),
    [
        ("ok 1\nbad{x=1} 2\n", 2, "invalid labels"),
        ("# TYPE\n", 1, None),  # too short to be a TYPE line: an ordinary comment, no error
        ("# TYPE foo\n", 1, "TYPE line without a type"),
        ("a 1\nb 1 2 3\n", 2, "invalid value"),
        ("a 1_000\n", 1, "invalid value"),
        ("a one\n", 1, "invalid value"),
        ('a{x="1",x="2"} 1\n', 1, "duplicate label"),
        ("1abc 1\n", 1, "invalid metric name"),
        ("just_a_name\n", 1, "sample without a value"),
        ('a{x="unterminated} 1\n', 1, "invalid labels"),
        ("<html>\n", 1, "sample without a value"),
        ("<html> x\n", 1, "invalid metric name"),
    ],
)
def test_errors_name_the_line(text: str, lineno: int, why: str | None) -> None:
    reader = ExpositionReader()
    if why is None:
        assert reader.parse(text) == []
        return
    with pytest.raises(ParseError) as err:
        reader.parse(text)
    assert err.value.lineno == lineno
    assert why in str(err.value)


def test_cache_follows_the_targets_cardinality() -> None:
    reader = ExpositionReader()
    for i in range(200):  # every exposition brings 50 new series
        reader.parse("".join(f'churn{{id="{i}-{j}"}} 1\n' for j in range(50)))
        assert len(reader._cache) <= 2 * 51 + 64 + 50


def test_label_values_escape_as_the_text_format_says_stated_by_hand() -> None:
    raw = 'C:\\models\\7b "chat"\nv2'
    wire = 'C:\\\\models\\\\7b \\"chat\\"\\nv2'  # backslash, double quote and line feed, each escaped
    assert escape_label_value(raw) == wire and unescape_label_value(wire) == raw
    assert unescape_label_value("plain") == "plain"


def test_a_parse_error_names_the_line_and_shows_at_most_120_characters_of_it() -> None:
    assert str(ParseError(3, "x" * 120, "bad")) == f"line 3: bad: {'x' * 120!r}"
    assert str(ParseError(4, "y" * 121, "bad")) == f"line 4: bad: {'y' * 117 + '...'!r}"


@pytest.mark.parametrize(
    "line",
    ['foo{a="b"} \u0661\u0662', 'foo{a="b"} \xa01', "foo 1e9999", "foo 1 \u0661\u0662\u0663"],
    ids=["Arabic-Indic digits", "a no-break space", "out of range", "a timestamp in other digits"],
)
def test_a_value_python_reads_and_prometheus_does_not_is_refused(line: str) -> None:
    """Copied to the wire as sent, it would fail the whole scrape: every engine, GPU and host series of the node."""
    with pytest.raises(ParseError):
        ExpositionReader({"vllm_instance": "e0"}).parse(line + "\n")
    assert ExpositionReader().parse("foo +Inf\nbar -Inf\nbaz NaN\n")  # the spellings Prometheus reads stay


def test_a_line_with_a_missing_brace_is_refused_though_its_series_is_cached() -> None:
    reader = ExpositionReader()
    reader.parse('foo{a="b"} 1\nfoo 2\n')
    for broken in ('foo{a="b" 1\n', "foo} 1\n"):
        with pytest.raises(ParseError, match="unbalanced braces"):
            reader.parse(broken)


def test_blank_lines_do_not_let_the_series_cache_grow_without_bound() -> None:
    reader = ExpositionReader()
    for tick in range(4):  # new series every tick, padded with blank lines
        reader.parse("".join(f'foo{{n="{tick}-{i}"}} 1\n' for i in range(500)) + "\n" * 50_000)
    assert len(reader._cache) <= 2 * 500 + 64


def test_a_repeated_help_or_type_line_replaces_the_one_before() -> None:
    """Prometheus keeps the last; appended each time, the header grew quadratically (20,000 lines: 11 s)."""
    text = "".join(f"# HELP foo take {i}\n# TYPE foo gauge\n" for i in range(2000)) + "foo 1\n"
    (family,) = ExpositionReader().parse(text)
    assert family.header == "# HELP foo take 1999\n# TYPE foo gauge\n" and family.help == "take 1999"
