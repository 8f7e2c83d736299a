#!/bin/bash
# The H200 run of managed memory inside the quota and bounded pinned host memory, one
# device-tool call from the repository root:
#   run(command="bash scripts/gpu/run-h200-uvm.sh", carry=[".whl"], timeout_s=420)
# .whl holds the wheels the GPU host lacks (trio and its dependencies), as for
# run-h200-cuda.sh. Here first, with the emulated backend (every step that needs no GPU):
#   bash scripts/gpu/run-h200-uvm.sh --dry
# Steps (each bounded by a timeout; the whole run well under 6 minutes):
#  1. natively, what libcuda makes of each errno a refused nvidia-uvm mmap can return (an
#     LD_PRELOAD shim fails the managed mmap with it: uvm_errno_shim.c), of an mmap that
#     made no range followed by UVM_VALIDATE_VA_RANGE answering NV_ERR_NO_MEMORY, and the
#     shape of its managed mmaps (offset = address, flags);
#  2. a broker with the real backend, tenants through the seccomp front end; a host thread
#     polls NVML the whole time (the device's used memory above the baseline: <= 8 GiB);
#  3. u8 (8 GiB): CuPy managed 6 GiB filled + summed on the GPU; 12 GiB ->
#     cudaErrorMemoryAllocation; 4 GiB managed + 4 GiB cudaMalloc then 1 GiB more of each;
#     PyTorch trains 200 steps through a CUDAPluggableAllocator calling cudaMallocManaged;
#  4. p1 (pinned_host_memory 1 GiB): cudaHostAlloc / cudaHostRegister of 2 GiB -> out of
#     memory, then 256 MiB pinned and a copy through it work;
#  5. the escape harness's managed-range attacks through the real driver.
# Writes $OUT/run.log and $OUT/results.json; bundle.tgz holds the audit and broker logs.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
DRY=0; [ "${1:-}" = "--dry" ] && DRY=1
if [ $DRY = 1 ]; then OUT=${OUT:-/tmp/h200-uvm-dry-out}; fi
gpu_run_start h200-uvm
RUN=/run/devbroker-uvm
if [ $DRY = 1 ]; then
  BACKEND=emulated
  [ -x "$REPO/.venv/bin/python" ] && PY="$REPO/.venv/bin/python"
  export PYTHONPATH="$REPO/src"
  POLICY="$W/policy.toml"
  "$PY" - "$POLICY" <<'PYEOF'
import sys
from devbroker.testing.policies import one_h200, tenant
caps = ["nvml", "compute", "uvm"]
open(sys.argv[1], "w").write(one_h200(
    tenant("u8", memory_quota="8GiB", capabilities=caps),
    tenant("p1", memory_quota="8GiB", capabilities=caps, pinned_host_memory="1GiB"),
    driver_version=None))
PYEOF
else
  BACKEND=real
  POLICY=scripts/gpu/h200-uvm-policy.toml
  install_wheels
  step "build the native listener loop"
  put native_loop "$("$PY" -m devbroker.native 2>&1 | tail -1)"
  cat /proc/driver/nvidia/version
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
fi
put mode "{\"dry\": $DRY, \"backend\": \"$BACKEND\"}"
CHK="$PY scripts/gpu/uvm_checks.py"
GiB=$((1 << 30))

step "build the errno shim and the managed allocator for PyTorch"
gcc -O2 -shared -fPIC -o "$W/uvm_errno_shim.so" scripts/gpu/uvm_errno_shim.c -ldl \
  && put shim_built true || put shim_built false
"$PY" scripts/gpu/uvm_checks.py allocator-source > "$W/managed_alloc.c"
ALLOC_SO="$W/managed_alloc.so"
NVCC=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
if [ -n "$NVCC" ]; then
  # (the CUDA runtime linked in statically, nvcc's default: nothing to find at load time)
  "$NVCC" -shared -Xcompiler -fPIC -o "$ALLOC_SO" -x cu "$W/managed_alloc.c" \
    > "$W/alloc-build.log" 2>&1; tail -3 "$W/alloc-build.log"
