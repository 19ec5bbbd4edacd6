#!/usr/bin/env bash
# Compiles the kubelet's pod-resources API (src/batchlens/exporter/kubelet/podresources.proto) into
# podresources_pb2.py with the pinned grpcio-tools of the test extra. The output is committed;
# tests/test_pod_resources.py compiles it again and fails if the committed file differs.
#   scripts/compile-proto.sh [OUT_DIR]   (default: the source tree)
set -euo pipefail
cd "$(dirname "$0")/../src"
out="${1:-.}"
"${PYTHON:-python}" -m grpc_tools.protoc -I . --python_out="$out" batchlens/exporter/kubelet/podresources.proto
