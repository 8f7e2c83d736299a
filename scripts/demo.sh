#!/usr/bin/env bash
# The README's first command: set up, then run the broker on the built-in example policy
# (two emulated H200s, tenants alice and bob) and show what each tenant sees.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Real NVIDIA clients (nvidia-smi 535 from Debian non-free) make the demo more telling.
if [ -x scripts/install-nvidia-clients.sh ] && [ "${DEVBROKER_NO_NVIDIA_CLIENTS:-0}" != 1 ]; then
    scripts/install-nvidia-clients.sh || echo "demo: nvidia-smi not installed; showing the probe only" >&2
fi
exec .venv/bin/devbroker --run-dir "${DEVBROKER_RUN_DIR:-/run/devbroker-demo}" demo "$@"
