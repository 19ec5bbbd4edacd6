"""Who may call the admin API: a signed call (what batchlens sends) or a bearer token. Pure but for the clock.

batchlens signs each admin call with the engine's token instead of sending it (docs/vllm-plugin.md, "The
API"), so an address that is not the engine learns nothing it can reuse: docs/security.md, "Where a token
goes". The plugin and the simulator check with :class:`AdminAuth`; the hook, the controller, the exporter
and ``batchlens sweep`` sign with :func:`admin_headers`.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from batchlens.admin_api import API_PREFIX, TOKEN_ENV, AdminError

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
#: What a caller's 503 may mean: for its log line, after the server's own reason.
UNAVAILABLE_HINT = "a server without BATCHLENS_ADMIN_TOKEN answers 503, and one not yet started"
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


_REPLAY = "this signed request was already taken once (a replay)"


class AdminAuth:
    """The server's check of an admin call: a signature (each taken once) or a bearer token.

    ``pod``: the pod this server runs in (:func:`own_pod`); a signature for another pod is refused. None (a
    test's fake engine) takes any. The server remembers each signature it took until its time is past the
    skew, so a call that reached the wrong address and was passed on is refused. A restart forgets them; the API
    server processes of one vLLM server share them (``shared``). At most ``max_remembered`` at once: past that a
    call is refused (503) rather than one forgotten early (only a holder of the token can make one it remembers).
    """

    def __init__(
        self, token: str | None, *, pod: PodIdentity | None = None, max_remembered: int = 65536,
        shared: Callable[[str, int, float], str | None] | None = None,
    ):  # fmt: skip
        """``shared``: where the signatures taken are remembered when several processes serve one server (vLLM's
        API servers: vllm_plugin/siblings.py); it answers None (taken), "replay" or "full"."""
        self.token, self.pod = token or None, pod
        self._seen: OrderedDict[str, int] = OrderedDict()  # nonce -> when it may be forgotten, in arrival order
        self._max = max_remembered
        self._latest = -math.inf
        self._shared = shared

    def check(self, authorization: str | None, method: str, path: str, body: bytes = b"", *,
              now: float | None = None) -> None:  # fmt: skip
        """Raise the contract's 503 (no token configured) or 401 (missing, wrong, stale or replayed) for a change.

        A read (GET or HEAD) with no credential is taken: what it shows (the batch limit, the queue, the caps, the
        versions) vLLM's own unauthenticated /metrics and /version show too, and the exporter, which only reads,
        then needs no token at all (docs/security.md). A read that carries a credential has it checked.
        """
        if not authorization and method.upper() in ("GET", "HEAD"):
            return
        if not self.token:
            raise AdminError(
                503,
                f"the batchlens admin API takes no change: set {TOKEN_ENV} in the server's environment "
                "(a change to the batch limit is never open without a token)",
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
        if self._shared is not None:
            refused = self._shared(nonce, until, now)
            if refused == "replay":
                raise AdminError(401, _REPLAY)
            if refused is not None:
                raise AdminError(503, f"too many signed calls within {SIGNATURE_MAX_SKEW_SECONDS} s: try again later")
            return
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise AdminError(401, _REPLAY)
        if len(self._seen) >= self._max:  # arrival order is not expiry order (clocks differ): look at them all
            self._seen = OrderedDict((n, at) for n, at in self._seen.items() if at >= now)
            if len(self._seen) >= self._max:
                raise AdminError(503, f"over {self._max} signed calls within {SIGNATURE_MAX_SKEW_SECONDS} s: "
                                      "try again later")  # fmt: skip
        self._seen[nonce] = until  # then its time is refused anyway


def refuse_encoded(content_encoding: str | None) -> None:
    """415 for a compressed body, as every batchlens server answers one (http_server.refuse_encoded_bodies): here
    also because a signature covers the bytes as sent, which one server would see decompressed and another not."""
    if content_encoding and content_encoding.strip().lower() != "identity":
        raise AdminError(415, f"Content-Encoding {content_encoding[:64]!r} is not taken: send the body as it is")


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an Authorization header carries ``token`` as a bearer token (the scheme in any case).

    Compared in constant time, and never echoed or logged. A header that is not UTF-8 (aiohttp hands its bytes
    on as surrogates) is a wrong token, not an error.
    """
    scheme, _, given = (authorization or "").partition(" ")
    sent = given.strip().encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, token.encode())
