"""The escape-test harness in CI: every attack of devbroker.escape.attacks is run
from inside a tenant against the FUSE front end (devbroker run + devbroker exec sandboxes)
and the seccomp front end (broker core in-process, tenants under run_tenant), and must come
back REFUSED with its audit record (or, for kernel/sandbox refusals, with the reason no
audit line can exist). One harness run per front end (about a minute each).

Known escapes are xfail(strict=True) with the bug: when the fix lands the test XPASSes and
fails, so the entry has to be removed — the attack itself is never weakened.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from devbroker.escape.attacks import ATTACKS, FLOOD

pytestmark = pytest.mark.root

# No known escapes: fd-pass and rm-alloc-memory were fixed in core.py (pid-namespace binding
# of sessions; RM_ALLOC_MEMORY under the class allowlist and quota).
KNOWN: dict[tuple[str, str], str] = {}

_REPORTS: dict = {}


def report(front_end):
    if front_end not in _REPORTS:
        from devbroker.escape.harness import format_table, run_escape_tests

        r = run_escape_tests(front_end)
        print(format_table(r))
        _REPORTS[front_end] = r
    return _REPORTS[front_end]


def _cases():
    out = []
    for fe in ("fuse", "seccomp"):
        for a in ATTACKS + [FLOOD]:
            if a is not FLOOD and (fe not in a.frontends or "emulated" not in a.backends):
                continue  # (the racing-thread attacks need the real driver: checked below)
            marks = []
            if (fe, a.id) in KNOWN:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[(fe, a.id)]))
            out.append(pytest.param(fe, a.id, id=f"{fe}-{a.id}", marks=marks))
    return out


@pytest.mark.parametrize("front_end,attack_id", _cases())
def test_attack_is_refused_and_audited(front_end, attack_id):
    rows = {r.attack.id: r for r in report(front_end).rows}
    row = rows[attack_id]
    assert row.verdict == "REFUSED", (f"{attack_id} on {front_end}: {row.verdict} "
                                      f"got={row.got} detail={row.detail} audit={row.audit}")
    assert row.audit, "every refusal names its audit record or why there is none"


@pytest.mark.parametrize("front_end", ["fuse", "seccomp"])
def test_report_covers_every_attack(front_end):
    r = report(front_end)
    ids = [x.attack.id for x in r.rows]
    assert sorted(ids) == sorted([a.id for a in ATTACKS] + ["flood"])
    assert not r.notes, r.notes


def test_real_driver_attacks_are_listed_not_applicable_with_their_reason():
    """The racing-thread attacks continue calls in the tenant, which only real
    driver files do: with the emulated backend the report lists them N/A and says why,
    never as refused."""
    rows = {r.attack.id: r for r in report("seccomp").rows}
    races = [a for a in ATTACKS if "emulated" not in a.backends]
    assert {a.id for a in races} >= {"race-nvos02-class", "race-root-class",
                                     "race-direct-open"}
    for a in races:
        assert rows[a.id].verdict == "N/A", rows[a.id]
        assert "needs the real driver" in rows[a.id].detail


def test_one_gpu_host_runs_the_real_driver_attacks_and_lists_the_second_gpu_ones_na():
    """On a host with one GPU (the lent H200) the real-driver harness cannot give the victim a
    GPU of its own: its policy names only GPU 0 (a policy naming a GPU the host lacks is
    refused by the broker), and the attacks aimed at a GPU only the victim has are N/A with
    the reason, not run against a GPU that is not there."""
    from devbroker.broker.policy import load_policy_text
    from devbroker.escape.harness import _na_rows, _select, host_gpus, policy_text

    if host_gpus("real") < 2:  # CI: no driver (0 GPUs); the lent H200: 1
        p = load_policy_text(policy_text("real"), "escape-test policy")
        assert list(p.tenants["alice"].gpus) == [0]
    run, skip = _select("seccomp", None, "real", gpus=1)
    two = {a.id for a in ATTACKS if a.gpus == 2}
    assert two >= {"attach-foreign", "gpu-id-fields", "attach-gpus-to-fd"}
    assert not two & {a.id for a in run}
    assert {"race-nvos02-class", "race-root-class"} <= {a.id for a in run}
    rows = {r.attack.id: r for r in _na_rows("seccomp", skip)}
    for i in two:
        assert rows[i].verdict == "N/A" and "only the victim has" in rows[i].detail, rows[i]
    # with two GPUs they run
    assert two <= {a.id for a in _select("seccomp", None, "real", gpus=2)[0]}


def test_cli_lists_attacks():
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "devbroker.cli.main", "escape-test", "--list"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "class-83de" in r.stdout and "flood" in r.stdout


# The attacks a container changes, from inside runc containers made from
# `devbroker cdi` and `devbroker oci-seccomp` (victim and attacker in containers of their
# own, the seccomp listener handed over by runc itself). Seconds per run.
CONTAINERS = ("runc-fuse", "runc-seccomp")


def _container_cases():
    from devbroker.escape.harness import _select

    return [pytest.param(fe, a.id, id=f"{fe}-{a.id}") for fe in CONTAINERS
            for a in _select(fe, None)[0]]


@pytest.mark.parametrize("front_end,attack_id", _container_cases())
def test_attack_from_a_container_is_refused(front_end, attack_id):
    test_attack_is_refused_and_audited(front_end, attack_id)


@pytest.mark.parametrize("front_end", CONTAINERS)
def test_container_report(front_end):
    from devbroker.escape.harness import CONTAINER_ATTACKS

    r = report(front_end)
    assert sorted(x.attack.id for x in r.rows) == sorted(a.id for a in ATTACKS)
    ran = {x.attack.id for x in r.rows if x.verdict != "N/A"}
    want = set(CONTAINER_ATTACKS) - ({"io-uring"} if front_end == "runc-fuse" else set())
    assert ran == want
    assert not r.notes, r.notes  # among them: both containers attached through runc
