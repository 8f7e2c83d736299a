#!/usr/bin/env bash
# The README's second command (and what CI runs): install what the tests need, run them.
#   scripts/test.sh [pytest args...]
# Environment: DEVBROKER_SKIP_INSTALL=1 skips the apt installs (nvidia-smi 535, runc/crun,
# Prometheus, libfuse3-dev, QEMU guest kernel) when they are already there; DEVBROKER_SKIP_K8S=1
# skips building the Kubernetes test cluster (scripts/k8s/build.sh); DEVBROKER_SLOW=1
# also runs the suites marked slow.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
if [ "${DEVBROKER_SKIP_INSTALL:-0}" != 1 ]; then
    # Real NVIDIA clients nobody here wrote (Debian non-free, 535.309.01).
    [ -x scripts/install-nvidia-clients.sh ] && scripts/install-nvidia-clients.sh
    # Debian's runc and crun for the container tests (issue 17).
    [ -x scripts/install-container-runtimes.sh ] && scripts/install-container-runtimes.sh
    # Prometheus + promtool and systemd-analyze for the operations tests.
    [ -x scripts/install-ops-tools.sh ] && scripts/install-ops-tools.sh
    # gcc and libfuse3-dev for the hot-path benchmark's C floor and stand-in driver node.
    [ -x scripts/install-bench-tools.sh ] && scripts/install-bench-tools.sh
    # A Debian guest kernel for the kernel-module and CUSE front ends (QEMU/TCG).
    [ -x scripts/qemu/setup.sh ] && scripts/qemu/setup.sh
fi
# The Kubernetes test cluster's programs (docs/kubernetes.md): a link when the Go build cache
# is warm, tens of minutes cold. DEVBROKER_SKIP_K8S=1 skips it (its tests then skip).
if [ "${DEVBROKER_SKIP_K8S:-0}" != 1 ] && [ -x scripts/k8s/build.sh ]; then
    k8s_t0=$(date +%s)
    scripts/k8s/build.sh
    echo "test: Kubernetes test cluster built in $(( $(date +%s) - k8s_t0 ))s" >&2
fi
echo "test: running pytest" >&2
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ $rc = 5 ]; then
    echo "test: pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit $rc
