#!/usr/bin/env bash
# Build the DRA driver's kubelet plugin (k8s/dra, Go) into .cache/k8s/bin/devbroker-dra-plugin.
# Skips the build when the binary is newer than every source file (go.mod, go.sum, *.go):
# the Kubernetes pieces' build shares the Go module cache and the machine's cores.
# Needs Go (>= 1.26) and the Go module proxy (or a warm module cache).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SRC=$ROOT/k8s/dra
OUT=$ROOT/.cache/k8s/bin/devbroker-dra-plugin
mkdir -p "$(dirname "$OUT")"
if [[ -x $OUT ]] && [[ -z $(find "$SRC" \( -name '*.go' -o -name go.mod -o -name go.sum \) -newer "$OUT" -print -quit) ]]; then
    echo "build-dra: $OUT is up to date"
    exit 0
fi
cd "$SRC"
export GOFLAGS="${GOFLAGS:--buildvcs=false}"
# no -trimpath: the Go build cache is keyed on it, and the cluster's builds fill a plain one
go build -o "$OUT.tmp" .
mv -f "$OUT.tmp" "$OUT"
echo "build-dra: built $OUT"
