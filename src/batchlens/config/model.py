"""The whole configuration: every section, and the rules that span sections."""

from __future__ import annotations

from pydantic import Field, model_validator

from batchlens.config.base import Section
from batchlens.config.breaker import Breaker
from batchlens.config.control import Control
from batchlens.config.engines import Engine
from batchlens.config.exporter import Exporter
from batchlens.config.kubernetes import Kubernetes
from batchlens.config.links import Links
from batchlens.config.plan import Plan
from batchlens.config.remediate import Remediate
from batchlens.config.routing import Routing
from batchlens.config.thresholds import Thresholds
from batchlens.goodput import Slo


class Config(Section):
    engines: list[Engine] = Field(default_factory=list)
    exporter: Exporter = Field(default_factory=Exporter)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    breaker: Breaker = Field(default_factory=Breaker)
    remediate: Remediate = Field(default_factory=Remediate)
    slo: Slo = Field(default_factory=lambda: Slo(Thresholds().p99_seconds))  # see _slo_follows_the_breaker
    control: Control = Field(default_factory=Control)
    links: Links = Field(default_factory=Links)
    kubernetes: Kubernetes = Field(default_factory=Kubernetes)
    routing: Routing = Field(default_factory=Routing)
    plan: Plan = Field(default_factory=Plan)

    @model_validator(mode="before")
    @classmethod
    def _slo_follows_the_breaker(cls, data: object) -> object:
        """One objective: unless set, the goodput TTFT bound is the breaker's P99 bound."""
        if not isinstance(data, dict) or isinstance(data.get("slo"), Slo):
            return data
        slo = data.get("slo") if isinstance(data.get("slo"), dict) else {} if data.get("slo") is None else None
        given = data.get("thresholds")
        p99 = given.get("p99_seconds") if isinstance(given, dict) else getattr(given, "p99_seconds", None)
        if slo is not None and slo.get("ttft_seconds") is None:
            data = {**data, "slo": {**slo, "ttft_seconds": Thresholds().p99_seconds if p99 is None else p99}}
        return data

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
