"""Settings and thresholds: the one source of truth for every batchlens component.

Values are layered, later layers winning:

1. the defaults below (the article's thresholds, loopback listeners);
2. the YAML file given with ``--config`` (or env ``BATCHLENS_CONFIG``);
3. environment variables ``BATCHLENS_<SECTION>__<KEY>``, for example
   ``BATCHLENS_EXPORTER__INTERVAL_SECONDS=2``, and ``BATCHLENS_ENGINES`` holding a
   YAML/JSON list of engines;
4. command-line flags.

The file names the environment variables that hold tokens; it never holds a token.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Mapping, Sequence
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from batchlens.masking import mask_url

ENV_PREFIX = "BATCHLENS_"
_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_seconds(text: str) -> float:
    """A Prometheus duration ("90s", "1h30m", "24h") in seconds; ValueError for anything else."""
    if not _DURATION.match(text):
        raise ValueError(f"expected a Prometheus duration such as 30s, 1m or 1h30m, got {text!r}")
    return sum(int(n) * _UNIT_SECONDS[unit] for n, unit in re.findall(r"([0-9]+)(ms|s|m|h|d|w|y)", text))


class ConfigError(Exception):
    """The configuration is invalid. The message names each bad key and what it expects."""


class _Section(BaseModel):
    # No setting takes infinity or NaN: an infinite TTFT makes an infinite cap (int() overflows each tick), and an
    # infinite stale_seconds a door that never fails open. Strict: a value is taken as the type it is written
    # in (a 1 is no switch, a true no limit of 1), except that a whole number serves where a float is asked.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6) as a (host, port) pair."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {value!r}")
    return host.strip("[]"), int(port)


def _check_listen(value: str) -> str:
    parse_listen(value)
    return value


Listen = Annotated[str, AfterValidator(_check_listen)]


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML parse error in one line: where, and what."""
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return where + " ".join(str(getattr(exc, "problem", None) or exc).split())


def http_url(value: str, example: str = "http://127.0.0.1:8000") -> str:
    """A base URL, checked: http or https, a host, a valid port; returned without a trailing slash."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL such as {example}, got {value!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bad port in {value!r}: {exc}") from None
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


#: How a URL setting shows in the config's schema: every output masks these (:func:`masked_dump`, :func:`mask_url`).
URL_FORMAT = "uri"


def url_setting(example: str, *, optional: bool = True) -> Any:
    """The type of a URL setting: checked by :func:`http_url`, and marked in the schema (``format: uri``) so that
    every output finds it and masks its password. ``optional``: empty means "none"."""

    def check(value: str) -> str:
        return "" if optional and not value.strip() else http_url(value, example)

    return Annotated[str, AfterValidator(check), Field(json_schema_extra={"format": URL_FORMAT})]


#: The article's stage 2 (docs/routing.md): the bulk of the traffic, latency-sensitive requests, prompts over
#: the long bound, and arrivals after a quiet spell. One engine may serve several roles.
ROLES = ("main", "interactive", "long", "cold")
Role = Literal["main", "interactive", "long", "cold"]


def _roles(value: Any) -> Any:
    """``role: main`` or ``role: [main, cold]``: a role or a list of them, as a tuple without repeats."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list | tuple) and not value:
        raise ValueError("give at least one role: " + ", ".join(ROLES))
    return tuple(dict.fromkeys(value)) if isinstance(value, list | tuple) else value


AdminAuthMode = Literal["signed", "bearer"]
ADMIN_AUTH_HELP = (
    "how admin calls prove the token: signed (an HMAC per call; the token never goes on the wire) or bearer (the "
    "token itself, for a plugin from before signed calls: upgrade the engines first, then go back to signed)"
)


