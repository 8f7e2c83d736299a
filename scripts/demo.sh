#!/usr/bin/env bash
# The README's first command: set up, then run the broker on the built-in example policy
# (two emulated H200s, tenants alice and bob) and show what each tenant sees.
# Works from any checkout location (a 0700 home, /tmp): the tenants run as root without
# capabilities in devbroker exec sandboxes. It says first where everything it needed is.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Real NVIDIA clients (nvidia-smi 535 from Debian non-free) make the demo more telling.
if [ -x scripts/install-nvidia-clients.sh ] && [ "${DEVBROKER_NO_NVIDIA_CLIENTS:-0}" != 1 ]; then
    scripts/install-nvidia-clients.sh || echo "demo: nvidia-smi not installed; showing the probe only" >&2
fi
run_dir=${DEVBROKER_RUN_DIR:-/run/devbroker-demo}
echo "== where things are"
echo "devbroker:  $PWD/.venv/bin/devbroker (virtual environment made by scripts/setup.sh)"
if smi=$(command -v nvidia-smi); then
    echo "nvidia-smi: $smi ($(dpkg-query -W -f='Debian package ${Package} ${Version}' nvidia-smi \
        2>/dev/null || echo 'not from a Debian package'), installed by scripts/install-nvidia-clients.sh)"
else
    echo "nvidia-smi: not installed (the tenants run devbroker's own probe only)"
fi
echo "run dir:    $run_dir (FUSE nodes in nodes/<tenant>/, control.sock, audit.log; the audit"
echo "            log stays there afterwards)"
echo
exec .venv/bin/devbroker --run-dir "$run_dir" demo "$@"
