#!/bin/bash
# A short H200 run of the FUSE front end with the real backend (issue 14): natively, then a
# broker per mode of MODES ("name" or "name:VAR=value,...", the broker's environment; by
# default one broker as it ships), each with a FUSE tenant running pynvml's checks,
# nvidia-smi, RM_CONTROL FB_GET_INFO_V2 x2000 and NVML's init sequence x30.
#   run(command="bash scripts/gpu/fuse_probe.sh", carry=[".whl"], timeout_s=300)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start fuse-probe
MODES=${MODES:-"fuse"}
TC="$PY scripts/gpu/tenant_checks.py"
step "native"
put native_control "$($TC bench-control 2000 2>&1 | last)"
put native_nvml_seq "$($TC bench-nvml 30 2>&1 | last)"
n=0
for mode in $MODES; do
  n=$((n + 1))
  name=$(mode_name "$mode")
  step "broker $n: $name ($(mode_vars "$mode"))"
  mode_broker "$mode" /run/devbroker-fuse$n scripts/gpu/h200-cuda-policy.toml "$W/audit$n.log" "$W/broker$n.log"
  fexec() { timeout 120 "$PY" -m devbroker.cli.main --run-dir "$PROBE_RUN" exec --tenant c16 \
      --uid 0 --frontend fuse "${BINDS[@]}" -- env PYTHONPATH="$PYTHONPATH" "$@"; }
  put "${name}_nvml" "$(fexec $TC nvml 2>&1 | last)"
  fexec nvidia-smi > "$W/smi$n.txt" 2>&1; put "${name}_smi_rc" "$?"
  head -12 "$W/smi$n.txt"
  put "${name}_control" "$(fexec $TC bench-control 2000 2>&1 | last)"
  put "${name}_nvml_seq" "$(fexec $TC bench-nvml 30 2>&1 | last)"
  put "${name}_lanes" "$("$PY" -m devbroker.cli.main --run-dir "$PROBE_RUN" status --json 2>/dev/null | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({k: d.get(k) for k in ("control_lane",)}))')"
  kill -TERM $BROKER; wait $BROKER
  grep -E '"error"|"violation"' "$W/audit$n.log" | tail -5; tail -3 "$W/broker$n.log"
done
step "summary"
MODES="$MODES" "$PY" - "$RES" <<'PYX' | tee "$OUT/summary.txt"
import json, os, sys
d = json.load(open(sys.argv[1]))
g = lambda k, f: d.get(k, {}).get(f) if isinstance(d.get(k), dict) else None
nc, ns = g("native_control", "p50_us"), g("native_nvml_seq", "p50_us")
print(f"native: RM_CONTROL p50 {nc} us, NVML sequence p50 {ns} us")
for mode in os.environ["MODES"].split():
    name = mode.split(":")[0]
    c, s = g(f"{name}_control", "p50_us"), g(f"{name}_nvml_seq", "p50_us")
    nv = d.get(f"{name}_nvml") if isinstance(d.get(f"{name}_nvml"), dict) else {}
    mem = [x.get("memory") for x in nv.get("gpus", [])]
    print(f"{name}: pynvml init {nv.get('init')}, {nv.get('count')} GPU(s), memory {mem}, "
          f"nvidia-smi rc {d.get(name + '_smi_rc')}, "
          f"RM_CONTROL p50 {c} us (+{(c or 0) - (nc or 0):.1f}), NVML sequence {s} us "
          f"({(s or 0) / (ns or 1):.2f}x), lanes {d.get(name + '_lanes')}")
PYX
