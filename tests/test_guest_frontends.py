"""The real broker core (emulated backend) behind the kernel module's nodes and, in a
separate boot, behind CUSE nodes, with tenants as ordinary uids in a QEMU/TCG guest.

Each front end gets one boot (kmod: ~45 s, CUSE: ~60 s under TCG on 2 cores) running
devbroker.testing.guest_broker, which prints one ``GUEST-RESULT {json}`` line per check
with what it observed; the assertions are here. Policy: alice = uid 1001 on GPU 0 with
16 GiB, bob = uid 1002 on GPU 1 with 8 GiB, other uids refused (tenant_by_uid).

Debian's nvidia-smi 535 (installed on the host; the guest sees the host root) runs
unmodified against the nodes when it is installed; otherwise those tests skip.
"""
from __future__ import annotations

import csv
import errno
import io
import json
import os
import re
import shutil
import subprocess

import pytest

from devbroker.testing import qemu

pytestmark = pytest.mark.qemu

UUID = {"alice": "GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0001",
        "bob": "GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0002"}
QUOTA = {"alice": 16 << 30, "bob": 8 << 30}
UID_TENANT = {1001: "alice", 1002: "bob"}
NV_ERR_INSUFFICIENT_PERMISSIONS = 0x1B
HAVE_SMI = shutil.which("nvidia-smi") is not None
IDLE = {"alice": {"open_files": 0, "clients": 0, "used": 0},
        "bob": {"open_files": 0, "clients": 0, "used": 0}}

SETUP = {
    # major=195: nothing holds it in the guest, and NVML only talks to char 195:255.
    "kmod": "insmod kmod/devbroker.ko major=195 gpus=2 timeout_ms=5000 || exit 90",
    "cuse": "modprobe cuse || exit 91",
}
UNLOAD = {"kmod": "rmmod devbroker && insmod kmod/devbroker.ko && rmmod devbroker",
          "cuse": "rmmod cuse"}
SCRIPT = """
set -u
{setup}
mkdir -p $DBRUN/{fe}
$GUEST_PYTHON -m devbroker.testing.guest_broker checks --frontend {fe} --dir $DBRUN/{fe} {smi}
rc=$?
# unload while idle: the broker has exited and every tenant file is closed
{unload} && echo UNLOAD-IDLE ok
exit $rc
"""


def _ensure_qemu() -> None:
    venv_ok = (qemu.GUEST_VENV / "bin" / "python3").exists()
    if qemu.qemu_available() and venv_ok:
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run([str(qemu.SCRIPTS / "setup.sh")], check=False, capture_output=True,
                       timeout=1200)
    if not qemu.qemu_available():
        pytest.skip("qemu-system-x86_64 is not installed and scripts/qemu/setup.sh could "
                    "not install it")
    if not (qemu.GUEST_VENV / "bin" / "python3").exists():
        pytest.skip("the guest venv (scripts/qemu/setup.sh) is missing")


@pytest.fixture(scope="module")
def kver():
    _ensure_qemu()
    return qemu.build()


@pytest.fixture(scope="module", params=["kmod", "cuse"])
def guest(request, kver):
    fe = request.param
    script = SCRIPT.format(setup=SETUP[fe], fe=fe, unload=UNLOAD[fe],
                           smi="--smi" if HAVE_SMI else "")
    r = qemu.run_in_guest(script, timeout=400, kver=kver)
    results = {}
    for line in r.output.splitlines():
        if line.startswith("GUEST-RESULT "):
            d = json.loads(line[len("GUEST-RESULT "):])
            results[d.pop("check")] = d
    return fe, r, results


def _ctx(r: qemu.GuestResult) -> str:
    return f"guest output:\n{r.output[-5000:]}\nconsole tail:\n{r.console[-1500:]}"


def _get(guest, name: str) -> dict:
    fe, r, results = guest
    assert name in results, f"{fe}: check {name} did not report\n" + _ctx(r)
    d = results[name]
    assert "crashed" not in d, f"{fe}: {name} crashed: {d['crashed']}\n{d.get('trace')}"
    return d


def test_guest_ran(guest):
    fe, r, results = guest
    assert r.status == 0, _ctx(r)
    assert "error" not in _get(guest, "broker_start"), _ctx(r)
    assert _get(guest, "broker_stop")["rc"] == 0


def test_nodes_are_nvidia_char_devices(guest):
    nodes = _get(guest, "nodes")["nodes"]
    assert nodes["nvidiactl"] == {"chr": True, "mode": "0o666", "rdev": "195:255"}
    assert nodes["nvidia0"] == {"chr": True, "mode": "0o666", "rdev": "195:0"}
    assert nodes["nvidia1"] == {"chr": True, "mode": "0o666", "rdev": "195:1"}
    uvm, tools = nodes["nvidia-uvm"], nodes["nvidia-uvm-tools"]
    assert uvm["chr"] and tools["chr"], nodes
    assert uvm["rdev"].split(":")[0] == tools["rdev"].split(":")[0], nodes  # one UVM major
    assert (uvm["rdev"].split(":")[1], tools["rdev"].split(":")[1]) == ("0", "1"), nodes


def test_open_is_mapped_by_uid(guest):
    assert _get(guest, "open")["errno"] == {
        "alice_ctl": 0, "alice_gpu0": 0,
        "alice_gpu1": errno.EACCES,  # not alice's GPU
        "bob_gpu1": 0,
        "nobody_ctl": errno.EACCES,  # uid 1003 is no tenant's
    }


