"""The admin API contract's pure parts: token and signature checks, body validation, data-parallel merge. No I/O."""

from __future__ import annotations

import json
import re
import socket

import pytest

from batchlens.admin_api import (
    ADMISSION_PATH,
    BATCH_PATH,
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    SIGNATURE_MAX_SKEW_SECONDS,
    SIGNED_SCHEME,
    AdminAuth,
    AdminError,
    AdmissionState,
    PodIdentity,
    admin_headers,
    combine,
    own_pod,
    parse_admission,
    parse_update,
    refuse_encoded,
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


def status(fn, *args) -> int:
    with pytest.raises(AdminError) as raised:
        fn(*args)
    return raised.value.status


def check(auth: AdminAuth, header, method: str = "GET", path: str = BATCH_PATH, body: bytes = b"", now=None) -> None:
    auth.check(header, method, path, body, now=now)


def test_no_token_configured_is_503_whatever_the_request_says() -> None:
    assert status(check, AdminAuth(None), "Bearer anything") == 503
    assert status(check, AdminAuth(""), None) == 503
    assert status(check, AdminAuth(None), admin_headers("x", "GET", BATCH_PATH)["Authorization"]) == 503


# "\udcff": the surrogate aiohttp hands on for a header byte that is not UTF-8 (it answered 500, with a traceback)
@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer wrong", "Basic s3cret", "s3cret", "Bearer s3cret2", "Bearer \udcff",
     f"{SIGNED_SCHEME}", f"{SIGNED_SCHEME} t=\udcff,n=00,s=00", f"{SIGNED_SCHEME} t=1,n={'0' * 32},s={'0' * 64}",
     f"{SIGNED_SCHEME} s3cret"],
)  # fmt: skip
def test_a_missing_or_wrong_token_is_401(header) -> None:
    assert status(check, AdminAuth("s3cret"), header) == 401


def test_the_right_token_passes_in_any_scheme_case() -> None:
    check(AdminAuth("s3cret"), "Bearer s3cret")
    check(AdminAuth("s3cret"), "bearer s3cret")
    signed = admin_headers("s3cret", "GET", BATCH_PATH)["Authorization"]
    check(AdminAuth("s3cret"), signed.replace(SIGNED_SCHEME, SIGNED_SCHEME.lower()))


def test_a_signed_call_carries_no_token_and_holds_only_for_what_was_signed() -> None:
    body = b'{"max_num_active_seqs": 8}'
    header = admin_headers("s3cret", "PUT", "/prefix" + BATCH_PATH, body, now=1000)["Authorization"]
    assert "s3cret" not in header and header.startswith(SIGNED_SCHEME + " ")
    check(AdminAuth("s3cret"), header, "PUT", BATCH_PATH, body, now=1000)  # a proxy's path prefix is no part
    for method, path, sent in (("PUT", BATCH_PATH, b'{"max_num_active_seqs": 1}'), ("GET", BATCH_PATH, b""),
                               ("PUT", ADMISSION_PATH, body)):  # fmt: skip
        assert status(check, AdminAuth("s3cret"), header, method, path, sent, 1000) == 401
    assert status(check, AdminAuth("other"), header, "PUT", BATCH_PATH, body, 1000) == 401


def test_a_signature_is_taken_once_within_the_skew_and_never_outside_it() -> None:
    auth, header = AdminAuth("s3cret"), admin_headers("s3cret", "GET", BATCH_PATH, now=1000)["Authorization"]
    assert status(check, auth, header, "GET", BATCH_PATH, b"", 1000 - SIGNATURE_MAX_SKEW_SECONDS - 1) == 401  # ahead
    check(auth, header, now=1000 + SIGNATURE_MAX_SKEW_SECONDS)  # the clocks may disagree this much
    with pytest.raises(AdminError, match="replay"):
        check(auth, header, now=1000 + SIGNATURE_MAX_SKEW_SECONDS)
    with pytest.raises(AdminError, match="clock"):  # forgotten, and then refused by its time
        check(auth, header, now=1000 + SIGNATURE_MAX_SKEW_SECONDS + 1)


def test_a_captured_signature_cannot_be_given_a_nonce_a_time_or_a_pod_of_its_own() -> None:
    header = admin_headers("s3cret", "GET", BATCH_PATH, pod="vllm-0", now=1000)["Authorization"]
    forged = (re.sub(r"n=[0-9a-f]+", "n=" + "ab" * 16, header), header.replace("t=1000", "t=1200"),
              header.replace(",p=vllm-0", ",p=vllm-1"), header.replace(",p=vllm-0", ""))  # fmt: skip
    for changed in forged:
        with pytest.raises(AdminError, match="wrong signature"):
            check(AdminAuth("s3cret", pod=PodIdentity("vllm-1")), changed, now=1200)
    check(AdminAuth("s3cret", pod=PodIdentity("vllm-0")), header, now=1000)


def test_a_signature_for_another_pod_is_refused_and_one_for_none_is_taken_anywhere() -> None:
    here = PodIdentity("vllm-0", "serving")
    for signed, taken in (("serving/vllm-0", True), ("vllm-0", True), ("team-b/vllm-0", False),
                          ("serving/vllm-1", False), ("", True)):  # fmt: skip  # "": an engine of the config's
        header = admin_headers("s3cret", "GET", BATCH_PATH, pod=signed)["Authorization"]
        if taken:
            check(AdminAuth("s3cret", pod=here), header)
        else:
            with pytest.raises(AdminError, match=f"signed for the pod {signed}, and this is serving/vllm-0"):
                check(AdminAuth("s3cret", pod=here), header)
    assert PodIdentity("vllm-0").names("team-b/vllm-0"), "no namespace known here: the name alone is judged"


