#!/bin/bash
# The H200 run of issue 7: one device-tool `run` call, from the repository root:
#   run(command="bash scripts/gpu/run-h200.sh", carry=[".whl"], timeout_s=540)
# It installs the carried wheels, records a native baseline, starts the broker with the real
# backend and the FUSE front end, runs the checks in tenant sandboxes, and writes into $OUT:
#   run.log (everything), results.md (table), results.json, session.nvtrace (record mode),
#   audit.log, broker.log.
set -u
OUT=${OUT:-/tmp/h200-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1
PY=$(command -v python3)
RUN=/run/devbroker-h200
RES="$OUT/results.json"; echo '{}' > "$RES"
step() { echo; echo "=== $* [$(date +%T)]"; }
put() { # put KEY JSON-VALUE-FILE-OR-STRING
  "$PY" - "$RES" "$1" "$2" <<'PYEOF'
import json, sys
p, k, v = sys.argv[1:4]
d = json.load(open(p))
try: d[k] = json.loads(v)
except Exception: d[k] = v
json.dump(d, open(p, "w"), indent=1)
PYEOF
}

step "install carried wheels"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$REPO/src:/tmp/site"
chmod -R a+rX /tmp/site "$REPO/src" 2>/dev/null
"$PY" -c 'import trio, pynvml, sys; print("python", sys.version.split()[0], "trio", trio.__version__)'

step "reconnaissance (host view)"
uname -a; nproc
cat /proc/driver/nvidia/version
cat /proc/driver/nvidia/gpus/*/information
grep -E "ModifyDeviceFiles|DeviceFile|RmProfilingAdminOnly" /proc/driver/nvidia/params
ls -l /dev/nvidia* /dev/fuse; ls -l /dev/nvidia-caps 2>/dev/null
cat /sys/devices/system/memory/block_size_bytes 2>/dev/null
nvidia-smi
nvidia-smi -q | head -60
nvidia-smi --query-gpu=name,uuid,memory.total,memory.used,pci.bus_id,persistence_mode --format=csv
put host_smi_csv "$(nvidia-smi --query-gpu=name,uuid,memory.total,memory.used --format=csv,noheader)"

step "native baseline (no broker): pynvml, NVML init sequence, one RM_CONTROL"
put native_nvml "$("$PY" scripts/gpu/tenant_checks.py nvml)"
put native_bench_nvml "$("$PY" scripts/gpu/tenant_checks.py bench-nvml 30)"
put native_bench_control "$("$PY" scripts/gpu/tenant_checks.py bench-control 500)"

step "start the broker: real backend, FUSE front end, record mode"
rm -rf "$RUN"; mkdir -p "$RUN"
BROKER_CMD=("$PY" -m devbroker.cli.main --run-dir "$RUN" run --backend real
            --policy scripts/gpu/h200-policy.toml --record "$OUT/session.nvtrace"
            --audit "$OUT/audit.log")
echo "broker command: ${BROKER_CMD[*]}"
"${BROKER_CMD[@]}" > "$OUT/broker.log" 2>&1 &
BROKER=$!
for i in $(seq 1 100); do [ -S "$RUN/control.sock" ] && break; sleep 0.2
  kill -0 $BROKER 2>/dev/null || break; done
[ -S "$RUN/control.sock" ] || { echo "broker did not start"; cat "$OUT/broker.log"; exit 1; }
cat "$OUT/broker.log"
RELAY=$(pgrep -P $BROKER -f devbroker.backends.relay | head -1)
echo "broker pid $BROKER, relay pid $RELAY"; grep -E "^(Uid|Gid|Cap|NoNewPrivs)" /proc/$RELAY/status
put relay_status "$(grep -E '^(Uid|Cap(Eff|Prm|Bnd)|NoNewPrivs)' /proc/$RELAY/status | tr '\t' ' ' | paste -sd';')"
put broker_capeff "$(grep CapEff /proc/$BROKER/status | tr -d '\t')"
relay_fds() { ls /proc/$RELAY/fd | wc -l; }
put relay_fds_idle "$(relay_fds)"
DB=("$PY" -m devbroker.cli.main --run-dir "$RUN")
"${DB[@]}" status
ls -la "$RUN/nodes" "$RUN/nodes/t16" 2>&1 | head -20

# Tenants run in `devbroker exec` sandboxes, as a user would: the broker's FUSE nodes at
# /dev/nvidia*, the tenant's /proc/driver/nvidia view, and the seccomp stat shim that makes
# NVML see character devices 195:N (docs/sandbox.md).
# As root (`devbroker exec` defaults to nobody), with the checkout (if it is under /tmp) and
# /tmp/site bound in: each tenant's /tmp is its own; the host's files are read-only to it.
mapfile -t BINDS < <("$PY" -c 'from devbroker.testing.tenant_binds import bind_args; print("\n".join(bind_args()))' | sed '/^$/d')
BINDS+=(--bind /tmp/site)  # the carried wheels (PYTHONPATH)
texec() { # texec TENANT CMD...
  local t=$1; shift
  "${DB[@]}" exec --tenant "$t" --uid 0 "${BINDS[@]}" -- env PYTHONPATH="$PYTHONPATH" PYTHONUNBUFFERED=1 "$@"
}
step "sandbox smoke test"
texec t16 /bin/sh -c 'ls -l /dev/nvidia*; cat /proc/driver/nvidia/params | head -3'
put sandbox exec

step "tenant t16 (16 GiB on GPU 0): pynvml"
put t16_nvml "$(texec t16 "$PY" scripts/gpu/tenant_checks.py nvml)"
step "tenant t16: nvidia-smi"
texec t16 nvidia-smi; put t16_smi_rc $?
put t16_smi_csv "$(texec t16 nvidia-smi --query-gpu=name,uuid,memory.total,memory.used,memory.free --format=csv,noheader)"
texec t16 nvidia-smi --query-gpu=name,uuid,memory.total,memory.used,memory.free,pci.bus_id,driver_version --format=csv
texec t16 nvidia-smi -q | head -80
step "tenant t16: quota (64 MiB, then 17 GiB, class 0x40 as CUDA allocates)"
put t16_quota "$(texec t16 "$PY" -m devbroker.tools.probe --json --alloc 64MiB --alloc 17GiB)"

step "tenant nogpu: sees no GPU"
put nogpu_nvml "$(texec nogpu "$PY" scripts/gpu/tenant_checks.py nvml)"
texec nogpu nvidia-smi; put nogpu_smi_rc $?

step "tenant t16: privileged / dangerous operations"
put t16_dangerous "$(texec t16 "$PY" scripts/gpu/tenant_checks.py dangerous)"

step "two tenants at once on GPU 0; then SIGKILL of the one holding memory"
put host_before_hold "$("$PY" scripts/gpu/tenant_checks.py nvml)"
sleep 600 | texec t16 "$PY" -m devbroker.tools.probe --alloc 1GiB --keep > "$OUT/hold.txt" 2>&1 &
HOLD=$!
for i in $(seq 1 50); do grep -q holding "$OUT/hold.txt" && break; sleep 0.2; done
cat "$OUT/hold.txt"
put t16_while_holding "$(texec t16 "$PY" scripts/gpu/tenant_checks.py nvml)"
put t8_concurrent "$(texec t8 "$PY" scripts/gpu/tenant_checks.py nvml)"
put t8_smi_csv "$(texec t8 nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader)"
put t16_smi_holding "$(texec t16 nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader)"
texec t16 nvidia-smi
put host_while_holding "$("$PY" scripts/gpu/tenant_checks.py nvml)"
put relay_fds_holding "$(relay_fds)"
"${DB[@]}" status
PIDS=$("${DB[@]}" status --json | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(" ".join(str(p) for t in d["tenants"] if t["name"]=="t16" for p in t["processes"]))')
echo "t16 processes (broker view): $PIDS; SIGKILL"
[ -n "$PIDS" ] && kill -9 $PIDS
sleep 2
put host_after_kill "$("$PY" scripts/gpu/tenant_checks.py nvml)"
put relay_fds_after_kill "$(relay_fds)"
"${DB[@]}" status
put status_after_kill "$("${DB[@]}" status --json)"
kill $HOLD 2>/dev/null
# The holder's stdin came from `sleep 600`: end it too, or it keeps this script's output
# pipe open until the device tool's limit.
pkill -P $$ -x sleep 2>/dev/null

step "host: nvidia-smi after SIGKILL"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv
step "relayed latency (tenant t16)"
put relayed_bench_nvml "$(texec t16 "$PY" scripts/gpu/tenant_checks.py bench-nvml 30)"
put relayed_bench_control "$(texec t16 "$PY" scripts/gpu/tenant_checks.py bench-control 500)"

step "after every tenant exited: host view"
sleep 1
put host_after_all "$("$PY" scripts/gpu/tenant_checks.py nvml)"
put relay_fds_end "$(relay_fds)"
nvidia-smi
"${DB[@]}" status

step "stop the broker"
kill -TERM $BROKER; wait $BROKER; echo "broker exit $?"
sleep 0.5; [ -d /proc/$RELAY ] && echo "relay still alive" || echo "relay exited"
put host_after_stop "$("$PY" scripts/gpu/tenant_checks.py nvml)"

step "audit: refusals"
grep '"deny"' "$OUT/audit.log" | head -60
grep '"notice"' "$OUT/audit.log" | head -20

step "record file"
"$PY" scripts/gpu/summarize.py "$RES" "$OUT/session.nvtrace" "$OUT/audit.log" > "$OUT/results.md"
cat "$OUT/results.md"
step "broker log tail"; tail -40 "$OUT/broker.log"
