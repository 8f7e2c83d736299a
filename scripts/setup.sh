#!/usr/bin/env bash
# Set up devbroker on a fresh Debian 12 machine: a virtual environment with the package and
# what its tests need. Idempotent. Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

if [ "$(id -u)" != 0 ]; then
    echo "setup: devbroker mounts FUSE file systems and makes namespaces: run as root" >&2
    exit 1
fi
if [ ! -e /dev/fuse ]; then
    echo "setup: /dev/fuse is missing: this kernel has no FUSE (CONFIG_FUSE_FS)" >&2
    exit 1
fi
# setpriv/unshare (util-linux) drop capabilities and make namespaces for tenant sandboxes.
if ! command -v setpriv >/dev/null || ! command -v unshare >/dev/null; then
    scripts/apt-install.sh setup util-linux
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PY --version)" >&2
    "$PY" -m venv .venv
fi
extras=""
[ $want_test = 1 ] && extras="[test]"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# pip's chatter (setuptools deprecation notes, ignored find-links) goes to a log, shown on failure.
log=.venv/pip-install.log
if ! .venv/bin/python -m pip install -q -e ".$extras" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup: pip install failed (whole log: $PWD/$log)" >&2
    exit 1
fi
.venv/bin/python -c "import devbroker.cli.main, trio" || { echo "setup: install failed" >&2; exit 1; }
# Byte-compiled once here: an editable install writes no .pyc, and where
# PYTHONDONTWRITEBYTECODE is set (some CI hosts) every broker, tenant and QEMU-guest process
# would compile the ABI tables (~1 MB of source) again at its start.
.venv/bin/python -m compileall -q -j0 src >/dev/null || echo "setup: compileall failed" >&2
# The seccomp listener's native loop (src/devbroker/native/lane.c, loaded with ctypes): built
# now so the broker does not build it at its first tenant. Without a compiler the broker
# still runs, on its Python listener (slower: docs/benchmarks.md).
if ! command -v cc >/dev/null; then
    echo "setup: no C compiler: installing gcc (the native listener loop)" >&2
    scripts/apt-install.sh setup gcc libc6-dev || true
fi
.venv/bin/python -m devbroker.native >/dev/null \
    || echo "setup: the native listener loop did not build; the Python one will serve" >&2
echo "setup: ready: $PWD/.venv (devbroker installed from $PWD/src; pip log $PWD/$log)" >&2
