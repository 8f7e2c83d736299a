#!/bin/bash
# What the H200's channel-group timeslices do to two busy CUDA processes (issue 15), without
# devbroker: the measurements the broker's slice choice (broker/compute.py) is based on.
#   run(command="OUT=$OUT bash scripts/gpu/compute_sweep.sh", carry=[".whl"], timeout_s=420)
# Plain root processes; scripts/gpu/greedy_tsg.c (preloaded) turns CUDA's own SET_TIMESLICE on
# its compute channel group into the slice under test (GREEDY_US) and leaves the interleave
# level alone unless GREEDY_LEVEL says otherwise. Parts:
#   pairs    two matmul loops (compute_workload.py, MATMUL_BATCH matmuls per synchronize)
#            with slices A:B: the measured throughput ratio against A/B
#   latency  a latency loop (4 small kernels + synchronize, CUDA's slice) next to a matmul
#            loop whose slice is L: p50 step time against alone
# Writes $OUT/run.log and $OUT/results.json.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
gpu_run_start compute-sweep
install_wheels
WL="$PY $REPO/scripts/gpu/compute_workload.py"
SO=/tmp/greedy_tsg.so
gcc -O2 -shared -fPIC -o $SO scripts/gpu/greedy_tsg.c -lpthread || exit 1
at() { "$PY" -c "import time; print(f'{time.time() + $1:.3f}')"; }
SECS=${SECS:-8}

# pair NAME A_US B_US [BATCH] [A_LEVEL B_LEVEL]
pair() { local name=$1 a=$2 b=$3 batch=${4:-4} la=${5:-none} lb=${6:-none} t; t=$(at 7)
  timeout 60 env MATMUL_BATCH=$batch GREEDY_US=$a GREEDY_LEVEL=$la LD_PRELOAD=$SO $WL matmul $SECS "$t" a > "$W/$name.a" 2> "$W/$name.a.err" & local pa=$!
  timeout 60 env MATMUL_BATCH=$batch GREEDY_US=$b GREEDY_LEVEL=$lb LD_PRELOAD=$SO $WL matmul $SECS "$t" b > "$W/$name.b" 2> "$W/$name.b.err" & local pb=$!
  wait $pa; wait $pb
  grep -h "greedy:" "$W/$name.a.err" "$W/$name.b.err" | head -4
  local r; r=$($WL ratio "$W/$name.a" "$W/$name.b")
  echo "$name slices $a:$b batch $batch levels $la:$lb -> $r"
  put "pair_${name}" "{\"slices\": [$a, $b], \"batch\": $batch, \"levels\": [\"$la\", \"$lb\"], \"measured\": $r}"
}

step "one matmul loop alone"
timeout 60 $WL matmul $SECS "$(at 6)" alone > "$W/alone.json" 2>&1
put alone "$(grep -o '"tflops": [0-9.]*' "$W/alone.json")"
step "pairs: slice ratio 3:1 at several scales, 1:1, and the batch size"
pair s3_2048 6144 2048
pair s3_1024 3072 1024
pair s3_512 1536 512
pair s3_256 768 256
pair s3_128 384 128
pair s3_4096 12288 4096
pair s3_8192 24576 8192
pair s1_1024 1024 1024
pair s3_1024_b16 3072 1024 16
pair s3_256_b16 768 256 16
pair s3_1024_lvl 3072 1024 4 2 0

step "latency next to a matmul loop with slice L"
timeout 60 $WL latency $SECS "$(at 6)" alone > "$W/lat_alone.json" 2>&1
put lat_alone "$(tail -1 "$W/lat_alone.json")"
for L in 64 128 256 1024; do
  t=$(at 7)
  timeout 60 $WL latency $SECS "$t" high > "$W/lat_$L.json" 2>&1 & pa=$!
  timeout 60 env GREEDY_US=$L GREEDY_LEVEL=none LD_PRELOAD=$SO $WL matmul $SECS "$t" low > "$W/lat_${L}_low.json" 2> "$W/lat_${L}_low.err" & pb=$!
  wait $pa; wait $pb
  put "lat_low_$L" "{\"latency\": $($WL pct "$W/lat_$L.json" "$W/lat_alone.json"), \"low\": {$(grep -o '"tflops": [0-9.]*' "$W/lat_${L}_low.json")}}"
done
# the same with the levels a root process may set: latency HIGH, matmul LOW (slice 256)
t=$(at 7)
timeout 60 env GREEDY_US=2048 GREEDY_LEVEL=2 LD_PRELOAD=$SO $WL latency $SECS "$t" high > "$W/lat_lvl.json" 2> "$W/lat_lvl.err" & pa=$!
timeout 60 env GREEDY_US=256 GREEDY_LEVEL=0 LD_PRELOAD=$SO $WL matmul $SECS "$t" low > "$W/lat_lvl_low.json" 2> "$W/lat_lvl_low.err" & pb=$!
wait $pa; wait $pb
grep -h "greedy:" "$W/lat_lvl.err" "$W/lat_lvl_low.err" | head -6
put lat_levels_high_low_256 "{\"latency\": $($WL pct "$W/lat_lvl.json" "$W/lat_alone.json"), \"low\": {$(grep -o '"tflops": [0-9.]*' "$W/lat_lvl_low.json")}}"
cat "$RES"
