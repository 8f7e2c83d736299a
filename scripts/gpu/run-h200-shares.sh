#!/bin/bash
# Share policies on the H200 (broker/shares.py; docs/security.md "Share policies"), one
# device-tool call from the repository root:
#   run(command="bash scripts/gpu/run-h200-shares.sh", carry=[".whl"], timeout_s=480)
# 1. natively, no broker: may another process map a victim's memory with
#    UVM_MAP_EXTERNAL_ALLOCATION, the memory not shared / shared with everyone / shared with
#    one other client (scripts/gpu/uvm_external_probe.py);
# 2. through devbroker: CUDA's legacy IPC between two processes of one tenant
#    (scripts/gpu/ipc_check.py), the broad share kept in the broker's books;
# 3. the escape harness against the real driver through seccomp (uvm-external-foreign too).
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
probe_start h200-shares
step "the driver alone: UVM_MAP_EXTERNAL_ALLOCATION from another process"
timeout 240 "$PY" scripts/gpu/uvm_external_probe.py 2>&1 | tee "$OUT/uvm_probe.txt"
step "CUDA IPC between two processes natively"
put ipc_native "$(timeout 180 "$PY" scripts/gpu/ipc_check.py 2>&1 | tail -1)"
step "CUDA IPC between two processes of one tenant through devbroker"
probe_broker /run/devbroker-shares scripts/gpu/h200-cuda-policy.toml "$W/audit.log" "$W/broker.log"
put ipc_devbroker "$(PTEXEC_TIMEOUT=200 ptexec "$PY" scripts/gpu/ipc_check.py 2>&1 | tail -1)"
grep -h "RM_SHARE\|RM_DUP\|kept inside" "$W/audit.log" | tail -5
kill $BROKER; wait $BROKER 2>/dev/null
step "the escape harness against the real driver through seccomp"
escape_real seccomp
cp "$W/escape-seccomp.json" "$OUT/escape-seccomp.json" 2>/dev/null
cat "$RES"