class Engine(_Section):
    """One vLLM server (an API server, which may front several engine cores)."""

    name: str = Field("", description="the vllm_instance label; defaults to host:port of the url")
    url: url_setting("http://127.0.0.1:8000", optional=False) = Field(
        description="vLLM base URL; /metrics and /batchlens/v1/* live under it"
    )
    admin_port: int | None = Field(
        None, ge=1, le=65535,
        description="the admin API's own port on the url's host (vLLM with BATCHLENS_ADMIN_PORT); default: the url's",
    )  # fmt: skip
    admin_token_env: str = "BATCHLENS_ADMIN_TOKEN"
    admin_auth: AdminAuthMode = Field("signed", description=ADMIN_AUTH_HELP)
    pod: str = Field(
        "", pattern=r"^(([a-z0-9][a-z0-9.-]{0,252}/)?[a-z0-9][a-z0-9.-]{0,252})?$",
        description="the engine's pod, <namespace>/<name> (discovery sets it): a signed admin call names it, and a "
        "plugin in another pod refuses the call",
    )  # fmt: skip
    gpus: list[int | str] = Field(default_factory=list, description="static GPU mapping (indexes or UUIDs)")
    simulated_gpu: bool = Field(
        False, description="a `batchlens simulate` server: read its simulated GPU from /batchlens/v1/sim/gpu"
    )
    labels: dict[str, str] = Field(
        default_factory=dict, description="more labels on the engine's series (discovery: namespace and pod)"
    )
    role: Annotated[tuple[Role, ...], BeforeValidator(_roles)] = Field(
        ("main",), description="what the router sends it: main, interactive, long or cold, or a list"
    )
    max_model_len: int | None = Field(
        None, ge=1, description="vLLM's --max-model-len: the router's context-window check sends no longer prompt"
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vLLM's --scheduling-policy; priority: the router gives each request its role's priority"
    )
    deployment: str = Field(
        "", pattern=r"^([A-Za-z0-9][A-Za-z0-9._/:-]{0,252})?$",
        description="the data-parallel deployment this server is one rank or one node of (vLLM's external "
        "balancer: one `vllm serve --data-parallel-rank R` per rank; hybrid: one per node): the servers of one "
        "deployment are one engine, named after it, whose series, alerts and decisions are the deployment's",
    )  # fmt: skip
    # A discovered engine's token, read from the Secret its own pod holds (discovery/kubernetes.py). Never a
    # field: a config file names where a token lives and never holds one, and repr and dumps leave it out.
    _admin_token: str | None = PrivateAttr(None)
    _admin_token_from: str = PrivateAttr("")

    @property
    def instance(self) -> str:
        """The ``vllm_instance`` its series, alerts and decisions carry: its deployment's, or its own name."""
        return self.deployment or self.name

    @property
    def series_labels(self) -> dict[str, str]:
        """The labels that say which engine a series is of: ``vllm_instance``, and in a deployment of several
        servers ``server`` (this one's name), so that two servers' series of one instance stay apart."""
        return {"vllm_instance": self.instance, **({"server": self.name} if self.deployment else {})}

    def with_admin_token(self, token: str | None, source: str) -> Engine:
        """This engine with its token from ``source`` (what a log or a hint calls it), not from the environment."""
        engine = self.model_copy()
        engine._admin_token, engine._admin_token_from = token, source
        return engine

    @property
    def admin_token_from_environment(self) -> bool:
        """Whether the token comes from the variable admin_token_env, not from discovery."""
        return not self._admin_token_from

    def admin_token(self, environ: Mapping[str, str]) -> str | None:
        """The token this engine's admin API takes: its own (discovered), else the variable admin_token_env."""
        if not self.admin_token_from_environment:
            return self._admin_token
        return environ.get(self.admin_token_env) or None

    @property
    def admin_token_source(self) -> str:
        """Where the token comes from, in words for a hint: never the token."""
        return self._admin_token_from or f"the variable {self.admin_token_env}"

    @model_validator(mode="after")
    def _default_name(self) -> Engine:
        if not self.name:
            object.__setattr__(self, "name", self.host_port)
        return self

    @property
    def host_port(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{self.port}"

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def admin_url(self) -> str:
        """Where /batchlens/v1/* lives: the url, or its host on admin_port. Never another host, so the token
        goes only to the address that is this engine."""
        if self.admin_port is None:
            return self.url
        parts = urlsplit(self.url)
        host = parts.netloc.rpartition(":")[0] if parts.port else parts.netloc  # user info and brackets kept
        return urlunsplit((parts.scheme, f"{host}:{self.admin_port}", parts.path, "", ""))

    @property
    def is_local(self) -> bool:
        """Whether the URL points at this host, so its server process can be inspected."""
        host = urlsplit(self.url).hostname or ""
        if host == "localhost":
            return True
        try:
            return ip_address(host).is_loopback
        except ValueError:
            return False


class Exporter(_Section):
    listen: Listen = "127.0.0.1:9400"
    interval_seconds: float = Field(5.0, gt=0, le=3600)
    timeout_seconds: float = Field(3.0, gt=0, le=600, description="per engine, per request")
    max_response_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="larger /metrics bodies are refused")
    nvml: bool = Field(True, description="read GPUs through NVML; off on a host known to have none (the demo)")
    pod_resources_socket: str = Field(
        "", description="the kubelet's pod-resources socket, for GPU-to-pod labels on Kubernetes; empty: not asked"
    )
    headless_engine: str = Field(
        "", description="on a `vllm serve --headless` node (engine cores, no API server): the engine they serve, "
        "named as the head's exporter names it; this node's vLLM GPU processes are mapped to it and each GPU to "
        "its DP rank, by the processes' titles",
    )  # fmt: skip
    sysfs_path: str = Field(
        "/sys", description="the host's sysfs, where the PCI bus tells a GPU node whose driver is gone from a CPU "
        "node (batchlens_pci_nvidia_gpus); a container sees the host's bus at /sys",
    )  # fmt: skip


