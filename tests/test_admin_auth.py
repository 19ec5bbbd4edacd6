"""Who may call the admin API (batchlens.admin_auth): bearer tokens, signatures, the pod a call names. No I/O."""

from __future__ import annotations

import re
import socket

import pytest

from batchlens.admin_api import ADMISSION_PATH, BATCH_PATH, AdminError
from batchlens.admin_auth import (
    POD_NAME_ENV,
    POD_NAMESPACE_ENV,
    SIGNATURE_MAX_SKEW_SECONDS,
    SIGNED_SCHEME,
    AdminAuth,
    PodIdentity,
    admin_headers,
    own_pod,
    refuse_encoded,
)
from harness.admin import refused_with


def check(auth: AdminAuth, header, method: str = "GET", path: str = BATCH_PATH, body: bytes = b"", now=None) -> None:
    auth.check(header, method, path, body, now=now)


def test_no_token_configured_is_503_for_a_change_or_a_credential_whatever_the_request_says() -> None:
    assert refused_with(check, AdminAuth(None), "Bearer anything") == 503
    assert refused_with(check, AdminAuth(""), None, "PUT") == 503
    assert refused_with(check, AdminAuth(None), admin_headers("x", "GET", BATCH_PATH)["Authorization"]) == 503


def test_a_read_with_no_credential_is_taken_and_a_change_with_none_never_is() -> None:
    for auth in (AdminAuth("s3cret"), AdminAuth(None)):
        check(auth, None, "GET"), check(auth, "", "HEAD")
        for method in ("PUT", "POST", "DELETE", "PATCH"):
            assert refused_with(check, auth, None, method) in (401, 503)


# "\udcff": the surrogate aiohttp hands on for a header byte that is not UTF-8 (it answered 500, with a traceback)
@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer wrong", "Basic s3cret", "s3cret", "Bearer s3cret2", "Bearer \udcff",
     f"{SIGNED_SCHEME}", f"{SIGNED_SCHEME} t=\udcff,n=00,s=00", f"{SIGNED_SCHEME} t=1,n={'0' * 32},s={'0' * 64}",
     f"{SIGNED_SCHEME} s3cret"],
)  # fmt: skip
def test_a_missing_or_wrong_token_is_401(header) -> None:
    assert refused_with(check, AdminAuth("s3cret"), header, "PUT") == 401
    if header:  # a read that carries a credential has it checked
        assert refused_with(check, AdminAuth("s3cret"), header) == 401


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
        assert refused_with(check, AdminAuth("s3cret"), header, method, path, sent, 1000) == 401
    assert refused_with(check, AdminAuth("other"), header, "PUT", BATCH_PATH, body, 1000) == 401


def test_a_signature_is_taken_once_within_the_skew_and_never_outside_it() -> None:
    auth, header = AdminAuth("s3cret"), admin_headers("s3cret", "GET", BATCH_PATH, now=1000)["Authorization"]
    ahead = 1000 - SIGNATURE_MAX_SKEW_SECONDS - 1  # the server's clock behind the signer's by more than the skew
    assert refused_with(check, auth, header, "GET", BATCH_PATH, b"", ahead) == 401
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
    assert refused_with(refuse_encoded, "gzip") == 415


def test_errors_never_echo_the_token() -> None:
    for header in ("Bearer guess", admin_headers("guess", "GET", BATCH_PATH)["Authorization"]):
        with pytest.raises(AdminError) as raised:
            check(AdminAuth("s3cret"), header)
        assert "s3cret" not in raised.value.message and "guess" not in raised.value.message


def test_a_bearer_header_is_sent_only_where_asked() -> None:
    assert admin_headers(None, "GET", BATCH_PATH) == {}
    assert admin_headers("s3cret", "GET", BATCH_PATH, signed=False) == {"Authorization": "Bearer s3cret"}
