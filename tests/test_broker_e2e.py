"""The walking skeleton end to end: a real broker process, FUSE nodes, tenant sandboxes,
real tenant processes doing real ioctls."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devbroker.testing.policies import tenant, two_h200

from devbroker.abi import status as nvs
from tenant_io import lines

pytestmark = pytest.mark.root

GiB = 1 << 30
HERE = Path(__file__).resolve().parent
PROBE = [sys.executable, "-m", "devbroker.tools.probe"]
TENANT = [sys.executable, str(HERE / "tenant_prog.py")]

POLICY = two_h200(tenant("alice", gpus=[0]), tenant("bob", gpus=[1], memory_quota="32GiB"),
                  driver_version=None)




def probe(broker, tenant, *args):
    r = broker.exec(tenant, *PROBE, "--json", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def wait_for(pred, what: str, timeout: float = 30.0):
    """Poll for a state change the broker makes asynchronously (e.g. FUSE RELEASE)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(params=["fuse", "seccomp"])
def broker(start_broker, request):
    """The same tenant behaviour through both ways `devbroker exec` reaches the broker: FUSE
    node files, and seccomp user notification on character nodes (with the emulated backend
    the seccomp files are memfd placeholders; real driver files need the real backend)."""
    b = start_broker(POLICY)
    b.frontend = request.param
    return b


def test_nvml_sequence_sees_only_its_gpu_and_quota(broker):
    alice = probe(broker, "alice")
    assert alice["version_reply"] == 1
    assert alice["cards"] == [0]
    assert [g["minor"] for g in alice["gpus"]] == [0]
    g = alice["gpus"][0]
    assert g["uuid"] == "GPU-11111111-2222-3333-4444-555555555555"
    assert g["name"] == "NVIDIA H200"
    assert g["memory"]["total"] == 16 * GiB
    assert g["memory"]["used"] == 0

    bob = probe(broker, "bob")
    assert bob["cards"] == [1]
    assert [g["minor"] for g in bob["gpus"]] == [1]
    assert bob["gpus"][0]["uuid"] == "GPU-66666666-7777-8888-9999-000000000000"
    assert bob["gpus"][0]["memory"]["total"] == 32 * GiB


def test_sandbox_shows_only_the_tenants_nodes(broker):
    r = broker.exec("alice", "sh", "-c", "ls /dev | grep nvidia; ls /proc/driver/nvidia/gpus")
    assert r.returncode == 0, r.stderr
    names = r.stdout.split()
    assert "nvidiactl" in names and "nvidia0" in names
    assert "nvidia1" not in names and "nvidia-caps" not in names
    assert names[-1] == "0000:00:06.0"


def test_proc_driver_view_is_a_read_only_copy_of_the_brokers(broker):
    """/proc/driver/nvidia in the sandbox holds the broker's view of the tenant (its GPUs
    only), copied into the sandbox's own tmpfs: NVML reads it ~15 times per nvmlInit, and
    through the broker's mount each open+read+close cost FUSE round trips."""
    script = (
        "import json, os\n"
        "st = os.statvfs('/proc/driver/nvidia')\n"
        "fs = open('/proc/self/mountinfo').read().splitlines()\n"
        "mine = [l for l in fs if l.split()[4] == '/proc/driver']\n"
        "try:\n"
        "    open('/proc/driver/nvidia/params', 'a')\n"
        "    write = 'ok'\n"
        "except OSError as e:\n"
        "    write = e.errno\n"
        "print(json.dumps({'mount': mine[-1].split(' - ')[1].split()[0] if mine else None,\n"
        "                  'ro': bool(st.f_flag & os.ST_RDONLY), 'write': write,\n"
        "                  'gpus': sorted(os.listdir('/proc/driver/nvidia/gpus')),\n"
        "                  'version': open('/proc/driver/nvidia/version').read()}))\n")
    r = broker.exec("alice", sys.executable, "-c", script)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["mount"] == "tmpfs" and got["ro"]
    assert got["write"] in (errno.EROFS, errno.EACCES)
    assert got["gpus"] == ["0000:00:06.0"]  # alice's GPU only
    view = broker.run_dir / "nodes" / "alice" / "proc" / "driver" / "nvidia" / "version"
    if view.exists():  # the broker's own view (FUSE), when it serves one
        assert got["version"] == view.read_text()
    assert "NVRM version" in got["version"]


