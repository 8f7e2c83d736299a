#!/bin/bash
# One pod on a real one-node Kubernetes cluster running PyTorch with its ResourceClaim's
# quota, on the lent H200 (issue 48; docs/kubernetes.md, "On a GPU node"). The cluster's
# programs travel packed in parts (scripts/k8s/pack-h200.sh prints the device calls): each
# call but the last carries one part and runs `--stage P` (unpack it, report what this
# machine has); the last carries the last part and runs the job:
#   run(command="bash scripts/gpu/run-h200-k8s.sh --stage a", carry=[".k8spack/a"], timeout_s=120)
#   run(command="bash scripts/gpu/run-h200-k8s.sh", carry=[".k8spack/b"], timeout_s=560)
# A machine keeps the ignored files of earlier calls while it stays warm (~30 s after a call):
# make the calls one right after the other. The job says which part it lacks if one is gone.
#
#   scripts/gpu/run-h200-k8s.sh [--stage P] [--backend real|emulated]
#
# The job: the broker (`devbroker run --backend real`), the test cluster of
# devbroker.testing.k8s with one node (etcd, apiserver, controller manager, scheduler,
# containerd 2.4 + Debian's runc, kubelet), the DRA plugin, the pause and host-tools images
# built here, a ResourceClaimTemplate of 8 GiB and ONE pod: nvidia-smi shows 8192 MiB, torch
# allocates 6 GiB and gets OutOfMemoryError at 12 GiB; then the pod is deleted and its tenant
# is gone (scripts/gpu/k8s_pod_run.py). If the cluster cannot get the pod to run, the same
# container runs by runc with the CDI spec and the seccomp hand-over (the fallback, logged
# as such). `--backend emulated` runs it all on a machine without a GPU (nvidia-smi only).
# Into $OUT (default /tmp/h200-k8s-out): run.log (timestamped), results.json, probe.json,
# bundle.tgz (broker, audit, plugin, kubelet, containerd, apiserver ... logs, the pod spec).
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
STAGE=run BACKEND=real
while [ $# -gt 0 ]; do
  case $1 in
    --stage) STAGE=$2; shift 2 ;;
    --backend) BACKEND=$2; shift 2 ;;
    *) echo "usage: $0 [--stage P] [--backend real|emulated]" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/h200-k8s-out}; mkdir -p "$OUT"
