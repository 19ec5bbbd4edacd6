"""The batchlens admin API contract (DESIGN.md, "Admin API"). Pure: no HTTP, no vLLM.

The vLLM plugin and the simulator serve it; the exporter and the remediation
hook call it. Keeping the models, the checks and the status codes here means
every side validates the same shape and answers the same errors.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

API_PREFIX = "/batchlens/v1/"
BATCH_PATH = API_PREFIX + "batch"
INFO_PATH = API_PREFIX + "info"
#: POST: empty the prefix cache (vLLM's own reset, behind the admin token instead of vLLM's dev mode).
CACHE_RESET_PATH = API_PREFIX + "reset_prefix_cache"
#: GET and PUT: the engine's admission caps, vLLM's queued-token and queued-request caps (docs/admission.md).
ADMISSION_PATH = API_PREFIX + "admission"
TOKEN_ENV = "BATCHLENS_ADMIN_TOKEN"
MAX_BODY_BYTES = 4096
# A refusal's Retry-After is at most this: a client told to come back in days never does, and a minute on the
# backlog and its drain rate have both moved.
RETRY_AFTER_MAX_SECONDS = 60


Model = TypeVar("Model", bound="BaseModel")


class EngineBatch(BaseModel):
    """One engine core's scheduler, as its batchlens utility method reports it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    engine: int = Field(ge=0, description="data-parallel rank")
    max_num_seqs: int = Field(ge=1)
    max_num_active_seqs: int = Field(ge=1)
    num_running: int = Field(ge=0)
    num_waiting: int = Field(ge=0)


class BatchState(BaseModel):
    """Reply of ``GET`` and ``PUT /batchlens/v1/batch``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    max_num_seqs: int = Field(ge=1, description="the engine's capacity (vLLM --max-num-seqs)")
    max_num_active_seqs: int = Field(ge=1, description="the admission limit in force (batchlens batch limit)")
    num_running: int = Field(ge=0)
    num_waiting: int = Field(ge=0)
    #: Each engine core behind the server (several with data parallelism).
    engines: tuple[EngineBatch, ...] = ()


class BatchUpdate(BaseModel):
    """Body of ``PUT /batchlens/v1/batch``. Strict: ``"4"``, ``4.0`` and ``true`` are not 4."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_num_active_seqs: int


class AdminInfo(BaseModel):
    """Reply of ``GET /batchlens/v1/info``: what the server runs and its fixed limits."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    vllm_version: str
    batchlens_version: str
    engines: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    block_size: int = Field(ge=1)
    num_gpu_blocks: int | None = Field(None, ge=0)
    #: How the plugin caps admission on this release (docs/compatibility.md); None from servers before it said.
    admission: str | None = None
    #: How the routes are served: vLLM's endpoint plugins, or the ``--middleware`` hook on older releases.
    api_route: str | None = None
    #: Whether ``/batchlens/v1/admission`` sets vLLM's own queued caps here; None from servers before it said.
    queued_caps: bool | None = None
    #: Who applies the admission caps: "vllm" (its own, 0.29 and later), "plugin" (the plugin's middleware, on
    #: older releases), or None (the route answers 501, or a server from before it said).
    door: str | None = None


class AdmissionState(BaseModel):
    """Reply of ``GET`` and ``PUT /batchlens/v1/admission``: the caps in force, and what they count now.

    A request that would pass a cap is refused at once with 503, before any work is done for it.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    #: Prompt tokens of the requests still in prefill at which a new request is refused; None: no cap. 0 (refuse
    #: every request) is vLLM's to allow at launch (``--max-num-queued-tokens 0``), never the PUT's.
    max_num_queued_tokens: int | None = Field(None, ge=0)
    #: Unfinished requests (waiting and running) at which a new request is refused; None: no cap.
    max_num_queued_reqs: int | None = Field(None, ge=0)
    num_queued_tokens: int = Field(ge=0)
    num_unfinished_reqs: int = Field(ge=0)
    #: The prefill rate the caps rest on, as the controller measured it: a refusal's Retry-After is the backlog
    #: divided by it. None: not given (Retry-After 1).
    prefill_tokens_per_second: float | None = Field(None, gt=0)


