"""Live upgrade: a new broker process takes over from the running one while real
tenant processes keep making calls, through the FUSE nodes and through seccomp listeners
(`devbroker exec --frontend seccomp`: the listeners and their sessions pass over too).

The longest pause a tenant saw is printed as a benchmark (run with -s to see it); it is not
a test threshold."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devbroker.testing.policies import tenant, two_h200

from tenant_io import readline_json
from test_metrics import scrape, total
from test_prometheus import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TENANT = [sys.executable, str(HERE / "tenant_prog.py")]
UNIT = REPO / "deploy" / "systemd" / "devbroker.service"
MiB = 1 << 20
TENANTS = ["t0", "t1", "t2", "t3"]
UUIDS = ("GPU-11111111-2222-3333-4444-555555555550", "GPU-11111111-2222-3333-4444-555555555551")


def policy(metrics_port: int | None = None) -> str:
    return two_h200(*(tenant(t, gpus=[i % 2], memory_quota="2GiB") for i, t in enumerate(TENANTS)),
                    driver_version=None, uuids=UUIDS,
                    metrics=f"127.0.0.1:{metrics_port}" if metrics_port is not None else None)


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def successors():
    """Brokers started by an upgrade are not the test's children: ended here."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def accounting(status: dict) -> dict:
    return {t["name"]: (t["memory"], t["clients"], t["objects"]) for t in status["tenants"]}


# ------------------------------------------------------------------------------ no root needed
def test_handover_knows_all_broker_state():
    """The hand-over carries the broker's state by attribute name: a field added to the core
    or the emulated backend without a hand-over must stop upgrades, not vanish in one."""
    from devbroker.backends.emulated import EmulatedBackend
    from devbroker.broker.core import Broker
    from devbroker.broker.handover import HandoverError, check_supported
    from devbroker.broker.policy import load_policy_text

    broker = Broker(load_policy_text(policy()), EmulatedBackend(version="535.309.01"))
    check_supported(broker)
    broker.extra_state = {}
    with pytest.raises(HandoverError, match="the broker has state the hand-over does not "
                                            "carry: extra_state"):
        check_supported(broker)
    del broker.extra_state
    with pytest.raises(HandoverError, match="2 tenant.s. attached through the container stat "
                                            "shim front end cannot be handed over yet"):
        check_supported(broker, frontends={"container stat shim": 2})


def test_handover_knows_all_seccomp_supervisor_state():
    """The same for a seccomp supervisor (frontends/seccomp.py exports its own state): an
    attribute the hand-over does not know of stops the upgrade."""
    from devbroker.backends.emulated import EmulatedBackend
    from devbroker.broker.core import Broker
    from devbroker.broker.handover import HandoverError, check_supported
    from devbroker.broker.policy import load_policy_text
    from devbroker.frontends.seccomp import SeccompSupervisor
    from devbroker.upgrade import front_end_state

    broker = Broker(load_policy_text(policy()), EmulatedBackend(version="535.309.01"))
    sup = SeccompSupervisor(broker, "t0")
    check_supported(broker, front_state=front_end_state([sup]))
    sup.new_table = {}
    with pytest.raises(HandoverError, match="a seccomp supervisor has state the hand-over "
                                            "does not carry: new_table"):
        check_supported(broker, front_state=front_end_state([sup]))


