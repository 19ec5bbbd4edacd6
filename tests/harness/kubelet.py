"""A fake kubelet: a real gRPC server on a temporary unix socket, serving recorded PodResourcesLister answers.

Fake boundary: the kubelet itself (no Kubernetes node runs here). The wire is real:
grpcio on both sides, the method path and messages of the published v1 API, and the
answers are recorded List responses in protobuf's JSON form (tests/data/kubelet/).
``mode`` makes it answer, hang past any deadline, or fail with a status.
"""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import json_format

from batchlens.exporter.kubelet import podresources_pb2 as pb

ANSWERS = Path(__file__).resolve().parent.parent / "data" / "kubelet"


def recorded(name: str) -> pb.ListPodResourcesResponse:
    return json_format.Parse((ANSWERS / f"{name}.json").read_text(), pb.ListPodResourcesResponse())


class FakeKubelet:
    def __init__(self, socket: Path, answer: str = "full-gpus"):
        self.socket = socket
        self.answer = recorded(answer)
        self.mode = "answer"  # or "hang", or "unavailable"
        self.calls = 0
        self._release = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.unary_unary_rpc_method_handler(
            self._list,
            request_deserializer=pb.ListPodResourcesRequest.FromString,
            response_serializer=pb.ListPodResourcesResponse.SerializeToString,
        )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("v1.PodResourcesLister", {"List": handler}),)
        )
        self._server.add_insecure_port(f"unix://{socket}")
        self._server.start()

    def _list(self, _request, context):
        self.calls += 1
        if self.mode == "hang":
            self._release.wait(30)  # past the client's deadline; released when the test ends
        elif self.mode == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is restarting")
        return self.answer

    def stop(self) -> None:
        self._release.set()
        self._server.stop(grace=None)
