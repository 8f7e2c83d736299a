#!/bin/bash
# The hot path's speed before and after a change, in one call on the H200: a broker from the
# code before (.before/src, carried) and one from the checkout take turns (ABAB, ROUNDS each),
# each measuring RM_CONTROL latency (tenant_checks.py bench-control), the NVML init sequence
# (bench-nvml) and CUDA init + first allocation (cuda_checks.py init), with native
# measurements in the same rounds. Make .before from the revision to compare against:
#   rm -rf .before && mkdir .before && git archive REV src | tar -x -C .before
#   run(command="bash scripts/gpu/run-h200-ab.sh", carry=[".whl", ".before"], timeout_s=400)
# Writes run.log and results.json (ab_<tree>_<round>_<what>, native_<round>_<what>) to $OUT.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start h200-ab
[ -d .before/src/devbroker ] || { echo "no .before/src: see the header"; exit 1; }
ROUNDS=${ROUNDS:-2}
POL=scripts/gpu/h200-cuda-policy.toml
CHK="$PY scripts/gpu/cuda_checks.py"
SITE=/tmp/site
chmod -R a+rX "$REPO/.before" 2>/dev/null
PYTHONPATH="$REPO/.before/src:$SITE" "$PY" -m devbroker.native >/dev/null \
  || echo "the code before: native loop did not build"
for r in $(seq 1 "$ROUNDS"); do
  step "round $r: native"
  put "native_${r}_control" "$("$PY" scripts/gpu/tenant_checks.py bench-control 1000 2>&1 | last)"
  put "native_${r}_nvml" "$("$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
  put "native_${r}_init" "$($CHK init 2>&1 | last)"
  for tree in before after; do
    step "round $r: $tree"
    if [ $tree = before ]; then export PYTHONPATH="$REPO/.before/src:$SITE"
    else export PYTHONPATH="$REPO/src:$SITE"; fi
    BINDS=(); unset BINDS
    probe_broker /run/devbroker-ab "$POL" "$W/audit-$tree-$r.log" "$W/broker-$tree-$r.log"
    put "ab_${tree}_${r}_control" "$(ptexec "$PY" scripts/gpu/tenant_checks.py bench-control 1000 2>&1 | last)"
    put "ab_${tree}_${r}_nvml" "$(ptexec "$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
    put "ab_${tree}_${r}_init" "$(ptexec $CHK init 2>&1 | last)"
    put "ab_${tree}_${r}_init2" "$(ptexec $CHK init 2>&1 | last)"
    kill -TERM $BROKER; wait $BROKER 2>/dev/null
    grep -E '"deny"|"error"' "$W/audit-$tree-$r.log" | head -5 | cut -c1-300
  done
done
export PYTHONPATH="$REPO/src:$SITE"
cat "$RES"