@pytest.mark.parametrize("tenant", ["alice", "bob"])
def test_nvml_sequence(guest, tenant):
    d = _get(guest, f"probe_{tenant}")
    assert d["rc"] == 0, d
    rep = d["report"]
    assert rep["version_reply"] == 1 and len(rep["cards"]) == 1, rep
    [g] = rep["gpus"]
    assert (g["name"], g["uuid"]) == ("NVIDIA H200", UUID[tenant]), g
    assert g["memory"] == {"total": QUOTA[tenant], "free": QUOTA[tenant], "used": 0}, g


def test_quota(guest):
    d = _get(guest, "quota")
    assert d["rc"] == 0, d
    [g] = d["report"]["gpus"]
    assert [a["status"] for a in g["allocations"]] == ["NV_OK", "NV_ERR_NO_MEMORY"], g
    assert g["memory_after_alloc"]["used"] == 10 << 30, g
    assert g["memory_after_free"]["used"] == 0, g
    assert d["after"] == IDLE


def test_refusals_are_audited(guest):
    d = _get(guest, "refusals")
    assert d["rc"] == 0, d
    assert d["results"] == [{"what": "registry", "errno": errno.EPERM},
                            {"what": "debugger", "status": NV_ERR_INSUFFICIENT_PERMISSIONS},
                            {"what": "ecc", "status": NV_ERR_INSUFFICIENT_PERMISSIONS}], d
    whats = [(a["tenant"], a["what"]) for a in d["audit"]]
    assert whats == [("alice", "NV_ESC_RM_ACCESS_REGISTRY"),
                     ("alice", "RM_ALLOC GT200_DEBUGGER"),
                     ("alice", "RM_CONTROL NV2080_CTRL_CMD_GPU_SET_ECC_CONFIGURATION")], d
    assert all(a["pid"] and a["node"] == "nvidiactl" and a["reason"] for a in d["audit"])


def test_uvm_raw_command(guest):
    # a bare UVM number: no size in the command, the broker reads/writes tenant memory
    assert _get(guest, "uvm_raw") == {"ret": 0, "rmStatus": 0}


def test_tenant_kill_releases_everything(guest):
    d = _get(guest, "tenant_kill")
    assert d["ready"] == {"ready": True}, d
    assert d["before"]["alice"] == {"open_files": 2, "clients": 1, "used": 1 << 30}, d
    assert d["killed"] and d["released"], d
    assert d["after"] == IDLE, d


def test_16_concurrent_tenants(guest):
    d = _get(guest, "concurrent")
    assert len(d["results"]) == 16, d
    for res in d["results"]:
        tenant = UID_TENANT[res["uid"]]
        assert "error" not in res, res
        assert (res["ids"], res["uuid"], res["total"]) == (1, UUID[tenant], QUOTA[tenant]), res
        assert 64 << 20 <= res["used_after_alloc"] <= QUOTA[tenant], res
    assert d["idle_after"] and d["after"] == IDLE, d


def test_broker_death_fails_calls_promptly(guest):
    fe = guest[0]
    d = _get(guest, "broker_death")
    assert d["ready"] == {"ready": True} and d["broker_rc"] == -9, d
    if fe == "kmod":
        # calls on existing files: EIO; new opens: ENODEV (no driver); files of the dead
        # broker stay dead after a restart
        assert (d["call_errno"], d["open_errno"], d["old_file_after_restart_errno"]) == \
            (errno.EIO, errno.ENODEV, errno.EIO), d
    else:
        # the kernel aborts the CUSE connection: ENOTCONN, and the nodes disappear
        assert d["call_errno"] in (errno.ENOTCONN, errno.ECONNABORTED), d
        assert d["open_errno"] in (errno.ENOENT, errno.ENODEV), d
        assert d["old_file_after_restart_errno"] in (errno.ENOTCONN, errno.ENODEV), d


def test_broker_restart_serves_again(guest):
    d = _get(guest, "broker_restart")
    assert d["rc"] == 0, d
    [g] = d["report"]["gpus"]
    assert g["uuid"] == UUID["alice"] and g["memory"]["used"] == 0, d


def test_unload_when_idle(guest):
    fe, r, _ = guest
    assert "UNLOAD-IDLE ok" in r.output, _ctx(r)


def test_no_kernel_warnings(guest):
    fe, r, _ = guest
    assert "9p" in r.dmesg  # the log really is the guest's
    assert qemu.kernel_problems(r.dmesg) == [], r.dmesg[-4000:]


@pytest.mark.nvidia
@pytest.mark.skipif(not HAVE_SMI, reason="nvidia-smi is not installed on the host "
                    "(scripts/install-nvidia-clients.sh installs Debian's 535; CI does)")
@pytest.mark.parametrize("tenant", ["alice", "bob"])
def test_nvidia_smi_shows_the_tenants_view(guest, tenant):
    d = _get(guest, f"smi_csv_{tenant}")
    assert d["rc"] == 0, d
    rows = list(csv.reader(io.StringIO(d["stdout"]), skipinitialspace=True))
    assert rows == [["index", "name", "uuid", "memory.total [MiB]", "memory.used [MiB]"],
                    ["0", "NVIDIA H200", UUID[tenant], f"{QUOTA[tenant] >> 20} MiB", "0 MiB"]], d
    d = _get(guest, f"smi_list_{tenant}")
    assert d["rc"] == 0, d
    assert re.findall(r"^GPU (\d+): (.+) \(UUID: (\S+)\)$", d["stdout"], re.M) == \
        [("0", "NVIDIA H200", UUID[tenant])], d
