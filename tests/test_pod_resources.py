"""GPU-to-pod attribution from the kubelet's PodResourcesLister.

Fake boundaries: the kubelet (tests/harness/kubelet.py: a real gRPC server on a unix
socket, serving recorded List answers) and the GPU driver (tests/harness/fake_pynvml.py).
The gRPC client, the compiled proto, the mapping, the NVML source and the renderer are real.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchlens.config import Engine
from batchlens.exporter.kubelet.client import PodResourcesClient, PodResourcesError
from batchlens.exporter.kubelet.holders import PodRef, holders
from batchlens.exporter.nvml_source import NvmlSource
from batchlens.exporter.render import render
from batchlens.exporter.snapshot import Snapshot, SourceState
from harness.exporter import parse_samples, pick
from harness.fake_pynvml import FakeNvml, a100_80gb, h100_mig
from harness.kubelet import FakeKubelet, recorded

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def kubelet(tmp_path):
    servers = []

    def start(answer: str = "full-gpus") -> FakeKubelet:
        servers.append(FakeKubelet(tmp_path / "kubelet.sock", answer))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_full_gpus_go_to_their_pods_and_other_resources_are_ignored() -> None:
    held = holders(recorded("full-gpus"))
    assert held == {
        "GPU-a100-0000-0": [PodRef("serving", "vllm-0", "vllm")],
        "GPU-a100-0000-1": [PodRef("serving", "vllm-1", "vllm")],
    }


def test_mig_instances_are_matched_by_their_own_uuid_not_their_gpus(kubelet) -> None:
    server = kubelet("mig")
    fake = FakeNvml([h100_mig()])
    source = NvmlSource([], nvml=fake.module(), pod_resources=PodResourcesClient(str(server.socket), 2))
    _, samples = scrape(source, fake)
    pods = {dict(k)["uuid"]: (dict(k)["namespace"], dict(k)["pod"]) for k in pick(samples, "batchlens_gpu_info")}
    assert pods == {"GPU-h100-0000-0": ("", ""), "MIG-h100-0-1": ("serving", "small-0"),
                    "MIG-h100-0-2": ("batch", "small-1")}  # fmt: skip


def test_time_sliced_shares_name_their_gpu_and_every_holder_is_kept_in_order() -> None:
    held = holders(recorded("time-sliced"))
    assert held["GPU-a100-0000-0"] == [PodRef("serving", "vllm-a", "vllm"), PodRef("serving", "vllm-b", "vllm")]
    assert held["GPU-a100-0000-1"] == [PodRef("research", "notebook", "jupyter")]  # nvidia.com/gpu.shared


def test_the_client_reads_a_real_grpc_answer(kubelet, tmp_path) -> None:
    server = kubelet("time-sliced")
    answer = PodResourcesClient(str(server.socket), timeout=2).list()
    assert answer == recorded("time-sliced") and server.calls == 1


def test_a_missing_hanging_or_refusing_socket_is_a_reason_not_a_crash(kubelet, tmp_path) -> None:
    with pytest.raises(PodResourcesError) as missing:
        PodResourcesClient(str(tmp_path / "absent.sock"), timeout=0.5).list()
    assert missing.value.reason == "missing"

    server = kubelet()
    server.mode = "hang"
    client = PodResourcesClient(str(server.socket), timeout=0.5)
    started = time.monotonic()
    with pytest.raises(PodResourcesError) as hung:
        client.list()
    assert hung.value.reason == "timeout" and time.monotonic() - started < 3
    server.mode = "unavailable"
    with pytest.raises(PodResourcesError) as restarting:
        client.list()
    assert restarting.value.reason == "unavailable"
    server.mode = "answer"
    assert client.list() == recorded("full-gpus")  # the same client recovers

    dead = tmp_path / "dead.sock"  # a socket file nobody listens on: connection refused
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(dead))
        with pytest.raises(PodResourcesError) as refused:
            PodResourcesClient(str(dead), timeout=1).list()
    assert refused.value.reason == "unavailable"


def scrape(source: NvmlSource, fake: FakeNvml):
    fake.advance(5)
    reading = source.sample_now({})
    state = SourceState("nvml", (), True, reading, 1.0, 0.01, {})
    return reading, parse_samples(render(Snapshot(1, (state,))).decode())


def test_every_gpu_series_carries_its_pod_and_the_pods_engine_gets_the_gpu(kubelet) -> None:
    server = kubelet("full-gpus")
    fake = FakeNvml([a100_80gb(0), a100_80gb(1)])
    engines = [Engine(name="serving/vllm-1", url="http://10.0.0.7:8000")]  # named as discovery names pods
    source = NvmlSource(engines, nvml=fake.module(), pod_resources=PodResourcesClient(str(server.socket), 2))
    reading, samples = scrape(source, fake)
    assert not reading.soft_errors
    used = pick(samples, "batchlens_gpu_memory_used_bytes")
    by_gpu = {labels["gpu"]: labels for labels in (dict(key) for key in used)}
    assert {k: by_gpu["0"][k] for k in ("namespace", "pod", "container", "vllm_instance")} == {
        "namespace": "serving", "pod": "vllm-0", "container": "vllm", "vllm_instance": ""}  # fmt: skip
    assert {k: by_gpu["1"][k] for k in ("namespace", "pod", "container", "vllm_instance")} == {
        "namespace": "serving", "pod": "vllm-1", "container": "vllm", "vllm_instance": "serving/vllm-1"}  # fmt: skip
    info = {(dict(k)["gpu"], dict(k)["pod"]) for k in pick(samples, "batchlens_gpu_pod_info")}
    assert info == {("0", "vllm-0"), ("1", "vllm-1")}


def test_a_time_sliced_gpu_lists_every_holder_and_labels_its_series_with_the_first(kubelet) -> None:
    server = kubelet("time-sliced")
    fake = FakeNvml([a100_80gb(0)])
    source = NvmlSource([], nvml=fake.module(), pod_resources=PodResourcesClient(str(server.socket), 2))
    _, samples = scrape(source, fake)
    [labels] = [dict(k) for k in pick(samples, "batchlens_gpu_memory_used_bytes")]
    assert labels["pod"] == "vllm-a"
    assert sorted(dict(k)["pod"] for k in pick(samples, "batchlens_gpu_pod_info")) == ["vllm-a", "vllm-b"]


def test_a_hanging_kubelet_is_counted_and_the_gpu_series_go_on_without_pod_labels(kubelet) -> None:
    server = kubelet("full-gpus")
    server.mode = "hang"
    fake = FakeNvml([a100_80gb(0)])
    source = NvmlSource([], nvml=fake.module(), pod_resources=PodResourcesClient(str(server.socket), 0.3))
    started = time.monotonic()
    reading, samples = scrape(source, fake)
    assert time.monotonic() - started < 3
    assert dict(reading.soft_errors).keys() == {"pod_resources_timeout"}
    [labels] = [dict(k) for k in pick(samples, "batchlens_gpu_memory_used_bytes")]
    assert labels["pod"] == "" and labels["uuid"] == "GPU-a100-0000-0"
    server.mode = "answer"
    reading, samples = scrape(source, fake)
    assert not reading.soft_errors
    assert [dict(k)["pod"] for k in pick(samples, "batchlens_gpu_memory_used_bytes")] == ["vllm-0"]


def test_without_a_socket_configured_the_series_keep_todays_labels() -> None:
    fake = FakeNvml([a100_80gb(0)])
    _, samples = scrape(NvmlSource([], nvml=fake.module()), fake)
    [labels] = [dict(k) for k in pick(samples, "batchlens_gpu_memory_used_bytes")]
    assert "pod" not in labels and not pick(samples, "batchlens_gpu_pod_info")


def test_the_committed_proto_output_is_what_protoc_makes(tmp_path) -> None:
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(ROOT / "scripts" / "compile-proto.sh"), str(tmp_path)], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    generated = tmp_path / "batchlens" / "exporter" / "kubelet" / "podresources_pb2.py"
    committed = ROOT / "src" / "batchlens" / "exporter" / "kubelet" / "podresources_pb2.py"
    assert generated.read_text() == committed.read_text(), "run scripts/compile-proto.sh"
