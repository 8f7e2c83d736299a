#!/bin/bash
# A short H200 run for issue 12's launch-bound target (2,000 tiny kernels ≤ 2 % slower
# through devbroker) and the matmul one: `cuda_checks.py bench` (median of 9 passes of the
# tiny loop) natively and in a devbroker tenant, alternating, three times each.
#   run(command="bash scripts/gpu/launch_probe.sh", carry=[".whl"], timeout_s=300)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start launch-probe
RUN=/run/devbroker-launch
CHK="$PY scripts/gpu/cuda_checks.py"
probe_broker "$RUN" scripts/gpu/h200-cuda-policy.toml "$W/audit.log" "$W/broker.log"
for i in 1 2 3; do
  step "round $i"
  put "native_bench$i" "$($CHK bench 2>&1 | last)"
  put "dev_bench$i" "$(ptexec $CHK bench 2>&1 | last)"
done
kill -TERM $BROKER; wait $BROKER
"$PY" - "$RES" <<'PYX'
import json, statistics, sys
d = json.load(open(sys.argv[1]))
for k in ("native", "dev"):
    rows = [d.get(f"{k}_bench{i}", {}) for i in (1, 2, 3)]
    print(k, "tiny median of medians", statistics.median(r.get("tiny_2000_s", 0) for r in rows),
          "tiny", [r.get("tiny_2000_s") for r in rows], "min", [r.get("tiny_2000_min_s") for r in rows],
          "tflops", [r.get("bf16_tflops") for r in rows])
PYX
