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
gpu_run_start nvml-probe
RUN=/run/devbroker-nvml
METRICS=http://127.0.0.1:9464/metrics
install_wheels
"$PY" -m devbroker.native >/dev/null || echo "native loop did not build"
CHK="$PY scripts/gpu/cuda_checks.py"
put native_nvml_seq "$("$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
for i in 1 2 3; do put "native_init$i" "$($CHK init 2>&1 | last)"; done
POL="$W/policy.toml"
{ cat scripts/gpu/h200-cuda-policy.toml; printf '\n[broker.metrics]\nlisten = "127.0.0.1:9464"\n'; } > "$POL"
probe_broker "$RUN" "$POL" "$W/audit.log" "$W/broker.log"
grep "seccomp listeners" "$W/broker.log"
"$PY" scripts/gpu/calls.py snap $METRICS "$W/m0.json"
step "NVML sequence x30 (and one warm-up) through devbroker"
put dev_nvml_seq "$(ptexec "$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
"$PY" scripts/gpu/calls.py snap $METRICS "$W/m1.json"
put dev_nvml_listener "$(grep '"tenant-detached"' "$W/audit.log" | tail -1)"
step "CUDA init + first allocation x3 through devbroker"
for i in 1 2 3; do put "dev_init$i" "$(ptexec $CHK init 2>&1 | last)"; done
"$PY" scripts/gpu/calls.py snap $METRICS "$W/m2.json"
put dev_init_listener "$(grep '"tenant-detached"' "$W/audit.log" | tail -1)"
kill -TERM $BROKER; wait $BROKER
step "per-call broker time: NVML sequence"
"$PY" scripts/gpu/calls.py diff "$W/m0.json" "$W/m1.json" 31 | tee "$OUT/nvml-calls.txt"
step "per-call broker time: CUDA init (import included)"
"$PY" scripts/gpu/calls.py diff "$W/m1.json" "$W/m2.json" 3 | tee "$OUT/cuda-calls.txt"
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