async def test_state_round_trips(tmp_path):
    """Export → import into a fresh broker and backend → export again: the same books."""
    from devbroker.abi.nodes import NodeKind
    from devbroker.backends.emulated import EmulatedBackend
    from devbroker.broker import handover
    from devbroker.broker.core import Broker
    from devbroker.broker.policy import load_policy_text
    from test_record import POLICY, Tenant

    broker = Broker(load_policy_text(POLICY), EmulatedBackend(version="580.159.04"))
    t = Tenant(broker)
    ctl = await t.open(NodeKind.CTL)
    _, out, _ = await t.alloc(ctl, 0, 0, 0x41)
    client = out.hObjectNew
    await t.alloc(ctl, client, client, 0x80, t.new("NV0080_ALLOC_PARAMETERS", deviceId=0),
                  new=0xA0)
    mem = t.new("NV_MEMORY_ALLOCATION_PARAMS", owner=client, flags=0x1C101, attr=0x18000000,
                size=64 << 20, alignment=2 << 20)
    _, out, _ = await t.alloc(ctl, client, 0xA0, 0x40, mem, new=0xC0)
    _, out, _ = await t.alloc(ctl, client, 0xA0, 0x40, mem.replace(size=4 << 30), new=0xC1)
    # Shared with every client (as CUDA IPC does): kept in the broker's books (shares.py)
    rep, out, _ = await t.esc(ctl, "NV_ESC_RM_SHARE", t.new(
        "NVOS57_PARAMETERS", hClient=client, hObject=0xC0,
        sharePolicy={"target": 0, "accessMask": {"limbs": [1]}, "type": 1, "action": 0}))
    assert rep.errno == 0 and out.status == 0
    # A second client holds a duplicate of the 64 MiB (RM_DUP_OBJECT): one charge, shared.
    ctl2 = await t.open(NodeKind.CTL)
    _, out, _ = await t.alloc(ctl2, 0, 0, 0x41)
    client2 = out.hObjectNew
    await t.alloc(ctl2, client2, client2, 0x80, t.new("NV0080_ALLOC_PARAMETERS", deviceId=0),
                  new=0xA1)
    rep, out, _ = await t.esc(ctl2, "NV_ESC_RM_DUP_OBJECT", t.new(
        "NVOS55_PARAMETERS", hClient=client2, hParent=0xA1, hObject=0xD0, hClientSrc=client,
        hObjectSrc=0xC0))
    assert rep.errno == 0 and out.status == 0
    # The 64 MiB exported into a third nvidiactl file (OS_UNIX_EXPORT_OBJECTS_TO_FD): its
    # export slots and the driver's hidden client holding them pass too.
    xfd = await t.open(NodeKind.CTL)
    rep, out, got = await t.control(ctl, client, client, 0x3D0B, fd=xfd, hDevice=0xA0,
                                    maxObjects=4, numObjects=1, index=1, objects=[0xC0])
    assert rep.errno == 0 and out.status == 0 and got is not None
    assert [f.export.slots[1] is not None for f in broker.backend.files.values()
            if f.export is not None] == [True]
    # (as NV_ESC_ATTACH_GPUS_TO_FD leaves the file: a second one is refused with EINVAL)
    broker.sessions[t.fds[ctl]].file.attached = True
    before = handover.books(broker)
    assert before["alice"]["memory"] == {"0": 64 << 20}
    state = json.loads(json.dumps({"broker": handover.export_broker(broker),
                                   "backend": handover.export_emulated(broker.backend)}))
    fresh = Broker(load_policy_text(POLICY), EmulatedBackend(version="580.159.04"))
    files = handover.import_emulated(fresh.backend, state["backend"])
    handover.import_broker(fresh, state["broker"], files)
    assert handover.books(fresh) == before
    again = {"broker": handover.export_broker(fresh),
             "backend": handover.export_emulated(fresh.backend)}
    assert json.loads(json.dumps(again)) == state
    assert fresh.sessions[t.fds[ctl]].file.attached
    # the share kept in the books, and the grant the driver got for the duplicate, passed
    assert fresh.tenants["alice"].clients[client].objects[0xC0].tenant_share == 1
    assert fresh.backend.clients[client].objects[0xC0].policies == [(3, client2, 1, 0)]
    assert [f.attached for f in fresh.backend.files.values()].count(True) == 1
    [ex] = [f.export for f in fresh.backend.files.values() if f.export is not None]
    assert ex.client is fresh.backend.clients[ex.client.handle] and len(ex.slots) == 4
    assert ex.client.objects[ex.slots[1]].share is not None  # shares the 64 MiB's charge
    # the imported broker goes on: the tenant's next allocation is checked against the
    # quota with what it already holds ...
    t.b = fresh
    _, out, _ = await t.alloc(ctl, client, 0xA0, 0x40, mem.replace(size=1 << 30), new=0xC2)
    assert out.status == 0x51  # 64 MiB + 1 GiB > the 1 GiB quota: NV_ERR_NO_MEMORY
    assert fresh.backend.used[0] == 64 << 20
    # ... and the duplicate group survived: freeing the original leaves the charge with the
    # duplicate in both the broker's books and the emulator's, freeing that gives it back.
    v = t.new("NVOS00_PARAMETERS", hRoot=client, hObjectParent=0xA0, hObjectOld=0xC0)
    rep, out, _ = await t.esc(ctl, "NV_ESC_RM_FREE", v)
    assert out.status == 0
    assert handover.books(fresh)["alice"]["memory"] == {"0": 64 << 20}
    assert fresh.backend.used[0] == 64 << 20
    v = t.new("NVOS00_PARAMETERS", hRoot=client2, hObjectParent=0xA1, hObjectOld=0xD0)
    rep, out, _ = await t.esc(ctl2, "NV_ESC_RM_FREE", v)
    assert out.status == 0
    # the export slot still holds it (as the driver's hidden client does) until its file
    # closes
    assert handover.books(fresh)["alice"]["memory"] == {"0": 64 << 20}
    assert fresh.backend.used[0] == 64 << 20
    from devbroker.broker.interface import ReleaseRequest

    await fresh.release(ReleaseRequest(session=t.fds[xfd]))
    assert handover.books(fresh)["alice"]["memory"] == {"0": 0}
    assert fresh.backend.used[0] == 0


