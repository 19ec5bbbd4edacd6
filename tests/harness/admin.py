"""The admin API contract (docs/architecture.md, "Public names"), as checks any server can be put through.

The vLLM plugin and the simulator both serve this API; their tests call the
same functions here, over real HTTP, so that the two cannot drift apart.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from batchlens.admin_api import ADMISSION_PATH, BATCH_PATH, CACHE_RESET_PATH, INFO_PATH, AdminError, BatchState
from batchlens.admin_auth import SIGNED_SCHEME, AdminAuth, PodIdentity, admin_headers


def refused_with(fn, *args) -> int:
    """The status of the AdminError that ``fn(*args)`` raises (it must raise one)."""
    with pytest.raises(AdminError) as raised:
        fn(*args)
    return raised.value.status


def accepted(
    token: str, authorization: str, method: str, path: str, body: bytes = b"", pod: PodIdentity | None = None
) -> bool:
    """Whether the engine's side takes ``authorization`` for this call with ``token``: signed (for ``pod``, where
    the fake engine has one), or the bearer token."""
    try:
        AdminAuth(token, pod=pod).check(authorization, method, path, body)
    except AdminError:
        return False
    return True


def signed_with(token: str, authorization: str, method: str, path: str, body: bytes = b"") -> bool:
    """Whether ``authorization`` is a valid signature of this call by ``token``, the token itself not sent."""
    return authorization.startswith(SIGNED_SCHEME) and accepted(token, authorization, method, path, body)


@dataclass
class AdminClient:
    url: str  # the server's base URL
    token: str | None

    def request(
        self, method: str, path: str = BATCH_PATH, body: bytes | None = None, token: str | None = "default",
        auth: dict[str, str] | None = None,
    ) -> tuple[int, dict]:  # fmt: skip
        """One call, signed with ``token`` (the client's own by default) as batchlens signs, or with ``auth``."""
        if auth is None:
            auth = admin_headers(self.token if token == "default" else token, method, path, body or b"")
        headers = {"Content-Type": "application/json", **auth}
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def state(self) -> BatchState:
        status, body = self.request("GET")
        assert status == 200, f"GET {BATCH_PATH} answered {status}: {body}"
        return BatchState.model_validate(body)

    def put(self, limit: object, token: str | None = "default") -> tuple[int, dict]:
        return self.request("PUT", body=json.dumps({"max_num_active_seqs": limit}).encode(), token=token)

    def set_limit(self, limit: int) -> BatchState:
        status, body = self.put(limit)
        assert status == 200, f"PUT {limit} answered {status}: {body}"
        return BatchState.model_validate(body)


def check_contract(admin: AdminClient, max_num_seqs: int) -> None:
    """Auth, validation and a change that reads back; the limit ends where it began."""
    before = admin.state()
    assert before.max_num_seqs == max_num_seqs
    assert before.engines and all(e.max_num_seqs == max_num_seqs for e in before.engines)

    for token in (None, "wrong-token"):
        status, reply = admin.request("PUT", body=b'{"max_num_active_seqs": 2}', token=token)
        assert status == 401 and "token" in reply["error"], (token, status, reply)
        assert admin.request("POST", CACHE_RESET_PATH, token=token)[0] == 401  # never vLLM's open dev-mode route
    # A read needs no credential (the exporter holds none on Kubernetes); one that carries a wrong one is refused.
    assert admin.request("GET", token=None) == (200, before.model_dump(mode="json"))
    assert admin.request("GET", INFO_PATH, token=None)[0] == 200
    assert (
        admin.request("GET", token="wrong-token")[0] == admin.request("GET", INFO_PATH, token="wrong-token")[0] == 401
    )

    check_signatures(admin)

    bad = [0, -1, "abc", max_num_seqs + 1, 2.0, True, None, [2]]
    bodies = [json.dumps({"max_num_active_seqs": v}).encode() for v in bad]
    bodies += [b"{}", b"not json", b"", b'{"max_num_active_seqs": 2, "extra": 1}', b"\xff\xfe", b"[2]"]
    for body in bodies:
        status, reply = admin.request("PUT", body=body)
        assert status == 400 and reply.get("error"), (body, status, reply)
        assert admin.state().max_num_active_seqs == before.max_num_active_seqs, f"{body!r} changed the limit"

    changed = admin.set_limit(2)
    assert changed.max_num_active_seqs == 2 and all(e.max_num_active_seqs == 2 for e in changed.engines)
    assert admin.state().max_num_active_seqs == 2
    status, info = admin.request("GET", INFO_PATH)
    assert status == 200 and info["max_num_seqs"] == max_num_seqs and info["engines"] == len(before.engines)
    assert admin.set_limit(before.max_num_active_seqs).max_num_active_seqs == before.max_num_active_seqs
    status, reset = admin.request("POST", CACHE_RESET_PATH)
    assert status == 200 and reset == {"reset": True}, (status, reset)  # idle: nothing holds a cached block


def check_signatures(admin: AdminClient) -> None:
    """A signed call is taken once, for the method, route, pod and body it was signed for, near the server's time;
    a bearer token still serves (a person with curl, a hook from before signed calls). The limit ends as it began.
    The server runs on this host, outside any pod: its pod is this host's name."""
    limit = admin.state().max_num_active_seqs
    put = json.dumps({"max_num_active_seqs": 2}).encode()
    signed = admin_headers(admin.token, "PUT", BATCH_PATH, put, pod=socket.gethostname())
    stale = admin_headers(admin.token, "PUT", BATCH_PATH, put, now=time.time() - 600)
    fresh = admin_headers(admin.token, "PUT", BATCH_PATH, put)["Authorization"]
    renamed = re.sub(r"n=[0-9a-f]+", "n=" + "ab" * 16, fresh)  # a captured signature given a nonce of its own
    later = re.sub(r"t=([0-9]+)", lambda m: f"t={int(m[1]) + 60}", fresh)  # or a time of its own
    refused = {
        "another body": ("PUT", BATCH_PATH, b'{"max_num_active_seqs": 3}', signed),
        "a GET's signature": ("PUT", BATCH_PATH, put, admin_headers(admin.token, "GET", BATCH_PATH)),
        "another route's": ("GET", INFO_PATH, None, admin_headers(admin.token, "GET", BATCH_PATH)),
        "another token's": ("PUT", BATCH_PATH, put, admin_headers("wrong-token", "PUT", BATCH_PATH, put)),
        "ten minutes old": ("PUT", BATCH_PATH, put, stale),
        "another nonce": ("PUT", BATCH_PATH, put, {"Authorization": renamed}),
        "another time": ("PUT", BATCH_PATH, put, {"Authorization": later}),
        "another pod's": ("PUT", BATCH_PATH, put, admin_headers(admin.token, "PUT", BATCH_PATH, put, pod="vllm-x")),
        "not the scheme's shape": ("GET", BATCH_PATH, None, {"Authorization": f"{SIGNED_SCHEME} t=1,n=zz,s=00"}),
    }
    for why, (method, path, body, auth) in refused.items():
        status, reply = admin.request(method, path, body, auth=auth)
        assert status == 401 and reply.get("error"), (why, status, reply)
    status, reply = admin.request("PUT", BATCH_PATH, put, auth={**signed, "Content-Encoding": "gzip"})
    assert status == 415 and "Content-Encoding" in reply["error"], (status, reply)  # the bytes signed are as sent
    assert admin.state().max_num_active_seqs == limit, "a refused signature changed the limit"
    assert admin.request("PUT", BATCH_PATH, put, auth=signed)[0] == 200
    status, reply = admin.request("PUT", BATCH_PATH, put, auth=signed)
    assert status == 401 and "replay" in reply["error"], (status, reply)
    assert admin.request("GET", auth={"Authorization": f"Bearer {admin.token}"})[0] == 200
    assert admin.set_limit(limit).max_num_active_seqs == limit


def set_caps(admin: AdminClient, **caps: int | None) -> dict:
    status, reply = admin.request("PUT", ADMISSION_PATH, json.dumps(caps).encode())
    assert status == 200, f"PUT {ADMISSION_PATH} {caps} answered {status}: {reply}"
    return reply


def check_admission_contract(admin: AdminClient, door: str = "vllm") -> None:
    """The queued caps: auth, validation that changes nothing, a change that reads back; no cap at the end.

    ``door``: who applies them, vLLM's own caps or, on a release without them, the plugin's door.
    """
    status, before = admin.request("GET", ADMISSION_PATH)
    assert status == 200 and before["max_num_queued_tokens"] is None and before["max_num_queued_reqs"] is None, before
    assert before["num_queued_tokens"] >= 0 and before["num_unfinished_reqs"] >= 0
    assert admin.request("GET", ADMISSION_PATH, token=None)[0] == 200 and admin.request(
        "GET", ADMISSION_PATH, token="wrong-token")[0] == 401  # fmt: skip
    for token in (None, "wrong-token"):
        assert admin.request("PUT", ADMISSION_PATH, b'{"max_num_queued_reqs": 1}', token=token)[0] == 401
    bad = [b'{"max_num_queued_reqs": 0}', b'{"max_num_queued_tokens": -1}', b'{"max_num_queued_tokens": 2.5}',
           b'{"max_num_queued_reqs": "4"}', b'{"max_num_queued_reqs": true}', b"{}", b'{"max_num_seqs": 4}',
           b"not json", b"[[" * 2000, b'{"prefill_tokens_per_second": 0}', b'{"prefill_tokens_per_second": 9.0}',
           b'{"max_num_queued_tokens": 1' + b"0" * 400 + b"}", b'{"max_predicted_ttft_seconds": 0}',
           b'{"max_predicted_ttft_seconds": 3601}', b'{"max_predicted_ttft_seconds": "2"}']  # fmt: skip
    for body in bad:
        status, reply = admin.request("PUT", ADMISSION_PATH, body)
        assert status == 400 and reply.get("error"), (body[:40], status, reply)
    assert admin.request("GET", ADMISSION_PATH)[1]["max_num_queued_reqs"] is None, "a refused PUT changed a cap"
    assert set_caps(admin, max_num_queued_tokens=4096)["max_num_queued_tokens"] == 4096
    both = set_caps(admin, max_num_queued_reqs=64)  # the other cap stays as it was
    assert (both["max_num_queued_tokens"], both["max_num_queued_reqs"]) == (4096, 64)
    rated = set_caps(admin, max_num_queued_tokens=4096, prefill_tokens_per_second=2500)  # for Retry-After
    assert rated["prefill_tokens_per_second"] == 2500
    predicting = set_caps(admin, max_predicted_ttft_seconds=2.5)  # the per-request door, beside the caps
    assert (predicting["max_predicted_ttft_seconds"], predicting["max_num_queued_tokens"]) == (2.5, 4096), predicting
    assert set_caps(admin, max_predicted_ttft_seconds=None)["max_predicted_ttft_seconds"] is None
    cleared = set_caps(admin, max_num_queued_tokens=None, max_num_queued_reqs=None, prefill_tokens_per_second=None)
    assert (cleared["max_num_queued_tokens"], cleared["max_num_queued_reqs"]) == (None, None)
    info = admin.request("GET", INFO_PATH)[1]
    assert (info["door"], info["queued_caps"]) == (door, door == "vllm"), info


def check_disabled_without_token(admin: AdminClient) -> None:
    """No token configured: every change, and every read that carries a credential, answers 503 and says why; a
    read with none is answered."""
    for token in (None, "any-token"):
        for method, path, body in (
            ("GET", BATCH_PATH, None),
            ("PUT", BATCH_PATH, b'{"max_num_active_seqs": 1}'),
            ("GET", INFO_PATH, None),
            ("POST", CACHE_RESET_PATH, None),
            ("GET", ADMISSION_PATH, None),
            ("PUT", ADMISSION_PATH, b'{"max_num_queued_reqs": 1}'),
        ):
            status, reply = admin.request(method, path, body, token=token)
            if method == "GET" and token is None:
                assert status == 200, (method, path, status, reply)
            else:
                assert status == 503 and "BATCHLENS_ADMIN_TOKEN" in reply["error"], (method, path, status, reply)


def check_concurrent_puts(
    admin: AdminClient, max_num_seqs: int, puts: int = 50, values: Sequence[int] | None = None
) -> BatchState:
    """``puts`` PUTs at once: each succeeds, and one consistent state remains, equal to one of them."""
    values = list(values or range(1, max_num_seqs + 1))
    wanted = [values[(i * 7) % len(values)] for i in range(puts)]
    with ThreadPoolExecutor(puts) as pool:
        replies = list(pool.map(admin.put, wanted))
    assert [status for status, _ in replies] == [200] * puts, replies[:3]
    final = admin.state()
    assert final.max_num_active_seqs in wanted
    assert {e.max_num_active_seqs for e in final.engines} == {final.max_num_active_seqs}, final
    return final
