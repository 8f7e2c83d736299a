#!/bin/bash
# The H200 run of issue 15 (compute shares), one device-tool call from the repository root:
#   run(command="bash scripts/gpu/compute_shares.sh", carry=[".whl"], timeout_s=480)
# .whl: the wheels the GPU host lacks (trio and its dependencies), as for run-h200-cuda.sh.
# About 5-6 minutes. Parts, each independent (a failure is logged and the run goes on):
#   a  what the unprivileged scheduling controls do on the real driver (a plain process), and
#      what a tenant gets through devbroker for the same calls
#   b  two tenants (seccomp front end, real backend), continuous bf16 matmuls for 20 s,
#      weights 3:1 then 1:1: throughput of each, ratio, sum vs one tenant alone
#   e  `devbroker policy apply` 1:1 -> 3:1 in the middle of a run: ratio before/after and how
#      long until the new ratio held
#   c  a high-priority latency loop (small kernels + synchronize) next to a low-priority
#      matmul loop: p50 step time vs alone (natively too, for comparison)
#   d  a greedy tenant (CUDA's own SET_TIMESLICE rewritten to 1 s from an LD_PRELOAD, with a
#      racing thread, plus SET_INTERLEAVE_LEVEL HIGH) next to a plain one: natively and
#      through devbroker; racing threads on the controls themselves
# Writes into $OUT: run.log, results.json (short: one entry per measurement), bundle.tgz
# (audit log, broker log, every workload's output). PARTS="a b e c d" selects parts;
# TURNS_MS=N runs them with the broker's weighted turns of N ms (broker/turns.py).
# EXTRAS=0 leaves out what the done-when items do not need (the 16-matmul batches of part b,
# the interleaved-runlist pair of part c), so that every part fits one 10-minute device call.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
gpu_run_start compute-shares
RUN=/run/devbroker-shares
PARTS=${PARTS:-a b e c d}
EXTRAS=${EXTRAS:-1}
install_wheels
WL="$PY $REPO/scripts/gpu/compute_workload.py"
"$PY" -c 'import trio, torch, sys; print("python", sys.version.split()[0], "trio", trio.__version__, "torch", torch.__version__)'
cat /proc/driver/nvidia/version; nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
trap 'kill $(jobs -p) 2>/dev/null; tar czf "$OUT/bundle.tgz" -C "$W" . 2>/dev/null' EXIT

# putall KEY FILE: every JSON line of FILE, as a list, under KEY
putall() { put "$1" "$("$PY" -c 'import json,sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]))' "$2" 2>&1)"; }
# part NAME FUNCTION: run one part; a failure (or a hang past its timeout) is logged, the run goes on
part() { local name=$1; shift
  case " $PARTS " in *" $name "*) ;; *) return 0;; esac
  step "part $name: $*"
  ( "$@" ); local rc=$?
  [ $rc -eq 0 ] || { echo "part $name FAILED (exit $rc)"; put "part_${name}_failed" "$rc"; }
}
# policy FILE WA PA WB PB: tenants sa and sb on GPU 0 with these weights and priorities
# (TURNS_MS=N: the broker's weighted turns, [broker] compute_turns_ms, broker/turns.py)
policy() { cat > "$1" <<EOF
[broker]
backend = "real"
compute_turns_ms = ${TURNS_MS:-0}

[tenant.sa]
gpus = [0]
memory_quota = "24GiB"
compute_weight = $2
priority = "$3"

[tenant.sb]
gpus = [0]
memory_quota = "24GiB"
compute_weight = $4
priority = "$5"
EOF
}
now() { date +%s.%N; }
at() { "$PY" -c "import time; print(f'{time.time() + $1:.3f}')"; }

# ------------------------------------------------------------------ native, before the broker
native_a() {
  timeout 60 "$PY" -m devbroker.tools.sched_probe probe > "$W/a_native.txt" 2>&1
  cat "$W/a_native.txt"; putall a_native_controls "$W/a_native.txt"
}
part a native_a
native_alone() {
  timeout 60 $WL matmul 6 "$(at 6)" native > "$W/alone_native.json" 2>&1
  tail -1 "$W/alone_native.json" | cut -c1-300; put alone_native "$(grep -o '"tflops": [0-9.]*' "$W/alone_native.json")"
}
part b native_alone

# ------------------------------------------------------------------ the broker
step "start the broker (real backend, weights 3:1)"
policy "$W/p31.toml" 3 normal 1 normal
policy "$W/p11.toml" 1 normal 1 normal
policy "$W/phl.toml" 1 high 1 low
rm -rf "$RUN"; mkdir -p "$RUN"
"$PY" -m devbroker.cli.main --run-dir "$RUN" run --backend real --policy "$W/p31.toml" \
   --audit "$W/audit.log" > "$W/broker.log" 2>&1 &
BROKER=$!
for i in $(seq 1 150); do [ -S "$RUN/seccomp.sock" ] && [ -S "$RUN/control.sock" ] && break
  sleep 0.2; kill -0 $BROKER 2>/dev/null || break; done