class Thresholds(_Section):
    bandwidth_ratio: float = Field(0.70, gt=0, le=1)
    bandwidth_for: str = "5m"
    kv_blocks_ratio: float = Field(0.80, gt=0, le=1)
    kv_blocks_for: str = "2m"
    p99_seconds: float = Field(0.5, gt=0)
    p99_window: str = "1m"
    p99_latency: Literal["ttft", "e2e", "itl"] = "ttft"

    @field_validator("bandwidth_for", "kv_blocks_for", "p99_window")
    @classmethod
    def _duration(cls, value: str) -> str:
        duration_seconds(value)
        return value


class Breaker(_Section):
    strikes: int = Field(3, ge=1)
    cooldown_seconds: float = Field(60, ge=0)
    cold_start_limit: int = Field(1, ge=1)
    recovery_interval_seconds: float = Field(300, gt=0)
    #: A queue this many batches long means missing capacity: the breaker holds instead of halving.
    overload_queue_ratio: float = Field(4.0, gt=0)
    #: On VllmKvCacheBlocksHigh, empty the engine's prefix cache once per cooldown, through the plugin's
    #: POST /batchlens/v1/reset_prefix_cache with the engine's admin token (never vLLM's dev-mode route).
    reset_prefix_cache: bool = False
    dry_run: bool = False
    #: Alertmanager sends a firing alert again every repeat_interval (2 m on the provisioned breaker route). An
    #: open breaker that hears nothing this long takes its episode for over: a lost resolution (the hook down
    #: when it came), or a firing that nobody will resolve, would otherwise hold the limit down for good.
    firing_silence_seconds: float = Field(
        1800, gt=0, description="an open breaker with no firing delivery this long recovers; keep it well above "
        "the breaker route's repeat_interval"
    )  # fmt: skip


class Remediate(_Section):
    listen: Listen = "127.0.0.1:9401"
    webhook_token_env: str = "BATCHLENS_WEBHOOK_TOKEN"
    state_path: str = "batchlens-state.sqlite"
    alertmanager_url: url_setting("http://127.0.0.1:9093") = Field(
        "", description="Alertmanager to page through (API v2); empty: log pages only"
    )
    prometheus_url: url_setting("http://127.0.0.1:9090") = Field(
        "", description="the Prometheus that evaluates the breaker: an alert it does not show firing moves nothing "
        "(docs/security.md, 'What the hook trusts'); empty: alerts are acted on as delivered, with a warning",
    )  # fmt: skip
    cluster: str = Field("", description="act only on alerts whose cluster label is this; empty: on every alert")
    store_max_bytes: int = Field(
        256 * 2**20, ge=4 * 2**20, description="the state store's byte budget (database, its journal and the action "
        "log): past it the oldest decided deliveries go, and a delivery that still does not fit gets a 503",
    )  # fmt: skip


