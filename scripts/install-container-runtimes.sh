#!/bin/sh
# Install the OCI runtimes the container tests drive (tests/test_containers.py, the escape
# harness's runc-fuse/runc-seccomp): Debian's runc and crun (libseccomp2 comes with them; the
# tests also compile seccomp sections with it). Idempotent; needs root on Debian 12.
set -eu
PKGS="runc crun"
installed() {
    for p in $PKGS; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
    done
}
if installed; then
    echo "install-container-runtimes: already installed: $(dpkg-query -W -f='${Package} ${Version}  ' $PKGS)"
    exit 0
fi
"$(dirname "$0")/apt-install.sh" install-container-runtimes $PKGS || exit 1
installed || { echo "install-container-runtimes: $PKGS still not installed" >&2; exit 1; }
echo "install-container-runtimes: installed: $(dpkg-query -W -f='${Package} ${Version}  ' $PKGS)"
