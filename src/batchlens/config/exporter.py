"""The `exporter:` section."""

from __future__ import annotations

from pydantic import Field

from batchlens.config.base import Listen, Section


class Exporter(Section):
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