class Slo(_Section):
    """The service-level objective goodput counts against (vLLM's `bench serve --goodput`)."""

    ttft_seconds: float | None = Field(None, gt=0, description="time to first token; default: thresholds.p99_seconds")
    tpot_seconds: float = Field(0.1, gt=0, description="time per output token after the first")


class Control(_Section):
    """The adaptive batch controller, run inside `batchlens remediate` (docs/control.md)."""

    enabled: bool = False
    interval_seconds: float = Field(2.0, gt=0, le=300, description="how often each engine is read and decided")
    timeout_seconds: float = Field(2.0, gt=0, le=60, description="per read of an engine's /metrics or admin API")
    min_limit: int = Field(1, ge=1)
    max_limit: int | None = Field(None, ge=1, description="default: the engine's capacity; never above it")
    start_limit: int | None = Field(None, ge=1, description="where control starts; default: the limit in force")
    max_step: float = Field(0.5, gt=0, le=1, description="one move is at most this share of the limit")
    kv_target: float = Field(0.95, gt=0, le=1, description="KV usage the limit is kept under")
    drain_seconds: float = Field(30.0, ge=0, description="after a cut, the longest hold while the running batch "
                                 "drains to the new limit (the hold ends once it has)")  # fmt: skip
    past_peak: float | None = Field(0.85, gt=0, le=1, description="a larger limit serving under this share of the "
                                    "peak's tokens/s goes back to the peak's limit; null: never")  # fmt: skip
    keep_up: float | None = Field(1.15, ge=1, le=3, description="serving under this multiple of the tokens/s "
                                  "asked is falling short: then, where the pace grows faster than the batch, "
                                  "the limit steps down toward the throughput peak; null: never")  # fmt: skip
    manual_hold_seconds: float = Field(600, ge=0, description="a limit set by hand pauses control this long")
    admission: bool = Field(
        False, description="also set the engine's queued-token cap from its measured prefill throughput: "
        "wide enough that what it refuses would have missed slo.ttft_seconds (vLLM 0.29 and later, the plugin's "
        "door before; docs/admission.md)",
    )  # fmt: skip
    admission_confidence: float = Field(
        0.95, gt=0, lt=1, description="how sure the door is that a request it refuses would have missed its TTFT"
    )
    admission_margin: float = Field(
        1.0, gt=0, le=2, description="a multiple of the cap the confidence gives: under 1 refuses sooner"
    )
    admission_min_windows: int = Field(3, ge=1, description="saturated windows before a cap is set; fewer: no cap")
    admission_stale_seconds: float = Field(
        60.0, gt=0, description="a saturated window older than this no longer counts; none left: no cap"
    )
    dry_run: bool = Field(False, description="decide, log and export the target; never set it")

    @model_validator(mode="after")
    def _bounds(self) -> Control:
        if self.max_limit is not None and self.max_limit < self.min_limit:
            raise ValueError(f"control.max_limit {self.max_limit} is below control.min_limit {self.min_limit}")
        start = self.start_limit
        if start is not None and not self.min_limit <= start <= (self.max_limit or start):
            raise ValueError(f"control.start_limit {start} is outside control.min_limit {self.min_limit} .. "
                             f"max_limit {self.max_limit or 'the capacity'}")  # fmt: skip
        # A window a tick: the door needs its min_windows within stale_seconds, or it never sets a cap at all.
        needed = (self.admission_min_windows - 1) * self.interval_seconds
        if self.admission and self.admission_stale_seconds < needed:
            raise ValueError(f"control.admission_stale_seconds {self.admission_stale_seconds:g} is shorter than "
                             f"the {needed:g} s that admission_min_windows {self.admission_min_windows} windows, one "
                             f"each interval_seconds {self.interval_seconds:g}, span: the door would never set a "
                             "cap")  # fmt: skip
        return self


class SecretToFill(_Section):
    """A Secret the chart rendered empty, because ``helm template`` cannot keep a random token: the hook writes one."""

    namespace: str = Field(min_length=1)
    name: str = Field(min_length=1)
    keys: list[str] = Field(min_length=1)


#: LeaderWorkerSet's labels, which the multi-node vLLM deployments of llm-d and vLLM's own docs wear: the set's
#: name, and which of its replicas (groups) a pod is of.
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"


