#!/bin/sh
# Install what the QEMU harness needs on the host (Debian 12). Idempotent: a second run
# only refreshes the package lists and finds everything installed.
# The guest kernel itself (Debian's linux-image/headers .debs) is fetched by build-kernel.sh
# into the repo's .cache/, never installed on the host: the host runs a different kernel.
set -eu
# Only what is missing, no recommends (qemu's pull in a GUI stack we never use).
"$(dirname "$0")/../apt-install.sh" qemu-setup qemu-system-x86 busybox-static kmod xz-utils \
    make gcc libc6-dev python3-venv cpio
# Guest-side Python: a venv from Debian's /usr/bin/python3 (the pyenv interpreter of .venv
# starts 2-3 s slower over 9p), with trio and the repo's src/ on its path.
REPO=$(cd "$(dirname "$0")/../.." && pwd)
GV=${DEVBROKER_QEMU_CACHE:-$REPO/.cache/qemu}/venv-guest
if ! "$GV/bin/python3" -c "import trio" 2>/dev/null; then
    /usr/bin/python3 -m venv "$GV"
    "$GV/bin/pip" install -q trio
    echo "$REPO/src" > "$(echo "$GV"/lib/python3*/site-packages)/devbroker-src.pth"
fi
exec "$(dirname "$0")/build-kernel.sh"
