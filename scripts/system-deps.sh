#!/usr/bin/env bash
# The real Prometheus, promtool, Alertmanager and amtool that the tests and the demo run, and Chromium for the
# report page's browser test (Debian packages).
# Installs them when missing and we are root; otherwise fails and says what to install.
# `system-deps.sh demo` asks for what `make demo` runs only: no Chromium.
set -euo pipefail

pairs="prometheus:prometheus promtool:prometheus prometheus-alertmanager:prometheus-alertmanager amtool:prometheus-alertmanager"
[ "${1:-}" = demo ] || pairs="$pairs chromium:chromium"
need=()
for pair in $pairs; do
  bin=${pair%%:*} pkg=${pair##*:}
  command -v "$bin" >/dev/null 2>&1 || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && { echo "system-deps: present: $(for p in $pairs; do printf '%s ' "${p%%:*}"; done)"; exit 0; }
mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)

if [ "$(id -u)" -ne 0 ]; then
  echo "system-deps: missing Debian packages: ${need[*]}" >&2
  echo "system-deps: install them with: sudo apt-get install -y ${need[*]}" >&2
  exit 1
fi
echo "system-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
