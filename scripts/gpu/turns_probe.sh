#!/bin/bash
# A short H200 run of issue 12's launch-bound and matmul targets with a native process and a
# devbroker tenant alive at once, taking turns on the GPU (cuda_checks.py turns): PAIRS
# pairs (2), the side going first alternating, both pinned to CPU BENCH_CPU (3).
#   run(command="bash scripts/gpu/turns_probe.sh", carry=[".whl"], timeout_s=300)
# TURNS_TINY / TURNS_MM: units of each kind per process (60 / 30).
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start turns-probe
RUN=/run/devbroker-turns
probe_broker "$RUN" "${POLICY:-scripts/gpu/h200-cuda-policy.toml}" "$W/audit.log" "$W/broker.log"
turns_setup
for i in $(seq 1 "${PAIRS:-2}"); do
  step "pair $i"
  if [ $((i % 2)) = 1 ]; then turns_pair "$i" b a ptexec; else turns_pair "$i" a b ptexec; fi
done
kill -TERM $BROKER; wait $BROKER
step "summary"
"$PY" scripts/gpu/turns_summary.py "$RES" | tee "$OUT/summary.txt"
