#!/bin/bash
# A/B probe of broker settings on the H200, in one device call: native first, then one
# broker per mode of MODES (each "name" or "name:VAR=value,VAR=value": the broker's
# environment), each measuring RM_CONTROL FB_GET_INFO_V2 p50 (2000 calls), NVML's init
# sequence x30 and CUDA init + first allocation x INITS as tenant c16; native again at the
# end (the host drifts: compare each mode with the natives around it). The lanes' counters
# and the listener's come from each broker's status and audit log. CHECKS: tenant_checks.py
# subcommands run once natively and once per mode after the timings (e.g. "dup-handle").
#   run(command="MODES='base pin:DEVBROKER_LISTENER_CPUS=2 base2' bash scripts/gpu/ab_probe.sh",
#       carry=[".whl"], timeout_s=540)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start ab-probe
MODES=${MODES:-"a b"}
INITS=${INITS:-3}
CHECKS=${CHECKS:-}
CHK="$PY scripts/gpu/cuda_checks.py"
native() {
  step "native ($1)"
  put "native$1_control" "$("$PY" scripts/gpu/tenant_checks.py bench-control 2000 2>&1 | last)"
  put "native$1_nvml_seq" "$("$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
  for i in $(seq "$INITS"); do put "native$1_init$i" "$($CHK init 2>&1 | last)"; done
  for c in $CHECKS; do put "native$1_$c" "$("$PY" scripts/gpu/tenant_checks.py "$c" 2>&1 | last)"; done
}
native 1
n=0
for mode in $MODES; do
  n=$((n + 1))
  name=$(mode_name "$mode")
  step "broker $n: $name ($(mode_vars "$mode"))"
  RUN=/run/devbroker-ab$n
  mode_broker "$mode" "$RUN" scripts/gpu/h200-cuda-policy.toml "$W/audit$n.log" "$W/broker$n.log"
  grep "seccomp listeners" "$W/broker$n.log"
  put "${name}_control" "$(ptexec "$PY" scripts/gpu/tenant_checks.py bench-control 2000 2>&1 | last)"
  put "${name}_nvml_seq" "$(ptexec "$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
  for i in $(seq "$INITS"); do put "${name}_init$i" "$(ptexec $CHK init 2>&1 | last)"; done
  for c in $CHECKS; do put "${name}_$c" "$(ptexec "$PY" scripts/gpu/tenant_checks.py "$c" 2>&1 | last)"; done
  put "${name}_lanes" "$("$PY" -m devbroker.cli.main --run-dir "$RUN" status --json 2>/dev/null | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({k: d.get(k) for k in ("control_lane", "continue_lane")}))')"
  put "${name}_listener" "$(grep '"tenant-detached"' "$W/audit$n.log" | tail -1)"
  kill -TERM $BROKER; wait $BROKER
  grep -v '"event": "deny"' "$W/audit$n.log" | grep -v tenant-detached | tail -5
done
native 2
step "summary"
MODES="$MODES" INITS="$INITS" "$PY" - "$RES" <<'PYX' | tee "$OUT/summary.txt"
import json, os, statistics, sys
d = json.load(open(sys.argv[1]))
inits = int(os.environ["INITS"])
def g(k, f):
    v = d.get(k)
    return v.get(f) if isinstance(v, dict) else None
def row(name):
    c, s = g(f"{name}_control", "p50_us"), g(f"{name}_nvml_seq", "p50_us")
    i = [g(f"{name}_init{k}", "init_first_alloc_s") for k in range(1, inits + 1)]
    return c, s, [x for x in i if x is not None]
nat = [row("native1"), row("native2")]
nc = statistics.mean(x[0] for x in nat if x[0]); nn = statistics.mean(x[1] for x in nat if x[1])
ni = statistics.median([v for x in nat for v in x[2]])
print(f"native (both rounds): RM_CONTROL p50 {[x[0] for x in nat]} us, NVML seq p50 "
      f"{[x[1] for x in nat]} us, init {[x[2] for x in nat]} (median {ni:.4f} s)")
for mode in os.environ["MODES"].split():
    name = mode.split(":")[0]
    c, s, i = row(name)
    med = statistics.median(i) if i else None
    print(f"{name}: RM_CONTROL p50 {c} us (+{(c or 0) - nc:.1f}), NVML seq {s} us "
          f"({(s or 0) / nn:.2f}x), init {i} ({med and round(med / ni, 3)}x on medians), "
          f"lanes {d.get(name + '_lanes')}")
PYX