class AdmissionUpdate(BaseModel):
    """Body of ``PUT /batchlens/v1/admission``: the caps to change (null: no cap), the others left as they are."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_num_queued_tokens: int | None = None
    max_num_queued_reqs: int | None = None
    prefill_tokens_per_second: float | None = None


class CacheReset(BaseModel):
    """Reply of ``POST /batchlens/v1/reset_prefix_cache``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    #: False where vLLM declined: running requests still hold cached blocks (it resets only an idle cache).
    reset: bool


class AdminError(Exception):
    """A refused request: the HTTP status and a message that says what to do."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict[str, str]:
        return {"error": self.message}


#: The scheme of a signed request. batchlens signs each admin call with the token instead of sending it, so an
#: address that is not the engine (a deleted pod's IP, taken by a new pod within a discovery poll) learns
#: nothing it can reuse: the call names the pod it is for, and an engine takes each signature once.
SIGNED_SCHEME = "Batchlens-HMAC-SHA256"
#: How far a signature's time may be from the server's clock: the hook's and the engine's hosts may disagree by
#: this much (AWS's Signature Version 4 takes 5 minutes too). Within it, each signature is taken once.
SIGNATURE_MAX_SKEW_SECONDS = 300
#: The variables that name the plugin's pod and its namespace, from the downward API (``metadata.name``,
#: ``metadata.namespace``). Without them: the host name (Kubernetes sets it to the pod's name, cut to 63
#: characters, unless ``hostNetwork`` or ``spec.hostname``), and the service account's namespace file.
POD_NAME_ENV, POD_NAMESPACE_ENV = "BATCHLENS_POD_NAME", "BATCHLENS_POD_NAMESPACE"
_SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_HOST_NAME_MAX = 63  # kubelet cuts a pod's host name to this (and then trims a trailing "-" or ".")
# p: <namespace>/<pod name>, or a name alone (an engine of the config's); DNS-1123 names.
_NAME = r"[a-z0-9][a-z0-9.-]{0,252}"
_SIGNED = re.compile(
    rf"t=(?P<t>[0-9]{{1,12}}),n=(?P<n>[0-9a-f]{{16,64}})(?:,p=(?P<p>{_NAME}(?:/{_NAME})?))?,s=(?P<s>[0-9a-f]{{64}})"
)
#: What a caller's 401 may also mean, beside a token that differs: for its log line.
SIGNED_401_HINT = (
    f"Do the two hosts' clocks agree within {SIGNATURE_MAX_SKEW_SECONDS} s? Is the pod the plugin runs in the one "
    f"batchlens calls it by ({POD_NAME_ENV}, {POD_NAMESPACE_ENV})? A plugin from before signed calls wants "
    "admin_auth: bearer"
)
_AUTH_HELP = f"sign the request ({SIGNED_SCHEME}, as batchlens does) or send 'Authorization: Bearer <token>'"


def route_of(path: str) -> str:
    """The part of a URL path a signature covers: from the admin prefix on, so a proxy's path prefix is no part."""
    at = path.find(API_PREFIX)
    return path[at:] if at >= 0 else path


@dataclass(frozen=True)
class PodIdentity:
    """The pod a server runs in, as it judges the pod a signed call names."""

    name: str
    namespace: str | None = None  # None: not known here, so a call's namespace is not checked
    cut: bool = False  # the name is a host name: kubelet cut a longer pod name to it

    def names(self, signed: str) -> bool:
        """Whether ``signed`` (``<namespace>/<name>``, or a name alone) is this pod."""
        namespace, _, name = signed.rpartition("/")
        if namespace and self.namespace is not None and namespace != self.namespace:
            return False
        return name == self.name or (self.cut and len(name) > _HOST_NAME_MAX
                                     and name[:_HOST_NAME_MAX].rstrip("-.") == self.name)  # fmt: skip

    def __str__(self) -> str:
        return f"{self.namespace or '?'}/{self.name}"


def own_pod(environ: Mapping[str, str]) -> PodIdentity:
    """The pod this server runs in: from the downward API's variables, else the host name and the service
    account's namespace (docs/vllm-plugin.md)."""
    namespace = environ.get(POD_NAMESPACE_ENV)
    if not namespace:
        try:
            namespace = _SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or None
        except OSError:  # not in a pod, or no service account mounted
            namespace = None
    name = environ.get(POD_NAME_ENV)
    return PodIdentity(name or socket.gethostname(), namespace, cut=not name)


