#!/bin/bash
# A channel allocated right under the device (what the driver's checkpoint does inside a CUDA
# tenant) and the channel group the driver makes for it, on the H200. One device-tool call
# from the repository root (under 2 minutes; .whl: the wheels the GPU host lacks, trio and
# its dependencies, as for the other runs):
#   run(command="bash scripts/gpu/run-h200-devchannel.sh", carry=[".whl"], timeout_s=300)
# 1. natively, no broker (devbroker.tools.sched_probe devchan): the channel under the device
#    (the parameters the driver takes, tried in turn), whether the answer names the driver's
#    group (hPhysChannelGroup: the source clears it), the group found with GET_HANDLE_INFO,
#    its default timeslice, SET/GET_TIMESLICE on it, the group gone after the channel's free;
# 2. through devbroker (seccomp front end, real backend; tenant dc weight 3 next to dc1
#    weight 1 on GPU 0): the same channel from a tenant process, the broker's status showing
#    the driver's group with the policy's timeslice, the tenant reading that value back from
#    the driver (GET_TIMESLICE on the group's handle), the group out of status after the free,
#    no deny or error in the audit (scripts/gpu/devchan_check.py).
# Writes $OUT/run.log, $OUT/results.json (native, devbroker), $OUT/audit.jsonl, broker.log.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start h200-devchannel
cat /proc/driver/nvidia/version 2>/dev/null | head -1

step "1. natively: a channel right under the device, and the driver's group for it"
timeout 60 "$PY" -m devbroker.tools.sched_probe devchan > "$W/native.txt" 2>&1
echo "exit $?"; cat "$W/native.txt"
put native "$("$PY" -c 'import json,sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]))' "$W/native.txt")"

step "2. through devbroker: the tenant's channel under the device, the broker's view"
cat > "$W/policy.toml" <<EOF
[broker]
backend = "real"

[tenant.dc]
gpus = [0]
memory_quota = "8GiB"
capabilities = ["nvml", "compute"]
compute_weight = 3

[tenant.dc1]
gpus = [0]
memory_quota = "8GiB"
capabilities = ["nvml", "compute"]
EOF
probe_broker /run/devbroker-devchan "$W/policy.toml" "$W/audit.log" "$W/broker.log"
timeout 90 "$PY" scripts/gpu/devchan_check.py --run-dir "$PROBE_RUN" --tenant dc \
  --policy "$W/policy.toml" --audit "$W/audit.log" -- \
  "$PY" -m devbroker.cli.main --run-dir "$PROBE_RUN" exec --tenant dc --uid 0 "${BINDS[@]}" \
  -- env PYTHONPATH="$PYTHONPATH" "$PY" -m devbroker.tools.sched_probe hold 1 \
  > "$W/devbroker.txt" 2>&1
echo "exit $?"; cat "$W/devbroker.txt"
put devbroker "$(grep '"ok"' "$W/devbroker.txt" | tail -1)"
kill $BROKER 2>/dev/null; wait $BROKER 2>/dev/null
cp "$W/audit.log" "$OUT/audit.jsonl" 2>/dev/null
tail -n 40 "$W/broker.log" > "$OUT/broker.log" 2>/dev/null
step "results"
cat "$RES"
