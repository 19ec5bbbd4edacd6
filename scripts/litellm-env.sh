#!/usr/bin/env bash
# Create (or reuse) the LiteLLM proxy's virtual environment, with batchlens installed into it, for the routing
# plugin (make litellm-env; docs/routing.md). LiteLLM is large (about 400 MB with the proxy's dependencies), so
# it lives in a cache folder outside the clone, as vLLM's does, and is reused while healthy.
# The tests load the batchlens wheel they build over it (PYTHONPATH), so a stale batchlens here never hides
# a packaging bug.
set -euo pipefail

# The release whose proxy hook API (CustomLogger.async_pre_call_hook) and tag routing the plugin targets:
# the newest whose [proxy] extra resolves from this machine's index (1.108 and later pin proxy packages it lacks).
LITELLM_VERSION="${LITELLM_VERSION:-1.106.12}"
VENV="${BATCHLENS_LITELLM_VENV:-$HOME/.cache/batchlens/litellm-$LITELLM_VERSION}"
PYTHON="${PYTHON:-python3.11}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

healthy() {
  [ -x "$VENV/bin/python" ] && [ -f "$VENV/.batchlens-ok" ] && LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" - <<PY >/dev/null 2>&1
import sys
from importlib.metadata import version
import aiohttp, litellm.proxy.proxy_server, prometheus_client, pydantic, yaml  # noqa: F401
sys.exit(version("litellm") != "$LITELLM_VERSION")
PY
}

if healthy; then
  echo "litellm-env: reusing healthy $VENV (litellm $LITELLM_VERSION)"
else
  echo "litellm-env: building $VENV (litellm[proxy] $LITELLM_VERSION); this downloads about 400 MB once"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "litellm[proxy]==$LITELLM_VERSION"
fi
# batchlens beside it, without moving any of LiteLLM's pins: what LiteLLM installed constrains the resolver.
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$VENV/bin/pip" freeze --exclude batchlens > "$constraints"
"$VENV/bin/pip" install --quiet --constraint "$constraints" "$ROOT"
LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c "import litellm.proxy.proxy_server, batchlens.routing.router; print('litellm-env: LiteLLM and batchlens import OK')"
touch "$VENV/.batchlens-ok"