def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing: scripts/install-ops-tools.sh installs it")
    # The unit names /usr/local/bin/devbroker; verify it as installed from this checkout.
    exe = str(Path(sys.executable).parent / "devbroker")
    assert os.access(exe, os.X_OK), exe
    text = UNIT.read_text()
    assert [line.split("=", 1)[0] for line in text.splitlines()
            if line.startswith("Exec")] == ["ExecStart", "ExecReload"]
    unit = tmp_path / "devbroker.service"
    unit.write_text(text.replace("/usr/local/bin/devbroker", exe))
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "" and r.stdout == "", r.stdout + r.stderr
    assert "Type=notify" in text and "NotifyAccess=all" in text
    assert "ExecReload=/usr/local/bin/devbroker --run-dir /run/devbroker upgrade" in text


# ------------------------------------------------------------------------------ real processes
@pytest.mark.root
@pytest.mark.parametrize("frontend", ["fuse", "seccomp"])
def test_four_tenants_see_no_failed_or_lost_call_across_an_upgrade(start_broker, successors,
                                                                   frontend):
    mport = free_port()
    broker = start_broker(policy(mport))
    broker.frontend = frontend
    old_pid = broker.proc.pid
    url = f"http://127.0.0.1:{mport}/metrics"
    procs: list[subprocess.Popen] = []
    try:
        # Each tenant holds memory in one process across the upgrade (i + 1) * 128 MiB ...
        for i, t in enumerate(TENANTS):
            p = broker.exec_popen(t, *TENANT, "hold", f"{(i + 1) * 128}MiB",
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert readline_json(p)["memory"]["used"] == (i + 1) * 128 * MiB
        before = broker.status()
        assert before["pid"] == old_pid
        for i, t in enumerate(TENANTS):
            assert accounting(before)[t][0] == {str(i % 2): {"used": (i + 1) * 128 * MiB,
                                                             "quota": 2048 * MiB}}
        # ... and loops on NVML-style queries and allocations in another.
        loops = []
        for t in TENANTS:
            p = broker.exec_popen(t, *TENANT, "nvml-loop", "64MiB", "2MiB",
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            loops.append(p)
        for p in loops:
            assert readline_json(p)["what"] == "ready"
        # one seccomp listener per tenant process (none through FUSE)
        assert len(broker.status()["seccomp"]) == (8 if frontend == "seccomp" else 0)
        # A baseline window of the same length as the upgrade's, in the same run: the
        # longest call a tenant sees when nothing is being upgraded (this machine is shared).
        for p in loops:
            p.stdin.write("window\n")
            p.stdin.flush()
            readline_json(p)
        time.sleep(1.5)
        baseline = []
        for p in loops:
            p.stdin.write("window\n")
            p.stdin.flush()
            baseline.append(readline_json(p))
        calls_before = total(scrape(url), "devbroker_calls_total")
        t_upgrade = time.monotonic()

        r = broker.cli("upgrade", "--json", timeout=200)
        assert r.returncode == 0, r.stderr + broker.output()
        reply = json.loads(r.stdout)
        new_pid = reply["pid"]
        successors.append(new_pid)
        assert reply["old_pid"] == old_pid and new_pid != old_pid
        assert reply["seccomp_listeners"] == (8 if frontend == "seccomp" else 0)
        # The old process exits by itself; the new one answers the same control socket.
        assert broker.proc.wait(timeout=30) == 0
        assert not alive(old_pid)
        listening = broker.status()
        assert listening["pid"] == new_pid
        if frontend == "seccomp":
            # every listener is served by the new broker, its counters carried over
            assert sorted(s["tenant"] for s in listening["seccomp"]) == sorted(TENANTS * 2)
            assert all(s["opens"] >= 2 and s["ioctls"] > 0 for s in listening["seccomp"])
        top = broker.cli("top", "--once")
        assert top.returncode == 0 and f"pid {new_pid}" in top.stdout, top.stdout + top.stderr

        # the loops go on against the new broker: the window is as long as the baseline's
        time.sleep(max(0.0, 1.5 - (time.monotonic() - t_upgrade)))
        results = []
        for p in loops:
            p.stdin.write("stop\n")
            p.stdin.flush()
            results.append(readline_json(p))
            p.wait(timeout=30)
        for t, res in zip(TENANTS, results):
            assert res["what"] == "done"
            assert res["failed"] == 0, (t, res["failures"])
            assert res["iterations"] > 10
        # The tenants' calls before and after were served: more calls counted than before
        # the upgrade, by the new broker's metrics (counters carried over).
        m = scrape(url)
        assert total(m, "devbroker_info", pid=str(new_pid)) == 1
        assert total(m, "devbroker_calls_total") > calls_before

        # Accounting: at the hand-over the new broker's books were the old one's exactly ...
        audit = broker.audit()
        handed = next(a for a in audit if a["event"] == "upgrade")
        taken = next(a for a in audit if a["event"] == "upgraded")
        assert handed["to_pid"] == new_pid and taken["from_pid"] == old_pid
        assert taken["books"] == handed["books"] == reply["books"]
        # ... and with the loops gone, status shows what it showed before the upgrade.
        wait_for(lambda: all(t["open_files"] == 2 for t in broker.status()["tenants"]),
                 "the loops' files released")
        after = broker.status()
        assert accounting(after) == accounting(before)
        assert [t["processes"] for t in after["tenants"]] == \
            [t["processes"] for t in before["tenants"]]

        def ms(values):
            return ", ".join(f"{v * 1000:.1f}" for v in values)

        # Per tenant: the longest call that overlapped the freeze (the pause it saw), and the
        # longest one anywhere in the upgrade's window (the successor's start competes for the
        # same 2 cores), against the longest in the baseline window.
        frozen, serving = reply["frozen_at"], reply["serving_at"]
        spanning = [max([d for start, d in r["slow_calls"]
                         if start <= serving and start + d >= frozen] or [0.0])
                    for r in results]
        print(f"\nlive upgrade benchmark ({frontend} tenants): broker-side pause {reply['pause_ms']} ms "
              f"({reply['phases_ms']}; whole "
              f"upgrade {reply['total_ms']} ms, successor start included). Longest call per "
              f"tenant, ms: spanning the pause [{ms(spanning)}]; anywhere in the upgrade "
              f"window [{ms(r['longest_call_s'] for r in results)}]; in a baseline window of "
              f"the same length before it [{ms(b['longest_call_s'] for b in baseline)}]. "
              f"{sum(r['calls'] for r in results)} calls, none failed")

        # The holders give their memory back to the new broker.
        for p in procs[:4]:
            p.stdin.close()
            p.wait(timeout=30)
        wait_for(lambda: all(t["open_files"] == 0 for t in broker.status()["tenants"]),
                 "every file released")
        assert all(m["used"] == 0 for t in broker.status()["tenants"]
                   for m in t["memory"].values())
        if frontend == "seccomp":
            # the listeners the new broker adopted ended with their tenants
            wait_for(lambda: not broker.status()["seccomp"], "the adopted listeners' end")
            detached = [a for a in broker.audit() if a["event"] == "tenant-detached"]
            assert len(detached) == 8 and all(a.get("adopted") for a in detached)
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.root
def test_a_successor_that_fails_calls_the_upgrade_off(start_broker, tmp_path):
    broker = start_broker(policy())
    old_pid = broker.proc.pid
    loop = broker.exec_popen("t0", *TENANT, "nvml-loop", stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert readline_json(loop)["what"] == "ready"
        # An interpreter that exits at once: no hello, the running broker serves on.
        r = broker.cli("upgrade", "--python", "/bin/false", timeout=200)
        assert r.returncode == 1
        assert f"called off, broker pid {old_pid} goes on serving" in r.stderr
        # One that starts but refuses the state (a format it does not read).
        fake = tmp_path / "fake-successor"
        fake.write_text(f"#!{sys.executable}\n" + FAKE_SUCCESSOR)
        fake.chmod(0o755)
        r = broker.cli("upgrade", "--python", str(fake), timeout=200)
        assert r.returncode == 1
        assert "the new broker refused the state: HandoverError: no thanks" in r.stderr
        time.sleep(0.5)
        loop.stdin.write("stop\n")
        loop.stdin.flush()
        done = readline_json(loop)
        assert done["failed"] == 0, done["failures"]
        assert broker.proc.poll() is None and broker.status()["pid"] == old_pid
        failed = [a for a in broker.audit() if a["event"] == "upgrade-failed"]
        assert len(failed) == 2
    finally:
        loop.kill()
        loop.wait()


# Speaks the successor's side of the protocol and refuses the state it gets.
FAKE_SUCCESSOR = r'''
import sys, trio, socket
from devbroker import upgrade

async def main(fd):
    chan = upgrade.Channel(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))
    await chan.send({"format": upgrade.handover.FORMAT, "pid": 0})
    state, fds = await chan.recv()
    upgrade.close_fds(fds)
    await chan.send({"ready": False, "error": "HandoverError: no thanks"})

trio.run(main, int(sys.argv[sys.argv.index("--takeover-fd") + 1]))
'''


@pytest.mark.root
def test_service_manager_hears_ready_and_the_new_main_pid(start_broker, successors,
                                                          tmp_path, monkeypatch):
    """What systemd's Type=notify sees: READY=1 from the broker, then, after an upgrade,
    MAINPID= of the successor (before the old process exits) and READY=1."""
    path = tmp_path / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(path))
    listener.settimeout(60)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    broker = start_broker(policy())
    first = listener.recv(4096).decode().split("\n")
    assert "READY=1" in first and f"MAINPID={broker.proc.pid}" in first
    r = broker.cli("upgrade", "--json", timeout=200)
    assert r.returncode == 0, r.stderr
    new_pid = json.loads(r.stdout)["pid"]
    successors.append(new_pid)
    second = listener.recv(4096).decode().split("\n")
    assert "READY=1" in second and f"MAINPID={new_pid}" in second
    assert broker.proc.wait(timeout=30) == 0
    # and the new broker can be upgraded in turn
    r = broker.cli("upgrade", "--json", timeout=200)
    assert r.returncode == 0, r.stderr
    third = json.loads(r.stdout)
    successors.append(third["pid"])
    assert third["old_pid"] == new_pid
    assert f"MAINPID={third['pid']}" in listener.recv(4096).decode().split("\n")
    wait_for(lambda: not alive(new_pid), "the second broker's exit")
    assert broker.status()["pid"] == third["pid"]
    listener.close()


@pytest.mark.root
def test_real_backend_relay_and_files_pass_to_a_successor(tmp_path):
    """The real backend's part of an upgrade, with stand-in nodes (no GPU here): a broker
    process hands its RealBackend — the relay process with the driver files it holds, the
    broker's own GPU file, a seccomp tenant's file, the private-node mount — to a successor
    process and exits; the successor's calls reach the same relay and files, before and
    after the old process is gone (the relay no longer dies with its parent), and stopping
    the successor's backend ends the relay."""
    dev, proc, run = tmp_path / "dev", tmp_path / "proc", tmp_path / "run"
    dev.mkdir()
    (proc / "gpus" / "0000:00:06.0").mkdir(parents=True)
    run.mkdir()
    (proc / "version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
        "(dvs-builder@U22-I3-AF03-09-1)  Thu Oct 16 00:00:00 UTC 2025\n")
    (proc / "gpus" / "0000:00:06.0" / "information").write_text(
        "Model: \t\t NVIDIA H200\nGPU UUID: \t GPU-d4ad161b\nBus Location: \t 0000:00:06.0\n"
        "Device Minor: \t 0\n")
    # stand-ins: ioctls on the control node answer ENOTTY, the GPU node maps zeros
    for name, host in [("nvidiactl", "/dev/null"), ("nvidia0", "/dev/zero"),
                       ("nvidia-uvm", "/dev/null")]:
        os.mknod(dev / name, 0o020666, os.stat(host).st_rdev)
    old = subprocess.Popen([sys.executable, str(HERE / "real_handover_prog.py"), "old",
                            str(dev), str(proc), str(run)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = readline_json(old)
        assert before["what"] == "before" and before["mounted"] and before["unknown"] == []
        assert before["ioctl"] == [-1, errno.ENOTTY, "params"] and before["page_zeros"]
        # the successor shares the old process's stdout: their lines come in either order
        lines = {m["what"]: m for m in (readline_json(old), readline_json(old))}
        adopted, handed = lines["adopted"], lines["handed"]
        assert handed["reply"] == {"ready": True}
        assert old.wait(timeout=30) == 0
        # the same relay, the same files, the same answers; nothing reopened
        for k in ("ioctl", "aioctl", "page_zeros", "relay_pid", "relay_fds", "gpu_fds"):
            assert adopted[k] == before[k], k
        assert adopted["gpu_fds"] == [os.stat("/dev/zero").st_rdev]
        assert adopted["mounted"] and adopted["private_dir"] == str(run / "private-nodes")
        assert adopted["tenant_file"][2:] == [[0xC1D00001], True]
        assert alive(before["relay_pid"])  # the old broker's exit did not take it along
        old.stdin.write("again\n")
        old.stdin.flush()
        after = readline_json(old)
        assert after["what"] == "after" and after["relay_alive"]
        for k in ("ioctl", "aioctl", "page_zeros", "relay_pid", "relay_fds", "gpu_fds"):
            assert after[k] == before[k], k
        stopped = readline_json(old)
        assert stopped == {"what": "stopped", "relay_exited": True, "still_mounted": False}
        wait_for(lambda: not alive(before["relay_pid"]), "the relay's exit")
    finally:
        old.kill()
        old.wait()
        subprocess.run(["umount", "-l", str(run / "private-nodes")], capture_output=True)


# Runs a command in a mount namespace of its own where the NVIDIA driver's files are
# stand-ins: /proc/driver/nvidia (version, one GPU) on a tmpfs, and a /dev of copies of the
# host's common nodes plus nvidiactl and nvidia-uvm as /dev/null's device and nvidia0 as
# /dev/zero's. The host's mounts are private (the namespace sends nothing back) except the run
# dir, made shared by the test so that the broker's FUSE mount is seen by `devbroker exec`.
STAND_IN_NS = r"""
set -e
T=$1; shift
mkdir -p "$T/dev"
mount -t tmpfs -o mode=755 standin-dev "$T/dev"
for d in null zero full random urandom fuse tty ptmx; do
    if [ -e /dev/$d ]; then cp -a /dev/$d "$T/dev/"; fi
done
mkdir "$T/dev/pts" "$T/dev/shm"
mknod -m 666 "$T/dev/nvidiactl" c 1 3
mknod -m 666 "$T/dev/nvidia0" c 1 5
mknod -m 666 "$T/dev/nvidia-uvm" c 1 3
mount --bind "$T/dev" /dev
mount -t tmpfs -o mode=755 standin-driver /proc/driver
mkdir -p /proc/driver/nvidia/gpus/0000:00:06.0
printf 'NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22-I3-AF03-09-1)  Thu Oct 16 00:00:00 UTC 2025\n' > /proc/driver/nvidia/version
printf 'Model: \t\t NVIDIA H200\nGPU UUID: \t GPU-d4ad161b\nBus Location: \t 0000:00:06.0\nDevice Minor: \t 0\n' > /proc/driver/nvidia/gpus/0000:00:06.0/information
exec "$@"
"""


@pytest.mark.root
def test_real_backend_broker_upgrade_with_stand_in_nodes(tmp_path, successors):
    """A whole `devbroker upgrade` of a broker on the real backend (`--backend real`, with
    stand-in driver files: STAND_IN_NS) while a seccomp tenant (a real driver file of its
    own, installed by the broker) and a FUSE tenant (its file relayed) loop on ioctls the
    broker decides and the stand-in answers (ENOTTY): every call gets the same answer before
    and after, none is lost, the new broker serves through the same relay process and still
    knows the seccomp tenant's file as its session (it decides its ioctls; an unknown file
    would be left to the kernel), and the old process exits."""
    from conftest import DEVBROKER, RunningBroker

    run, stage = tmp_path / "run", tmp_path / "stage"
    run.mkdir()
    stage.mkdir()
    (tmp_path / "policy.toml").write_text(
        '[broker]\nbackend = "real"\n\n[tenant.t0]\ngpus = [0]\nmemory_quota = "2GiB"\n\n'
        '[tenant.t1]\ngpus = [0]\nmemory_quota = "2GiB"\n')
    subprocess.run(["mount", "--bind", str(run), str(run)], check=True)
    subprocess.run(["mount", "--make-shared", str(run)], check=True)

    class StandInBroker(RunningBroker):
        def __init__(self):
            self.run_dir, self.policy = run, tmp_path / "policy.toml"
            self.log = open(tmp_path / "broker.log", "w+")
            self.proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "unchanged", "sh", "-c", STAND_IN_NS, "ns",
                 str(stage), *DEVBROKER, "--run-dir", str(run), "run", "--policy",
                 str(self.policy)],
                stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
            self._wait_ready()

    broker = StandInBroker()
    old_pid = broker.proc.pid
    loop = [sys.executable, str(HERE / "real_handover_prog.py"), "loop"]
    procs = {}
    try:
        for tenant, frontend in (("t0", "seccomp"), ("t1", "fuse")):
            broker.frontend = frontend
            p = broker.exec_popen(tenant, *loop, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
            procs[frontend] = p
            assert readline_json(p)["what"] == "ready"
        relay_pid = next(int(a["message"].split("relay pid ")[1].split()[0])
                         for a in broker.audit() if "relay pid" in a.get("message", ""))
        assert alive(relay_pid)
        before = broker.status()
        [sup_before] = before["seccomp"]
        assert sup_before["ioctls"] > 0 and sup_before["ioctls_continued"] == 0

        r = broker.cli("upgrade", "--json", timeout=200)
        assert r.returncode == 0, r.stderr + broker.output()
        reply = json.loads(r.stdout)
        successors.append(reply["pid"])
        assert reply["old_pid"] == old_pid and reply["seccomp_listeners"] == 1
        assert broker.proc.wait(timeout=30) == 0
        assert alive(relay_pid)  # the relay outlived the broker that started it
        time.sleep(1.0)  # the loops go on against the new broker
        after = broker.status()
        assert after["pid"] == reply["pid"]
        [sup_after] = after["seccomp"]
        # the new broker decides the seccomp tenant's ioctls on its (adopted) file
        assert sup_after["ioctls"] > sup_before["ioctls"]
        assert sup_after["ioctls_continued"] == 0 and sup_after["refused_foreign"] == 0
        # the FUSE tenant's version checks (lane calls on a relayed file) ran on the
        # broker's own duplicates of the relay's file, before and after: the successor
        # takes them through the pidfd of the relay it was handed (its counter starts at 0)
        assert before["control_lane"]["relayed_here"] > 0, before["control_lane"]
        assert after["control_lane"]["relayed_here"] > 0, after["control_lane"]
        adopted = [a for a in broker.audit() if a["event"] == "notice"
                   and f"relay pid {relay_pid} adopted with" in a["message"]]
        assert len(adopted) == 1, broker.audit()
        results = {}
        for frontend, p in procs.items():
            p.stdin.write("stop\n")
            p.stdin.flush()
            results[frontend] = readline_json(p)
            assert p.wait(timeout=30) == 0
        for frontend, res in results.items():
            # every call answered, all alike: the stand-in's ENOTTY through the broker
            assert res["answers"] == {str(errno.ENOTTY): res["calls"]}, (frontend, res)
        # the same open files, and no tenant's refusals grew
        assert [(t["name"], t["open_files"], t["refusals"]) for t in after["tenants"]] == \
            [(t["name"], t["open_files"], t["refusals"]) for t in before["tenants"]]
        frozen, serving = reply["frozen_at"], reply["serving_at"]
        spanning = {fe: max([d for start, d in res["slow_calls"]
                             if start <= serving and start + d >= frozen] or [0.0])
                    for fe, res in results.items()}
        print(f"\nlive upgrade benchmark (real backend, stand-in nodes): broker-side pause "
              f"{reply['pause_ms']} ms ({reply['phases_ms']}); longest call spanning it, ms: "
              + ", ".join(f"{fe} {v * 1000:.1f}" for fe, v in spanning.items())
              + f"; {sum(r['calls'] for r in results.values())} calls, none failed")
        # the new broker's exit ends the relay (its channels close)
        new = reply["pid"]
        os.kill(new, signal.SIGTERM)
        wait_for(lambda: not alive(new), "the new broker's exit")
        wait_for(lambda: not alive(relay_pid), "the relay's exit")
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        broker.stop(signal.SIGKILL)
        subprocess.run(["umount", "-l", str(run)], capture_output=True)


# A tenant with many calls queued behind its rate limit: N threads each looping on one
# ioctl (the attached GPU ids), or on an open (and close) of its nvidiactl ("open"), until
# told to stop; then what every call answered.
QUEUED_PROG = r'''
import json, os, sys, threading
from devbroker.tools.probe import Client, NvError
n = int(sys.argv[1])
opens = sys.argv[2:] == ["open"]
c = Client(); c.check_version(); c.open_root()
stop, answers, lock = threading.Event(), {}, threading.Lock()
def call():
    if opens:
        os.close(os.open("/dev/nvidiactl", os.O_RDWR))
        return "ok"
    return "ok" if c.attached_ids() else "empty"
def loop():
    while not stop.is_set():
        try:
            got = call()
        except (OSError, NvError) as e:
            got = repr(e)
        with lock:
            answers[got] = answers.get(got, 0) + 1
ts = [threading.Thread(target=loop) for _ in range(n)]
for t in ts:
    t.start()
print(json.dumps({"what": "ready"}), flush=True)
sys.stdin.readline()
stop.set()
for t in ts:
    t.join()
print(json.dumps({"what": "done", "answers": answers}), flush=True)
'''


@pytest.mark.parametrize("frontend", ["fuse", "seccomp"])
@pytest.mark.parametrize("decide", ["successor", "called-off"])
def test_calls_queued_behind_a_rate_limit_do_not_hold_an_upgrade(start_broker, successors,
                                                                  tmp_path, decide, frontend):
    """With 1,500 of a tenant's calls queued behind its rate limit,
    `devbroker upgrade` waited for the queue (the drain timeout) while every tenant was
    frozen, and was then called off. Calls still waiting for their pace token have had
    nothing decided: the pause cancels their wait and they go to the successor, which
    answers them on the same seccomp listener (by id) or FUSE connection (by unique), or,
    when the upgrade is called off, this broker decides them again. 80 waiting calls at 5/s
    are a 16 s queue, longer than the drain timeout: the upgrade goes through, and every
    call is answered right."""
    text = two_h200(tenant("q", gpus=[0], rate_limit={"requests_per_second": 5, "burst": 1}),
                    tenant("t1", gpus=[1]), driver_version=None, uuids=UUIDS)
    broker = start_broker(text)
    broker.frontend = frontend
    old_pid = broker.proc.pid
    p = broker.exec_popen("q", sys.executable, "-c", QUEUED_PROG, "80",
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert readline_json(p, timeout=120)["what"] == "ready"
        time.sleep(1.0)  # every thread's call is waiting for a token now
        assert broker.tenant("q")["rate_limited"] >= 40
        if decide == "successor":
            r = broker.cli("upgrade", "--json", timeout=200)
            assert r.returncode == 0, r.stderr + broker.output()
            reply = json.loads(r.stdout)
            successors.append(reply["pid"])
            assert reply["old_pid"] == old_pid
            print(f"\nupgrade with 80 calls queued behind the pace: pause {reply['pause_ms']} ms, "
                  f"phases {reply['phases_ms']}")
            assert broker.proc.wait(timeout=30) == 0
        else:
            fake = tmp_path / "fake-successor"
            fake.write_text(f"#!{sys.executable}\n" + FAKE_SUCCESSOR)
            fake.chmod(0o755)
            r = broker.cli("upgrade", "--python", str(fake), timeout=200)
            assert r.returncode == 1 and "no thanks" in r.stderr, r.stderr
            assert broker.status()["pid"] == old_pid
        time.sleep(1.0)
        p.stdin.write("stop\n")
        p.stdin.flush()
        done = readline_json(p, timeout=120)  # every queued call came back ...
        assert set(done["answers"]) == {"ok"}, done  # ... answered right
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("frontend", ["fuse", "seccomp"])
def test_opens_queued_behind_a_rate_limit_do_not_hold_an_upgrade(start_broker, successors,
                                                                   frontend):
    """The same with opens of the tenant's nvidiactl queued behind its pace: through
    seccomp they go to the successor undecided like ioctls; through FUSE their waits end at
    the pause and they are decided at once, unpaced (an open costs the broker little; its
    request is not kept to be handed over). Every open answered right."""
    text = two_h200(tenant("q", gpus=[0], rate_limit={"requests_per_second": 5, "burst": 1}),
                    tenant("t1", gpus=[1]), driver_version=None, uuids=UUIDS)
    broker = start_broker(text)
    broker.frontend = frontend
    p = broker.exec_popen("q", sys.executable, "-c", QUEUED_PROG, "80", "open",
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert readline_json(p, timeout=120)["what"] == "ready"
        time.sleep(1.0)
        assert broker.tenant("q")["rate_limited"] >= 40
        r = broker.cli("upgrade", "--json", timeout=200)
        assert r.returncode == 0, r.stderr + broker.output()
        reply = json.loads(r.stdout)
        successors.append(reply["pid"])
        print(f"\nupgrade with 80 opens queued behind the pace ({frontend}): pause "
              f"{reply['pause_ms']} ms, phases {reply['phases_ms']}")
        assert broker.proc.wait(timeout=30) == 0
        time.sleep(1.0)
        p.stdin.write("stop\n")
        p.stdin.flush()
        done = readline_json(p, timeout=120)
        assert set(done["answers"]) == {"ok"}, done
    finally:
        p.kill()
        p.wait()
