#!/bin/bash
# An H200 experiment for issue 15 (no broker): does NVA06C_CTRL_CMD_GPFIFO_SCHEDULE
# {bEnable = 0}, sent by a thread without capabilities on a busy CUDA process's own channel
# groups, stop its work — and what does a latency loop next to it see then? A low process
# runs bf16 matmuls for 26 s with scripts/gpu/pause_tsg.c preloaded, which disables its
# groups from second 10 to 18; latency loops (4 small kernels + synchronize per step) run
# alone first, then next to it busy (seconds 3-9), paused (11-17) and resumed (20-24).
#   run(command="bash scripts/gpu/pause_probe.sh", carry=[".whl"], timeout_s=240)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
gpu_run_start pause-probe
WL="$PY $REPO/scripts/gpu/compute_workload.py"
at() { "$PY" -c "import time; print(f'{time.time() + $1:.3f}')"; }
gcc -O2 -shared -fPIC -o "$W/pause_tsg.so" scripts/gpu/pause_tsg.c -lpthread || exit 1
step "latency loop alone"
$WL latency 6 "$(at 8)" alone > "$W/alone.json" 2> "$W/alone.err"; tail -1 "$W/alone.json"
step "low matmul with its groups paused from +10 to +18 s; latency loops next to it"
T0=$(at 12)
P=$("$PY" -c "print($T0 + 10)"); R=$("$PY" -c "print($T0 + 18)")
env LD_PRELOAD="$W/pause_tsg.so" PAUSE_MODE=${PAUSE_MODE:-tsg} PAUSE_AT=$P RESUME_AT=$R $WL matmul 26 "$T0" low \
  > "$W/low.json" 2> "$W/low.err" & PL=$!
$WL latency 6 "$("$PY" -c "print($T0 + 3)")" busy > "$W/busy.json" 2> "$W/busy.err" & PA=$!
$WL latency 6 "$("$PY" -c "print($T0 + 11)")" paused > "$W/paused.json" 2> "$W/paused.err" & PB=$!
$WL latency 4 "$("$PY" -c "print($T0 + 20)")" resumed > "$W/resumed.json" 2> "$W/resumed.err" & PC=$!
wait $PA $PB $PC; wait $PL; echo "low exit $?"
grep "pause:" "$W/low.err" | head -20
tail -3 "$W/low.err" | cut -c1-300
step "results"
for k in alone busy paused resumed; do put "latency_$k" "$(tail -1 "$W/$k.json")"; done
put low "$(tail -1 "$W/low.json")"
put pause_log "$(grep 'pause:' "$W/low.err" | paste -sd'|')"
"$PY" - "$RES" "$T0" "$P" "$R" <<'PYX' | tee "$OUT/summary.txt"
import json, sys
d = json.load(open(sys.argv[1])); t0, p, r = map(float, sys.argv[2:5])
for k in ("alone", "busy", "paused", "resumed"):
    x = d.get(f"latency_{k}", {})
    print(f"latency {k:8s} p50 {x.get('p50_us')} us p90 {x.get('p90_us')} steps {x.get('steps')}")
low = d.get("low", {})
bins, bs = low.get("bins", []), low.get("bin_s", 0.25)
start = low.get("start", t0)
def rate(a, b):
    sel = [n for i, n in enumerate(bins) if a <= start + i * bs < b]
    return round(sum(sel) / max(len(sel) * bs, 1e-9), 1)
print("low matmuls/s: before pause", rate(start + 1, p), "paused", rate(p + 0.5, r),
      "after", rate(r + 0.5, start + 26), "ok", low.get("ok"), "tflops", low.get("tflops"))
# PAUSE_MODE=escape: the process's own GPFIFO_SCHEDULE bEnable=1 two seconds into the pause
print("low matmuls/s: paused, before its own GPFIFO_SCHEDULE(1)", rate(p + 0.5, p + 2),
      "after it", rate(p + 2.5, r))
PYX
