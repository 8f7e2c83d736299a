#!/usr/bin/env bash
# Pack the test cluster for one pod on a lent GPU machine (docs/kubernetes.md, "On a GPU
# node"): builds what is missing (scripts/k8s/build.sh, build-dra.sh), fetches the wheels the
# GPU machine's Python lacks into .whl, then writes the git-ignored parts .k8spack/a, b, c ...
# (scripts/k8s/pack_h200.py: xz-compressed programs, Debian's runc, CNI plugins and tools, the
# wheels), each small enough to travel in one device call beside the working tree, and prints
# the device calls to make, one part each, the last one running scripts/gpu/run-h200-k8s.sh.
#
#   scripts/k8s/pack-h200.sh [--limit-mib N]
#
# Compressing everything takes a few minutes on two busy cores; the compressed files are kept
# in .k8spack/.cache by content, so a second pack (or one in a checkout given a copy of that
# folder) only copies.
set -euo pipefail
cd "$(dirname "$0")/../.."
say() { echo "pack-h200: $*" >&2; }

bash scripts/k8s/build.sh
bash scripts/k8s/build-dra.sh

# The wheels the GPU machine lacks (it has attrs, idna, sortedcontainers; docs/hardware.md).
need=()
for w in trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 prometheus_client==0.26.0; do
    n=${w%%==*}
    compgen -G ".whl/${n}-*.whl" >/dev/null || need+=("$w")
done
if [ ${#need[@]} -gt 0 ]; then
    say "downloading wheels: ${need[*]}"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 -d .whl "${need[@]}"
fi

summary=$(python3 scripts/k8s/pack_h200.py pack "$@")
parts=$(python3 -c 'import json, sys; print(" ".join(json.loads(sys.argv[1])["parts"]))' "$summary")
set -- $parts
last=${!#}
echo
echo "The device calls, one right after the other (a machine stays warm ~30 s after a call and"
echo "keeps the parts carried before; scripts/gpu/run-h200-k8s.sh says which part is missing):"
for p in $parts; do
    if [ "$p" = "$last" ]; then
        cmd="bash scripts/gpu/run-h200-k8s.sh"; t=560
    else
        cmd="bash scripts/gpu/run-h200-k8s.sh --stage $p"; t=120
    fi
    echo "  run(command=\"$cmd\", carry=[\".k8spack/$p\"], timeout_s=$t)"
done
