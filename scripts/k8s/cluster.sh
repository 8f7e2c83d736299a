#!/bin/sh
# Start, stop or show the test cluster (docs/kubernetes.md, "The test cluster"):
#   scripts/k8s/cluster.sh up|down|status [STATE_DIR]      (default .cache/k8s/run; root)
# `up` prints the KUBECONFIG to export. The binaries come from scripts/k8s/build.sh.
set -eu
cd "$(dirname "$0")/../.."
cmd=${1:?usage: $0 up|down|status [STATE_DIR]}
state=${2:-.cache/k8s/run}
py=.venv/bin/python
[ -x "$py" ] || py=python3
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} exec "$py" -m devbroker.testing.k8s "$cmd" --state-dir "$state"