else
  # the CUDA runtime headers and library a pip-installed CUDA brings (torch's nvidia/*)
  CUDA_DIR=$("$PY" - <<'PYEOF' 2>/dev/null
import glob, os, site
for root in site.getsitepackages() + ["/usr/local/cuda"]:
    for inc in glob.glob(os.path.join(root, "**", "cuda_runtime_api.h"), recursive=True):
        print(os.path.dirname(os.path.dirname(inc))); raise SystemExit
PYEOF
)
  [ -n "$CUDA_DIR" ] && gcc -O2 -shared -fPIC -I"$CUDA_DIR/include" -o "$ALLOC_SO" \
     "$W/managed_alloc.c" -L"$CUDA_DIR/lib" -L"$CUDA_DIR/lib64" -lcudart \
     -Wl,-rpath,"$CUDA_DIR/lib:$CUDA_DIR/lib64" 2>&1 | tail -3
fi
[ -f "$ALLOC_SO" ] && put allocator_built true || put allocator_built false
chmod a+rx "$W" "$W"/*.so 2>/dev/null

if [ $DRY = 0 ]; then
  step "native: libcuda's managed mmaps, and what it makes of each refusal errno"
  SHIM="$W/uvm_errno_shim.so"
  SHIM_LOG="$W/shim-plain.jsonl" LD_PRELOAD="$SHIM" timeout 60 $CHK managed 1 2>&1 | tail -2
  put native_uvm_mmaps "$("$PY" -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []; print(json.dumps({"count": len(r), "offset_is_address": all(x["offset"] == x["result"] for x in r if not x["errno"]), "flags": sorted({x["flags"] for x in r}), "lengths": [x["len"] for x in r][:8]}))' "$W/shim-plain.jsonl")"
  for e in ENOMEM:12 EINVAL:22 EPERM:1 EACCES:13 ENOSPC:28 EAGAIN:11 EFAULT:14 ENODEV:19 EBADF:9; do
    name=${e%%:*}; num=${e##*:}
    put "native_refused_$name" "$(SHIM_LOG="$W/shim-$name.jsonl" INJECT_ERRNO=$num \
      LD_PRELOAD="$SHIM" timeout 60 $CHK managed 1 2>&1 | last)"
  done
  # the other way a refusal could reach CUDA: the mmap "made" but no range, and the
  # driver's UVM_VALIDATE_VA_RANGE for it answering NV_ERR_NO_MEMORY
  put native_refused_fake_validate "$(SHIM_LOG="$W/shim-fake.jsonl" INJECT_FAKE=1 \
    INJECT_STATUS=0x51 LD_PRELOAD="$SHIM" timeout 60 $CHK managed 1 2>&1 | last)"
  put native_fake_validate_seen "$(grep -c '"via": "validate"' "$W/shim-fake.jsonl" 2>/dev/null || echo 0)"
  put native_managed_6 "$(timeout 90 $CHK managed 6 2>&1 | last)"
fi

step "start the broker ($BACKEND backend)"
rm -rf "$RUN"; mkdir -p "$RUN"
"$PY" -m devbroker.cli.main --run-dir "$RUN" run --backend $BACKEND --frontend seccomp \
   --policy "$POLICY" --audit "$W/audit.log" > "$W/broker.log" 2>&1 &
BROKER=$!
for i in $(seq 1 150); do [ -S "$RUN/seccomp.sock" ] && [ -S "$RUN/control.sock" ] && break
  sleep 0.2; kill -0 $BROKER 2>/dev/null || break; done
[ -S "$RUN/seccomp.sock" ] || { echo "broker did not start"; cat "$W/broker.log"; exit 1; }
DB=("$PY" -m devbroker.cli.main --run-dir "$RUN")
mapfile -t BINDS < <("$PY" -c 'from devbroker.testing.tenant_binds import bind_args; print("\n".join(bind_args()))' | sed '/^$/d')
[ $DRY = 0 ] && BINDS+=(--bind /tmp/site)
BINDS+=(--bind "$W")  # the allocator .so
texec() { local t=$1; shift
  timeout "${TEXEC_TIMEOUT:-120}" "${DB[@]}" exec --tenant "$t" --frontend seccomp --uid 0 \
     "${BINDS[@]}" -- env PYTHONPATH="$PYTHONPATH" PYTHONUNBUFFERED=1 "$@"; }
status_of() { "${DB[@]}" status --json | "$PY" -c 'import json,sys; d=json.load(sys.stdin); t=[t for t in d["tenants"] if t["name"]==sys.argv[1]][0]; print(json.dumps({"memory": t["memory"], "managed_memory": t.get("managed_memory"), "pinned_host_memory": t.get("pinned_host_memory")}))' "$1"; }

if [ $DRY = 0 ]; then
  step "u8 (8 GiB) with NVML polled on the host the whole time"
  $CHK nvml-poll "$W/nvml-poll.json" & POLL=$!
  sleep 0.5
  put u8_managed_6 "$(texec u8 $CHK managed 6 2>&1 | last)"
  put u8_managed_12 "$(texec u8 $CHK managed 12 2>&1 | last)"
  put u8_mix_4_4 "$(texec u8 $CHK mix 4 4 2>&1 | last)"
  # (the context is charged too, ~530 MiB on the H200: 4 + 4 may not both fit in 8 GiB;
  # then 4 managed + what is left of the quota, and the next 1 GiB of each must fail)
  put u8_mix_4_3 "$(texec u8 $CHK mix 4 3 2>&1 | last)"
  put u8_torch_managed "$(TEXEC_TIMEOUT=180 texec u8 $CHK torch-managed "$ALLOC_SO" 200 2>&1 | last)"
  kill -TERM $POLL; wait $POLL
  put nvml_poll "$(cat "$W/nvml-poll.json")"
  "$PY" - "$RES" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
p = d.get("nvml_poll") or {}
d["nvml_within_quota"] = isinstance(p, dict) and p.get("max_above_baseline", 1 << 62) <= 8 << 30
json.dump(d, open(sys.argv[1], "w"), indent=1)
PYEOF
  put u8_after "$(status_of u8)"
  step "p1 (pinned_host_memory 1 GiB)"
  put p1_pinned_2 "$(texec p1 $CHK pinned 2 2>&1 | last)"
else
  step "u8 (8 GiB), emulated: the same sizes through tests/managed_prog.py"
  MP="$PY tests/managed_prog.py"
  put u8_managed_6 "$(texec u8 $MP map:6GiB used 2>&1 | last)"
  put u8_managed_12 "$(texec u8 $MP map:12GiB 2>&1 | last)"
  put u8_mix_4_4 "$(texec u8 $MP map:4GiB alloc:4GiB alloc:1GiB map:1GiB 2>&1 | tail -4 | paste -sd, | sed 's/^/[/; s/$/]/')"
  put u8_after "$(status_of u8)"
  step "p1 (pinned_host_memory 1 GiB), emulated"
  put p1_pinned_2 "$(texec p1 $MP pinned:2GiB pinned:256MiB 2>&1 | tail -2 | paste -sd, | sed 's/^/[/; s/$/]/')"
fi
put p1_after "$(status_of p1)"
"${DB[@]}" status
grep -E '"deny"|"error"|"violation"' "$W/audit.log" | tail -15 | cut -c1-400
kill -TERM $BROKER; wait $BROKER

step "escape harness: managed-range attacks ($BACKEND backend)"
timeout 150 "$PY" -m devbroker.cli.main escape-test --frontend seccomp --backend $BACKEND \
   --only managed-pieces --only managed-remap-race --only managed-grow --no-flood --json \
   --workdir "$W/escape" > "$W/escape.json" 2> "$W/escape.err"
echo "escape-test: exit $?"
put escape_managed "$("$PY" -c 'import json,sys
try: r = json.load(open(sys.argv[1]))
except Exception as e: print(json.dumps({"error": str(e)})); raise SystemExit
print(json.dumps({x.get("id") or x.get("attack"): [x.get("verdict"), x.get("got"), str(x.get("detail"))[:160]] for x in r.get("rows", [])}))' "$W/escape.json")"
tail -3 "$W/escape.err"

step "summary"
"$PY" - "$RES" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
def ok(k):
    v = d.get(k)
    return isinstance(v, dict) and v.get("ok")
print(json.dumps({k: d.get(k) for k in ("mode", "u8_managed_6", "u8_managed_12", "u8_mix_4_4",
                  "u8_mix_4_3", "u8_torch_managed", "nvml_within_quota", "p1_pinned_2",
                  "escape_managed")}, indent=1)[:6000])
PYEOF
tar czf "$OUT/bundle.tgz" -C "$W" --exclude='*.so' . 2>/dev/null
echo done
