#!/bin/bash
# Two GPUs on one host (issue 16), one device-tool call from the repository root:
#   run(kind="nvidia-h200-x2", command="bash scripts/gpu/run-h200-x2.sh", carry=[".whl"])
# Tenant A on GPU 0 (16 GiB), B on GPU 1 (24 GiB), C on both (8 GiB each), the real backend,
# tenants started with plain `devbroker exec` (seccomp front end with real driver files).
# Writes into $OUT: run.log, results.json, bundle.tgz (audit and broker logs).
# X2_ONLY=views: only the views, the routes to the other GPU and the quotas.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
gpu_run_start h200-x2
TORCHRUN=$(dirname "$PY")/torchrun
RUN=/run/devbroker-x2
install_wheels
nvidia-smi -L
nvidia-smi --query-gpu=index,uuid,pci.bus_id,memory.total,memory.used --format=csv
nvidia-smi topo -m 2>&1 | head -8
T2="$PY scripts/gpu/two_gpu_checks.py"
put host_view "$($T2 view 2>&1 | last)"
# GPU 0 and 1 as the host sees them (by minor number, what the policy's indexes mean).
read -r U0 P0 U1 P1 < <("$PY" - <<'PYX'
import glob, re
g = {}
for info in glob.glob("/proc/driver/nvidia/gpus/*/information"):
    t = open(info).read()
    minor = int(re.search(r"Device Minor:\s*(\d+)", t).group(1))
    uuid = re.search(r"GPU UUID:\s*(\S+)", t).group(1)
    bus = re.search(r"Bus Location:\s*(\S+)", t).group(1)
    g[minor] = (uuid, bus)
print(g[0][0], g[0][1], g[1][0], g[1][1])
PYX
)
echo "GPU 0: $U0 $P0; GPU 1: $U1 $P1"
put host_gpus "{\"0\": [\"$U0\", \"$P0\"], \"1\": [\"$U1\", \"$P1\"]}"
put host_before "$("$PY" scripts/gpu/tenant_checks.py nvml 2>&1 | last)"

cat > "$W/policy.toml" <<'EOF'
[broker]
backend = "real"

[tenant.a]
gpus = [0]
memory_quota = "16GiB"
capabilities = ["nvml", "compute", "uvm"]

[tenant.b]
gpus = [1]
memory_quota = "24GiB"
capabilities = ["nvml", "compute", "uvm"]

[tenant.c]
gpus = [0, 1]
memory_quota = "8GiB"
capabilities = ["nvml", "compute", "uvm"]
EOF

step "start the broker (real backend, two GPUs)"
rm -rf "$RUN"; mkdir -p "$RUN"
"$PY" -m devbroker.cli.main --run-dir "$RUN" run --backend real --policy "$W/policy.toml" \
   --audit "$W/audit.log" > "$W/broker.log" 2>&1 &
BROKER=$!
for i in $(seq 1 150); do [ -S "$RUN/seccomp.sock" ] && [ -S "$RUN/control.sock" ] && break
  sleep 0.2; kill -0 $BROKER 2>/dev/null || break; done
[ -S "$RUN/seccomp.sock" ] || { echo "broker did not start"; cat "$W/broker.log"; exit 1; }
cat "$W/broker.log"
DB=("$PY" -m devbroker.cli.main --run-dir "$RUN")
# The tenants run this checkout's Python and the carried wheels: root inside the sandbox
# (exec's default is nobody) and the paths they need bound in (each tenant's /tmp is its own).
mapfile -t BINDS < <("$PY" -c 'from devbroker.testing.tenant_binds import bind_args; print("\n".join(bind_args()))' | sed '/^$/d')
BINDS+=(--bind /tmp/site)
texec() { local t=$1; shift
  timeout 300 "${DB[@]}" exec --tenant "$t" --uid 0 "${BINDS[@]}" -- env PYTHONPATH="$PYTHONPATH" PYTHONUNBUFFERED=1 "$@"; }

if [ "${X2_SKIP_VIEWS:-0}" != 1 ]; then
for t in a b c; do
  step "tenant $t: what it sees (torch, pynvml, nvidia-smi, /proc)"
  put "${t}_view" "$(texec $t $T2 view 2>&1 | tail -30)"
  texec $t nvidia-smi --query-gpu=index,uuid,pci.bus_id,memory.total --format=csv
  put "${t}_smi" "$(texec $t nvidia-smi --query-gpu=uuid,pci.bus_id,memory.total --format=csv,noheader 2>&1 | paste -sd';')"
done

