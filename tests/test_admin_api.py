"""The admin API contract's pure parts: body validation, data-parallel merge. No I/O."""

from __future__ import annotations

import json

import pytest

from batchlens.admin_api import (
    AdminError,
    AdmissionState,
    combine,
    parse_admission,
    parse_update,
    retry_after,
)
from batchlens.queued_caps import (
    MESSAGES,
    cap_refusal,
    door_priority,
    plugin_refusal,
    priority_class,
    priority_of,
    refusal,
    refusal_body,
)
from harness.admin import refused_with


@pytest.mark.parametrize(
    "body",
    [b'{"max_num_active_seqs": 0}', b'{"max_num_active_seqs": -1}', b'{"max_num_active_seqs": "4"}',
     b'{"max_num_active_seqs": 33}', b'{"max_num_active_seqs": 4.0}', b'{"max_num_active_seqs": true}',
     b'{"max_num_active_seqs": null}', b"{}", b"[4]", b"4", b"abc", b"", b"\xff",
     b'{"max_num_active_seqs": 4, "x": 1}', b'{"max_num_active_seqs": 1e400}',
     b'{"max_num_active_seqs": 4}' + b" " * 5000, b"[" * 2000 + b"]" * 2000],  # nested past Python's recursion
)  # fmt: skip
def test_bad_bodies_are_400(body: bytes) -> None:
    assert refused_with(parse_update, body, 32) == 400


def test_a_good_body_gives_its_limit() -> None:
    assert parse_update(b'{"max_num_active_seqs": 1}', 32) == 1
    assert parse_update(b'{"max_num_active_seqs": 32}', 32) == 32


def test_the_400_names_the_allowed_range() -> None:
    with pytest.raises(AdminError) as raised:
        parse_update(b'{"max_num_active_seqs": 33}', 32)
    assert "1..32" in raised.value.message


def test_data_parallel_engines_combine_into_one_state() -> None:
    state = combine(
        [
            {"engine": 0, "max_num_seqs": 32, "max_num_active_seqs": 8, "num_running": 8, "num_waiting": 3},
            {"engine": 1, "max_num_seqs": 32, "max_num_active_seqs": 16, "num_running": 5, "num_waiting": 0},
        ]
    )
    assert (state.max_num_seqs, state.max_num_active_seqs, state.num_running, state.num_waiting) == (32, 8, 13, 3)
    assert [e.engine for e in state.engines] == [0, 1]
    assert refused_with(combine, []) == 503


@pytest.mark.parametrize(
    ("body", "changes"),
    [
        (b'{"max_num_queued_tokens": 4096}', {"max_num_queued_tokens": 4096}),
        (b'{"max_num_queued_reqs": null}', {"max_num_queued_reqs": None}),
        (
            b'{"max_num_queued_tokens": 1, "max_num_queued_reqs": 2}',
            {"max_num_queued_tokens": 1, "max_num_queued_reqs": 2},
        ),
        (b'{"max_predicted_ttft_seconds": 2.5}', {"max_predicted_ttft_seconds": 2.5}),  # the per-request door alone
        (b'{"max_predicted_ttft_seconds": null}', {"max_predicted_ttft_seconds": None}),
    ],
)
def test_an_admission_put_names_the_caps_it_changes(body, changes) -> None:
    assert parse_admission(body) == changes


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"max_num_queued_reqs": 0}', "0 would refuse every request"),
        (b'{"max_num_queued_tokens": -5}', "1 or more"),
        (b'{"max_num_queued_tokens": 10.0}', "valid integer"),
        (b'{"max_num_queued_reqs": true}', "valid integer"),
        (b"{}", "name at least one cap"),
        (b'{"prefill_tokens_per_second": 900.0}', "name at least one cap"),  # a rate alone changes no cap
        (b'{"max_num_queued_tokens": 1' + b"0" * 400 + b"}", "at most 2147483647"),  # JSON integers are unbounded
        (b'{"max_num_seqs": 4}', "max_num_seqs: Extra inputs"),  # names the key it does not know
        (b"[" * 2000, "not JSON"),
        (b'{"prefill_tokens_per_second": 0}', "above 0"),
        (b'{"prefill_tokens_per_second": NaN}', "above 0"),
        (b'{"max_predicted_ttft_seconds": 0}', "above 0 and at most 3600"),
        (b'{"max_predicted_ttft_seconds": 3601}', "above 0 and at most 3600"),
        (b'{"max_predicted_ttft_seconds": "2"}', "valid number"),
    ],
)
def test_a_bad_admission_put_is_a_400_that_says_why(body, says) -> None:
    with pytest.raises(AdminError) as err:
        parse_admission(body)
    assert err.value.status == 400 and says in err.value.message


