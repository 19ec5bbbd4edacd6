#!/usr/bin/env bash
# Check the NVML source against a real GPU: run it on a machine with an NVIDIA GPU, from the repo root.
#
#   scripts/gpu-check.sh [OUTDIR]        (OUTDIR defaults to $OUT, else ./gpu-check-out)
#   GPU_CHECK_LOAD=copy scripts/gpu-check.sh OUTDIR
#
# It starts a stand-in engine (a process listening on a port, whose child runs a bf16
# matmul loop on GPU 0 through PyTorch, or with GPU_CHECK_LOAD=copy a device-to-device copy
# loop, bound by memory bandwidth as decode is), starts the exporter with that engine, scrapes
# /metrics twice 5 s apart while the loop runs, and checks that the values are plausible:
# memory busy above 0 under load, a peak bandwidth near the data sheet's, the GPU mapped to
# the engine through the process tree; under the copy load, the DRAM bandwidth ratio above the
# article's 70% threshold (the alert's signal) and the bytes/s near what the copy moves. It also runs `batchlens doctor` under that load. The
# GPU's health as the exporter reads it: the Xid event set (registered on every GPU, a wait that times out
# cleanly), the remapped rows, and the PCI bus's count of GPUs against NVML's (health.txt).
# The scrapes, doctor's report and a summary land in OUTDIR; record them in docs/gpu-validation.md.
#
# Needs: python3 with torch (CUDA), nvidia-ml-py, aiohttp, click, psutil, prometheus-client,
# PyYAML, pydantic and grafana-foundation-sdk. The package itself runs from src/ (no install). Wheels of the
# missing packages can be put in ./.whl: all of them are installed (pip install --no-index --no-deps).
set -euo pipefail

OUTDIR=${1:-${OUT:-gpu-check-out}}
export GPU_CHECK_LOAD=${GPU_CHECK_LOAD:-matmul}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import pydantic, grafana_foundation_sdk" 2>/dev/null && [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps .whl/*.whl
fi

port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
ENGINE_PORT=$(port)
EXPORTER_PORT=$(port)

# The stand-in engine: a listener (as vLLM's API server) with a GPU worker child (as its EngineCore).
"$PY" - "$ENGINE_PORT" >"$OUTDIR/engine.log" 2>&1 <<'EOF' &
import socket, subprocess, sys
worker = r'''
import os, time, torch
if os.environ["GPU_CHECK_LOAD"] == "copy":
    a = torch.empty(1 << 32, device="cuda", dtype=torch.uint8)  # 4 GiB, far past the 60 MB L2
    b = torch.empty_like(a)
    step = lambda: b.copy_(a)
else:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    step = lambda: a @ b
t0 = time.time()
end, said, moved = t0 + 25, False, 0
while time.time() < end:
    for _ in range(20):
        step()
        moved += 2 * a.numel() * a.element_size()
    torch.cuda.synchronize()
    if not said and time.time() > t0 + 6 and os.environ["GPU_CHECK_LOAD"] == "copy":  # before the scrapes are read
        print(f"copy load: {moved / (time.time() - t0) / 1e12:.2f} TB/s read and written", flush=True)
        said = True
'''
child = subprocess.Popen([sys.executable, "-c", worker])
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
child.wait()
EOF
ENGINE_PID=$!

"$PY" -m batchlens --log-level info exporter --engine "gpu-check=http://127.0.0.1:$ENGINE_PORT" \
    --listen "127.0.0.1:$EXPORTER_PORT" --interval 1 >"$OUTDIR/exporter.log" 2>&1 &
EXPORTER_PID=$!
trap 'kill $EXPORTER_PID $ENGINE_PID 2>/dev/null || true' EXIT

sleep 8  # the worker allocates and warms up; the exporter takes two GPM samples
curl -sf "http://127.0.0.1:$EXPORTER_PORT/metrics" >"$OUTDIR/scrape1.prom"
sleep 5
curl -sf "http://127.0.0.1:$EXPORTER_PORT/metrics" >"$OUTDIR/scrape2.prom"
# `batchlens doctor` on the real GPU while the worker still loads it (exit 3 means warnings only).
"$PY" -m batchlens doctor --sample-seconds 2 >"$OUTDIR/doctor.txt" 2>&1 || true
"$PY" -m batchlens doctor --sample-seconds 1 --json >"$OUTDIR/doctor.json" 2>/dev/null || true
kill $EXPORTER_PID $ENGINE_PID 2>/dev/null || true
wait $EXPORTER_PID 2>/dev/null || true

# The health reads on the real driver: the Xid waiter (batchlens.exporter.xid_events) over every GPU for 3 s,
# nvmlDeviceGetRemappedRows, and the PCI bus beside NVML's count.
"$PY" - >"$OUTDIR/health.txt" 2>&1 <<'EOF' || true
import time, pynvml
from batchlens.exporter.pci_bus import nvidia_gpus
from batchlens.exporter.xid_events import XidWaiter
pynvml.nvmlInit()
count = pynvml.nvmlDeviceGetCount()
handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
print(f"nvml GPUs {count}; pci bus NVIDIA GPUs {nvidia_gpus()}")
for index, handle in handles:
    supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
    try:
        rows = pynvml.nvmlDeviceGetRemappedRows(handle)
    except pynvml.NVMLError as exc:
        rows = f"({exc})"
    print(f"GPU {index}: event types {supported:#x} (xid {bool(supported & pynvml.nvmlEventTypeXidCriticalError)}); "
          f"remapped rows (correctable, uncorrectable, pending, failure) {rows}")
