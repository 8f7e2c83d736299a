#!/bin/bash
# What the native loop's settled controls buy on the H200 (frontends/nativelane.py, "settled
# controls"), in one device call: native first, then one broker with settled controls on and
# one with them off (DEVBROKER_SETTLED=0), each measuring RM_CONTROL FB_GET_INFO_V2 p50, NVML's
# init sequence ×30 and CUDA init + first allocation ×3 as tenant c16; a second broker with
# them on ends the run (on/off/on: the host's drift shows). The control lane's counters
# (settled of admitted) are read from each broker's status after its tenants.
#   run(command="bash scripts/gpu/settled_probe.sh", carry=[".whl"], timeout_s=420)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start settled-probe
CHK="$PY scripts/gpu/cuda_checks.py"
step "native"
put native_control "$("$PY" scripts/gpu/tenant_checks.py bench-control 2000 2>&1 | last)"
put native_nvml_seq "$("$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
for i in 1 2 3; do put "native_init$i" "$($CHK init 2>&1 | last)"; done
n=0
for mode in on off on2; do
  n=$((n + 1))
  step "broker $n: settled controls ${mode%2}"
  RUN=/run/devbroker-settled$n
  DEVBROKER_SETTLED=$([ "$mode" = off ] && echo 0 || echo 1) \
    probe_broker "$RUN" scripts/gpu/h200-cuda-policy.toml "$W/audit$n.log" "$W/broker$n.log"
  grep "seccomp listeners" "$W/broker$n.log"
  put "${mode}_control" "$(ptexec "$PY" scripts/gpu/tenant_checks.py bench-control 2000 2>&1 | last)"
  put "${mode}_nvml_seq" "$(ptexec "$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
  for i in 1 2 3; do put "${mode}_init$i" "$(ptexec $CHK init 2>&1 | last)"; done
  put "${mode}_lane" "$("$PY" -m devbroker.cli.main --run-dir "$RUN" status --json 2>/dev/null | "$PY" -c 'import json,sys; print(json.dumps(json.load(sys.stdin).get("control_lane")))')"
  put "${mode}_listener" "$(grep '"tenant-detached"' "$W/audit$n.log" | tail -1)"
  kill -TERM $BROKER; wait $BROKER
  grep -v '"event": "deny"' "$W/audit$n.log" | grep -v tenant-detached | tail -5
done
step "summary"
"$PY" - "$RES" <<'PYX' | tee "$OUT/summary.txt"
import json, statistics, sys
d = json.load(open(sys.argv[1]))
def g(k, f):
    v = d.get(k)
    return v.get(f) if isinstance(v, dict) else None
nc, nn = g("native_control", "p50_us"), g("native_nvml_seq", "p50_us")
ni = [g(f"native_init{i}", "init_first_alloc_s") for i in (1, 2, 3)]
print(f"native: RM_CONTROL p50 {nc} us, NVML seq p50 {nn} us, init {ni}")
for m in ("on", "off", "on2"):
    c, s = g(f"{m}_control", "p50_us"), g(f"{m}_nvml_seq", "p50_us")
    i = [g(f"{m}_init{k}", "init_first_alloc_s") for k in (1, 2, 3)]
    try:
        ratio = statistics.median(i) / statistics.median(ni)
    except Exception:
        ratio = None
    print(f"{m}: RM_CONTROL p50 {c} us (+{(c or 0) - (nc or 0):.1f}), NVML seq {s} us "
          f"({(s or 0) / (nn or 1):.2f}x), init {i} ({ratio and round(ratio, 3)}x on medians), "
          f"lane {d.get(m + '_lane')}")
PYX
