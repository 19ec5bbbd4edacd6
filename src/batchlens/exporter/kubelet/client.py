"""A client of the kubelet's PodResourcesLister (v1 List) on its unix socket, with a deadline.

Every failure becomes a :class:`PodResourcesError` with a short reason that the NVML
source counts (``missing``, ``permission``, ``timeout``, ``unavailable``, ``error``):
a node without the socket, a kubelet that hangs or refuses, never a crash. grpcio is
the ``batchlens[kubernetes]`` extra, imported only when a socket is configured.
"""

from __future__ import annotations

import os

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST = "/v1.PodResourcesLister/List"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # a node with many pods answers in well under this


class PodResourcesError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class PodResourcesClient:
    def __init__(self, socket_path: str, timeout: float):
        try:
            import grpc

            from batchlens.exporter.kubelet import podresources_pb2
        except ImportError as exc:
            raise RuntimeError(
                f"exporter.pod_resources_socket is set, but {exc.name} is not installed: "
                "pip install 'batchlens[kubernetes]'"
            ) from None
        self._grpc, self._pb = grpc, podresources_pb2
        self.socket_path, self.timeout = socket_path, timeout
        self._channel = None
        self._list = None

    def list(self):
        """The kubelet's ``ListPodResourcesResponse``; raises :class:`PodResourcesError`."""
        if not os.path.exists(self.socket_path):
            raise PodResourcesError("missing", f"no kubelet pod-resources socket at {self.socket_path}")
        if not os.access(self.socket_path, os.R_OK | os.W_OK):
            raise PodResourcesError("permission", f"{self.socket_path} is not ours to use (it is root-only)")
        if self._list is None:
            self._channel = self._grpc.insecure_channel(
                f"unix://{self.socket_path}", options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
            )
            self._list = self._channel.unary_unary(
                LIST,
                request_serializer=self._pb.ListPodResourcesRequest.SerializeToString,
                response_deserializer=self._pb.ListPodResourcesResponse.FromString,
            )
        try:
            return self._list(self._pb.ListPodResourcesRequest(), timeout=self.timeout)
        except self._grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            reason = {
                self._grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
                self._grpc.StatusCode.UNAVAILABLE: "unavailable",
            }.get(code, "error")
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            raise PodResourcesError(reason, f"kubelet pod-resources List failed ({reason}): {detail}") from None

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._list = None