def caps(tokens=None, reqs=None, *, queued=0, unfinished=0) -> AdmissionState:
    return AdmissionState(max_num_queued_tokens=tokens, max_num_queued_reqs=reqs, num_queued_tokens=queued,
                          num_unfinished_reqs=unfinished)  # fmt: skip


@pytest.mark.parametrize(
    ("state", "n", "refused"),
    [
        (caps(), 1, None),  # no cap: everything is admitted
        (caps(reqs=4, unfinished=3), 1, None),
        (caps(reqs=4, unfinished=4), 1, "max_num_queued_reqs"),
        (caps(reqs=4, unfinished=3), 2, "max_num_queued_reqs"),  # n sequences count as n, as in vLLM
        (caps(tokens=100, queued=99), 1, None),
        (caps(tokens=100, queued=100), 1, "max_num_queued_tokens"),  # at the cap: the backlog is full
        (caps(tokens=100, reqs=4, queued=500, unfinished=9), 1, "max_num_queued_reqs"),  # vLLM checks reqs first
    ],
)
def test_the_queued_caps_refuse_as_vllm_does(state, n, refused) -> None:
    assert refusal(state, n) == refused


@pytest.mark.parametrize(
    ("state", "priority", "refused"),
    [
        (caps(reqs=4, unfinished=100), 1, None),  # critical: never refused at the door, however full
        (caps(tokens=100, queued=10_000), 7, None),
        (caps(reqs=4, unfinished=4), 0, "max_num_queued_reqs"),  # standard: the caps as they are
        (caps(reqs=4, unfinished=1), -1, None),  # sheddable: half of each cap
        (caps(reqs=4, unfinished=2), -1, "max_num_queued_reqs"),  # 2 + 1 > 4 x 0.5
        (caps(tokens=100, queued=49), -3, None),
        (caps(tokens=100, queued=50), -3, "max_num_queued_tokens"),
        (caps(), -1, None),  # no cap: the door is open to every class
        (caps(reqs=1, unfinished=0), -1, None),  # half a cap of 1 is still 1: an idle engine takes it
        (caps(reqs=2, unfinished=1), -1, "max_num_queued_reqs"),  # half a cap of 2 is 1, and one is in
        (caps(reqs=0, unfinished=0), -1, "max_num_queued_reqs"),  # but never past the cap: 0 (at launch) is 0
        (caps(tokens=0, queued=0), -1, "max_num_queued_tokens"),
        (caps(tokens=1, queued=0), -1, None),
    ],
)
def test_a_requests_door_priority_decides_when_it_is_refused(state, priority, refused) -> None:
    assert refusal(state, priority=priority) == refused


@pytest.mark.parametrize(
    ("priority", "vllm_caps", "refused"),
    [
        (-1, False, "max_num_queued_reqs"),  # the plugin's door: every class's rule
        (0, False, "max_num_queued_reqs"),
        (1, False, None),
        (-1, True, "max_num_queued_reqs"),  # vLLM's caps: the plugin refuses only the sheddable class early
        (0, True, None),  # ... vLLM refuses the standard and critical ones itself
        (1, True, None),
    ],
)
def test_the_plugin_refuses_every_class_where_it_keeps_the_door_and_only_the_sheddable_one_beside_vllm(
    priority, vllm_caps, refused
) -> None:
    assert plugin_refusal(lambda: caps(reqs=4, unfinished=4), priority, vllm_caps) == refused


def test_beside_vllms_caps_the_plugin_reads_no_state_for_the_classes_vllm_judges() -> None:
    def unread() -> AdmissionState:
        raise AssertionError("the caps were read on a request the plugin does not judge")

    assert plugin_refusal(unread, 0, vllm_caps=True) is None and plugin_refusal(unread, 1, vllm_caps=True) is None


