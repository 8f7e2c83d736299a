#!/bin/bash
# The H200 run of issue 49 (priority preemption by checkpoint), one device-tool call from the
# repository root:
#   run(command="bash scripts/gpu/run-h200-preempt.sh", carry=[".whl"], timeout_s=590)
# .whl holds the wheels the GPU host lacks (trio and its dependencies: docs/hardware.md).
# ONLY=a,b,... runs some parts (default all; the whole run is ~6-7 minutes: split it over two
# calls, e.g. ONLY=a,b then ONLY=c,d,e, if the command limit is near).
#   a  native baseline: a PyTorch process holding LOW_GIB (64) GiB checkpointed and restored
#      by the executor's helper (scripts/gpu/ckpt_native.py), timed; and the unpreempted
#      reference loss curve (scripts/gpu/ckpt_train.py, same seed)
#   r  the reference loss curve alone (for b when a ran in an earlier call)
#   b  through devbroker (scripts/gpu/h200-preempt-policy.toml, preemption on): `low`
#      (preemptible) trains holding LOW_GIB GiB and writes its loss per step; `high` asks for
#      HIGH_GIB (80) GiB: the request-to-answer time against the native checkpoint time;
#      high exits; low is restored by the broker; its loss curve against the reference
#   c  CYCLES (5) rounds of `devbroker preempt low` / `devbroker resume low` on a trainer
#      holding CYCLE_GIB (16) GiB; host memory after each against the baseline
#   d  a preemptible tenant holding managed memory (mlow) is not preempted: high's
#      allocation gets its answer without checkpointing it, mlow trains on
#   e  a SIGSTOPped low tenant: high's allocation waits at most the lock timeout, then the
#      fallback (no preemption); low, continued, trains on
#   f  a low tenant spinning one kernel for SPIN_S (40) s: the same bound and fallback; the
#      kernel ends and its memory is intact (scripts/gpu/ckpt_spin.py)
# Writes into $OUT as it goes: run.log (everything), results.json (`put`), and at the end
# (or on exit) bundle.tgz: the loss files, broker log, audit log, status snapshots.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
gpu_run_start h200-preempt
trap 'tar czf "$OUT/bundle.tgz" -C "$W" . 2>/dev/null' EXIT
ONLY=${ONLY:-a,b,c,d,e,f}
want() { [[ ",$ONLY," == *",$1,"* ]]; }
LOW_GIB=${LOW_GIB:-64}      # >= 60 GiB held by the preempted tenant (issue 49)
HIGH_GIB=${HIGH_GIB:-80}    # with low's, more than the H200's ~140 GiB
CYCLE_GIB=${CYCLE_GIB:-16}
CYCLES=${CYCLES:-5}
STEPS=${STEPS:-1500}        # low's training steps (b), STEP_SLEEP s apart
STEP_SLEEP=${STEP_SLEEP:-0.02}
RUN=/run/devbroker-preempt
TD=/tmp/devbroker-preempt   # loss files and ready marks, bound read-write into tenants
rm -rf "$TD"; mkdir -p "$TD"; chmod 777 "$TD"
install_wheels
cat /proc/driver/nvidia/version
nvidia-smi --query-gpu=name,uuid,persistence_mode,memory.total,memory.used --format=csv
hostmem() { awk '/MemTotal/ {t=$2} /MemAvailable/ {a=$2} END {print int((t-a)/1024)}' /proc/meminfo; }
put host_used_mib_start "$(hostmem)"
TRAIN="scripts/gpu/ckpt_train.py"

if want a; then
  step "a: native checkpoint and restore of a process holding $LOW_GIB GiB (the executor's helper)"
  timeout 300 "$PY" scripts/gpu/ckpt_native.py --gib "$LOW_GIB" --cycles 1 > "$W/native.txt" 2>&1
  echo "exit $?"; cut -c1-400 "$W/native.txt"
  put native "$(last < "$W/native.txt")"
  "$PY" - "$RES" <<'PYX'
import json, sys
c = json.load(open(sys.argv[1])).get("native", {}).get("cycle1", {})
print("native: checkpoint", c.get("checkpoint", {}).get("ms"), "ms, restore",
      c.get("restore", {}).get("ms"), "ms; host MiB", c.get("host_before_mib"), "->",
      c.get("host_ckpt_mib"), "->", c.get("host_after_mib"), "; check", c.get("check"))
