"""The batchlens admin API contract (docs/architecture.md, "Public names"). Pure: no HTTP, no vLLM.

The vLLM plugin and the simulator serve it; the exporter and the remediation
hook call it. Keeping the models, the checks and the status codes here means
every side validates the same shape and answers the same errors. Who may call it
is batchlens.admin_auth's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
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
# A cap is at most this: past it no engine queues anything, and a bigger integer (JSON has no bound) overflows the
# float arithmetic of the sheddable share on vLLM's serving path.
MAX_QUEUED_CAP = 2**31 - 1
#: The largest TTFT the per-request door takes (an hour: past it no request would ever be refused by it).
MAX_PREDICTED_TTFT_SECONDS = 3600.0


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
    #: The per-request door (docs/admission.md, "The per-request door"): a request whose predicted TTFT is past
    #: this many seconds is refused (reason ``predicted_ttft``). None: no such door.
    max_predicted_ttft_seconds: float | None = Field(None, gt=0)
    #: The prefill rate the per-request door has learned from this API server's own requests; None: too few yet.
    learned_prefill_tokens_per_second: float | None = Field(None, gt=0)
    #: The API server processes that share these caps and counts (``vllm serve --api-server-count``, by default
    #: the data-parallel size): the counts above are the whole server's, the caps hold in each.
    api_servers: int = Field(1, ge=1)
    #: The API servers, by index, that do not have these caps in force: a process that has not applied them
    #: yet, or does not tick at all (hung, or started without the plugin). Empty when every one applies them.
    api_servers_behind: list[int] = Field(default_factory=list)


class AdmissionUpdate(BaseModel):
    """Body of ``PUT /batchlens/v1/admission``: the caps to change (null: no cap), the others left as they are."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_num_queued_tokens: int | None = None
    max_num_queued_reqs: int | None = None
    prefill_tokens_per_second: float | None = None
    max_predicted_ttft_seconds: float | None = None


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


def _body(body: bytes, model: type[Model], expected: str) -> Model:
    if len(body) > MAX_BODY_BYTES:
        raise AdminError(400, f"body larger than {MAX_BODY_BYTES} bytes")
    try:
        return model.model_validate(json.loads(body))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: [[[[... nested past 1000
        if isinstance(exc, ValidationError):
            error = exc.errors()[0]
            field = ".".join(str(part) for part in error["loc"])  # which key: "Extra inputs" alone names none
            detail = f"{field}: {error['msg']}" if field else error["msg"]
        else:
            detail = "body is not JSON"
        raise AdminError(400, f"expected {expected}: {detail}") from None


def parse_update(body: bytes, max_num_seqs: int) -> int:
    """The new limit from a PUT body, or the contract's 400 saying what is wrong."""
    value = _body(body, BatchUpdate, '{"max_num_active_seqs": <integer>}').max_num_active_seqs
    if not 1 <= value <= max_num_seqs:
        raise AdminError(400, f"max_num_active_seqs must be in 1..{max_num_seqs} (max_num_seqs), got {value}")
    return value


def parse_admission(body: bytes) -> dict[str, int | float | None]:
    """The caps a PUT changes (field -> cap, None for no cap), or the contract's 400 saying what is wrong."""
    expected = (
        '{"max_num_queued_tokens": <integer or null>, "max_num_queued_reqs": <integer or null>, '
        '"prefill_tokens_per_second": <number or null, optional>, "max_predicted_ttft_seconds": <number or null>}'
    )
    update = _body(body, AdmissionUpdate, expected)
    changes = {name: getattr(update, name) for name in update.model_fields_set}
    for name, cap in changes.items():
        if name == "prefill_tokens_per_second":
            if cap is not None and not 0 < cap < float("inf"):
                raise AdminError(400, f"prefill_tokens_per_second must be above 0, or null, got {cap}")
        elif name == "max_predicted_ttft_seconds":
            if cap is not None and not 0 < cap <= MAX_PREDICTED_TTFT_SECONDS:
                raise AdminError(
                    400,
                    f"max_predicted_ttft_seconds must be above 0 and at most "
                    f"{MAX_PREDICTED_TTFT_SECONDS}, or null for no per-request door, got {cap}",
                )
        elif cap is not None and cap < 1:
            raise AdminError(400, f"{name} must be 1 or more, or null for no cap (0 would refuse every request)")
        elif cap is not None and cap > MAX_QUEUED_CAP:
            raise AdminError(400, f"{name} must be at most {MAX_QUEUED_CAP}, or null for no cap, got {cap}")
    if not changes.keys() - {"prefill_tokens_per_second"}:  # the rate alone changes no cap
        raise AdminError(400, f"expected {expected}: name at least one cap")
    return changes


_RUST_FRONTEND = (
    "vLLM's Rust frontend (VLLM_USE_RUST_FRONTEND=1) and its gRPC server load no Python plugins, so they have no "
    "batchlens admin API: start vllm serve without VLLM_USE_RUST_FRONTEND (and without --grpc-port) for batchlens "
    "to steer the server"
)
_NO_PLUGIN = (
    "set VLLM_PLUGINS=batchlens for the whole server, so that every API server process loads the plugin (before "
    "vLLM 0.32 also --middleware batchlens.vllm_plugin.middleware.AdminMiddleware); with BATCHLENS_ADMIN_PORT set "
    "the admin API is on that port alone (the engine's admin_port)"
)


def missing_plugin(body: bytes | None) -> str:
    """Why a server answered an admin route 404, from the 404's body (None: not read), and the setting to change.

    vLLM's Python API server answers a route it does not have in FastAPI's JSON (``{"detail": "Not Found"}``);
    its Rust frontend (0.32) with an empty body.
    """
    if body is None:
        return (
            f"no batchlens admin API: either vLLM's Python API server without the plugin ({_NO_PLUGIN}), or "
            f"{_RUST_FRONTEND}"
        )
    if not body.strip():
        return f"an empty 404, as vLLM's Rust frontend answers a route it does not have: {_RUST_FRONTEND}"
    return f"vLLM's Python API server, without the batchlens plugin: {_NO_PLUGIN}"


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
