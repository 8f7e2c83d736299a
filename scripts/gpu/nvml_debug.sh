#!/bin/bash
# NVML's init sequence through one broker per mode of MODES ("name" or
# "name:VAR=value,..."; the broker's environment), its audit log and the broker's own log
# kept in $OUT (the refusals say which call failed), with the pynvml traceback.
#   run(command="MODES='a b:DEVBROKER_X=0' bash scripts/gpu/nvml_debug.sh", carry=[".whl"])
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start nvml-debug
MODES=${MODES:-"a"}
N=${N:-10}
n=0
for mode in $MODES; do
  n=$((n + 1))
  name=$(mode_name "$mode")
  step "broker $n: $name ($(mode_vars "$mode"))"
  RUN=/run/devbroker-dbg$n
  mode_broker "$mode" "$RUN" scripts/gpu/h200-cuda-policy.toml "$OUT/audit-$name.log" "$OUT/broker-$name.log"
  ptexec "$PY" -X faulthandler -c "
import json, sys, traceback, pynvml as nv
for i in range($N):
    try:
        nv.nvmlInit(); h = nv.nvmlDeviceGetHandleByIndex(0); nv.nvmlDeviceGetMemoryInfo(h); nv.nvmlShutdown()
    except Exception as e:
        print('sequence', i, 'failed:', repr(e)); traceback.print_exc(); break
else:
    print('all', $N, 'sequences passed')
" 2>&1 | tee "$OUT/nvml-$name.txt"
  "$PY" -m devbroker.cli.main --run-dir "$RUN" status --json > "$OUT/status-$name.json" 2>&1
  kill -TERM $BROKER; wait $BROKER
  grep -c '"deny"' "$OUT/audit-$name.log"
done
