#!/bin/sh
# Install those of the Debian packages named that are not installed yet, and nothing else:
# packages already there keep their version (--no-upgrade), no recommends come along, and
# a dependency changes only where a new package needs it. Waits for another apt's lock (CI
# runs setup scripts side by side). Every install script of the project goes through here.
#   scripts/apt-install.sh WHO PKG...      (WHO: the name its messages start with)
set -eu
who=$1
shift
need=""
for p in "$@"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "install ok installed" \
        || need="$need $p"
done
[ -n "$need" ] || exit 0
[ "$(id -u)" = 0 ] || { echo "$who: needs root to install$need (apt-get)" >&2; exit 1; }
echo "$who: installing Debian packages:$need" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq -o DPkg::Lock::Timeout=900 \
    || { echo "$who: apt-get update failed (network? mirror?)" >&2; exit 1; }
# shellcheck disable=SC2086 # one word per package
apt-get install -y -qq -o DPkg::Lock::Timeout=900 --no-install-recommends --no-upgrade \
    $need >/dev/null || { echo "$who: apt-get install$need failed" >&2; exit 1; }
