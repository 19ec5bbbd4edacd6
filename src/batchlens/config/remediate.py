"""The `remediate:` section: the hook's server, store and the Prometheus and Alertmanager it talks to."""

from __future__ import annotations

from pydantic import Field

from batchlens.config.base import Listen, Section, url_setting


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