def test_quota_is_the_drivers_out_of_memory_and_free_returns_it(broker):
    r = probe(broker, "alice", "--alloc", "10GiB", "--alloc", "10GiB")
    g = r["gpus"][0]
    assert [a["status"] for a in g["allocations"]] == ["NV_OK", "NV_ERR_NO_MEMORY"]
    assert g["memory_after_alloc"]["used"] == 10 * GiB
    assert g["memory_after_free"]["used"] == 0
    denials = [a for a in broker.audit() if a["event"] == "deny" and a["tenant"] == "alice"]
    assert any("quota" in d["reason"] for d in denials)
    wait_for(lambda: broker.tenant("alice")["memory"]["0"]["used"] == 0, "quota returned")


def test_refusals_are_answered_like_the_driver_and_audited(broker):
    r = broker.exec("alice", *TENANT, "refusals")
    assert r.returncode == 0, r.stdout + r.stderr
    got = {x["what"]: x for x in lines(r.stdout)}
    assert got["registry"]["errno"] == 1  # EPERM
    assert got["debugger"]["status"] == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
    assert got["ecc"]["status"] == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
    denials = [a for a in broker.audit() if a["event"] == "deny"]
    whats = " ".join(d["what"] for d in denials)
    assert "NV_ESC_RM_ACCESS_REGISTRY" in whats
    assert "0x83de" in " ".join(d["reason"] for d in denials).lower()
    for d in denials:
        assert d["tenant"] == "alice" and d["pid"] and d["node"] and d["reason"]


def test_sigkill_frees_everything_the_tenant_held(broker):
    p = broker.exec_popen("alice", *TENANT, "hold", "4GiB", stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    try:
        held = json.loads(p.stdout.readline())
        assert held["memory"]["used"] == 4 * GiB
        t = broker.tenant("alice")
        assert t["memory"]["0"]["used"] == 4 * GiB and t["clients"] == 1
        # SIGKILL the tenant process itself (host pid, as the broker sees it).
        for pid in t["processes"]:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: broker.tenant("alice")["open_files"] == 0, "files released")
        t = broker.tenant("alice")
        assert t["memory"]["0"]["used"] == 0
        assert t["clients"] == 0 and t["objects"] == 0
    finally:
        p.kill()
        p.wait()


