#!/bin/sh
# Install what the hot-path benchmark (scripts/bench_hotpath.py, run short by
# tests/test_bench_hotpath.py) builds at run time: the C FUSE floor, a tiny libfuse3 server
# compiled with gcc against Debian's libfuse3-dev (and the same server as the real backend's
# stand-in driver node). Idempotent: does nothing when they are there. Needs root, Debian 12.
set -eu

fail() { echo "install-bench-tools: $*" >&2; exit 1; }
have() { command -v gcc >/dev/null && command -v pkg-config >/dev/null \
             && pkg-config --exists fuse3 2>/dev/null; }

if have; then
    echo "install-bench-tools: already installed: libfuse3 $(pkg-config --modversion fuse3)"
    exit 0
fi
"$(dirname "$0")/apt-install.sh" install-bench-tools gcc libc6-dev pkg-config libfuse3-dev \
    || exit 1
have || fail "gcc, pkg-config or libfuse3-dev still missing after apt-get"
echo "install-bench-tools: installed: libfuse3 $(pkg-config --modversion fuse3)"
