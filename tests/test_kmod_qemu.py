"""The kernel module front end, end to end in a QEMU/TCG guest running Debian's kernel.

One boot (~12 s under TCG, plus ~5 s to build) runs every guest-side check in
devbroker.testing.kmod_guest against the stand-in broker; each check becomes one test here.
The guest's dmesg must stay free of warnings, and the module must unload when idle.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from devbroker.testing import qemu

pytestmark = pytest.mark.qemu

CHECKS = [
    "no_broker_open_enodev", "second_broker_ebusy", "tenant_basic_ran", "ioctl_reply_bytes",
    "ioctl_denied_eperm", "ioctl_unknown_enotty", "ioctl_identity",
    "reply_to_readonly_buffer_efault", "mmap_broker_memfd", "mmap_shared_update",
    "audit_has_identity", "open_release_paired", "open_cgroup_id", "open_refused_eacces",
    "uvm_raw_cmd_nested_rw", "pass_ioctl_reaches_real_file", "pass_mmap_maps_real_file",
    "quota_status_no_memory", "killed_mid_call_exits_promptly", "killed_tenant_released",
    "late_verdict_enoent", "held_call_times_out", "concurrent_16_tenants",
    "threads_share_one_file", "broker_death_pending_eio", "broker_death_later_call_eio",
    "broker_death_open_enodev", "broker_restart_new_files_work", "broker_restart_old_file_eio",
    # frontends/kmod.py (KmodFrontend) against a stub BrokerInterface
    "adapter_ioctl_reply", "adapter_ioctl_deny", "adapter_mmap_map_read",
    "adapter_open_release", "adapter_closed_enodev",
]  # fmt: skip

GUEST_SCRIPT = """
set -u
insmod kmod/devbroker.ko gpus=2 timeout_ms=3000 || exit 90
PYTHONPATH=$PWD/src /usr/bin/python3 -m devbroker.testing.kmod_guest $DBRUN
rc=$?
# the trio adapter needs the guest venv (setup.sh makes it); without it these checks
# are simply missing and test_guest_check reports them
$GUEST_PYTHON -m devbroker.testing.kmod_adapter_guest || rc=1
# unload while idle (broker gone, every tenant file closed), then load and unload again
rmmod devbroker && echo UNLOAD-1 ok
insmod kmod/devbroker.ko && rmmod devbroker && echo UNLOAD-2 ok
exit $rc
"""


def _ensure_qemu() -> None:
    if qemu.qemu_available():
        return
    setup = qemu.SCRIPTS / "setup.sh"
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run([str(setup)], check=False, capture_output=True, timeout=1200)
    if not qemu.qemu_available():
        pytest.skip("qemu-system-x86_64 is not installed and scripts/qemu/setup.sh could not install it")


@pytest.fixture(scope="module")
def guest():
    _ensure_qemu()
    kver = qemu.build()
    r = qemu.run_in_guest(GUEST_SCRIPT, timeout=240, kver=kver)
    checks = {}
    for m in re.finditer(r"^CHECK (\S+) (ok|FAIL) ?(.*)$", r.output, re.M):
        checks[m.group(1)] = (m.group(2) == "ok", m.group(3))
    return r, checks


def _context(r: qemu.GuestResult) -> str:
    return f"guest output:\n{r.output[-4000:]}\nconsole tail:\n{r.console[-2000:]}"


def test_guest_ran(guest):
    r, checks = guest
    assert r.status is not None, _context(r)
    assert checks, _context(r)


@pytest.mark.parametrize("name", CHECKS)
def test_guest_check(guest, name):
    r, checks = guest
    assert name in checks, f"check {name} did not run\n" + _context(r)
    ok, detail = checks[name]
    assert ok, f"{name}: {detail}"


def test_every_guest_check_is_listed(guest):
    _, checks = guest
    assert sorted(checks) == sorted(CHECKS)


def test_unload_when_idle(guest):
    r, _ = guest
    assert "UNLOAD-1 ok" in r.output and "UNLOAD-2 ok" in r.output, _context(r)


def test_no_kernel_warnings(guest):
    r, _ = guest
    assert "devbroker: protocol" in r.dmesg  # the log really is the guest's
    assert qemu.kernel_problems(r.dmesg) == [], r.dmesg[-4000:]