W=/tmp/h200-k8s-work
PY=${PY:-$(command -v python3)}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
exec > >("$PY" -u -c '
import sys, time
for line in sys.stdin:
    sys.stdout.write(time.strftime("%H:%M:%S ") + line)
    sys.stdout.flush()' | tee -a "$OUT/run.log") 2>&1
LOGGER=$!
# the last lines reach run.log and the caller before the script's exit is reported
trap 'exec >&- 2>&-; wait $LOGGER 2>/dev/null || sleep 1' EXIT
step() { echo "=== $* (+$(( $(date +%s) - T0 ))s)"; }
# where scripts/k8s/pack_h200.py unpacks (outside the checkout: kept between calls)
PACKROOT=${K8SPACK_ROOT:-/tmp/devbroker-k8spack}
export K8SPACK_ROOT=$PACKROOT
BIN=$PACKROOT/bin
DEB=$PACKROOT/debian

step "stage $STAGE, backend $BACKEND, $(uname -r), python $PY"
ls -d .k8spack/*/ 2>/dev/null | tr '\n' ' '; echo
"$PY" scripts/k8s/pack_h200.py unpack; UNPACK=$?

# The Debian tools: runc and the CNI plugins always (the GPU machine has neither); ip,
# nsenter, unshare and openssl only where this machine lacks its own (K8S_CARRIED_TOOLS=1:
# the carried ones all the same, to try them). Wrappers in $BIN, which comes first in every
# cluster process's PATH (devbroker.testing.k8s). The carried libraries reach the carried
# tool alone: runc re-executes itself (/proc/self/exe), so it gets LD_LIBRARY_PATH with
# libseccomp alone; the others are started by the loader with --library-path, which their
# children (nsenter's containerd and kubelet) do not inherit. All need glibc >= 2.34.
tools() {
  [ -d "$DEB" ] || return 0
  mkdir -p "$BIN" "$DEB/lib-runc"
  ln -sfn "$DEB/lib/libseccomp.so.2" "$DEB/lib-runc/libseccomp.so.2"
  local t ldso=/lib64/ld-linux-x86-64.so.2
  for t in runc ip nsenter unshare openssl; do
    [ -x "$DEB/$t" ] || continue
    if [ "$t" != runc ] && [ "${K8S_CARRIED_TOOLS:-0}" != 1 ] &&
       PATH=${PATH#$BIN:} command -v "$t" >/dev/null; then
      rm -f "$BIN/$t"; echo "tool $t: this machine's $(PATH=${PATH#$BIN:} command -v $t)"; continue
    fi
    { echo '#!/bin/sh'
      case $t in
        runc) echo "LD_LIBRARY_PATH=$DEB/lib-runc\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} exec $DEB/runc \"\$@\"" ;;
        openssl) echo "OPENSSL_CONF=$DEB/openssl.cnf exec $ldso --library-path $DEB/lib $DEB/openssl \"\$@\"" ;;
        *) echo "exec $ldso --library-path $DEB/lib $DEB/$t \"\$@\"" ;;
      esac; } > "$BIN/$t"
    chmod 755 "$BIN/$t"
    echo "tool $t: carried ($DEB/$t)"
  done
  export PATH=$BIN:$PATH
  export DEVBROKER_K8S_RUNC=$BIN/runc DEVBROKER_K8S_CNI_BIN=$DEB/cni
  "$BIN/runc" --version 2>&1 | head -1
}
tools
if [ -d "$PACKROOT/whl" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$PACKROOT"/whl/*.whl && echo "wheels installed into /tmp/site"
fi
export PYTHONPATH="$REPO/src:/tmp/site"
# The runtime runs the CDI spec's hook (`PY -m devbroker.cli.main oci-hook`) with an
# environment of its own, no PYTHONPATH: the broker and the plugin run from a venv whose .pth
# names the checkout, the wheels and this python's own packages (what `pip install -e` would
# give). The pod runs this machine's own python ($HOST_PY, where torch is).
HOST_PY=$PY
VENV=/tmp/h200-k8s-venv
if [ ! -x "$VENV/bin/python" ]; then
  "$HOST_PY" -m venv --without-pip "$VENV" || { echo "NOT RUN: python3 -m venv failed"; exit 1; }
fi
"$HOST_PY" -c 'import sys; print("\n".join([sys.argv[1], "/tmp/site"] + [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]))' "$REPO/src" \
  > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/devbroker-checkout.pth"
PY=$VENV/bin/python
"$PY" -c 'import devbroker, trio; print("broker python:", devbroker.__file__, "trio", trio.__version__)' || exit 1

if [ "$STAGE" != run ]; then
  step "what this machine has (probe.json)"
  "$HOST_PY" scripts/gpu/k8s_pod_run.py probe > "$OUT/probe.json"; cat "$OUT/probe.json"
  [ -x "$BIN/kube" ] && "$BIN/kube" kubelet --version
  [ -x "$BIN/containerd" ] && "$BIN/containerd" --version
  step "stage $STAGE done (unpack exit $UNPACK: 0 all parts in place, 3 parts still to come)"
  exit 0
fi
if [ $UNPACK != 0 ]; then
  echo "NOT RUN: the pack is incomplete (above: the parts still to carry). Parts carried in"
  echo "earlier calls are kept only while the machine stays warm: make the calls again, one"
  echo "right after the other (scripts/k8s/pack-h200.sh printed them)."
  exit 1
fi

step "what this machine has"
rm -rf "$W"; mkdir -p "$W"
"$HOST_PY" scripts/gpu/k8s_pod_run.py probe > "$OUT/probe.json"; cat "$OUT/probe.json"
# A state dir's file system that cannot take an overlay's upper layer: containerd's native
# snapshotter (copies) instead.
if ! grep -q '"overlay_mount": "ok"' "$OUT/probe.json"; then
  echo "overlay mounts fail here: containerd uses the native snapshotter"
  export DEVBROKER_K8S_SNAPSHOTTER=native
fi
# the pod's container and the runtime's hook run as root: the checkout and wheels readable
chmod -R a+rX /tmp/site 2>/dev/null

step "the broker, the cluster, the plugin, the pod (scripts/gpu/k8s_pod_run.py)"
"$PY" scripts/gpu/k8s_pod_run.py run --backend "$BACKEND" --bin-dir "$BIN" --work "$W" \
  --out "$OUT" --facts "$OUT/probe.json" --deadline "${DEADLINE:-420}"
RC=$?   # 0: the pod ran as it must; 2: only the fallback did; 1: neither
step "results.json"
cat "$OUT/results.json"
tar czf "$OUT/bundle.tgz" -C "$W" . 2>/dev/null
ls -la "$OUT"
step "done: exit $RC"
exit $RC
