"""The `remediate:` section: the hook's server, store and the Prometheus and Alertmanager it talks to."""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from batchlens.config.base import Listen, Section, url_setting


class LeaderElection(Section):
    """Two or more hooks, one acting: who acts is the holder of a Lease (docs/scaling.md, "The hook survives its
    node"). The API server is the one kubernetes: reaches (the service account, or kubernetes.api_url)."""

    enabled: bool = False
    lease_name: str = Field("batchlens-remediate", min_length=1, description="the Lease (coordination.k8s.io/v1)")
    namespace: str = Field("", description="the Lease's and the state's namespace; empty: the pod's own")
    identity_env: str = Field(
        "BATCHLENS_POD_NAME", min_length=1, description="names this hook in the Lease; unset: the host name"
    )
    state_config_map: str = Field(
        "batchlens-remediate-state", min_length=1,
        description="the ConfigMap the leader keeps the breakers' and controllers' state in, for its successor",
    )  # fmt: skip
    lease_duration_seconds: float = Field(
        15.0, gt=0, le=300, description="a Lease not renewed this long is taken over: the failover's bound"
    )
    renew_deadline_seconds: float = Field(
        10.0, gt=0, description="a leader that could not renew this long stops acting, before another may take over"
    )
    retry_period_seconds: float = Field(2.0, gt=0, description="how often the Lease is renewed or tried")

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        # client-go's rule: a leader stops acting before its Lease can expire, and tries several times before that.
        if not self.retry_period_seconds < self.renew_deadline_seconds < self.lease_duration_seconds:
            raise ValueError(
                "leader_election: retry_period_seconds < renew_deadline_seconds < lease_duration_seconds, got "
                f"{self.retry_period_seconds:g}, {self.renew_deadline_seconds:g}, {self.lease_duration_seconds:g}"
            )
        return self


class Remediate(Section):
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
    leader_election: LeaderElection = Field(default_factory=LeaderElection)
