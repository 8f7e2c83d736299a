#!/bin/bash
# CUDA init + first allocation, native against brokers in several settings, paired round by
# round: every broker of MODES (words as ab_probe.sh's: "name" or "name:VAR=value,...") is
# started first and stays up, then each of ROUNDS rounds runs one native init and one
# tenant init per broker, in an order rotated every round, so that each tenant init has a
# native one beside it on the same host minutes (the host drifts by 10-15 % within minutes:
# docs/benchmarks.md, "CUDA init on this session's hosts"). The summary gives per mode the
# ratio of the medians and the median of the per-round ratios. In the first and the last
# round also one RM_CONTROL x N with each of GAPS (µs of sleep between calls: with a gap the
# CPUs go idle between calls, as in a CUDA init), natively and per broker. SYSTIME=1: every
# init under systime.so (scripts/gpu/systime.c), and per mode a table of what the broker adds
# to each kind of NVIDIA call (scripts/gpu/calls.py kinds) in $OUT/kinds.txt (with NVML=1
# also for NVML's sequence).
# A mode may run another source tree's broker: "old:PYTHONPATH=$PWD/old-src:/tmp/site".
# NVML=1: in every round and slot also NVML's init sequence x10 and one RM_CONTROL x500 (issue
# 14's H200 targets, paired the same way: median of the per-round ratios / differences).
# FLOORS="floor floor_sync:-s": also slots that run the command natively under
# scripts/gpu/notify_floor.c (devbroker's filter, every notification CONTINUEd at once by a
# minimal C supervisor; "-s" synchronous wake-ups): what the interception alone costs here.
#   run(command="MODES='base sync:DEVBROKER_SECCOMP_SYNC_WAKE=1,DEVBROKER_SECCOMP_SPIN_US=0' \
#       ROUNDS=6 bash scripts/gpu/init_pairs.sh", carry=[".whl"], timeout_s=540)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start init-pairs
MODES=${MODES:-"base sync:DEVBROKER_SECCOMP_SYNC_WAKE=1,DEVBROKER_SECCOMP_SPIN_US=0"}
ROUNDS=${ROUNDS:-6}
GAPS=${GAPS-"0 300"}  # (GAPS="": none)
N=${N:-1000}
CHK="$PY scripts/gpu/cuda_checks.py"
TC="$PY scripts/gpu/tenant_checks.py"
SYSTIME=${SYSTIME:-0}
ST=/tmp/systime; rm -rf $ST; mkdir -p $ST; chmod 1777 $ST
if [ "$SYSTIME" = 1 ]; then
  cc -O2 -shared -fPIC -o /tmp/site/systime.so scripts/gpu/systime.c -ldl || SYSTIME=0
fi
# timed NAME R: the command prefix that runs a command under systime.so when SYSTIME=1
# (records in $ST/NAME-rR.jsonl); nothing otherwise
timed() { [ "$SYSTIME" = 1 ] && echo "env LD_PRELOAD=/tmp/site/systime.so SYSTIME_KINDS=1 SYSTIME_OUT=$ST/$1-r$2.jsonl"; }
for mode in $MODES; do  # another source tree's native loop is built for it here
  case " $(mode_vars "$mode") " in *" PYTHONPATH="*)
    env $(mode_vars "$mode") "$PY" -m devbroker.native >/dev/null || echo "$(mode_name "$mode"): native loop did not build" ;;
  esac
done
declare -a RUNS PIDS NAMES FARGS
n=0
for mode in $MODES; do
  n=$((n + 1))
  step "broker $n: $(mode_name "$mode") ($(mode_vars "$mode"))"
  mode_broker "$mode" "/run/devbroker-ip$n" scripts/gpu/h200-cuda-policy.toml "$W/audit$n.log" "$W/broker$n.log"
  RUNS[$n]=$PROBE_RUN; PIDS[$n]=$BROKER; NAMES[$n]=$(mode_name "$mode")
  grep "seccomp listeners" "$W/broker$n.log"
done
NB=$n  # slots 1..NB are brokers; after them come the FLOORS
# FLOORS: words "name" or "name:ARGS" (notify_floor's options, "+" for a space, e.g.
# "floor floor_sync:-s"): the command runs natively under scripts/gpu/notify_floor.c, a
# minimal C supervisor that CONTINUEs every notification of devbroker's own filter (with
# the real backend's in-kernel rows) at once: the host's floor for the seccomp path.
if [ -n "${FLOORS:-}" ]; then
  cc -O2 -o /tmp/site/notify_floor scripts/gpu/notify_floor.c || FLOORS=""
  FILTER=$("$PY" -c 'from devbroker.abi import registry; from devbroker.broker import rules; from devbroker.sandbox.seccompwire import FilterOptions, build_filter; v = open("/sys/module/nvidia/version").read().strip(); print(build_filter(FilterOptions(kernel_ioctls=rules.kernel_commands(registry.get(v), frozenset(rules.DEFAULT_CAPABILITIES)))).hex())')
  for f in ${FLOORS:-}; do
    n=$((n + 1)); NAMES[$n]=$(mode_name "$f"); FARGS[$n]=$(echo "${f#*:}" | tr + ' ')
    [ "$f" = "${NAMES[$n]}" ] && FARGS[$n]=""
  done
fi
BINDS+=(--bind "$ST:$ST:rw")
# in_slot I CMD...: CMD natively (I = 0), as a tenant of broker I, or under floor I
in_slot() { local i=$1; shift
  if [ "$i" = 0 ]; then "$@"
  elif [ "$i" -gt "$NB" ]; then /tmp/site/notify_floor ${FARGS[$i]} -r "$W/floors.txt" "$FILTER" "$@"
  else PROBE_RUN=${RUNS[$i]} ptexec "$@"; fi; }
