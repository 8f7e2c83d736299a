# Shared by the GPU run scripts (sourced): log steps, record results, install the wheels the
# GPU host lacks. Needs PY, RES (results.json) and REPO set by the caller.
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
