#!/bin/sh
# Install what the operations tests run (tests/test_prometheus.py, tests/test_upgrade.py):
# Debian's Prometheus server and promtool (package prometheus) and systemd-analyze (package
# systemd, installed only where it is missing: never upgraded). Idempotent: does nothing
# when they are there. Needs root and Debian 12.
# The Prometheus package would start its own service on :9090; the tests start their own
# server on a free loopback port, so the package's is kept from starting during the install.
set -eu

fail() { echo "install-ops-tools: $*" >&2; exit 1; }
have() { command -v prometheus >/dev/null && command -v promtool >/dev/null \
             && command -v systemd-analyze >/dev/null; }

if have; then
    echo "install-ops-tools: already installed: $(prometheus --version 2>&1 | head -n1)"
    exit 0
fi
[ "$(id -u)" = 0 ] || fail "needs root (apt-get)"
pkgs=""
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || pkgs="prometheus"
command -v systemd-analyze >/dev/null || pkgs="$pkgs systemd"
# No service may start during the install (policy-rc.d exit 101: "action forbidden"). An
# existing policy-rc.d (a container's) is left as it is.
made_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    made_policy=1
fi
rc=0
# shellcheck disable=SC2086 # one word per package
"$(dirname "$0")/apt-install.sh" install-ops-tools $pkgs || rc=$?
[ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
[ $rc = 0 ] || exit 1
have || fail "prometheus, promtool or systemd-analyze still missing after apt-get"
echo "install-ops-tools: installed: $(prometheus --version 2>&1 | head -n1)"