PYX
fi
if want a || want r; then
  step "a/r: the unpreempted reference loss curve (native, same seed, small ballast)"
  timeout 200 "$PY" $TRAIN --gib 2 --steps "$STEPS" --loss "$TD/loss-reference.txt" 2>&1 | tail -2
  put reference "$(tail -1 "$TD/loss-reference.txt")"
fi

step "start the broker (real backend, preemption on)"
rm -rf "$RUN"; mkdir -p "$RUN"
"$PY" -m devbroker.cli.main --run-dir "$RUN" run --backend real \
   --policy scripts/gpu/h200-preempt-policy.toml --audit "$W/audit.log" > "$W/broker.log" 2>&1 &
BROKER=$!
for i in $(seq 1 150); do [ -S "$RUN/seccomp.sock" ] && [ -S "$RUN/control.sock" ] && break
  sleep 0.2; kill -0 $BROKER 2>/dev/null || break; done
[ -S "$RUN/control.sock" ] || { echo "broker did not start"; cat "$W/broker.log"; exit 1; }
head -20 "$W/broker.log"
DB=("$PY" -m devbroker.cli.main --run-dir "$RUN")
mapfile -t BINDS < <("$PY" -c 'from devbroker.testing.tenant_binds import bind_args; print("\n".join(bind_args()))' | sed '/^$/d')
BINDS+=(--bind /tmp/site --bind "$TD:$TD:rw")
texec() { local t=$1; shift
  timeout 400 "${DB[@]}" exec --tenant "$t" --uid 0 "${BINDS[@]}" -- \
    env PYTHONPATH="$PYTHONPATH" PYTHONUNBUFFERED=1 "$@"; }
