"""The `kubernetes:` section: discovery of the vLLM pods, and the Secrets the chart leaves to fill."""

from __future__ import annotations

from collections.abc import Mapping
from ipaddress import ip_network
from typing import Any

from pydantic import Field, field_validator, model_validator

from batchlens.config.base import Section, url_setting
from batchlens.config.engines import ADMIN_AUTH_HELP, AdminAuthMode


class SecretToFill(Section):
    """A Secret the chart rendered empty, because ``helm template`` cannot keep a random token: the hook writes one."""

    namespace: str = Field(min_length=1)
    name: str = Field(min_length=1)
    keys: list[str] = Field(min_length=1)


#: LeaderWorkerSet's labels, which the multi-node vLLM deployments of llm-d and vLLM's own docs wear: the set's
#: name, and which of its replicas (groups) a pod is of.
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"


class Kubernetes(Section):
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
