#!/bin/bash
# Issue 17, the H200 point: a plain runc container (no `devbroker exec`) whose NVIDIA calls
# reach the broker through runc's own seccomp hand-over (linux.seccomp.listenerPath), running
# PyTorch with its tenant's quota. Written for the lead's device-tool call from the repository
# root (NOT run by the helper that wrote it):
#   run(command="bash scripts/gpu/run-h200-runc.sh", carry=[".whl", ".runc"], timeout_s=580)
# .whl: the wheels the GPU host lacks (trio ...), as for run-h200-cuda.sh.
# .runc: Debian's runc if the host has none: on the development machine
#   apt-get download runc libseccomp2 && for d in runc_*.deb libseccomp2_*.deb; do
#     dpkg-deb -x "$d" .runc; done
# (runc then runs as .runc/usr/sbin/runc with LD_LIBRARY_PATH=.runc/usr/lib/x86_64-linux-gnu).
# Writes run.log and results.json into $OUT; bundle.tgz holds the audit and broker logs.
set -u
OUT=${OUT:-/tmp/h200-runc-out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/../.." && pwd); cd "$REPO"
W=/tmp/h200-runc-work; rm -rf "$W"; mkdir -p "$W"
exec > >(tee -a "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1
PY=$(command -v python3)
RUN=/run/devbroker-runc
step() { echo; echo "=== $* [$(date +%T)]"; }

step "carried wheels and runc"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$REPO/src:/tmp/site"
chmod -R a+rX /tmp/site "$REPO" 2>/dev/null
RUNC=$(command -v runc || true)
if [ -z "$RUNC" ] && [ -x .runc/usr/sbin/runc ]; then
  RUNC="$REPO/.runc/usr/sbin/runc"
  export LD_LIBRARY_PATH="$REPO/.runc/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  mkdir -p /tmp/runc-bin && ln -sf "$RUNC" /tmp/runc-bin/runc && export PATH="/tmp/runc-bin:$PATH"
fi
[ -n "$RUNC" ] || { echo "no runc: carry .runc (see the header)"; exit 1; }
runc --version; cat /proc/driver/nvidia/version
"$PY" -c 'import torch; print("torch", torch.__version__)'

step "broker (real backend), CDI spec for the seccomp front end"
rm -rf "$RUN"; mkdir -p "$RUN"
"$PY" -m devbroker.cli.main --run-dir "$RUN" run --backend real \
   --policy scripts/gpu/h200-cuda-policy.toml --audit "$W/audit.log" > "$W/broker.log" 2>&1 &
BROKER=$!
for i in $(seq 1 150); do [ -S "$RUN/oci-seccomp.sock" ] && break; sleep 0.2; done
[ -S "$RUN/oci-seccomp.sock" ] || { echo "broker did not start"; cat "$W/broker.log"; exit 1; }
DB=("$PY" -m devbroker.cli.main --run-dir "$RUN")
"${DB[@]}" cdi --frontend seccomp --output "$W/cdi.json" || exit 1

# One container per check: torch init, then the quota (8 GiB tenant asks for 12 GiB).
# The host's /usr, /etc, the torch environment (/opt), the checkout and the wheels, read-only.
"$PY" - "$W" "$REPO" "$PY" <<'PYEOF' > "$OUT/results.json"
import json, subprocess, sys, uuid
from pathlib import Path
from devbroker.testing.oci import Runtime, apply_cdi, load_config, make_bundle, save_config
work, repo, py = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = json.loads((work / "cdi.json").read_text())
rt = Runtime("runc", work / "runc-state")
db = [py, "-m", "devbroker.cli.main", "--run-dir", "/run/devbroker-runc"]
res = {}
for check in ("init", "quota"):
    b = work / f"bundle-{check}"
    b.mkdir()
    make_bundle(b, [py, f"{repo}/scripts/gpu/cuda_checks.py", check],
                binds=("/opt", repo, "/tmp/site"),
                env=[f"PYTHONPATH={repo}/src:/tmp/site", "PYTHONUNBUFFERED=1"])
    cfg = load_config(b)
    apply_cdi(cfg, spec, ["devbroker.io/gpu=c8"])
    save_config(b, cfg)
    subprocess.run(db + ["oci-seccomp", "--frontend", "seccomp", "--tenant", "c8",
                         "--config", str(b / "config.json")], check=True)
    cid = f"h200-{check}-{uuid.uuid4().hex[:6]}"
    r = rt.run(b, cid, capture_output=True, text=True, timeout=240)
    rt.delete(cid)
    print(f"--- {check}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}",
          file=sys.stderr)
    try:
        res[check] = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        res[check] = {"rc": r.returncode, "stderr": r.stderr[-1500:]}
audit = [json.loads(l) for l in open(work / "audit.log") if l.strip()]
res["attached"] = [a for a in audit if a.get("event") == "tenant-attached"]
res["status_after"] = json.loads(subprocess.run(db + ["status", "--json"], capture_output=True,
                                                text=True).stdout or "{}")
res["ok"] = (res.get("quota", {}).get("ok") is True and
             all(a.get("tenant") == "c8" and a.get("via") == "oci" for a in res["attached"]) and
             all(not t["open_files"] and not t["processes"]
                 for t in res["status_after"].get("tenants", [])))
print(json.dumps(res, indent=1))
PYEOF
cat "$OUT/results.json" | head -60
kill -TERM $BROKER; wait $BROKER
tar czf "$OUT/bundle.tgz" -C "$W" audit.log broker.log cdi.json