class Kubernetes(_Section):
    """Engine discovery on Kubernetes (docs/kubernetes.md): each vLLM pod is an engine named <namespace>/<pod>."""

    discover: bool = False
    selector: dict[str, str] = Field(
        default_factory=lambda: {"app.kubernetes.io/name": "vllm"}, description="the vLLM pods' labels"
    )
    namespaces: list[str] = Field(
        default_factory=list, description="the namespaces whose pods may be engines (required with discover)"
    )
    port: int = Field(8000, ge=1, le=65535, description="vLLM's API port on the pod's IP")
    deployment_label: str = Field(
        LWS_NAME, description="the pod label whose value names a data-parallel deployment: the pods that wear the "
        "same value (and LeaderWorkerSet group) are the servers of one engine, <namespace>/<value>[-<group>]; "
        "empty: every pod is an engine of its own",
    )  # fmt: skip
    admin_port: int | None = Field(
        None, ge=1, le=65535, description="the admin API's own port on the pod's IP (BATCHLENS_ADMIN_PORT); none: port"
    )
    node_name_env: str = Field(
        "NODE_NAME", description="the exporter reads only the pods of the node this variable names (a DaemonSet)"
    )
    interval_seconds: float = Field(15.0, gt=0, le=3600)
    timeout_seconds: float = Field(5.0, gt=0, le=60)
    api_url: url_setting("https://127.0.0.1:6443") = Field(
        "", description="an API server without credentials (kubectl proxy); empty: the service account or kubeconfig"
    )
    admin_token_secret: str = Field(
        "batchlens-admin-token",
        min_length=1,
        description="the Secret, in each engine's namespace, that its pod's BATCHLENS_ADMIN_TOKEN comes from",
    )
    admin_token_key: str = Field("token", min_length=1, description="the key of that Secret holding the token")
    admin_auth: AdminAuthMode = Field("signed", description=ADMIN_AUTH_HELP)
    webhook_token_key: str = Field(
        "webhook-token",
        min_length=1,
        description="the key of that Secret holding the namespace's webhook token: it acts on that namespace only",
    )
    fill_secrets: list[SecretToFill] = Field(
        default_factory=list,
        description="Secrets rendered without their tokens (helm template, GitOps): the hook fills them at start",
    )
    api_server_cidrs: list[str] | None = Field(
        None, description="the addresses the pods' NetworkPolicy lets them reach the API server on (the chart's "
        "networkPolicy.apiServer.cidrs); [] is any address, which discovery warns of at start; null: no policy known",
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _no_shared_token(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "admin_token_env" in data:
            raise ValueError(
                "admin_token_env is gone: a discovered engine's token is the one its own pod holds, read from "
                "the Secret admin_token_secret (default batchlens-admin-token) in the pod's namespace "
                "(docs/kubernetes.md, 'What makes a pod an engine')"
            )
        return data

    @field_validator("api_server_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str] | None) -> list[str] | None:
        for cidr in value or ():
            ip_network(cidr, strict=False)  # ValueError names it: "... does not appear to be an IPv4 or IPv6 network"
        return value

    @model_validator(mode="after")
    def _scoped(self) -> Kubernetes:
        if self.discover and not self.namespaces:
            raise ValueError(
                "discover needs namespaces: the list of namespaces whose pods may be engines. A label alone "
                "proves nothing on a shared cluster, where anyone who can create a pod can set it"
            )
        if "*" in self.namespaces or any(not ns.strip() for ns in self.namespaces):
            raise ValueError(f"namespaces must name namespaces, got {self.namespaces}")
        return self


class Links(_Section):
    """Where alert annotations point. Alerts leave for Slack and PagerDuty, where a relative link leads nowhere."""

    grafana_url: url_setting("https://grafana.example.com") = Field(
        "", description="Grafana's base URL for the alerts' dashboard_url; empty: relative"
    )
    runbook_url: url_setting("https://github.com/batchlens/batchlens/blob/main/docs/runbooks") = Field(
        "", description="base URL of the runbooks (docs/runbooks/ published); empty: relative"
    )


class Routing(_Section):
    """Workload-aware routing (the article's stage 2) in front of the engines: docs/routing.md."""

    model: str = Field(
        "", description="the model name clients ask the proxy for and the engines serve (--served-model-name)"
    )
    long_prompt_tokens: int = Field(2048, ge=1, description="a prompt over this many tokens goes to a long engine")
    latency_header: str = Field(
        "x-batchlens-latency-class", description="a request header whose value names its latency class"
    )
    latency_tag: str = Field("interactive", description="a LiteLLM request tag that marks the interactive class")
    latency_classes: list[str] = Field(
        default_factory=lambda: ["interactive"], description="header values that go to an interactive engine"
    )
    trusted_keys: list[str] = Field(
        default_factory=list,
        description="LiteLLM personal key aliases whose requests may claim the interactive class (header or tag), "
        "pin an engine or role by tag, or set vLLM's priority; the master key always may (docs/routing.md)",
    )
    trusted_key_hashes: list[str] = Field(
        default_factory=list,
        description="LiteLLM keys, by their SHA-256 (LiteLLM's hashed token, the `token` of /key/list), that may, as "
        "trusted_keys: unlike an alias, no tenant can change it, and it holds for a team's key too",
    )
    trusted_teams: list[str] = Field(
        default_factory=list,
        description="LiteLLM team ids (not aliases: an org admin may rename a team) whose keys may, as trusted_keys",
    )
    trust_metadata_tags: bool = Field(
        True,
        description="tags in a personal key's or a team's LiteLLM metadata count as the proxy admin's rules; false "
        "where tenants are team or org admins in LiteLLM, who can tag a team, or detach a team key and tag it",
    )
    trust_clients: bool = Field(
        False, description="every key may, as trusted_keys: the proxy serves one tenant (the demo stacks)"
    )
    cold_gap: float | Literal["auto"] = Field(
        "auto", description="seconds since the previous arrival that make a request cold; auto: the P90 of the gaps"
    )
    cold_gap_quantile: float = Field(0.9, gt=0, lt=1, description="the quantile `auto` takes (the article: P90)")
    cold_gap_window: int = Field(1000, ge=10, description="auto: the quantile of this many most recent gaps")
    cold_gap_min_gaps: int = Field(50, ge=2, description="auto: below this many gaps nothing is cold yet")
    fallbacks: dict[Role, list[Role]] = Field(
        default_factory=lambda: {"main": ["cold"], "interactive": ["main"], "long": ["main"], "cold": ["main"]},
        description="where a role's requests go when its engines are down or saturated, in order",
    )
    priority: dict[Role, int] = Field(
        default_factory=lambda: {"interactive": 0, "main": 1, "cold": 1, "long": 2},
        description="vLLM's request priority per role (lower first), for engines on --scheduling-policy priority",
    )
    door_priority: dict[Role, int] = Field(
        default_factory=lambda: {"interactive": 0, "main": 0, "cold": 0, "long": -1},
        description="the engine door's priority per role, sent as x-batchlens-priority: below 0 sheddable (refused "
        "first, at half the queued caps), 0 standard, above 0 critical (never refused by the plugin's door); "
        "docs/admission.md",
    )
    exporter_url: url_setting("http://127.0.0.1:9400", optional=False) = Field(
        "http://127.0.0.1:9400", description="the batchlens exporter the signals come from"
    )
    proxy_url: url_setting("http://127.0.0.1:4000") = Field(
        "", description="the LiteLLM proxy; the exporter reports whether it answers (empty: not watched)"
    )
    metrics_auth: bool = Field(
        True,
        description="the proxy's /metrics asks for its master key; false: Prometheus scrapes it without one "
        "(it only reads; the demo stacks, whose proxy is on loopback or compose's network)",
    )
    signals_ttl_seconds: float = Field(1.0, gt=0, le=60, description="signals are read at most this often")
    signals_stale_seconds: float = Field(
        15.0, gt=0, description="an engine's signals older than this are unknown: it is neither down nor saturated"
    )
    signals_timeout_seconds: float = Field(0.5, gt=0, le=10, description="one read of the exporter's /metrics")
    kv_saturated: float = Field(0.9, gt=0, le=1, description="KV usage at which an engine counts as saturated")

    @field_validator("trusted_key_hashes")
    @classmethod
    def _hashes(cls, value: list[str]) -> list[str]:
        return [h.lower() for h in value]  # hex in either case; LiteLLM's is lower case

    @field_validator("cold_gap")
    @classmethod
    def _gap(cls, value: float | str) -> float | str:
        if value != "auto" and not value > 0:
            raise ValueError(f"expected seconds above zero or auto, got {value!r}")
        return value

    @field_validator("fallbacks")
    @classmethod
    def _no_self_fallback(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for role, order in value.items():
            if role in order:
                raise ValueError(f"role {role!r} falls back to itself")
        return value


class Config(_Section):
    engines: list[Engine] = Field(default_factory=list)
    exporter: Exporter = Field(default_factory=Exporter)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    breaker: Breaker = Field(default_factory=Breaker)
    remediate: Remediate = Field(default_factory=Remediate)
    slo: Slo = Field(default_factory=Slo)
    control: Control = Field(default_factory=Control)
    links: Links = Field(default_factory=Links)
    kubernetes: Kubernetes = Field(default_factory=Kubernetes)
    routing: Routing = Field(default_factory=Routing)

    @model_validator(mode="after")
    def _slo_follows_the_breaker(self) -> Config:
        """One objective: unless set, the goodput TTFT bound is the breaker's P99 bound."""
        if self.slo.ttft_seconds is None:
            object.__setattr__(self.slo, "ttft_seconds", self.thresholds.p99_seconds)
        return self

    @model_validator(mode="after")
    def _long_engines_take_long_prompts(self) -> Config:
        bound = self.routing.long_prompt_tokens
        for engine in self.engines:
            if "long" in engine.role and engine.max_model_len is not None and engine.max_model_len <= bound:
                raise ValueError(
                    f"engine {engine.name!r} has the role long but max_model_len {engine.max_model_len}: a long "
                    f"prompt is over routing.long_prompt_tokens ({bound}), so it could take none"
                )
        return self

    def routing_warnings(self) -> list[str]:
        """What the routing settings allow but will not do what they seem to: said once by build and at start."""
        warnings, bound = [], self.routing.long_prompt_tokens
        if any(e.role != ("main",) for e in self.engines) and not self.routing.model:
            warnings.append("engines have routing roles but routing.model is empty: no router config is written "
                            "(routing/); set routing.model to the name clients ask for")  # fmt: skip
        short = [e.name for e in self.engines if "main" in e.role and e.max_model_len and e.max_model_len < bound]
        if short:
            warnings.append(f"main engine(s) {', '.join(short)} take prompts up to max_model_len, below "
                            f"routing.long_prompt_tokens ({bound}): a prompt between the two fits no main engine "
                            "and goes to a fallback")  # fmt: skip
        if self.routing.model and self.routing.metrics_auth:
            warnings.append("routing.metrics_auth is true: the proxy's /metrics/ wants its key, and the provisioned "
                            "Prometheus (provisioning/prometheus/prometheus.yml, job litellm) scrapes it without "
                            "one (HTTP 401): give that job the key (authorization.credentials_file), or set "
                            "routing.metrics_auth: false where only Prometheus reaches the proxy")  # fmt: skip
        return warnings

    @model_validator(mode="after")
    def _unique_engine_names(self) -> Config:
        seen: set[str] = set()
        for engine in self.engines:
            if engine.name in seen:
                raise ValueError(f"engine name {engine.name!r} is used twice; each vllm_instance must be unique")
            seen.add(engine.name)
        deployments = {e.deployment for e in self.engines if e.deployment}
        if clash := deployments & {e.name for e in self.engines if not e.deployment}:
            raise ValueError(f"deployment {sorted(clash)[0]!r} is also the name of an engine of no deployment")
        return self

    def token_envs(self) -> list[str]:
        """Names of the environment variables that hold secrets, in a stable order."""
        names = [e.admin_token_env for e in self.engines] + [self.remediate.webhook_token_env]
        return list(dict.fromkeys(names))


def by_instance(engines: Sequence[Engine]) -> dict[str, list[Engine]]:
    """The servers of each ``vllm_instance``: one engine's alone, or every server of a deployment, in order."""
    groups: dict[str, list[Engine]] = {}
    for engine in engines:
        groups.setdefault(engine.instance, []).append(engine)
    return groups


def parse_engine_flag(value: str) -> dict[str, str]:
    """``NAME=URL`` or a bare ``URL`` (named host:port), as given to ``--engine``."""
    name, sep, url = value.partition("=")
    if not sep or "://" in name:
        return {"url": value}
    return {"name": name, "url": url}


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config overrides from ``BATCHLENS_<SECTION>__<KEY>`` and ``BATCHLENS_ENGINES``.

    Other ``BATCHLENS_*`` variables (tokens, ``BATCHLENS_CONFIG``) are not config keys
    and are left alone. Values are read as YAML scalars, so ``2`` is a number and
    ``true`` a boolean.
    """
    out: dict[str, Any] = {}
    for var, raw in environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX) :].lower()
        if key != "engines" and "__" not in key:
            if (meant := _one_underscore(key)) is not None:  # ignored in silence, it would look applied
                raise ConfigError(f"{var}: not a config key; {ENV_PREFIX}{meant.upper()} (two underscores after "
                                  "the section) sets one")  # fmt: skip
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError as exc:
            raise ConfigError(f"{var}: not a valid YAML value: {yaml_problem(exc)}") from None
        path = key.split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _one_underscore(key: str) -> str | None:
    """``section__key`` where ``key`` (lowercased, after the prefix) is a section's key joined by one underscore."""
    for section, field in Config.model_fields.items():
        model = field.annotation
        rest = key.removeprefix(f"{section}_")
        if rest != key and isinstance(model, type) and issubclass(model, BaseModel) and rest in model.model_fields:
            return f"{section}__{rest}"
    return None


def _format_errors(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see `batchlens config show` for every key)"
        elif (
            "input" in err
            and err["type"] != "missing"
            and not isinstance(err["input"], dict)
            and (repr(err["input"]) not in msg)
        ):  # a whole section's dict says nothing the message does not (a check across its keys)
            msg += f" (got {err['input']!r})"
        lines.append(f"  {key}: {msg}")
    if len(lines) == 2:  # one error: one line
        return f"{lines[0][:-1]}: {lines[1].strip()}"
    return "\n".join(lines)


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the effective config from file, environment and flag overrides."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    origin = "defaults"
    if path:
        file = Path(path)
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {file} is not valid YAML: {yaml_problem(exc)}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {file}: expected a mapping at the top level, got {type(loaded).__name__}")
        data, origin = loaded, f"file {file}"
    env = env_overrides(environ)
    if env:
        data = _deep_merge(data, env)
        origin += " + BATCHLENS_* environment"
    if overrides:
        data = _deep_merge(data, overrides)
        origin += " + command-line flags"
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origin)) from None


def url_settings(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """The dotted paths of the URL settings (``format: uri`` in the schema), ``name[]`` standing for a list's items."""
    paths = []
    for name, field in (model or Config).model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get("format") == URL_FORMAT:
            paths.append(prefix + name)
        listed = typing.get_origin(field.annotation) is list
        for sub in typing.get_args(field.annotation) if listed else (field.annotation,):
            if isinstance(sub, type) and typing.get_origin(sub) is None and issubclass(sub, BaseModel):
                paths += url_settings(sub, f"{prefix}{name}{'[]' if listed else ''}.")
    return paths


def _mask_at(data: Any, path: list[str]) -> None:
    head, *rest = path
    if head.endswith("[]"):
        for item in data.get(head[:-2]) or []:
            _mask_at(item, rest)
    elif rest:
        _mask_at(data.get(head) or {}, rest)
    elif isinstance(data.get(head), str):
        data[head] = mask_url(data[head])


def masked_dump(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The effective config as plain data, safe to print: no secret leaves it.

    Every URL setting's password is masked, and a ``secrets`` section says whether each token variable is set,
    never what it holds.
    """
    environ = os.environ if environ is None else environ
    data = config.model_dump(mode="json")
    for path in url_settings():
        _mask_at(data, path.split("."))
    data["secrets"] = {name: ("set (****)" if environ.get(name) else "NOT SET") for name in config.token_envs()}
    return data
