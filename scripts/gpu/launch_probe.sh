#!/bin/bash
# A short H200 run for issue 12's launch-bound target (2,000 tiny kernels ≤ 2 % slower
# through devbroker) and the matmul one: `cuda_checks.py bench` (median of BENCH_PASSES
# passes of the tiny loop after a warm-up pass) natively and in a devbroker tenant,
# alternating, ROUNDS times each, every process pinned to the same CPU (BENCH_CPU, default
# 3): the loop is CPU-bound, and unpinned it ran in two modes (~12.5 / ~18 ms) natively
# and through devbroker alike, by where the process happened to run.
#   run(command="bash scripts/gpu/launch_probe.sh", carry=[".whl"], timeout_s=300)
# ROUNDS=N rounds (4), BENCH_PASSES=N passes per process (21), SYSTIME=1 (below),
# POLICY=FILE (scripts/gpu/h200-cuda-policy.toml).
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start launch-probe
RUN=/run/devbroker-launch
CHK="$PY scripts/gpu/cuda_checks.py"
ROUNDS=${ROUNDS:-4}
export BENCH_CPU=${BENCH_CPU:-3} BENCH_PASSES=${BENCH_PASSES:-21}
probe_broker "$RUN" "${POLICY:-scripts/gpu/h200-cuda-policy.toml}" "$W/audit.log" "$W/broker.log"
# SYSTIME=1: every process under scripts/gpu/systime.c, which writes the NVIDIA ioctls (by
# kind), opens and mmaps of the timed tiny-kernel passes alone (cuda_checks.py's "tiny"
# window): does the loop reach the driver, or the broker, at all?
pre() { :; }
if [ "${SYSTIME:-0}" = 1 ]; then
  ST=/tmp/systime; rm -rf $ST; mkdir -p $ST; chmod 1777 $ST
  cc -O2 -shared -fPIC -o /tmp/site/systime.so scripts/gpu/systime.c -ldl || echo "systime.so did not build"
  BINDS+=(--bind "$ST:$ST:rw")
  pre() { echo env LD_PRELOAD=/tmp/site/systime.so SYSTIME_KINDS=1 SYSTIME_OUT=$ST/$1.jsonl; }
fi
for i in $(seq 1 "$ROUNDS"); do
  step "round $i (CPU $BENCH_CPU)"
  put "native_bench$i" "$($(pre native$i) $CHK bench 2>&1 | last)"
  put "dev_bench$i" "$(ptexec $(pre dev$i) env BENCH_CPU=$BENCH_CPU BENCH_PASSES=$BENCH_PASSES $CHK bench 2>&1 | last)"
done
if [ "${SYSTIME:-0}" = 1 ]; then
  step "system calls of the timed tiny-kernel passes (systime.so, window \"tiny\")"
  grep -h '"window": "tiny"' $ST/*.jsonl | cut -c1-600 | tee "$OUT/tiny-systime.txt"
fi
kill -TERM $BROKER; wait $BROKER
step "summary"
"$PY" - "$RES" "$ROUNDS" <<'PYX' | tee "$OUT/launch.txt"
import json, statistics, sys
d, rounds = json.load(open(sys.argv[1])), int(sys.argv[2])
rows = {k: [d.get(f"{k}_bench{i}", {}) for i in range(1, rounds + 1)] for k in ("native", "dev")}
for k, rs in rows.items():
    print(k, "tiny medians (ms)", [round(1e3 * r.get("tiny_2000_s", 0), 2) for r in rs],
          "mins", [round(1e3 * r.get("tiny_2000_min_s", 0), 2) for r in rs],
          "cpus", [r.get("cpus") for r in rs], "tflops", [r.get("bf16_tflops") for r in rs])
ratios = [b.get("tiny_2000_s", 0) / a["tiny_2000_s"] for a, b in zip(rows["native"], rows["dev"])
          if a.get("tiny_2000_s")]
allp = {k: sorted(p for r in rs for p in r.get("tiny_2000_passes", [])) for k, rs in rows.items()}
med = {k: statistics.median(v) if v else 0 for k, v in allp.items()}
print("per-round ratio (devbroker / native, the native run just before):",
      [round(r, 3) for r in ratios])
# each process runs in one of two modes (~13 / ~19 ms) for all its passes: the median of
# the per-process medians compares the two sides process for process
mm = {k: statistics.median(r["tiny_2000_s"] for r in rs if r.get("tiny_2000_s"))
      for k, rs in rows.items() if any(r.get("tiny_2000_s") for r in rs)}
if len(mm) == 2:
    print(f"median of the {rounds} per-process medians: native {1e3 * mm['native']:.2f} ms, "
          f"devbroker {1e3 * mm['dev']:.2f} ms: {mm['dev'] / mm['native']:.3f}x; slow-mode "
          "processes (> 16 ms): native "
          f"{sum(r.get('tiny_2000_s', 0) > 0.016 for r in rows['native'])}, devbroker "
          f"{sum(r.get('tiny_2000_s', 0) > 0.016 for r in rows['dev'])}")
if med["native"]:
    print(f"median of every pass: native {1e3 * med['native']:.2f} ms, devbroker "
          f"{1e3 * med['dev']:.2f} ms: {med['dev'] / med['native']:.3f}x "
          f"({len(allp['native'])} / {len(allp['dev'])} passes)")
tf = {k: statistics.median(r.get("bf16_tflops", 0) for r in rs) for k, rs in rows.items()}
if tf["native"]:
    print(f"bf16 median TFLOP/s: native {tf['native']}, devbroker {tf['dev']}: "
          f"S = {1 - tf['dev'] / tf['native']:.4f}")
PYX