@pytest.mark.parametrize(
    ("header", "priority", "named"),
    [
        (None, 0, "standard"),
        (b"1", 1, "critical"),  # any priority above 0
        (b"5", 5, "critical"),
        ("-2", -2, "sheddable"),
        (b" 0 ", 0, "standard"),
        (b"high", 0, "standard"),
        (b"1.5", 0, "standard"),
        ("", 0, "standard"),
        (b"\xff", 0, "standard"),
        ("\u0661", 0, "standard"),  # an Arabic-Indic 1: int() reads it, the plugin's latin-1 bytes do not
        ("1_0", 0, "standard"),
        ("+3", 3, "critical"),
        ("9" * 10, 0, "standard"),  # past 9 digits: no integer a client means (5000 digits: int() raises)
    ],
)
def test_a_header_that_is_not_an_integer_is_standard_never_critical(header, priority, named) -> None:
    assert priority_of(header) == priority and priority_class(priority_of(header)) == named


def test_a_header_sent_twice_is_read_at_its_lowest_copy() -> None:
    """A gateway that appends its copy to the client's: no copy raises the request past another's."""
    assert door_priority([b"-5", b"1"]) == door_priority([b"1", b"-5"]) == -5
    assert door_priority([]) == 0 and door_priority(["2"]) == 2


def test_only_a_503_whose_body_is_a_queued_caps_counts_as_the_doors() -> None:
    assert all(cap_refusal(json.dumps(refusal_body(reason)).encode()) for reason in MESSAGES)
    assert not cap_refusal(b'{"error": {"message": "The server is shutting down", "code": 503}}')


def test_a_refusals_body_is_vllms_503_as_openai_clients_read_it() -> None:
    """Stated by hand: the OpenAI error shape vLLM 0.32 answers a queued cap with, typed by the status's phrase."""
    assert refusal_body("max_num_queued_tokens") == {
        "error": {"message": MESSAGES["max_num_queued_tokens"], "type": "Service Unavailable", "param": None,
                  "code": 503},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("queued", "rate", "seconds"),
    [(0, None, 1), (50_000, None, 1), (0, 2000.0, 1), (2000, 2000.0, 1), (2001, 2000.0, 2), (9000, 2000.0, 5),
     (300, 1e-3, 60), (300, 5e-324, 60)],  # a minute at most, and never ceil(inf)
)  # fmt: skip
def test_a_refusal_says_when_the_backlog_will_have_drained(queued, rate, seconds) -> None:
    state = AdmissionState(num_queued_tokens=queued, num_unfinished_reqs=1, prefill_tokens_per_second=rate)
    assert retry_after(state) == seconds


def test_a_cap_of_0_set_at_launch_reads_back_though_a_put_of_0_is_refused() -> None:
    """vLLM takes ``--max-num-queued-reqs 0`` (refuse everything); the reply must carry it, or GET answers 500 and
    every one of vLLM's own 503s dies in the middleware's Retry-After."""
    launched = AdmissionState(max_num_queued_reqs=0, num_queued_tokens=0, num_unfinished_reqs=0)
    assert launched.max_num_queued_reqs == 0 and retry_after(launched) == 1
    with pytest.raises(AdminError) as refused:
        parse_admission(b'{"max_num_queued_reqs": 0}')
    assert refused.value.status == 400


def test_a_404_says_whether_the_python_server_lacks_the_plugin_or_the_rust_frontend_has_none() -> None:
    from batchlens.admin_api import missing_plugin

    python = missing_plugin(b'{"detail":"Not Found"}')  # FastAPI's 404, as vLLM's Python API server answers
    assert "Python API server" in python and "VLLM_PLUGINS=batchlens" in python and "Rust" not in python
    rust = missing_plugin(b"")  # the Rust frontend's: an empty body
    assert "Rust frontend" in rust and "VLLM_USE_RUST_FRONTEND" in rust and "VLLM_PLUGINS" not in rust
    unread = missing_plugin(None)  # the exporter does not read a 404's body: both, each with its setting
    assert "VLLM_PLUGINS=batchlens" in unread and "VLLM_USE_RUST_FRONTEND" in unread
