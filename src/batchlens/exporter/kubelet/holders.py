"""Which pod holds which GPU, from the kubelet's List answer. Pure: the answer comes in as an argument.

The NVIDIA device plugin hands out GPUs by their UUID ("GPU-..."), MIG instances by
theirs ("MIG-..."), a time-sliced share as "<id>::<n>", and, with
``deviceIDStrategy=index``, a GPU by its index. A device may have several holders (time
slicing): all are listed, sorted, and a GPU series carries the first, as the engine
mapping does where engines share a GPU.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from batchlens.exporter.gpu_metrics import GpuDevice

#: The extended resources the NVIDIA device plugin advertises all start with this.
GPU_RESOURCE_PREFIX = "nvidia.com/"


class PodRef(NamedTuple):
    namespace: str
    pod: str
    container: str

    @property
    def instance(self) -> str:
        """The engine name engine discovery gives this pod's vLLM: ``<namespace>/<pod>``."""
        return f"{self.namespace}/{self.pod}"


def device_key(device_id: str) -> str:
    """The device a device ID names: a time-sliced share ``<id>::<n>`` is a share of ``<id>``."""
    return device_id.split("::", 1)[0]


def holders(response) -> dict[str, list[PodRef]]:
    """device key -> the containers holding it, sorted, from a ``ListPodResourcesResponse``."""
    held: dict[str, set[PodRef]] = defaultdict(set)
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if not devices.resource_name.startswith(GPU_RESOURCE_PREFIX):
                    continue
                for device_id in devices.device_ids:
                    held[device_key(device_id)].add(PodRef(pod.namespace, pod.name, container.name))
    return {key: sorted(refs) for key, refs in held.items()}


def device_holders(devices: Iterable[GpuDevice], held: Mapping[str, list[PodRef]]) -> dict[GpuDevice, list[PodRef]]:
    """device -> its holders. A MIG instance is matched by its own UUID only: its GPU's holders are not its."""
    out = {}
    for device in devices:
        keys = (device.uuid,) if device.is_mig else (device.uuid, str(device.index))
        refs = sorted({ref for key in keys for ref in held.get(key, ())})
        if refs:
            out[device] = refs
    return out
