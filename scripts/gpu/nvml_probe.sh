#!/bin/bash
# A short H200 run: where NVML's init sequence spends its time through devbroker (issue 14:
# ≤ 1.5× native). A broker with the real backend and a metrics endpoint; a seccomp tenant
# runs the NVML sequence 30 times; then the per-call latency sums (devbroker_call_duration_
# seconds) and the listener's counters (tenant-detached) say which calls cost what.
#   run(command="bash scripts/gpu/nvml_probe.sh", carry=[".whl"], timeout_s=240)
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
. scripts/gpu/lib.sh
gpu_run_start nvml-probe
RUN=/run/devbroker-nvml
install_wheels
put native_nvml_seq "$("$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
POL="$W/policy.toml"
{ cat scripts/gpu/h200-cuda-policy.toml; printf '\n[broker.metrics]\nlisten = "127.0.0.1:9464"\n'; } > "$POL"
probe_broker "$RUN" "$POL" "$W/audit.log" "$W/broker.log"
put dev_nvml_seq "$(ptexec "$PY" scripts/gpu/tenant_checks.py bench-nvml 30 2>&1 | last)"
"$PY" - > "$OUT/metrics.txt" <<'PYX'
import urllib.request
print(urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=10).read().decode())
PYX
kill -TERM $BROKER; wait $BROKER
put dev_nvml_listener "$(grep '"tenant-detached"' "$W/audit.log" | tail -1)"
"$PY" - "$OUT/metrics.txt" <<'PYX' | tee "$OUT/nvml-calls.txt"
import re, sys
sums, counts = {}, {}
for line in open(sys.argv[1]):
    m = re.match(r'devbroker_call_duration_seconds_(sum|count)\{(.*)\} (\S+)', line)
    if m:
        (sums if m.group(1) == "sum" else counts)[m.group(2)] = float(m.group(3))
rows = sorted(((sums[k], counts.get(k, 0), k) for k in sums), reverse=True)
tot = sum(r[0] for r in rows)
print(f"all calls: {tot * 1e3:.1f} ms over 31 sequences (one warm-up)")
for s, n, k in rows[:30]:
    print(f"{s * 1e3:8.2f} ms {int(n):6d} calls {s / max(n, 1) * 1e6:8.1f} us/call  {k}")
PYX
