#!/bin/bash
# A short H200 run: how a seccomp listener should wait on a many-CPU host (docs/seccomp.md,
# "How a listener waits"). Two brokers in turn, twice (spin, sync, spin, sync): `spin` looks
# for the next call for 100 µs after each answer and lets the kernel wake tenant and listener
# on their own CPUs (the default on 4+ CPUs); `sync` asks for synchronous wake-ups
# (SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP: the listener runs on the caller's CPU) and never
# spins. Each: CUDA init + first allocation x3, the NVML sequence x20, one RM_CONTROL x500,
# with native runs of the same in every round.
#   run(command="bash scripts/gpu/wake_probe.sh", carry=[".whl"], timeout_s=420)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start wake-probe
CHK="$PY scripts/gpu/cuda_checks.py"
TC="$PY scripts/gpu/tenant_checks.py"
measure() { local tag=$1 run=$2  # run: "" natively, "ptexec" in the tenant
  for i in 1 2 3; do put "${tag}_init$i" "$($run $CHK init 2>&1 | last)"; done
  put "${tag}_nvml" "$($run $TC bench-nvml 20 2>&1 | last)"
  put "${tag}_control" "$($run $TC bench-control 500 2>&1 | last)"
}
for round in 1 2; do
  step "round $round: native"
  measure "r${round}_native" ""
  for cfg in ${CONFIGS:-spin sync both}; do
    step "round $round: $cfg"
    case $cfg in
      spin) E=(DEVBROKER_SECCOMP_SYNC_WAKE=0 DEVBROKER_SECCOMP_SPIN_US=100) ;;
      sync) E=(DEVBROKER_SECCOMP_SYNC_WAKE=1 DEVBROKER_SECCOMP_SPIN_US=0) ;;
      both) E=(DEVBROKER_SECCOMP_SYNC_WAKE=1 DEVBROKER_SECCOMP_SPIN_US=100) ;;
    esac
    export "${E[@]}"
    probe_broker /run/devbroker-wake scripts/gpu/h200-cuda-policy.toml "$W/audit-$cfg$round.log" "$W/broker-$cfg$round.log"
    unset DEVBROKER_SECCOMP_SYNC_WAKE DEVBROKER_SECCOMP_SPIN_US
    measure "r${round}_$cfg" ptexec
    kill -TERM $BROKER; wait $BROKER
    put "r${round}_${cfg}_listener" "$(grep '"tenant-detached"' "$W/audit-$cfg$round.log" | tail -1)"
  done
done
step "summary"
"$PY" - "$RES" <<'PYX' | tee "$OUT/summary.txt"
import json, statistics, sys
d = json.load(open(sys.argv[1]))
for cfg in ("native", "spin", "sync", "both"):
    inits = [d.get(f"r{r}_{cfg}_init{i}", {}).get("init_first_alloc_s") for r in (1, 2) for i in (1, 2, 3)]
    nvml = [d.get(f"r{r}_{cfg}_nvml", {}).get("p50_us") for r in (1, 2)]
    ctl = [d.get(f"r{r}_{cfg}_control", {}).get("p50_us") for r in (1, 2)]
    ok = [x for x in inits if x]
    print(f"{cfg:6s} init+alloc s {inits} median {statistics.median(ok) if ok else None}; "
          f"NVML p50 us {nvml}; RM_CONTROL p50 us {ctl}; "
          f"sync_wake_up {[d.get(f'r{r}_{cfg}_listener', {}).get('sync_wake_up') for r in (1, 2)] if cfg != 'native' else ''}")
PYX