slot_name() { if [ "$1" = 0 ]; then echo native; else echo "${NAMES[$1]}"; fi; }
for r in $(seq "$ROUNDS"); do
  step "round $r"
  order=()
  for k in $(seq 0 "$n"); do order+=($(( (k + r - 1) % (n + 1) ))); done
  for i in "${order[@]}"; do
    name=$(slot_name "$i")
    put "r${r}_${name}_init" "$(in_slot "$i" $(timed "$name" "$r") $CHK init 2>&1 | last)"
    [ "$i" != 0 ] && [ "$i" -le "$NB" ] && put "r${r}_${name}_listener" "$(grep '"tenant-detached"' "$W/audit$i.log" | tail -1)"
    if [ "${NVML:-0}" = 1 ]; then
      put "r${r}_${name}_nvml" "$(in_slot "$i" $(timed "nvml_$name" "$r") $TC bench-nvml 10 2>&1 | last)"
      put "r${r}_${name}_ctl" "$(in_slot "$i" $TC bench-control 500 2>&1 | last)"
    fi
    if [ "$r" = 1 ] || [ "$r" = "$ROUNDS" ]; then
      for g in $GAPS; do
        put "r${r}_${name}_control_gap$g" "$(in_slot "$i" $TC bench-control "$N" "$g" 2>&1 | last)"
      done
    fi
  done
done
for i in $(seq "$NB"); do
  grep -h 'quota watch' "$W/audit$i.log" | head -2  # the quota watch's first look, per broker
  kill -TERM "${PIDS[$i]}"; wait "${PIDS[$i]}"
done
if [ "$SYSTIME" = 1 ]; then
  step "per call kind (systime.so): what each broker adds, per init"
  for i in $(seq "$n"); do
    echo "== ${NAMES[$i]}"
    "$PY" scripts/gpu/calls.py kinds $ST native- "${NAMES[$i]}-" "$(cat /sys/module/nvidia/version 2>/dev/null)" > "$W/kinds$i.txt" 2>&1
    head -45 "$W/kinds$i.txt"
    if [ "${NVML:-0}" = 1 ]; then  # NVML's sequence x10, the same table per run of ten
      echo "== ${NAMES[$i]}: NVML's sequence x10"
      "$PY" scripts/gpu/calls.py kinds $ST nvml_native- "nvml_${NAMES[$i]}-" "$(cat /sys/module/nvidia/version 2>/dev/null)" 2>&1 | head -40
    fi
  done > "$OUT/kinds.txt"
  head -30 "$OUT/kinds.txt"
fi
step "summary"
NAMES="${NAMES[*]}" ROUNDS="$ROUNDS" GAPS="$GAPS" "$PY" - "$RES" <<'PYX' | tee "$OUT/summary.txt"
import json, os, statistics, sys
d = json.load(open(sys.argv[1]))
rounds = range(1, int(os.environ["ROUNDS"]) + 1)
def init(r, name):
    v = d.get(f"r{r}_{name}_init")
    return v.get("init_first_alloc_s") if isinstance(v, dict) else None
def ctl(r, name, g):
    v = d.get(f"r{r}_{name}_control_gap{g}")
    return v.get("p50_us") if isinstance(v, dict) else None
nat = [init(r, "native") for r in rounds]
print("native inits (s):", nat)
for name in os.environ["NAMES"].split():
    mine = [init(r, name) for r in rounds]
    pairs = [m / x for m, x in zip(mine, nat) if m and x]
    ok_m, ok_n = [m for m in mine if m], [x for x in nat if x]
    rom = statistics.median(ok_m) / statistics.median(ok_n) if ok_m and ok_n else None
    print(f"{name}: inits {mine}; per-round ratios {[round(p, 3) for p in pairs]}; "
          f"median of ratios {statistics.median(pairs) if pairs else None:.3f}; "
          f"ratio of medians {rom:.3f}" if pairs and rom else f"{name}: inits {mine}")
    for g in os.environ["GAPS"].split():
        first, lastr = min(rounds), max(rounds)
        print(f"  RM_CONTROL p50 gap {g} us: native {[ctl(r, 'native', g) for r in (first, lastr)]}"
              f" {name} {[ctl(r, name, g) for r in (first, lastr)]}")
    def p50(r, n, what):
        v = d.get(f"r{r}_{n}_{what}")
        return v.get("p50_us") if isinstance(v, dict) else None
    nv = [(p50(r, name, "nvml"), p50(r, "native", "nvml")) for r in rounds]
    nv = [a / b for a, b in nv if a and b]
    if nv:
        print(f"  NVML sequence: per-round ratios {[round(x, 2) for x in nv]}; median "
              f"{statistics.median(nv):.3f}x (issue 14: <= 1.5)")
    ct = [(p50(r, name, "ctl"), p50(r, "native", "ctl")) for r in rounds]
    ct = [a - b for a, b in ct if a and b]
    if ct:
        print(f"  RM_CONTROL p50 over native per round (us) {[round(x, 1) for x in ct]}; "
              f"median +{statistics.median(ct):.1f} (issue 14: <= +50; issue 12: <= +40)")
    ls = [d.get(f"r{r}_{name}_listener") for r in rounds]
    ls = [x for x in ls if isinstance(x, dict)]
    if ls:
        ms = {k: round(statistics.median(x.get(k, 0) for x in ls) / 1e6, 1)
              for k in ls[0] if k.startswith(("lane_ns", "ns_"))}
        print(f"  listener per init (median of {len(ls)}, ms): {ms}; "
              f"sync_wake_up {ls[0].get('sync_wake_up')}")
PYX