if [ "${X2_PERF:-1}" = 1 ]; then
  step "per-call cost, native then through devbroker (tenant a), one run; a profile of the broker"
  CHK="$PY scripts/gpu/cuda_checks.py"
  put native_bench "$($CHK bench 2>&1 | last)"
  put native_control "$("$PY" scripts/gpu/tenant_checks.py bench-control 500 2>&1 | last)"
  put native_nvml_seq "$("$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
  put dev_bench "$(texec a $CHK bench 2>&1 | last)"
  put dev_control "$(texec a "$PY" scripts/gpu/tenant_checks.py bench-control 500 2>&1 | last)"
  put dev_nvml_seq "$(texec a "$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
  SPY=/tmp/site/bin/py-spy
  if [ -x "$SPY" ]; then
    "$SPY" record -p $BROKER -r 1000 -d 6 -f raw -o "$OUT/broker-profile.txt" >/dev/null 2>&1 &
    SPYPID=$!; sleep 0.5
    texec a "$PY" scripts/gpu/tenant_checks.py bench-control 3000 2>&1 | last
    wait $SPYPID
  fi
  "${DB[@]}" status --json | "$PY" -c "import json,sys; d=json.load(sys.stdin); print(json.dumps(d.get('seccomp', d.get('tenants')))[:1500])"
fi

step "a cannot reach GPU 1; b cannot reach GPU 0"
put a_reach_gpu1 "$(texec a $T2 reach "$U1" "$P1" 1 2>&1 | tail -20)"
put b_reach_gpu0 "$(texec b $T2 reach "$U0" "$P0" 0 2>&1 | tail -20)"
grep '"deny"' "$W/audit.log" | tail -12 | cut -c1-300

step "quotas on each GPU"
put a_quota "$(texec a $T2 quota 16 2>&1 | tail -20)"
put b_quota "$(texec b $T2 quota 24 2>&1 | tail -20)"
put c_quota "$(texec c $T2 quota 8 2>&1 | tail -20)"

fi  # X2_SKIP_VIEWS

if [ "${X2_ONLY:-all}" = views ]; then  # views, routes and quotas only (a short run)
  kill -TERM $BROKER; wait $BROKER; tar czf "$OUT/bundle.tgz" -C "$W" .; exit 0
fi

step "c: torchrun, NCCL all-reduce over both GPUs, 100 steps"
texec c timeout 150 env TENANT_QUOTA_GIB=8 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM "$TORCHRUN" --standalone --nproc_per_node 2 \
  scripts/gpu/two_gpu_checks.py ddp 100 > "$W/ddp.txt" 2>&1; echo "torchrun exit $?" >> "$W/ddp.txt"
grep -v "^\s*$" "$W/ddp.txt" | grep -iE "warn|error|fail|rank|exit|Traceback|via|P2P|SHM" | tail -40
put c_ddp "$(grep '"rank"' "$W/ddp.txt" | paste -sd'|')"
put c_ddp_exit "$(tail -1 "$W/ddp.txt")"
grep -E '"deny"|"error"' "$W/audit.log" | tail -20 | cut -c1-300

step "the escape harness against the real driver (seccomp: real driver files; fuse: the relay)"
for fe in ${X2_ESCAPE_FE:-seccomp fuse}; do escape_real $fe; done

step "kill each tenant's holder: host memory back to the baseline"
CHK="$PY scripts/gpu/cuda_checks.py"
texec a $CHK hold 6 > "$W/hold_a.txt" 2>&1 &
texec b $CHK hold 10 > "$W/hold_b.txt" 2>&1 &
texec c env CUDA_VISIBLE_DEVICES=0 $CHK hold 5 > "$W/hold_c0.txt" 2>&1 &
texec c env CUDA_VISIBLE_DEVICES=1 $CHK hold 7 > "$W/hold_c1.txt" 2>&1 &
for i in $(seq 1 200); do grep -q holding "$W/hold_a.txt" && grep -q holding "$W/hold_b.txt" \
  && grep -q holding "$W/hold_c0.txt" && grep -q holding "$W/hold_c1.txt" && break; sleep 0.2; done
nvidia-smi --query-gpu=index,memory.used --format=csv
put host_holding "$("$PY" scripts/gpu/tenant_checks.py nvml 2>&1 | last)"
"${DB[@]}" status
for t in a b c; do
  P=$("${DB[@]}" status --json | "$PY" -c "import json,sys; d=json.load(sys.stdin); print(' '.join(str(p) for t in d['tenants'] if t['name']=='$t' for p in t['processes']))")
  echo "tenant $t processes: $P; SIGKILL"; [ -n "$P" ] && kill -9 $P
  sleep 3
  put "host_after_kill_$t" "$("$PY" scripts/gpu/tenant_checks.py nvml 2>&1 | last)"
done
nvidia-smi --query-gpu=index,memory.used --format=csv

step "stop the broker"
kill -TERM $BROKER; wait $BROKER; echo "broker exit $?"
grep -E '"deny"|"error"' "$W/audit.log" | head -40 | cut -c1-300
tail -20 "$W/broker.log"
cat "$RES" | head -c 20000
tar czf "$OUT/bundle.tgz" -C "$W" .
