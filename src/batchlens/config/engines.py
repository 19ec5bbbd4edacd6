"""The `engines:` section: each vLLM server batchlens watches, and how servers make a deployment."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from ipaddress import ip_address
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BeforeValidator, Field, PrivateAttr, model_validator

from batchlens.config.base import Section, url_setting

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


class Engine(Section):
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
