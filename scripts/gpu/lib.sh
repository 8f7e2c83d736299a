# Shared by the GPU run scripts (sourced): log steps, record results, install the wheels the
# GPU host lacks. Needs PY, RES (results.json) and REPO set by the caller.
# gpu_run_start NAME (after `cd` to the repository root and sourcing this file): what every
# GPU run sets up. $OUT (default /tmp/NAME-out) is what the device tool brings back: run.log
# (all output from here on) and results.json ($RES, written with `put`); $W (/tmp/NAME-work,
# emptied) holds the rest; $PY is the host's python3.
gpu_run_start() {
  OUT=${OUT:-/tmp/$1-out}; mkdir -p "$OUT"
  W=/tmp/$1-work; rm -rf "$W"; mkdir -p "$W"
  exec > >(tee -a "$OUT/run.log") 2>&1
  export PYTHONUNBUFFERED=1
  PY=$(command -v python3)
  RES="$OUT/results.json"; echo '{}' > "$RES"
}
step() { echo; echo "=== $* [$(date +%T)]"; }
# put KEY TEXT: the last line of TEXT as JSON (or the text's tail) under KEY in $RES
put() { "$PY" - "$RES" "$1" "$2" <<'PYEOF'
import json, sys
p, k, v = sys.argv[1:4]
d = json.load(open(p))
try: d[k] = json.loads(v.strip().splitlines()[-1]) if v.strip() else v
except Exception: d[k] = v[-3000:]
json.dump(d, open(p, "w"), indent=1)
PYEOF
}
last() { tail -1; }
# The carried wheels (.whl: trio and its dependencies, prometheus_client, py-spy) go to
# /tmp/site, which the tenants get bound in; the checkout's src comes first.
install_wheels() {
  step "install carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$REPO/src:/tmp/site"
  chmod -R a+rX /tmp/site "$REPO" 2>/dev/null
}

# escape_real FE: the escape harness against the real driver through front end FE, its
# counts under escape_real_FE in $RES; report and stderr in $W/escape-FE.*
escape_real() { local fe=$1
  timeout 420 "$PY" -m devbroker.cli.main escape-test --frontend $fe --backend real \
     --workdir "$W/escape-$fe" --json > "$W/escape-$fe.json" 2> "$W/escape-$fe.err"
  echo "escape-test $fe: exit $?"
  "$PY" - "$W/escape-$fe.json" <<'PYX' | tee "$W/escape-$fe.txt"
import json, sys, collections
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no report:", e); sys.exit(0)
rows = r.get("rows", [])
c = collections.Counter(x.get("verdict") for x in rows)
print(dict(c))
for x in rows:
    if x.get("verdict") not in ("REFUSED", "N/A"):
        print(x.get("id") or x.get("attack"), x.get("verdict"), x.get("got"), str(x.get("detail"))[:200])
PYX
  put "escape_real_$fe" "$(head -1 "$W/escape-$fe.txt" | tr "'" '"')"
  tail -5 "$W/escape-$fe.err"
}

# probe_start NAME: what the short probes (launch, nvml, wake) begin with: gpu_run_start,
# the carried wheels, and the native listener loop built (its absence is said, not fatal).
probe_start() {
  gpu_run_start "$1"
  install_wheels
  "$PY" -m devbroker.native >/dev/null || echo "native loop did not build"
}

# The probes' broker and tenant (lane_probe.sh, nvml_probe.sh, launch_probe.sh):
# probe_broker RUN POLICY AUDIT LOG starts `devbroker run --backend real` in the background
# ($BROKER; environment assignments before the call reach it) and waits for its sockets;
# ptexec CMD... runs CMD as tenant c16 (root in its sandbox, the carried wheels bound in).
probe_broker() { local run=$1 pol=$2 audit=$3 logf=$4
  if [ -z "${BINDS+x}" ]; then
    mapfile -t BINDS < <("$PY" -c 'from devbroker.testing.tenant_binds import bind_args; print("\n".join(bind_args()))' | sed '/^$/d')
    BINDS+=(--bind /tmp/site)
  fi
  PROBE_RUN=$run
  rm -rf "$run"; mkdir -p "$run"
  "$PY" -m devbroker.cli.main --run-dir "$run" run --backend real --policy "$pol" \
     --audit "$audit" > "$logf" 2>&1 &
  BROKER=$!
  for i in $(seq 1 150); do [ -S "$run/seccomp.sock" ] && [ -S "$run/control.sock" ] && break; sleep 0.2; done
  sleep 0.5
}
# MODES words (ab_probe.sh, nvml_debug.sh, fuse_probe.sh): "name" or "name:VAR=value,...",
# the VARs being the broker's environment. mode_name WORD prints the name, mode_vars WORD
# the assignments (space-separated); mode_broker WORD RUN POLICY AUDIT LOG is probe_broker
# with them in the broker's environment only.
mode_name() { echo "${1%%:*}"; }
mode_vars() { local n=${1%%:*}; [ "$1" != "$n" ] && echo "${1#*:}" | tr , ' '; }
mode_broker() { local word=$1 v k; shift
  local assigns saved=(); read -r -a assigns <<< "$(mode_vars "$word")"
  for v in "${assigns[@]}"; do  # (a variable the script has, e.g. PYTHONPATH, is put back)
    k=${v%%=*}; if [ -n "${!k+x}" ]; then saved+=("$k=${!k}"); fi; export "$v"; done
  probe_broker "$@"
  for v in "${assigns[@]}"; do unset "${v%%=*}"; done
  for v in "${saved[@]}"; do export "$v"; done
}
ptexec() { timeout "${PTEXEC_TIMEOUT:-120}" "$PY" -m devbroker.cli.main --run-dir "$PROBE_RUN" \
    exec --tenant c16 --uid 0 "${BINDS[@]}" -- env PYTHONPATH="$PYTHONPATH" "$@"; }

# Native and tenant processes taking turns on the GPU (cuda_checks.py turns): turns_setup
# makes the two FIFOs in $TD and binds them into later tenants; turns_pair N DEV NAT
# TEXEC... runs `turns DEV` as a tenant (through the command TEXEC...) and `turns NAT`
# natively at once, both on CPU $BENCH_CPU (3), and records turnsN_native / turnsN_dev.
# scripts/gpu/turns_summary.py RES compares them.
turns_setup() {
  TD=/tmp/devbroker-turns; rm -rf "$TD"; mkdir -p "$TD"; mkfifo -m 666 "$TD/to-a" "$TD/to-b"
  BINDS+=(--bind "$TD:$TD:rw")
}
turns_pair() { local n=$1 dev=$2 nat=$3; shift 3
  local cpu=${BENCH_CPU:-3}
  "$@" env BENCH_CPU=$cpu "$PY" scripts/gpu/cuda_checks.py turns "$dev" "$TD" > "$W/turns$n-dev.txt" 2>&1 &
  local tp=$!
  env BENCH_CPU=$cpu "$PY" scripts/gpu/cuda_checks.py turns "$nat" "$TD" > "$W/turns$n-native.txt" 2>&1
  wait $tp
  put "turns${n}_native" "$(last < "$W/turns$n-native.txt")"
  put "turns${n}_dev" "$(last < "$W/turns$n-dev.txt")"
  tail -n 2 "$W/turns$n-native.txt" "$W/turns$n-dev.txt" | cut -c1-300
}
