#!/usr/bin/env bash
# Build the DRA driver's kubelet plugin (k8s/dra, Go) into .cache/k8s/bin/devbroker-dra-plugin.
# Skips the build when the binary is newer than every source file (go.mod, go.sum, *.go) and
# was linked with today's flags: the Kubernetes pieces' build shares the Go module cache and
# the machine's cores.
# Needs Go (>= 1.26) and the Go module proxy (or a warm module cache).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SRC=$ROOT/k8s/dra
OUT=$ROOT/.cache/k8s/bin/devbroker-dra-plugin
# -s -w (no symbol table, no DWARF) as build.sh links the cluster: 72 MB become ~50, which
# matters when the binary is carried to a GPU machine (scripts/k8s/pack-h200.sh).
LDFLAGS="-s -w"
STAMP=$ROOT/.cache/k8s/bin/.stamp-dra
mkdir -p "$(dirname "$OUT")"
if [[ -x $OUT ]] && [[ $(cat "$STAMP" 2>/dev/null) == "ldflags=$LDFLAGS" ]] && [[ -z $(find "$SRC" \( -name '*.go' -o -name go.mod -o -name go.sum \) -newer "$OUT" -print -quit) ]]; then
    echo "build-dra: $OUT is up to date"
    exit 0
fi
cd "$SRC"
export GOFLAGS="${GOFLAGS:--buildvcs=false}"
# no -trimpath: the Go build cache is keyed on it, and the cluster's builds fill a plain one
go build -ldflags="$LDFLAGS" -o "$OUT.tmp" .
mv -f "$OUT.tmp" "$OUT"
echo "ldflags=$LDFLAGS" > "$STAMP"
echo "build-dra: built $OUT"
