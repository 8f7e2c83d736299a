#!/usr/bin/env bash
# The tests that depend on where the checkout is, run from copies of this checkout in the
# places users clone to (CI runs this after scripts/test.sh):
#   private  under a fresh 0700 directory in $HOME (like a clone under /root): tenants that
#            run as other uids cannot read the checkout, so they must get what they need
#            from the tenant tree (devbroker.testing.tenant_tree)
#   tmp      under /tmp (world-readable): the QEMU guest has a tmpfs of its own on /tmp and
#            must still see the checkout, its cache and its run directories
# Each copy is set up from nothing by the README's test command (scripts/test.sh: its own
# .venv, guest kernel and kmod build under .cache/), then runs a targeted subset: the non-root
# sandbox tests, the tests that replay the H200 recordings of tests/data (in the broker and,
# for the control lane's, inside a tenant, whose /tmp hides a checkout under /tmp unless it
# is bound), and one guest boot (kmod from the private copy, CUSE, which needs modprobe and
# so the guest's /lib/modules, from the /tmp copy). A copy has nothing beside it: a test
# that read from outside the checkout fails here.
#   scripts/test-locations.sh [private|tmp]...     (default: both)
# Environment: DEVBROKER_LOCATIONS_KEEP=1 keeps the copies (their paths are printed).
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
NONROOT="tests/test_sandbox.py::test_runs_as_given_uid_without_capabilities
tests/test_stat_shim.py::test_sandbox_stat_shim_for_a_non_root_tenant"
# The recordings' tests: test_cuda_rules.py and test_fastlane.py's two that read them.
TRACES="tests/test_cuda_rules.py tests/test_fastlane.py"
TRACES_K="cuda_rules or test_lane_answers_as_the_general_path or general_steps_continue"
# the two sandbox tests, the recordings' 10 and at least ten of the guest's; fewer: the
# selection broke
MIN_PASSED=22

say() { echo "test-locations: $*" >&2; }

copy_checkout() {  # what a clone has, plus uncommitted edits: tracked and unignored files
    mkdir -p "$1"
    git -C "$SRC" ls-files -z -co --exclude-standard \
        | tar -C "$SRC" --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -C "$1" -xf -
}

run_at() {
    local name=$1 base fe dir log rc t0=$SECONDS
    case $name in
        private) base=$(mktemp -d "${HOME:-/root}/.devbroker-loc.XXXXXX") && fe=kmod ;;
        # world-readable: only the /tmp part is under test here
        tmp) base=$(mktemp -d /tmp/devbroker-loc.XXXXXX) && chmod 755 "$base" && fe=cuse ;;
        *) say "unknown location $name (private, tmp)"; return 2 ;;
    esac || { say "$name: cannot make a directory"; return 1; }
    dir=$base/devbroker
    log=$base/test.log
    copy_checkout "$dir" || { say "$name: copying the checkout failed"; return 1; }
    say "$name: $dir ($(stat -c %A "$base") $base), guest front end $fe"
    # Everything from the copy itself: no cache shared with this checkout. The Kubernetes
    # test cluster is not built there: none of these tests use it.
    (cd "$dir" && env -u DEVBROKER_QEMU_CACHE DEVBROKER_SKIP_K8S=1 bash scripts/test.sh \
        -p no:cacheprovider $NONROOT $TRACES tests/test_guest_frontends.py \
        -k "non_root_tenant or given_uid or $TRACES_K or $fe") \
        2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    local passed
    passed=$(grep -Eo '[0-9]+ passed' "$log" | tail -n1 | cut -d' ' -f1)
    if [ "$rc" = 0 ] && [ "${passed:-0}" -lt $MIN_PASSED ]; then
        say "$name: only ${passed:-0} tests passed, expected at least $MIN_PASSED"
        rc=1
    fi
    say "$name: exit $rc, ${passed:-0} passed, $((SECONDS - t0)) s ($dir)"
    if [ "${DEVBROKER_LOCATIONS_KEEP:-0}" = 1 ]; then
        say "$name: kept $base"
    else
        rm -rf --one-file-system "$base"
    fi
    return "$rc"
}

[ $# -gt 0 ] || set -- private tmp
rc=0
for name in "$@"; do
    run_at "$name" || rc=1
done
exit $rc