def test_broker_death_fails_tenant_calls_promptly_and_restart_remounts(broker, start_broker):
    p = broker.exec_popen("alice", *TENANT, "ioctl-after-line", stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(p.stdout.readline())["what"] == "ready"
        broker.stop(signal.SIGKILL)
        p.stdin.write("go\n")
        p.stdin.flush()
        after = json.loads(p.stdout.readline())
        assert after["what"] == "after"
        if broker.frontend == "fuse":
            assert after["errno"] in (107, 103, 5)  # ENOTCONN (aborted connection) or EIO
        else:  # the listener is gone: every notified call fails closed with ENOSYS
            assert after["errno"] == 38
        p.wait(timeout=30)
    finally:
        p.kill()
    # A new broker on the same run dir detaches the dead one's mount and serves again.
    again = start_broker(POLICY, run_dir=broker.run_dir)
    assert probe(again, "alice")["gpus"][0]["memory"]["total"] == 16 * GiB


def test_two_tenants_concurrently_do_not_see_each_other(broker):
    p = broker.exec_popen("alice", *TENANT, "hold", "2GiB", stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    try:
        held = json.loads(p.stdout.readline())
        bob = probe(broker, "bob")
        assert [g["minor"] for g in bob["gpus"]] == [1]
        assert bob["gpus"][0]["memory"]["used"] == 0
        r = broker.exec("bob", *TENANT, "foreign-client", hex(held["client"]))
        assert lines(r.stdout)[0]["status"] == nvs.NV_ERR_INVALID_CLIENT
        # bob cannot open alice's GPU node: it is not in bob's sandbox at all
        r = broker.exec("bob", "sh", "-c", "test -e /dev/nvidia0 && echo present || echo absent")
        assert r.stdout.strip() == "absent"
        assert broker.tenant("alice")["memory"]["0"]["used"] == 2 * GiB
        assert broker.tenant("bob")["memory"]["1"]["used"] == 0
    finally:
        p.stdin.close()
        p.wait(timeout=30)


def test_policy_hot_reload_refuses_bad_files_and_applies_good_ones(broker, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(POLICY.replace('memory_quota = "16GiB"', 'memory_quota = "sixteen"'))
    r = broker.cli("policy", "apply", str(bad))
    assert r.returncode == 1
    assert "line" in r.stderr and "stays in force" in r.stderr
    assert probe(broker, "alice")["gpus"][0]["memory"]["total"] == 16 * GiB

    good = tmp_path / "good.toml"
    good.write_text(POLICY.replace('memory_quota = "16GiB"', 'memory_quota = "8GiB"'))
    r = broker.cli("policy", "apply", str(good))
    assert r.returncode == 0, r.stderr
    assert probe(broker, "alice")["gpus"][0]["memory"]["total"] == 8 * GiB
    events = [a["event"] for a in broker.audit()]
    assert "policy-refused" in events and "policy-applied" in events


def test_status_command_reports_tenants(broker):
    r = broker.cli("status")
    assert r.returncode == 0, r.stderr
    assert "alice" in r.stdout and "16 GiB" in r.stdout and "bob" in r.stdout


def test_the_startups_objects_are_out_of_the_collectors_sight(broker):
    """daemon.run_forever freezes what the broker loaded before serving (its modules, the
    ABI tables' raw data and the rule tables: ~50,000 objects; before the metrics' names
    were read from the raw tables, every control's layout was built too, ~250,000), so no
    full collection over them can stall every listener in the middle of a tenant's call:
    the broker says how many it froze (0 without the freeze)."""
    assert broker.status()["gc_frozen"] > 20_000


def test_cuda_calls_decided_case_by_case(broker):
    """PERF_BOOST: CUDA's own boost reaches the driver (the emulator does not model it:
    NOT_SUPPORTED), any other is answered NV_OK by the broker without the driver. A debugger
    object only on the tenant's own context. An OS event only with an OS-event notifier."""
    r = broker.exec("alice", *TENANT, "cuda-rules")
    assert r.returncode == 0, r.stdout + r.stderr
    got = {x["what"]: x["status"] for x in lines(r.stdout)}
    assert got["boost-other"] == nvs.NV_OK
    assert got["boost-cuda"] == nvs.NV_ERR_NOT_SUPPORTED
    assert got["debugger-own"] != nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
    assert got["debugger-none"] == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
    assert got["event-kernel-callback"] == nvs.NV_ERR_INVALID_CLASS
    audit = broker.audit()
    assert any(a["event"] == "notice" and "PERF_BOOST" in a.get("message", "")
               and "answered by the broker" in a["message"] for a in audit)
    denied = " ".join(a["reason"] for a in audit if a["event"] == "deny")
    assert "a debugger only on the tenant's own context" in denied
    assert "is not an OS event" in denied
    # The boost the broker answered never reached the emulator; CUDA's did.
    notices = " ".join(a.get("message", "") for a in audit if a["event"] == "notice")
    assert "PERF_BOOST (0x2080200a) is not modelled" in notices


def test_dup_object_inside_the_tenant_keeps_one_charge_and_never_crosses_tenants(broker):
    """RM_DUP_OBJECT (CUDA IPC and peer mappings between a tenant's processes): a
    duplicate of device memory in another of the tenant's clients shares its charge, which
    stays while either handle lives; a client of another tenant cannot be a source."""
    bob = broker.exec_popen("bob", *TENANT, "hold", "1GiB", stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    p = None
    try:
        foreign = json.loads(bob.stdout.readline())["client"]
        p = broker.exec_popen("alice", *TENANT, "dup", "2GiB", hex(foreign),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def step() -> dict:
            line = json.loads(p.stdout.readline())
            return line

        d = step()
        assert d["what"] == "duplicated" and d["status"] == nvs.NV_OK
        t = broker.tenant("alice")
        assert t["memory"]["0"]["used"] == 2 * GiB  # one charge for two handles
        assert t["clients"] == 2
        p.stdin.write("\n"); p.stdin.flush()
        d = step()
        assert d["what"] == "original-freed" and d["status"] == nvs.NV_OK
        # the duplicate still holds the memory, in the other client
        assert broker.tenant("alice")["memory"]["0"]["used"] == 2 * GiB
        p.stdin.write("\n"); p.stdin.flush()
        d = step()
        assert d["what"] == "copy-freed" and d["status"] == nvs.NV_OK
        assert broker.tenant("alice")["memory"]["0"]["used"] == 0
        p.stdin.write("\n"); p.stdin.flush()
        d = step()
        assert d == {"what": "foreign", "status": nvs.NV_ERR_INVALID_CLIENT}
        d = step()
        assert d == {"what": "client-as-object", "status": nvs.NV_ERR_INVALID_OBJECT_HANDLE}
        denies = [a for a in broker.audit() if a.get("event") == "deny"
                  and a.get("what") == "RM_DUP_OBJECT"]
        assert any(f"hClientSrc={foreign:#x} is not a client of this tenant" in a["reason"]
                   for a in denies), denies
        assert broker.tenant("bob")["memory"]["1"]["used"] == 1 * GiB  # bob's, untouched
    finally:
        for proc in (p, bob):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_objects_exported_through_an_fd_stay_charged_and_inside_the_tenant(broker):
    """OS_UNIX_EXPORT_OBJECTS_TO_FD / IMPORT_OBJECTS_FROM_FD between two processes of one
    tenant (NCCL, CUDA IPC): the export file passed over SCM_RIGHTS imports the
    memory in the other process; the charge stays while the export slot or any handle
    holds the memory (the driver keeps it alive in the slot), and goes when all are gone; a
    file that is not one of the tenant's nvidiactl files is refused."""
    p = broker.exec_popen("alice", *TENANT, "export-import", "1GiB",
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        def step() -> dict:
            return json.loads(p.stdout.readline())

        def go() -> None:
            p.stdin.write("\n")
            p.stdin.flush()

        # ATTACH_GPUS_TO_FD: the tenant's own GPU id is attached, an id not its is EINVAL
        assert step() == {"what": "attach", "own": 0, "other": errno.EINVAL}
        d = step()
        assert d == {"what": "exported", "status": nvs.NV_OK, "info_status": nvs.NV_OK,
                     "max_objects": 1}
        assert broker.tenant("alice")["memory"]["0"]["used"] == 1 * GiB
        go()
        d = step()
        assert d == {"what": "original-freed", "status": nvs.NV_OK}
        d = step()  # the child imported it from the passed file
        assert d["what"] == "imported" and d["status"] == nvs.NV_OK and d["type"] == 1
        assert d["fd_seen"] == d["fd_sent"]  # the tenant's own fd number, not the broker's
        # freed by its exporter, held by the slot and the import: still one charge
        assert broker.tenant("alice")["memory"]["0"]["used"] == 1 * GiB
        go()
        d = step()
        assert d == {"what": "import-freed", "status": nvs.NV_OK}
        d = step()
        assert d == {"what": "import-not-ours", "status": nvs.NV_ERR_INVALID_PARAMETER}
        go()
        assert step() == {"what": "done"}
        p.wait(timeout=30)
        # every file closed: the export slot let go too
        wait_for(lambda: broker.tenant("alice")["memory"]["0"]["used"] == 0,
                 "the exported memory's charge to go with the export file")
        denies = [a for a in broker.audit() if a.get("event") == "deny"
                  and "EXPORT" in a.get("what", "") + a.get("reason", "")
                  or "IMPORT_OBJECTS" in a.get("what", "")]
        assert any("is not one of the tenant's nvidiactl files" in a["reason"]
                   for a in denies), denies
    finally:
        p.kill()
        p.wait()


@pytest.mark.root
def test_run_with_only_the_seccomp_front_end(start_broker):
    """`devbroker run --frontend seccomp`: no node file system is mounted, and tenants
    started with `devbroker exec --frontend seccomp` are served as with the default."""
    b = start_broker(POLICY, extra=["--frontend", "seccomp"])
    b.frontend = "seccomp"
    assert not os.path.ismount(b.run_dir / "nodes")  # plain files: the views the sandbox reads
    started = [e for e in b.audit() if e.get("event") == "started"]
    assert started[-1]["frontend"] == "seccomp" and started[-1]["mount"] is None
    alice = probe(b, "alice")
    assert alice["cards"] == [0] and alice["gpus"][0]["memory"]["total"] == 16 * GiB
    assert b.tenant("alice")["requests"] > 0
    # a policy change rewrites the tenants' directories: a new tenant gets its view
    carol = b.run_dir.parent / "carol.toml"
    carol.write_text(two_h200(tenant("alice", gpus=[0]), tenant("carol", gpus=[1]),
                              driver_version=None))
    r = b.cli("policy", "apply", str(carol))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(b.run_dir / "nodes")) == ["alice", "carol"]
    assert probe(b, "carol")["cards"] == [1]