# tenant_pids T: the host pids of tenant T's processes (the broker's view)
tenant_pids() { "${DB[@]}" status --json | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(" ".join(str(p) for t in d["tenants"] if t["name"]==sys.argv[1] for p in t["processes"]))' "$1"; }
# preempted T: the tenant's preemption state ("" when running)
preempted() { "${DB[@]}" status --json | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(next((t.get("preempted") or "" for t in d["tenants"] if t["name"]==sys.argv[1]), ""))' "$1"; }
snapshot() { "${DB[@]}" status > "$W/status-$1.txt" 2>&1; grep -iE "preempt|low|high" "$W/status-$1.txt" | head -8; }
# wait_lines FILE N [S]: until FILE has N lines (S seconds at most, default 120)
wait_lines() { for i in $(seq 1 $((${3:-120} * 5))); do
  [ -f "$1" ] && [ "$(wc -l < "$1")" -ge "$2" ] && return 0; sleep 0.2; done; return 1; }
# since T0: seconds from T0 (a `date +%s.%N`) to now
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN {printf "%.3f\n", b - a}'; }
# wait_state T STATE [S]: until `preempted T` prints STATE ("" = running)
wait_state() { local t0=$(date +%s.%N); for i in $(seq 1 $((${3:-120} * 5))); do
  [ "$(preempted "$1")" = "$2" ] && { since "$t0"; return 0; }; sleep 0.2; done
  echo "timeout"; return 1; }
audit_preempt() { grep -iE 'preempt|checkpoint|restore' "$W/audit.log" | tail -${1:-10} | cut -c1-400; }

if want b; then
  step "b: low trains holding $LOW_GIB GiB ($STEPS steps, seed 1234); high asks for $HIGH_GIB GiB"
  texec low "$PY" $TRAIN --gib "$LOW_GIB" --steps "$STEPS" --step-sleep "$STEP_SLEEP" \
    --loss "$TD/loss-preempted.txt" --ready "$TD/low-ready" > "$W/low-b.txt" 2>&1 &
  LOWJOB=$!
  wait_lines "$TD/loss-preempted.txt" 100 180 || { echo "low did not start"; cat "$W/low-b.txt"; }
  put b_low_holding "$(head -1 "$W/low-b.txt")"
  put b_host_before_mib "$(hostmem)"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader; snapshot b-before
  texec high "$PY" scripts/gpu/ckpt_alloc.py "$HIGH_GIB" 5 > "$W/high-b.txt" 2>&1 &
  HIGHJOB=$!
  # while high waits: low's state and the host's memory as the checkpoint goes
  for i in $(seq 1 60); do s=$(preempted low); echo "  [$(date +%T)] low: ${s:-running}; host MiB $(hostmem)"
    [ "$s" = preempted ] && break; kill -0 $HIGHJOB 2>/dev/null || break; sleep 2; done
  put b_host_preempted_mib "$(hostmem)"; snapshot b-preempted
  wait $HIGHJOB; cat "$W/high-b.txt"
  put b_high "$(last < "$W/high-b.txt")"
  step "b: high has exited; low is restored by the broker"
  put b_restore_wait_s "$(wait_state low "" 120)"
  put b_host_after_mib "$(hostmem)"; snapshot b-after
  wait $LOWJOB; tail -2 "$W/low-b.txt"
  put b_low "$(last < "$W/low-b.txt")"
  audit_preempt 12
  "$PY" - "$TD/loss-reference.txt" "$TD/loss-preempted.txt" "$RES" <<'PYX' | tee "$W/b-summary.txt"
import json, sys
def read(p):
    try:
        return [tuple(l.split()) for l in open(p)]
    except OSError:
        return None
ref, got = read(sys.argv[1]), read(sys.argv[2])
d = json.load(open(sys.argv[3]))
nat = (d.get("native") or {}).get("cycle1", {}).get("checkpoint", {}).get("ms")
high = d.get("b_high") or {}
if ref is None:
    print("no reference curve (run part a in the same call)")
else:
    same = sum(1 for a, b in zip(ref, got or []) if a == b)
    diff = max((abs(float(a[1]) - float(b[1])) for a, b in zip(ref, got or [])), default=None)
    print(f"loss curve: {same} of {len(ref)} steps identical to the unpreempted run "
          f"({len(got or [])} written; largest difference {diff})")
print(f"high's {high.get('gib')} GiB: answered in {high.get('alloc_s')} s, ok {high.get('ok')}; "
      f"native checkpoint of low's size {nat} ms")
print(f"low: {d.get('b_low')}")
PYX
  put b_summary "$(paste -sd' ' "$W/b-summary.txt")"
fi

if want c; then
  step "c: $CYCLES rounds of devbroker preempt/resume, low holding $CYCLE_GIB GiB"
  put c_host_baseline_mib "$(hostmem)"
  texec low "$PY" $TRAIN --gib "$CYCLE_GIB" --steps 100000 --step-sleep 0.01 \
    --loss "$TD/loss-cycles.txt" > "$W/low-c.txt" 2>&1 &
  LOWJOB=$!
  wait_lines "$TD/loss-cycles.txt" 50 180 || { echo "low did not start"; cat "$W/low-c.txt"; }
  put c_host_holding_mib "$(hostmem)"
  for n in $(seq 1 "$CYCLES"); do
    a=$(wc -l < "$TD/loss-cycles.txt")
    t0=$(date +%s.%N); "${DB[@]}" preempt low --json > "$W/preempt-$n.json" 2>&1; rc1=$?
    t1=$(date +%s.%N); hp=$(hostmem); b=$(wc -l < "$TD/loss-cycles.txt"); sleep 2
    c=$(wc -l < "$TD/loss-cycles.txt")
    "${DB[@]}" resume low --json > "$W/resume-$n.json" 2>&1; rc2=$?
    t2=$(date +%s.%N); sleep 2; d=$(wc -l < "$TD/loss-cycles.txt"); ha=$(hostmem)
    line="{\"cycle\": $n, \"preempt_rc\": $rc1, \"preempt_s\": $(awk -v a=$t0 -v b=$t1 'BEGIN {printf "%.3f", b - a}'), \"resume_rc\": $rc2, \"resume_s\": $(awk -v a=$t1 -v b=$t2 'BEGIN {printf "%.3f", b - a}'), \"host_preempted_mib\": $hp, \"host_after_mib\": $ha, \"steps_while_preempted\": $((c - b)), \"steps_after\": $((d - c))}"
    echo "  $line"; put "c_cycle$n" "$line"
    [ $rc1 = 0 ] || cat "$W/preempt-$n.json"; [ $rc2 = 0 ] || cat "$W/resume-$n.json"
  done
  for p in $(tenant_pids low); do kill -TERM "$p" 2>/dev/null; done
  wait $LOWJOB 2>/dev/null; sleep 2
  put c_host_end_mib "$(hostmem)"
  echo "host MiB: baseline $(grep -o '"c_host_baseline_mib": [0-9]*' "$RES"), end $(hostmem)"
  audit_preempt 12
fi

if want d; then
  step "d: mlow (preemptible) holds $LOW_GIB GiB and 32 MiB of managed memory; high asks for $HIGH_GIB GiB"
  texec mlow "$PY" $TRAIN --gib "$LOW_GIB" --steps 3000 --step-sleep 0.01 --managed 32 \
    --loss "$TD/loss-managed.txt" > "$W/mlow-d.txt" 2>&1 &
  MJOB=$!
  wait_lines "$TD/loss-managed.txt" 50 180 || { echo "mlow did not start"; cat "$W/mlow-d.txt"; }
  put d_mlow_holding "$(head -1 "$W/mlow-d.txt")"
  texec high "$PY" scripts/gpu/ckpt_alloc.py "$HIGH_GIB" 1 > "$W/high-d.txt" 2>&1
  cat "$W/high-d.txt"; put d_high "$(last < "$W/high-d.txt")"
  put d_mlow_state_after_high "$(preempted mlow)"
  "${DB[@]}" preempt mlow > "$W/preempt-mlow.txt" 2>&1; echo "devbroker preempt mlow: exit $?"
  cat "$W/preempt-mlow.txt"; put d_preempt_by_hand "$(cat "$W/preempt-mlow.txt")"
  a=$(wc -l < "$TD/loss-managed.txt"); sleep 2; b=$(wc -l < "$TD/loss-managed.txt")
  put d_mlow_steps_in_2s "$((b - a))"
  for p in $(tenant_pids mlow); do kill -TERM "$p" 2>/dev/null; done
  wait $MJOB 2>/dev/null; tail -2 "$W/mlow-d.txt"
  audit_preempt 6
fi

if want e; then
  step "e: low holding $LOW_GIB GiB is SIGSTOPped; high asks for $HIGH_GIB GiB"
  texec low "$PY" $TRAIN --gib "$LOW_GIB" --steps 3000 --step-sleep 0.01 \
    --loss "$TD/loss-stopped.txt" > "$W/low-e.txt" 2>&1 &
  LOWJOB=$!
  wait_lines "$TD/loss-stopped.txt" 50 180 || { echo "low did not start"; cat "$W/low-e.txt"; }
  LP=$(tenant_pids low); echo "low's processes: $LP; SIGSTOP"
  for p in $LP; do kill -STOP "$p"; done
  texec high "$PY" scripts/gpu/ckpt_alloc.py "$HIGH_GIB" 1 > "$W/high-e.txt" 2>&1
  cat "$W/high-e.txt"; put e_high "$(last < "$W/high-e.txt")"
  put e_low_state "$(preempted low)"
  audit_preempt 6
  for p in $LP; do kill -CONT "$p"; done
  a=$(wc -l < "$TD/loss-stopped.txt"); sleep 3; b=$(wc -l < "$TD/loss-stopped.txt")
  put e_low_steps_after_cont "$((b - a))"
  for p in $(tenant_pids low); do kill -TERM "$p" 2>/dev/null; done
  wait $LOWJOB 2>/dev/null; tail -2 "$W/low-e.txt"
fi

if want f; then
  SPIN_S=${SPIN_S:-40}
  step "f: low holding $LOW_GIB GiB spins one kernel for $SPIN_S s; high asks for $HIGH_GIB GiB"
  rm -f "$TD/spinning"
  texec low "$PY" scripts/gpu/ckpt_spin.py --gib "$LOW_GIB" --spin "$SPIN_S" \
    --ready "$TD/spinning" > "$W/low-f.txt" 2>&1 &
  LOWJOB=$!
  for _ in $(seq 1 120); do [ -e "$TD/spinning" ] && break; sleep 1; done
  [ -e "$TD/spinning" ] || { echo "low did not start spinning"; cat "$W/low-f.txt"; }
  texec high "$PY" scripts/gpu/ckpt_alloc.py "$HIGH_GIB" 1 > "$W/high-f.txt" 2>&1
  cat "$W/high-f.txt"; put f_high "$(last < "$W/high-f.txt")"
  put f_low_state "$(preempted low)"
  audit_preempt 6
  wait $LOWJOB; echo "low exit $?"; cat "$W/low-f.txt"
  put f_low "$(last < "$W/low-f.txt")"
fi

step "stop the broker"
kill -TERM $BROKER; wait $BROKER; echo "broker exit $?"
put host_used_mib_end "$(hostmem)"
grep -E '"deny"|"error"' "$W/audit.log" | tail -20 | cut -c1-400
cp "$TD"/loss-*.txt "$W/" 2>/dev/null
cat "$RES"