waiter = XidWaiter(pynvml, handles)
started = waiter.start()
time.sleep(3)
print(f"xid waiter started {started}; watched {waiter.watched}; counts {waiter.counts()}; wait errors {dict(waiter.errors)}")
waiter.close()
pynvml.nvmlShutdown()
EOF

# The tick's cost on the real driver, against the bare NVML calls (benchmarks/nvml.py --real).
"$PY" benchmarks/nvml.py --real --budget 3 >"$OUTDIR/tick-cost.txt" 2>&1 || true

"$PY" - "$OUTDIR" <<'EOF' | tee "$OUTDIR/summary.txt"
import datetime, os, pathlib, sys
from prometheus_client.parser import text_string_to_metric_families

out = pathlib.Path(sys.argv[1])
print("gpu-check", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "load", os.environ["GPU_CHECK_LOAD"])
print((out / "engine.log").read_text().rstrip())
failures = []
for name in ("scrape1.prom", "scrape2.prom"):
    samples = [s for f in text_string_to_metric_families((out / name).read_text()) for s in f.samples]
    gpu = [s for s in samples if s.name.startswith(("batchlens_gpu_", "batchlens_nvml_")) or
           (s.name == "batchlens_source_up" and s.labels.get("source") == "nvml")]
    print(f"--- {name}: {len(gpu)} GPU samples")
    for s in gpu:
        if s.labels.get("gpu", "0") == "0" and s.name != "batchlens_gpu_clock_event_active":
            shown = {k: v for k, v in s.labels.items() if k in ("gpu", "gpu_name", "vllm_instance", "pid", "type", "architecture", "bandwidth_basis", "mig_mode", "driver_version")}
            print(f"{s.name}{shown} {s.value:g}")
    by_name = {s.name: s for s in gpu if s.labels.get("gpu", "0") == "0"}
    checks = {
        "memory busy above 0 under load": by_name.get("batchlens_gpu_memory_busy_ratio", None) is not None and by_name["batchlens_gpu_memory_busy_ratio"].value > 0,
        "peak bandwidth present": "batchlens_gpu_memory_bandwidth_peak_bytes_per_second" in by_name,
        "GPM DRAM bandwidth ratio present (Hopper)": "batchlens_gpu_dram_bandwidth_ratio" in by_name,
        "GPU 0 mapped to the engine": by_name.get("batchlens_gpu_sm_busy_ratio") is not None and by_name["batchlens_gpu_sm_busy_ratio"].labels.get("vllm_instance") == "gpu-check",
    }
    pci = [s for s in samples if s.name == "batchlens_pci_nvidia_gpus"]
    listed = {s.labels["gpu"] for s in gpu if s.name == "batchlens_source_up" and s.labels.get("gpu")}
    checks["the PCI bus counts as many NVIDIA GPUs as NVML"] = bool(pci) and pci[0].value == len(listed)
    if by_name.get("batchlens_gpu_info") is not None and by_name["batchlens_gpu_info"].labels.get("architecture") in ("ampere", "hopper", "blackwell"):
        checks["row remapping read (Ampere and newer)"] = "batchlens_gpu_row_remapping_pending" in by_name
    dram = by_name.get("batchlens_gpu_dram_bandwidth_ratio")
    if os.environ["GPU_CHECK_LOAD"] == "copy":
        checks["DRAM bandwidth above the 70% threshold under a copy"] = dram is not None and dram.value > 0.7
    peak = by_name.get("batchlens_gpu_memory_bandwidth_peak_bytes_per_second")
    if peak is not None and "H200" in peak.labels.get("gpu_name", ""):
        checks["peak within 10% of 4.8 TB/s (H200)"] = abs(peak.value - 4.8e12) <= 0.48e12
    for what, ok in checks.items():
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(f"{name}: {what}")
health = (out / "health.txt").read_text() if (out / "health.txt").exists() else ""
print("--- GPU health reads (Xid event set, remapped rows, PCI bus)")
print(health.rstrip())
if "xid waiter started True" not in health or "wait errors {}" not in health:
    failures.append("the Xid waiter did not register and wait cleanly on this driver")
if (out / "tick-cost.txt").exists():
    print("--- the NVML tick's cost on this driver (benchmarks/nvml.py --real)")
    print((out / "tick-cost.txt").read_text().rstrip())
if (out / "doctor.txt").exists():
    print("--- batchlens doctor under load")
    print((out / "doctor.txt").read_text().rstrip())
print("RESULT", "pass" if not failures else "fail: " + "; ".join(failures))
sys.exit(1 if failures else 0)
EOF