def test_a_pod_knows_itself_from_the_downward_api_else_its_host_name_which_kubelet_cuts_to_63() -> None:
    named = own_pod({POD_NAME_ENV: "vllm-0", POD_NAMESPACE_ENV: "serving"})
    assert named == PodIdentity("vllm-0", "serving") and named.names("serving/vllm-0")
    long = "production-stack-llama-3-1-8b-instruct-deployment-vllm-7c9d5b8f6d-x2x7z"  # 72 characters
    assert own_pod({}).name == socket.gethostname() and own_pod({}).cut
    host = PodIdentity(long[:63].rstrip("-."), cut=True)  # what kubelet sets as its host name
    assert host.names(f"serving/{long}") and not host.names(f"serving/{long[:40]}")
    assert not PodIdentity(long[:63].rstrip("-.")).names(long), "a name from the downward API is exact"


def test_the_memory_of_signatures_is_bounded_forgets_the_expired_and_refuses_rather_than_forget_early() -> None:
    auth = AdminAuth("s3cret", max_remembered=3)
    ahead = admin_headers("s3cret", "GET", BATCH_PATH, now=1250)["Authorization"]  # a signer's clock ahead
    check(auth, ahead, now=1000)
    for _ in range(2):
        check(auth, admin_headers("s3cret", "GET", BATCH_PATH, now=1000)["Authorization"], now=1000)
    with pytest.raises(AdminError) as full:  # three signatures still within their time: none is forgotten
        check(auth, admin_headers("s3cret", "GET", BATCH_PATH, now=1000)["Authorization"], now=1001)
    assert full.value.status == 503
    check(auth, admin_headers("s3cret", "GET", BATCH_PATH, now=1400)["Authorization"], now=1400)
    assert len(auth._seen) == 2, "the two of 1000 are past their time, though behind the one of 1250"
    with pytest.raises(AdminError, match="replay"):
        check(auth, ahead, now=1400)


def test_a_clock_stepped_back_does_not_bring_a_forgotten_signature_back() -> None:
    auth, first = AdminAuth("s3cret"), admin_headers("s3cret", "GET", BATCH_PATH, now=1000)["Authorization"]
    check(auth, first, now=1000)
    check(auth, admin_headers("s3cret", "GET", BATCH_PATH, now=1305)["Authorization"], now=1305)  # forgets first
    with pytest.raises(AdminError, match="clock"):  # NTP steps the clock back 10 s: still past its time
        check(auth, first, now=1295)


def test_a_compressed_body_is_refused_as_the_signature_covers_the_bytes_sent() -> None:
    refuse_encoded(None), refuse_encoded("identity")
    assert status(refuse_encoded, "gzip") == 400


def test_errors_never_echo_the_token() -> None:
    for header in ("Bearer guess", admin_headers("guess", "GET", BATCH_PATH)["Authorization"]):
        with pytest.raises(AdminError) as raised:
            check(AdminAuth("s3cret"), header)
        assert "s3cret" not in raised.value.message and "guess" not in raised.value.message


def test_a_bearer_header_is_sent_only_where_asked() -> None:
    assert admin_headers(None, "GET", BATCH_PATH) == {}
    assert admin_headers("s3cret", "GET", BATCH_PATH, signed=False) == {"Authorization": "Bearer s3cret"}


@pytest.mark.parametrize(
    "body",
    [b'{"max_num_active_seqs": 0}', b'{"max_num_active_seqs": -1}', b'{"max_num_active_seqs": "4"}',
     b'{"max_num_active_seqs": 33}', b'{"max_num_active_seqs": 4.0}', b'{"max_num_active_seqs": true}',
     b'{"max_num_active_seqs": null}', b"{}", b"[4]", b"4", b"abc", b"", b"\xff",
     b'{"max_num_active_seqs": 4, "x": 1}', b'{"max_num_active_seqs": 1e400}',
     b'{"max_num_active_seqs": 4}' + b" " * 5000, b"[" * 2000 + b"]" * 2000],  # nested past Python's recursion
)  # fmt: skip
def test_bad_bodies_are_400(body: bytes) -> None:
    assert status(parse_update, body, 32) == 400


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
    assert status(combine, []) == 503


@pytest.mark.parametrize(
    ("body", "changes"),
    [
        (b'{"max_num_queued_tokens": 4096}', {"max_num_queued_tokens": 4096}),
        (b'{"max_num_queued_reqs": null}', {"max_num_queued_reqs": None}),
        (
            b'{"max_num_queued_tokens": 1, "max_num_queued_reqs": 2}',
            {"max_num_queued_tokens": 1, "max_num_queued_reqs": 2},
        ),
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
        (b'{"max_num_seqs": 4}', "Extra inputs"),
        (b"[" * 2000, "not JSON"),
        (b'{"prefill_tokens_per_second": 0}', "above 0"),
        (b'{"prefill_tokens_per_second": NaN}', "above 0"),
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
