#!/usr/bin/env bash
# Build the test cluster's programs into .cache/k8s/bin/ (docs/kubernetes.md, "Building the
# cluster"):
#   kube        k8s/cluster: kube-apiserver, kube-scheduler, kube-controller-manager, kubelet
#               and kubectl of k8s.io/kubernetes v1.37.2 in one multi-call binary (+ links)
#   etcd        k8s/etcd: go.etcd.io/etcd/server/v3 v3.7.3
#   containerd  k8s/containerd: containerd, containerd-shim-runc-v2, ctr of v2.4.2
#   pause       k8s/pause/pause.c, static: the sandbox image's only program
# and installs the Debian packages the cluster runs with (runc, the CNI plugins, iproute2,
# gcc/libc6-dev for the static pause) when they are missing.
#
#   scripts/k8s/build.sh [--force] [kube|etcd|containerd|pause ...]   (default: all)
#
# Each part is skipped when its stamp (a hash of its module's go.mod, go.sum and sources, the
# Go version and the build flags) matches the one its last build wrote. The Go build cache
# (GOCACHE, GOMODCACHE) does the rest: with a warm cache a fresh clone only links.
# Environment: DEVBROKER_K8S_BIN (default .cache/k8s/bin), DEVBROKER_SKIP_INSTALL=1 (no apt).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BIN=${DEVBROKER_K8S_BIN:-$ROOT/.cache/k8s/bin}
FORCE=0
PARTS=()
for a in "$@"; do
    case $a in
        --force) FORCE=1 ;;
        kube|etcd|containerd|pause) PARTS+=("$a") ;;
        *) echo "usage: $0 [--force] [kube|etcd|containerd|pause ...]" >&2; exit 2 ;;
    esac
done
[ ${#PARTS[@]} = 0 ] && PARTS=(pause etcd containerd kube)

say() { echo "k8s-build: $*" >&2; }
fail() { say "$*"; exit 1; }

# Debian packages the cluster runs with; installed only when one is missing.
DEBS="runc containernetworking-plugins iproute2 gcc libc6-dev openssl util-linux"
missing_debs() {
    local p out=""
    for p in $DEBS; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || out="$out $p"
    done
    echo "$out"
}
if [ "${DEVBROKER_SKIP_INSTALL:-0}" != 1 ]; then
    # (only what is missing, nothing upgraded: the project's one install helper)
    sh "$ROOT/scripts/apt-install.sh" k8s-build $DEBS || fail "installing Debian packages failed"
    miss=$(missing_debs)
    [ -z "$miss" ] || fail "still missing after apt-get:$miss"
fi

command -v go >/dev/null || fail "no go on PATH (Go >= 1.26.6 is needed)"
mkdir -p "$BIN"
# No -trimpath: the compile cache is keyed on it, and the Go build cache this machine keeps
# between CI runs is warmed by plain builds. -s -w only changes the link.
LDFLAGS="-s -w"
GOVERSION=$(go env GOVERSION)

# stamp PART FILES...: the hash that says whether PART's binaries are current.
stamp() {
    local part=$1; shift
    { echo "$part $GOVERSION ldflags=$LDFLAGS cgo=${CGO_ENABLED:-default}"; cat "$@"; } \
        | sha256sum | cut -d' ' -f1
}
current() {  # current PART HASH BINARIES...
    local part=$1 hash=$2 b; shift 2
    [ "$FORCE" = 1 ] && return 1
    [ "$(cat "$BIN/.stamp-$part" 2>/dev/null)" = "$hash" ] || return 1
    for b in "$@"; do [ -x "$BIN/$b" ] || return 1; done
}
now() { date +%s; }

build_pause() {
    local src=k8s/pause/pause.c h t0
    h=$(stamp pause "$src")
    if current pause "$h" pause; then say "pause: up to date"; return; fi
    t0=$(now)
    gcc -static -O2 -Wall -Werror -o "$BIN/pause.tmp" "$src" || fail "pause: gcc -static failed"
    mv "$BIN/pause.tmp" "$BIN/pause"
    echo "$h" > "$BIN/.stamp-pause"
    say "pause: built in $(( $(now) - t0 ))s"
}

build_etcd() {
    local h t0
    h=$(stamp etcd k8s/etcd/go.mod k8s/etcd/go.sum k8s/etcd/*.go)
    if current etcd "$h" etcd; then say "etcd: up to date"; return; fi
    t0=$(now)
    say "etcd: building go.etcd.io/etcd/server/v3 $(sed -n 's/^require go.etcd.io\/etcd\/server\/v3 //p' k8s/etcd/go.mod)"
    (cd k8s/etcd && go build -buildvcs=false -ldflags="$LDFLAGS" -o "$BIN/etcd" .) || fail "etcd: go build failed"
    echo "$h" > "$BIN/.stamp-etcd"
    say "etcd: built in $(( $(now) - t0 ))s"
}

build_containerd() {
    local h t0 c
    h=$(stamp containerd k8s/containerd/go.mod k8s/containerd/go.sum)
    if current containerd "$h" containerd containerd-shim-runc-v2 ctr; then
        say "containerd: up to date"; return
    fi
    t0=$(now)
    say "containerd: building containerd, containerd-shim-runc-v2, ctr"
    # btrfs needs its C headers; devmapper and zfs snapshotters are not used here.
    for c in containerd containerd-shim-runc-v2 ctr; do
        (cd k8s/containerd && go build -buildvcs=false -tags "no_btrfs no_devmapper no_zfs" -ldflags="$LDFLAGS" \
            -o "$BIN/$c" "github.com/containerd/containerd/v2/cmd/$c") \
            || fail "containerd: go build $c failed"
    done
    echo "$h" > "$BIN/.stamp-containerd"
    say "containerd: built in $(( $(now) - t0 ))s"
}

build_kube() {
    local h t0 c v ldflags p
    v=$(sed -n 's/^\tk8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' k8s/cluster/go.mod | head -1)
    [ -n "$v" ] || fail "kube: no k8s.io/kubernetes version in k8s/cluster/go.mod"
    # What hack/lib/version.sh stamps into a release build; a module build has none, and the
    # nodes would report kubelet v0.0.0-master.
    v=${v%%+*}
    ldflags=$LDFLAGS
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags="$ldflags -X $p.gitVersion=$v -X $p.gitMajor=$(echo "${v#v}" | cut -d. -f1)"
        ldflags="$ldflags -X $p.gitMinor=$(echo "$v" | cut -d. -f2) -X $p.gitTreeState=clean"
    done
    h=$(LDFLAGS=$ldflags stamp kube k8s/cluster/go.mod k8s/cluster/go.sum k8s/cluster/*.go)
    if current kube "$h" kube; then say "kube: up to date"; return; fi
    t0=$(now)
    say "kube: building k8s.io/kubernetes $v (cold: about 20 minutes on 2 busy cores; warm: a link)"
    (cd k8s/cluster && go build -buildvcs=false -ldflags="$ldflags" -o "$BIN/kube" .) || fail "kube: go build failed"
    for c in kube-apiserver kube-scheduler kube-controller-manager kubelet kubectl; do
        ln -sfn kube "$BIN/$c"
    done
    echo "$h" > "$BIN/.stamp-kube"
    say "kube: built in $(( $(now) - t0 ))s"
}

T0=$(now)
for p in "${PARTS[@]}"; do "build_$p"; done
say "done in $(( $(now) - T0 ))s: $BIN"