def _signature(token: str, method: str, route: str, stamp: str, nonce: str, pod: str, body: bytes) -> str:
    lines = ("batchlens-v1", method.upper(), route, stamp, nonce, pod, hashlib.sha256(body).hexdigest())
    return hmac.new(token.encode(), "\n".join(lines).encode(), hashlib.sha256).hexdigest()


def admin_headers(token: str | None, method: str, path: str, body: bytes = b"", *, signed: bool = True,
                  pod: str = "", now: float | None = None) -> dict[str, str]:  # fmt: skip
    """The Authorization header for one admin call; none when no token is configured.

    ``signed`` (the default): an HMAC of the method, the route, the time, a fresh nonce, the ``pod`` the call is
    for (a discovered engine's; none for an engine at an address of the config's) and the body as sent, keyed
    with the token, which never goes on the wire. Otherwise the token itself as a bearer token, for a plugin
    from before signatures (``admin_auth: bearer``).
    """
    if not token:
        return {}
    if not signed:
        return {"Authorization": f"Bearer {token}"}
    stamp, nonce = str(int(time.time() if now is None else now)), secrets.token_hex(16)
    signature = _signature(token, method, route_of(path), stamp, nonce, pod, body)
    named = f",p={pod}" if pod else ""
    return {"Authorization": f"{SIGNED_SCHEME} t={stamp},n={nonce}{named},s={signature}"}


class AdminAuth:
    """The server's check of an admin call: a signature (each taken once) or a bearer token.

    ``pod``: the pod this server runs in (:func:`own_pod`); a signature for another pod is refused. None (a
    test's fake engine) takes any. The server remembers each signature it took until its time is past the
    skew, so a call that reached the wrong address and was passed on is refused. A restart forgets them, and so
    does each API server process its own. At most ``max_remembered`` at once: past that a call is refused
    (503) rather than one forgotten early (only a holder of the token can make one it remembers).
    """

    def __init__(self, token: str | None, *, pod: PodIdentity | None = None, max_remembered: int = 65536):
        self.token, self.pod = token or None, pod
        self._seen: OrderedDict[str, int] = OrderedDict()  # nonce -> when it may be forgotten, in arrival order
        self._max = max_remembered
        self._latest = -math.inf

    def check(self, authorization: str | None, method: str, path: str, body: bytes = b"", *,
              now: float | None = None) -> None:  # fmt: skip
        """Raise the contract's 503 (no token configured) or 401 (missing, wrong, stale or replayed)."""
        if not self.token:
            raise AdminError(
                503,
                f"the batchlens admin API is disabled: set {TOKEN_ENV} in the server's environment "
                "(it changes the batch limit, so it is never open without a token)",
            )
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != SIGNED_SCHEME.lower():
            if not bearer_matches(authorization, self.token):
                raise AdminError(401, f"missing or wrong token: {_AUTH_HELP}")
            return
        # The latest time seen: a clock stepped back must not bring back a signature already forgotten.
        now = self._latest = max(self._latest, time.time() if now is None else now)
        parts = _SIGNED.fullmatch(given.strip())
        if parts is None:
            raise AdminError(401, f"a {SIGNED_SCHEME} header is 't=<unix seconds>,n=<hex nonce>[,p=<pod>],s=<hex "
                                  "HMAC>'")  # fmt: skip
        pod = parts["p"] or ""
        expected = _signature(self.token, method, route_of(path), parts["t"], parts["n"], pod, body)
        if not hmac.compare_digest(parts["s"], expected):
            raise AdminError(401, f"wrong signature: the token differs from the server's, or the request changed "
                                  f"on its way ({_AUTH_HELP})")  # fmt: skip
        if pod and self.pod is not None and not self.pod.names(pod):
            raise AdminError(401, f"signed for the pod {pod}, and this is {self.pod}: the address belongs to "
                                  f"another pod now, or this pod's {POD_NAME_ENV} and {POD_NAMESPACE_ENV} are "
                                  "not set from the downward API")  # fmt: skip
        skew = now - int(parts["t"])
        if abs(skew) > SIGNATURE_MAX_SKEW_SECONDS:
            side = "behind" if skew > 0 else "ahead of"
            raise AdminError(401, f"the signature's time is {abs(skew):.0f} s {side} this server's clock (at most "
                                  f"{SIGNATURE_MAX_SKEW_SECONDS} s): check both hosts' clocks (NTP)")  # fmt: skip
        self._remember(parts["n"], int(parts["t"]) + SIGNATURE_MAX_SKEW_SECONDS, now)

    def _remember(self, nonce: str, until: int, now: float) -> None:
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise AdminError(401, "this signed request was already taken once (a replay)")
        if len(self._seen) >= self._max:  # arrival order is not expiry order (clocks differ): look at them all
            self._seen = OrderedDict((n, at) for n, at in self._seen.items() if at >= now)
            if len(self._seen) >= self._max:
                raise AdminError(503, f"over {self._max} signed calls within {SIGNATURE_MAX_SKEW_SECONDS} s: "
                                      "try again later")  # fmt: skip
        self._seen[nonce] = until  # then its time is refused anyway


