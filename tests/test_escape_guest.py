"""The escape-test harness against the kernel module and CUSE, in the QEMU/TCG guest.

One guest boot (~60 s on 2 cores) runs devbroker.escape.guest for the module (insmod
major=195) and then for CUSE (modprobe cuse): the real broker core + emulated backend behind
the front end's char nodes 195:x, the victim as uid 1001 (alice), the attacker as uid 1002
(bob), the flooder as uid 1003 (mallory), tenants mapped by uid. The host judges every
attack's result against the broker's audit log exactly as for FUSE (harness.judge) and the
table is printed. Attacks that do not apply in the guest are N/A with the reason.

Known escapes are xfail(strict=True) with the bug: when the fix lands the test XPASSes and
fails, so the entry has to be removed — the attack itself is never weakened.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from devbroker.escape.attacks import ATTACKS, FLOOD

pytestmark = [pytest.mark.qemu, pytest.mark.root]

FRONT_ENDS = ("kmod", "cuse")

# fd-pass was an escape here (tenants are uids in one pid namespace); fixed in core.py:
# a session is bound to its opener's uid as well as its pid namespace. Known escapes would be
# listed here as xfail(strict=True); there are none.
KNOWN: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def reports():
    from devbroker.escape.harness import (GuestUnavailable, format_table,
                                          run_guest_escape_tests)

    from devbroker.testing import qemu

    ready = qemu.qemu_available() and (qemu.GUEST_VENV / "bin" / "python3").exists()
    if not ready and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run([str(qemu.SCRIPTS / "setup.sh")], check=False, capture_output=True,
                       timeout=1200)
    try:
        r = run_guest_escape_tests(FRONT_ENDS)
    except GuestUnavailable as e:
        pytest.skip(str(e))
    for fe in FRONT_ENDS:
        print(format_table(r[fe]))
        print()
    return r


def _cases():
    out = []
    for fe in FRONT_ENDS:
        for a in ATTACKS + [FLOOD]:
            if a is not FLOOD and fe not in a.frontends:
                continue
            marks = []
            if (fe, a.id) in KNOWN:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[(fe, a.id)]))
            out.append(pytest.param(fe, a.id, id=f"{fe}-{a.id}", marks=marks))
    return out


@pytest.mark.parametrize("front_end,attack_id", _cases())
def test_attack_is_refused_and_audited(reports, front_end, attack_id):
    row = {r.attack.id: r for r in reports[front_end].rows}[attack_id]
    assert row.verdict == "REFUSED", (f"{attack_id} on {front_end}: {row.verdict} "
                                      f"got={row.got} detail={row.detail} audit={row.audit}")
    assert row.audit, "every refusal names its audit record or why there is none"
    if row.attack.audit is not None:  # a broker refusal: its deny record, quoted
        assert not row.audit.startswith("(none)"), row.audit


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_report_covers_every_attack(reports, front_end):
    r = reports[front_end]
    assert sorted(x.attack.id for x in r.rows) == sorted([a.id for a in ATTACKS] + ["flood"])
    assert not r.notes, r.notes  # guest ran, broker started and stopped, no kernel warning
    for row in r.rows:
        if row.verdict == "N/A":
            assert row.detail and "does not apply to" not in row.detail, row.attack.id


def test_guest_runs_the_sandbox_attacks_that_make_sense(reports):
    """The guest is not a sandbox: only io_uring (a seccomp-filter bypass) is N/A there, and
    own-mount-ptr and fd-pass-mmap (both about the FUSE page cache: the module maps a
    broker memfd per file, CUSE has no mmap), and the racing-thread attacks (calls continued
    in the tenant exist only with real driver files behind the seccomp front end); the rest
    run as uid 1002 against the real char nodes, in the guest's variant where needed."""
    races = sorted(a.id for a in ATTACKS if "emulated" not in a.backends)
    # managed ranges are charged by the seccomp front end, which the guest does not run
    managed = sorted(a.id for a in ATTACKS if a.id.startswith("managed-"))
    for fe in FRONT_ENDS:
        na = sorted(r.attack.id for r in reports[fe].rows if r.verdict == "N/A")
        # no-layout-controls: checked in the host harness as a 535 tenant; the guest's
        # broker runs the same rule rows (its row says so)
        assert na == sorted(["fd-pass-mmap", "io-uring", "no-layout-controls",
                             "own-mount-ptr", *races, *managed]), (fe, na)
        rows = {r.attack.id: r for r in reports[fe].rows}
        # opened as bob even with alice's uid inside a user namespace: the front end names
        # the caller by its real uid, and the broker's open refusal is the audit record
        assert rows["userns-uid"].audit.startswith("open gpu1:"), rows["userns-uid"].audit
        assert "uid_in_ns: 1001" in rows["userns-uid"].detail


def test_cli_reports_a_missing_guest_clearly(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no qemu-system-x86_64 on this PATH
    r = subprocess.run([sys.executable, "-m", "devbroker.cli.main", "escape-test",
                        "--frontend", "kmod"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "qemu-system-x86_64 is not installed" in r.stderr and "setup.sh" in r.stderr
