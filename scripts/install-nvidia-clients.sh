#!/bin/sh
# Install NVIDIA's own nvidia-smi and libnvidia-ml1 (Debian non-free, 535.309.01): the
# unmodified clients tests/test_nvidia_clients.py runs against the emulated backend.
# Idempotent: does nothing when both are installed. Needs root and Debian 12 (bookworm).
set -eu

PKGS="nvidia-smi libnvidia-ml1"
SOURCES=/etc/apt/sources.list.d/debian.sources

installed() {
    for p in $PKGS; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
    done
}

if installed; then
    echo "install-nvidia-clients: already installed: $(dpkg-query -W -f='${Package} ${Version}  ' $PKGS)"
    exit 0
fi
fail() { echo "install-nvidia-clients: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root (apt-get)"
[ -f "$SOURCES" ] || fail "$SOURCES not found: expected a Debian 12 deb822 sources file"

# Enable contrib/non-free/non-free-firmware on every Components: line that lacks them (a
# change to the host's apt sources that stays: the README lists it; said here when made).
grep -q '^Components:' "$SOURCES" || fail "no Components: line in $SOURCES"
added=""
for c in contrib non-free non-free-firmware; do
    if grep '^Components:' "$SOURCES" | grep -qv " $c\( \|\$\)"; then
        # appends " $c" to each Components: line that lacks exactly that word
        sed -i "/^Components:/ { / $c\\( \\|\$\\)/! s/\$/ $c/ }" "$SOURCES"
        added="$added $c"
    fi
done
[ -z "$added" ] || echo "install-nvidia-clients: added the components$added to $SOURCES" \
    "(nvidia-smi is in Debian's non-free)" >&2

# No recommends: the kernel module (nvidia-kernel-dkms) is not wanted here.
"$(dirname "$0")/apt-install.sh" install-nvidia-clients $PKGS \
    || fail "is the non-free component reachable?"
installed || fail "packages still not installed after apt-get"
echo "install-nvidia-clients: installed: $(dpkg-query -W -f='${Package} ${Version}  ' $PKGS)"
