#!/bin/bash
# A short H200 run: where one control's time goes on this host (issues 12/14). The host's
# primitive costs (scripts/bench/syscall_costs.py), then a broker with the real backend and a
# seccomp tenant timing FB_GET_INFO_V2 and the NVML init sequence, and the listener's own
# per-phase counters (tenant-detached: lane_ns_*, ns_recv, ns_send), lane on and off.
#   run(command="bash scripts/gpu/lane_probe.sh", carry=[".whl"], timeout_s=300)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
gpu_run_start lane-probe
RUN=/run/devbroker-probe
install_wheels
step "host primitives"
put costs "$("$PY" scripts/bench/syscall_costs.py)"
put native_control "$("$PY" scripts/gpu/tenant_checks.py bench-control 2000 2>&1 | last)"
put native_nvml_seq "$("$PY" scripts/gpu/tenant_checks.py bench-nvml 20 2>&1 | last)"
step "build the native listener loop"
"$PY" -m devbroker.native || echo "native loop did not build"
# CONFIGS: lane:sync:spin[:native] words: DEVBROKER_CONTROL_LANE, DEVBROKER_SECCOMP_SYNC_WAKE,
# DEVBROKER_SECCOMP_SPIN_US, DEVBROKER_NATIVE_LANE (default 1) of each broker
for cfg in ${CONFIGS:-1:0:100:1 1:0:100:0 0:0:100:0}; do
  IFS=: read -r lane sync spin nat <<<"$cfg"
  nat=${nat:-1}
  step "broker, lane $lane, sync wake-ups $sync, spin $spin us, native loop $nat"
  DEVBROKER_NATIVE_LANE=$nat \
  DEVBROKER_CONTROL_LANE=$lane DEVBROKER_SECCOMP_SYNC_WAKE=$sync DEVBROKER_SECCOMP_SPIN_US=$spin \
    probe_broker "$RUN" scripts/gpu/h200-cuda-policy.toml "$W/audit$cfg.log" "$W/broker$cfg.log"
  texec() { PTEXEC_TIMEOUT=60 ptexec "$@"; }
  k="c${lane}${sync}_${spin}_n${nat}"
  put "${k}_control" "$(texec "$PY" scripts/gpu/tenant_checks.py bench-control 2000 2>&1 | last)"
  put "${k}_control_listener" "$(grep '"tenant-detached"' "$W/audit$cfg.log" | tail -1)"
  put "${k}_nvml_seq" "$(texec "$PY" scripts/gpu/tenant_checks.py bench-nvml 20 2>&1 | last)"
  put "${k}_init" "$(texec "$PY" scripts/gpu/cuda_checks.py init 2>&1 | last)"
  put "${k}_init2" "$(texec "$PY" scripts/gpu/cuda_checks.py init 2>&1 | last)"
  # the same control bench after CUDA tenants came and went (the listener's wait must not
  # depend on what ran before)
  put "${k}_control_after" "$(texec "$PY" scripts/gpu/tenant_checks.py bench-control 2000 2>&1 | last)"
  put "${k}_init_listener" "$(grep '"tenant-detached"' "$W/audit$cfg.log" | tail -1)"
  kill -TERM $BROKER; wait $BROKER
  grep -E '"error"' "$W/audit$cfg.log" | tail -5; tail -5 "$W/broker$cfg.log"
done
"$PY" - "$RES" <<'PYX'
import json, sys
d = json.load(open(sys.argv[1]))
print("native control p50", d["native_control"]["p50_us"], "nvml", d["native_nvml_seq"]["p50_us"])
for k in sorted(x[:-8] for x in d if x.endswith("_control")):
    c, l = d.get(k + "_control", {}), d.get(k + "_control_listener", {})
    if not isinstance(c, dict):
        print(k, "no result", str(c)[:200]); continue
    n = max(1, l.get("controls_fast", 0) or l.get("ioctls", 1))
    ph = {p: round(l.get(p, 0) / n / 1000, 1) for p in ("lane_ns_read", "lane_ns_admit",
          "lane_ns_dup", "lane_ns_driver", "lane_ns_finish", "lane_ns_write")}
    nn = max(1, l.get("notifications", 1))
    print(k, "control p50", c.get("p50_us"), "after CUDA tenants", d.get(k + "_control_after", {}).get("p50_us"), "nvml p50", d.get(k + "_nvml_seq", {}).get("p50_us"),
          "init", d.get(k + "_init", {}).get("init_first_alloc_s"), d.get(k + "_init2", {}).get("init_first_alloc_s"),
          "per ioctl", round(l.get("ns_ioctl", 0) / max(1, l.get("ioctls", 1)) / 1000, 1),
          "recv", round(l.get("ns_recv", 0) / nn / 1000, 1), "send", round(l.get("ns_send", 0) / nn / 1000, 1), ph)
PYX