[ -S "$RUN/seccomp.sock" ] || { echo "broker did not start"; cat "$W/broker.log"; exit 1; }
DB=("$PY" -m devbroker.cli.main --run-dir "$RUN")
mapfile -t BINDS < <("$PY" -c 'from devbroker.testing.tenant_binds import bind_args; print("\n".join(bind_args()))' | sed '/^$/d')
BINDS+=(--bind /tmp/site)
texec() { local t=$1; shift
  timeout 120 "${DB[@]}" exec --tenant "$t" --uid 0 "${BINDS[@]}" -- env PYTHONPATH="$PYTHONPATH" PYTHONUNBUFFERED=1 "$@"; }
apply() { "${DB[@]}" policy apply "$1" && echo "applied $1 at $(now)"; }
shares() { "${DB[@]}" status --json | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({t["name"]: t.get("compute") for t in d["tenants"]}))'; }
# pair NAME SECONDS DELAY CMD_A... -- CMD_B...: two tenants (sa, sb) starting together
pair() { local name=$1 secs=$2 delay=$3; shift 3
  local a=() b=() x; while [ $# -gt 0 ]; do x=$1; shift; [ "$x" = -- ] && break; a+=("$x"); done; b=("$@")
  local t; t=$(at "$delay")
  texec sa "${a[@]//@T/$t}" > "$W/${name}_a.json" 2> "$W/${name}_a.err" & local pa=$!
  texec sb "${b[@]//@T/$t}" > "$W/${name}_b.json" 2> "$W/${name}_b.err" & local pb=$!
  echo "$t" > "$W/${name}.start"
  wait $pa; wait $pb
  local f; for f in "$W/${name}_a.err" "$W/${name}_b.err"; do echo "== $f"; tail -n 2 "$f" | cut -c1-300; done
}

part_a_broker() {
  texec sa "$PY" -m devbroker.tools.sched_probe probe > "$W/a_broker.txt" 2>&1
  cat "$W/a_broker.txt"; putall a_through_broker "$W/a_broker.txt"
  grep '"rewrite"\|MAKE_REALTIME\|SCHED_POLICY' "$W/audit.log" | tail -6 | cut -c1-400
}
part a part_a_broker

part_b() {
  texec sa $WL matmul 10 "$(at 10)" alone > "$W/alone.json" 2> "$W/alone.err"
  tail -1 "$W/alone.json" | cut -c1-200; put alone_broker "$(grep -o '"tflops": [0-9.]*' "$W/alone.json")"
  # MATMUL_BATCH: matmuls between synchronizations (4: ~6 ms of work alone, 16: ~25 ms)
  pair b31 20 10 $WL matmul 20 @T sa -- $WL matmul 20 @T sb
  shares; put b_shares_31 "$(shares)"
  put b_ratio_31 "$($WL ratio "$W/b31_a.json" "$W/b31_b.json")"
  if [ "$EXTRAS" = 1 ]; then
  pair b31x16 20 10 env MATMUL_BATCH=16 $WL matmul 20 @T sa -- env MATMUL_BATCH=16 $WL matmul 20 @T sb
  put b_ratio_31_batch16 "$($WL ratio "$W/b31x16_a.json" "$W/b31x16_b.json")"
  fi
  apply "$W/p11.toml"
  pair b11 20 10 $WL matmul 20 @T sa -- $WL matmul 20 @T sb
  put b_ratio_11 "$($WL ratio "$W/b11_a.json" "$W/b11_b.json")"
  if [ "$EXTRAS" = 1 ]; then
  pair b11x16 20 10 env MATMUL_BATCH=16 $WL matmul 20 @T sa -- env MATMUL_BATCH=16 $WL matmul 20 @T sb
  put b_ratio_11_batch16 "$($WL ratio "$W/b11x16_a.json" "$W/b11x16_b.json")"
  fi
  "$PY" - "$RES" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
alone = float(str(d.get("alone_broker", "")).split(":")[-1] or 0)
for k in ("b_ratio_31", "b_ratio_11", "b_ratio_31_batch16", "b_ratio_11_batch16"):
    r = d.get(k)
    if isinstance(r, dict) and alone:
        r["sum_vs_alone"] = round(r["sum_tflops"] / alone, 3)
json.dump(d, open(sys.argv[1], "w"), indent=1)
PYEOF
}
part b part_b

part_e() {
  apply "$W/p11.toml"
  local t; t=$(at 10)
  texec sa env MATMUL_BATCH=${E_BATCH:-16} $WL matmul 16 "$t" sa > "$W/e_a.json" 2> "$W/e_a.err" & local pa=$!
  texec sb env MATMUL_BATCH=${E_BATCH:-16} $WL matmul 16 "$t" sb > "$W/e_b.json" 2> "$W/e_b.err" & local pb=$!
  "$PY" -c "import time; time.sleep(max(0, $t + 8 - time.time()))"
  local t_apply; t_apply=$(now); apply "$W/p31.toml"; local t_done; t_done=$(now)
  wait $pa; wait $pb
  put e_apply_s "$("$PY" -c "print(round($t_done - $t_apply, 3))")"
  put e_settle "$($WL settle "$W/e_a.json" "$W/e_b.json" "$t_apply" 3)"
  put e_shares_after "$(shares)"
}
part e part_e

part_c() {
  apply "$W/phl.toml"
  texec sa $WL latency 8 "$(at 10)" alone > "$W/c_alone.json" 2> "$W/c_alone.err"
  tail -1 "$W/c_alone.json"
  pair c 12 10 $WL latency 12 @T high -- $WL matmul 12 @T low
  put c_high_vs_low "$($WL pct "$W/c_a.json" "$W/c_alone.json")"
  put c_low_matmul "$(grep -o '"tflops": [0-9.]*' "$W/c_b.json")"
  put c_shares "$(shares)"
  # natively (every group CUDA's default: 2048 us, MEDIUM), for comparison
  timeout 60 $WL latency 8 "$(at 7)" native > "$W/c_native_alone.json" 2>&1
  local t; t=$(at 7)
  timeout 60 $WL latency 12 "$t" native-high > "$W/c_native_a.json" 2>&1 & local pa=$!
  timeout 60 $WL matmul 12 "$t" native-low > "$W/c_native_b.json" 2>&1 & local pb=$!
  wait $pa; wait $pb
  put c_native_pair "$($WL pct "$W/c_native_a.json" "$W/c_native_alone.json")"
  [ "$EXTRAS" = 1 ] || return 0
  # with the GPU's runlists in CHANNEL_INTERLEAVED scheduling (held by a plain process for
  # the pair; restored when it exits), if the driver lets an unprivileged client set it
  coproc HOLD { timeout 90 "$PY" -m devbroker.tools.sched_probe hold 0 2>&1; }
  local line=""
  read -r -t 30 line <&"${HOLD[0]}"; echo "$line"
  echo policy >&"${HOLD[1]}"; read -r -t 30 line <&"${HOLD[0]}"; echo "$line"
  put c_interleaved_policy "$line"
  if grep -q '"status": 0' <<<"$line"; then
    pair ci 12 10 $WL latency 12 @T high -- $WL matmul 12 @T low
    put c_high_vs_low_interleaved "$($WL pct "$W/ci_a.json" "$W/c_alone.json")"
  fi
  [ -n "${HOLD[1]:-}" ] && echo quit >&"${HOLD[1]}"  # (gone when the probe has exited)
  wait "${HOLD_PID:-}" 2>/dev/null || true
}
part c part_c

part_d() {
  gcc -O2 -shared -fPIC -o /tmp/site/greedy_tsg.so scripts/gpu/greedy_tsg.c -lpthread || return 1
  chmod a+rx /tmp/site/greedy_tsg.so
  apply "$W/p11.toml"
  local t; t=$(at 7)
  timeout 60 env LD_PRELOAD=/tmp/site/greedy_tsg.so $WL matmul 12 "$t" native-greedy > "$W/d_native_a.json" 2> "$W/d_native_a.err" & local pa=$!
  timeout 60 $WL matmul 12 "$t" native-plain > "$W/d_native_b.json" 2>&1 & local pb=$!
  wait $pa; wait $pb
  grep greedy "$W/d_native_a.err"
  put d_native_greedy_log "$(grep greedy "$W/d_native_a.err" | head -4 | paste -sd'|')"
  put d_native_ratio_greedy_vs_plain "$($WL ratio "$W/d_native_a.json" "$W/d_native_b.json")"
  pair d 12 10 env LD_PRELOAD=/tmp/site/greedy_tsg.so $WL matmul 12 @T greedy -- $WL matmul 12 @T plain
  grep greedy "$W/d_a.err"
  put d_broker_greedy_log "$(grep greedy "$W/d_a.err" | head -4 | paste -sd'|')"
  put d_broker_ratio_greedy_vs_plain "$($WL ratio "$W/d_a.json" "$W/d_b.json")"
  put d_rewrites "$(grep -c '"rewrite"' "$W/audit.log")"
  grep '"rewrite"' "$W/audit.log" | tail -4 | cut -c1-400
  put d_shares "$(shares)"
  # racing threads on the controls themselves (own channel groups of a probe client)
  printf 'race 8 300\nget\nquit\n' | texec sa "$PY" -m devbroker.tools.sched_probe hold 2 > "$W/d_race.txt" 2>&1
  cat "$W/d_race.txt"; putall d_race "$W/d_race.txt"
}
part d part_d

step "stop the broker"
"${DB[@]}" status
kill -TERM $BROKER; wait $BROKER; echo "broker exit $?"
grep -E '"error"' "$W/audit.log" | tail -10 | cut -c1-400
tail -20 "$W/broker.log"
cat "$RES"