def refuse_encoded(content_encoding: str | None) -> None:
    """The contract's 400 for a compressed body: a signature covers the bytes as sent, which one server would
    see decompressed and another not."""
    if content_encoding and content_encoding.strip().lower() != "identity":
        raise AdminError(400, f"Content-Encoding {content_encoding!r} is not taken: send the body as it is")


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an Authorization header carries ``token`` as a bearer token (the scheme in any case).

    Compared in constant time, and never echoed or logged. A header that is not UTF-8 (aiohttp hands its bytes
    on as surrogates) is a wrong token, not an error.
    """
    scheme, _, given = (authorization or "").partition(" ")
    sent = given.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, token.encode())


def _body(body: bytes, model: type[Model], expected: str) -> Model:
    if len(body) > MAX_BODY_BYTES:
        raise AdminError(400, f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        return model.model_validate(json.loads(body))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: [[[[... nested past 1000
        detail = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "body is not JSON"
        raise AdminError(400, f"expected {expected}: {detail}") from None


def parse_update(body: bytes, max_num_seqs: int) -> int:
    """The new limit from a PUT body, or the contract's 400 saying what is wrong."""
    value = _body(body, BatchUpdate, '{"max_num_active_seqs": <integer>}').max_num_active_seqs
    if not 1 <= value <= max_num_seqs:
        raise AdminError(400, f"max_num_active_seqs must be in 1..{max_num_seqs} (max_num_seqs), got {value}")
    return value


def parse_admission(body: bytes) -> dict[str, int | None]:
    """The caps a PUT changes (field -> cap, None for no cap), or the contract's 400 saying what is wrong."""
    expected = '{"max_num_queued_tokens": <integer or null>, "max_num_queued_reqs": <integer or null>}'
    update = _body(body, AdmissionUpdate, expected)
    changes = {name: getattr(update, name) for name in update.model_fields_set}
    if not changes:
        raise AdminError(400, f"expected {expected}: name at least one cap")
    for name, cap in changes.items():
        if name == "prefill_tokens_per_second":
            if cap is not None and not 0 < cap < float("inf"):
                raise AdminError(400, f"prefill_tokens_per_second must be above 0, or null, got {cap}")
        elif cap is not None and cap < 1:
            raise AdminError(400, f"{name} must be 1 or more, or null for no cap (0 would refuse every request)")
    return changes


def retry_after(state: AdmissionState) -> int:
    """A refusal's Retry-After: whole seconds for the backlog to drain at the measured prefill rate, at least 1
    and at most RETRY_AFTER_MAX_SECONDS (a rate of 1e-300 tokens/s would make it infinite)."""
    rate = state.prefill_tokens_per_second
    drain = state.num_queued_tokens / rate if rate else 1.0
    return min(RETRY_AFTER_MAX_SECONDS, max(1, math.ceil(drain))) if math.isfinite(drain) else RETRY_AFTER_MAX_SECONDS


def combine(engines: Sequence[Mapping[str, int]]) -> BatchState:
    """One reply for the whole server from each engine core's state.

    Requests are counted over every engine; the limit is the tightest one in
    force (after a PUT all engines have the same).
    """
    parsed = tuple(EngineBatch.model_validate(e) for e in engines)
    if not parsed:
        raise AdminError(503, "the server reports no engine cores")
    return BatchState(
        max_num_seqs=min(e.max_num_seqs for e in parsed),
        max_num_active_seqs=min(e.max_num_active_seqs for e in parsed),
        num_running=sum(e.num_running for e in parsed),
        num_waiting=sum(e.num_waiting for e in parsed),
        engines=parsed,
    )
