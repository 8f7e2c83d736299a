#!/bin/bash
# A short H200 run: where NVML's init sequence and a CUDA init spend their time through
# devbroker (issue 14: NVML ≤ 1.5× native; issue 12: CUDA init + first allocation ≤ 1.15×).
# A broker with the real backend and a metrics endpoint; a seccomp tenant runs the NVML
# sequence 30 times, then `cuda_checks.py init` 3 times (each natively first); the per-call
# broker time of each phase comes from the endpoint (snapshots before and after,
# scripts/gpu/calls.py) and the listener's counters from the tenant-detached records.
#   run(command="bash scripts/gpu/nvml_probe.sh", carry=[".whl"], timeout_s=300)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start nvml-probe
RUN=/run/devbroker-nvml
METRICS=http://127.0.0.1:9464/metrics
CHK="$PY scripts/gpu/cuda_checks.py"
# systime.so (scripts/gpu/systime.c): each process's wall time in open/ioctl/mmap/close,
# NVIDIA files apart, natively and in the tenant (what the broker's metrics cannot see).
ST=/tmp/systime; rm -rf $ST; mkdir -p $ST; chmod 1777 $ST  # (bound into the tenant writable)
cc -O2 -shared -fPIC -o /tmp/site/systime.so scripts/gpu/systime.c -ldl || echo "systime.so did not build"
shim() { env LD_PRELOAD=/tmp/site/systime.so SYSTIME_KINDS=1 SYSTIME_OUT=$ST/$1.jsonl "${@:2}"; }
put native_nvml_seq "$(shim native-nvml "$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
for i in 1 2 3; do put "native_init$i" "$(shim native-init$i $CHK init 2>&1 | last)"; done
POL="$W/policy.toml"
{ cat scripts/gpu/h200-cuda-policy.toml; printf '\n[broker.metrics]\nlisten = "127.0.0.1:9464"\n'; } > "$POL"
probe_broker "$RUN" "$POL" "$W/audit.log" "$W/broker.log"
BINDS+=(--bind "$ST:$ST:rw")
grep "seccomp listeners" "$W/broker.log"
"$PY" scripts/gpu/calls.py snap $METRICS "$W/m0.json"
step "NVML sequence x30 (and one warm-up) through devbroker"
put dev_nvml_seq "$(ptexec env LD_PRELOAD=/tmp/site/systime.so SYSTIME_KINDS=1 SYSTIME_OUT=$ST/dev-nvml.jsonl "$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
"$PY" scripts/gpu/calls.py snap $METRICS "$W/m1.json"
put dev_nvml_listener "$(grep '"tenant-detached"' "$W/audit.log" | tail -1)"
step "CUDA init + first allocation x3 through devbroker"
for i in 1 2 3; do put "dev_init$i" "$(ptexec env LD_PRELOAD=/tmp/site/systime.so SYSTIME_KINDS=1 SYSTIME_OUT=$ST/dev-init$i.jsonl $CHK init 2>&1 | last)"; done
"$PY" scripts/gpu/calls.py snap $METRICS "$W/m2.json"
put dev_init_listener "$(grep '"tenant-detached"' "$W/audit.log" | tail -1)"
SPY=/tmp/site/bin/py-spy
if [ -x $SPY ]; then
  step "NVML sequence x30 through devbroker under py-spy (not timed)"
  $SPY record --nonblocking -p $BROKER -d 6 -r 2000 -f raw --threads -o "$W/prof_nvml.txt" > /dev/null 2>&1 &
  SPYP=$!; sleep 0.5
  ptexec "$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last
  wait $SPYP
  "$PY" scripts/gpu/spysum.py "$W/prof_nvml.txt" | tee "$OUT/prof_nvml.summary" | head -45
  step "a fourth CUDA init through devbroker under py-spy (not timed)"
  $SPY record --nonblocking -p $BROKER -d 8 -r 2000 -f raw --threads -o "$W/prof_init.txt" > /dev/null 2>&1 &
  SPYP=$!; sleep 0.5
  ptexec $CHK init 2>&1 | last
  wait $SPYP
  "$PY" scripts/gpu/spysum.py "$W/prof_init.txt" | tee "$OUT/prof_init.summary" | head -45
fi
kill -TERM $BROKER; wait $BROKER
# what went wrong, if anything: the broker's last lines and its non-refusal audit records
step "the broker's last lines, and its audit records other than refusals"
tail -40 "$W/broker.log"
grep -v '"event": "deny"' "$W/audit.log" | grep -v tenant-detached | tail -30
step "per-call broker time: NVML sequence"
"$PY" scripts/gpu/calls.py diff "$W/m0.json" "$W/m1.json" 31 | tee "$OUT/nvml-calls.txt"
step "per-call broker time: CUDA init (import included)"
"$PY" scripts/gpu/calls.py diff "$W/m1.json" "$W/m2.json" 3 | tee "$OUT/cuda-calls.txt"
step "wall time in system calls per process (systime.so): ms and calls, native vs devbroker"
"$PY" - $ST <<'PYX' | tee "$OUT/systime.txt"
import json, sys, glob, os
rows = ("open_nvidia", "open_other", "ioctl_nvidia", "ioctl_other", "mmap_nvidia", "mmap_other", "close")
def load(name):
    recs = [json.loads(l) for f in glob.glob(os.path.join(sys.argv[1], name + ".jsonl")) for l in open(f)]
    # the measured program is the process with the most calls (python3 itself)
    return max(recs, key=lambda r: sum(r[k][0] for k in rows)) if recs else None
for a, b in [("native-nvml", "dev-nvml")] + [(f"native-init{i}", f"dev-init{i}") for i in (1, 2, 3)]:
    n, d = load(a), load(b)
    if not n or not d:
        print(a, b, "missing"); continue
    print(f"{a} vs {b}: " + "; ".join(
        f"{k} {n[k][1]:.1f}/{d[k][1]:.1f} ms ({n[k][0]}/{d[k][0]})" for k in rows))
PYX
step "CUDA init per call kind (systime.so): what the broker adds to each kind, per run"
"$PY" scripts/gpu/calls.py kinds $ST native-init dev-init "$(cat /sys/module/nvidia/version 2>/dev/null)" | tee "$OUT/kinds.txt"
step "NVML's sequence per call kind (systime.so), per run of 31 sequences"
"$PY" scripts/gpu/calls.py kinds $ST native-nvml dev-nvml "$(cat /sys/module/nvidia/version 2>/dev/null)" | tee "$OUT/kinds-nvml.txt" | head -40
cp $ST/*.jsonl "$W/" 2>/dev/null
step "summary"
"$PY" - "$RES" <<'PYX'
import json, sys
d = json.load(open(sys.argv[1]))
n, v = d.get("native_nvml_seq", {}), d.get("dev_nvml_seq", {})
if n.get("p50_us") and v.get("p50_us"):
    print(f"NVML sequence p50 {v['p50_us'] / 1e3:.1f} ms vs {n['p50_us'] / 1e3:.1f} native: "
          f"{v['p50_us'] / n['p50_us']:.2f}x")
ni = [d.get(f"native_init{i}", {}).get("init_first_alloc_s") for i in (1, 2, 3)]
di = [d.get(f"dev_init{i}", {}).get("init_first_alloc_s") for i in (1, 2, 3)]
print("CUDA init + first allocation (s): native", ni, "through devbroker", di)
PYX
