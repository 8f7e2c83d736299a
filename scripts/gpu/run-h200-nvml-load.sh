#!/bin/bash
# Issue 51 item 12 on the H200: four processes of one tenant looping NVML queries at the
# tenant's rate limit next to a training tenant, for a minute, through devbroker (real
# backend), on each front end. Done when: no refusal in the audit log for the NVML tenant,
# no NVML error in any process (the issue saw NVMLError_NoPermission in
# nvmlDeviceGetUtilizationRates, from a file of the tenant's refused as foreign and the
# unpublished 0x2080a097 refused), and the trainer within 1 % of its speed alone.
# One device-tool call from the repository root:
#   run(command="bash scripts/gpu/run-h200-nvml-load.sh", carry=[".whl"], timeout_s=600)
# Everything it writes is under $OUT: run.log, results.json (verdict_FE per front end),
# the audit logs and the workloads' JSON.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start h200-nvml-load
SECS=${SECS:-60}
cat > "$W/policy.toml" <<'TOML'
# scripts/gpu/run-h200-nvml-load.sh: a training tenant and an NVML tenant on GPU 0; the NVML
# tenant at a modest rate limit, so that four processes flooding meet it
[broker]
backend = "real"

[tenant.train]
gpus = [0]
memory_quota = "16GiB"
capabilities = ["nvml", "compute", "uvm"]

[tenant.mon]
gpus = [0]
memory_quota = "1GiB"
capabilities = ["nvml"]
rate_limit = { requests_per_second = 200, burst = 50 }
TOML
# texec FE TENANT CMD...: CMD as TENANT through front end FE (root in its sandbox)
texec() { local fe=$1 t=$2; shift 2
  timeout $((SECS + 240)) "$PY" -m devbroker.cli.main --run-dir "$PROBE_RUN" \
    exec --tenant "$t" --frontend "$fe" --uid 0 "${BINDS[@]}" -- env PYTHONPATH="$PYTHONPATH" "$@"; }
for fe in seccomp fuse; do
  step "$fe: broker"
  probe_broker /run/devbroker-nvml-load "$W/policy.toml" "$OUT/audit-$fe.log" "$OUT/broker-$fe.log"
  step "$fe: the trainer alone for $SECS s"
  at=$(( $(date +%s) + 25 ))
  texec $fe train "$PY" scripts/gpu/compute_workload.py matmul "$SECS" "$at" alone \
    > "$OUT/train-alone-$fe.json" 2> "$W/train-alone-$fe.err"; tail -c 300 "$OUT/train-alone-$fe.json"; echo
  step "$fe: the trainer next to four NVML-flooding processes of tenant mon, $SECS s"
  at=$(( $(date +%s) + 25 ))
  floods=()
  for i in 1 2 3 4; do
    texec $fe mon "$PY" scripts/gpu/nvml_flood.py flood "$SECS" "$at" "mon$i" \
      > "$OUT/flood$i-$fe.json" 2> "$OUT/flood$i-$fe.err" &
    floods+=($!)
  done
  texec $fe train "$PY" scripts/gpu/compute_workload.py matmul "$SECS" "$at" loaded \
    > "$OUT/train-loaded-$fe.json" 2> "$W/train-loaded-$fe.err"
  wait "${floods[@]}"
  for i in 1 2 3 4; do tail -c 300 "$OUT/flood$i-$fe.json"; echo; tail -3 "$OUT/flood$i-$fe.err"; done
  "$PY" -m devbroker.cli.main --run-dir "$PROBE_RUN" status --json > "$OUT/status-$fe.json" 2>&1
  kill $BROKER; wait $BROKER 2>/dev/null
  step "$fe: verdict"
  put "verdict_$fe" "$("$PY" scripts/gpu/nvml_flood.py verdict "$OUT/train-alone-$fe.json" \
      "$OUT/train-loaded-$fe.json" "$OUT"/flood[1-4]-$fe.json "$OUT/audit-$fe.log" mon)"
  grep -h '"tenant": "mon"' "$OUT/audit-$fe.log" | grep '"deny"\|"error"' | head -5
done
cat "$RES"
