"""The `routing:` section: engine roles behind the LiteLLM proxy (docs/routing.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from batchlens.config.base import Section, url_setting
from batchlens.config.engines import Role


class Routing(Section):
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
