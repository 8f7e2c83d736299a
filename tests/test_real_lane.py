"""The control lane on the real backend's relayed files (FUSE/CUSE/kmod front ends with
`--backend real`): `RealBackend.run_control` runs the lane's call, built from the
private header and parameter block, on the broker's own duplicate of the relay's file when
called from a thread that dropped the capabilities the driver checks (a FUSE reader's), and
through the relay's channel for front-end threads otherwise.

No GPU here: the relay runs for real (its own capability-less process) against stand-in
driver nodes — /dev/null's device as nvidiactl, so every ioctl meets the kernel's ENOTTY —
and the lane's answer must be the general path's answer for the same call (the driver's
errno, the header as the tenant sent it), for a control and an allocation header. A busy
thread channel sends the call the general way (NotHere)."""
from __future__ import annotations

import errno
import os
import struct
import threading
import time

import pytest

from devbroker.abi import registry
from devbroker.abi.nodes import NodeKind
from devbroker.backends.base import DriverCall, NotHere
from devbroker.backends.tenantfile import drop_driver_capabilities_for_thread
from devbroker.broker import fastlane

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod)")

VERSION = "580.159.04"


@pytest.fixture
def backend(tmp_path):
    from devbroker.backends.real import RealBackend

    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    (proc / "gpus").mkdir(parents=True)
    os.mknod(dev / "nvidiactl", 0o666 | 0o020000, os.makedev(1, 3))  # /dev/null's device
    (proc / "version").write_text(
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {VERSION}  Release Build\n")
    b = RealBackend(dev=str(dev), proc=proc, relay_uid=None, channels=2, discover=False,
                    private_dir=tmp_path / "private")
    yield b
    b.stop()


@pytest.mark.parametrize("kind", ["control", "alloc"])
def test_a_lane_call_on_a_relayed_file_answers_as_the_general_path(backend, kind):
    abi = registry.get(VERSION)
    f = backend.open(NodeKind.CTL, 0)
    assert backend.can_run_control(f) and not backend.control_is_plain_ioctl(f)
    header = next(h for h in fastlane.headers_of(abi).values()
                  if h.kind == kind and h.size == (32 if kind == "control" else 48))
    params = bytearray(b"private parameter block".ljust(48, b"."))
    hdr = bytearray(header.size)
    if kind == "control":
        struct.pack_into("<IIIIQI", hdr, 0, 0xC1D00001, 0xC1D00001, 0x20801303, 0,
                         0x7FFF00001000, len(params))
    else:
        struct.pack_into("<IIIIQQI", hdr, 0, 0xC1D00001, 0xC1D00001, 0x5C000001, 0x2080,
                         0x7FFF00001000, 0, 0)
    # From a thread that keeps the capabilities the driver checks: through the relay.
    ret, err, hdr_out = backend.run_control(f, -1, bytes(hdr), params, header, abi)
    assert f.local_fd == -1
    call = abi.decode_ioctl(NodeKind.CTL, header.ioctl_cmd, bytes(hdr))
    general = backend.ioctl_blocking(f, DriverCall(call, bytes(params), {}, abi=abi))
    assert (ret, err) == (-1, errno.ENOTTY) == (general.result, general.errno)
    assert hdr_out == bytes(hdr) == general.arg  # the tenant's pointer, as it sent it
    assert params.startswith(b"private parameter block")
    # From a thread without them for its life (a FUSE reader's): on the broker's own
    # duplicate of the relay's file (RealBackend._lend) — the same file the relay holds,
    # kept for the file's next calls — answered alike, also while the relay's channel for
    # threads is taken (another reader thread's call) ...
    def on_thread(fn, *, safe=True):
        got = []

        def main():
            if safe:
                drop_driver_capabilities_for_thread()
            try:
                got.append(fn())
            except Exception as e:  # noqa: BLE001 - handed to the test's thread
                got.append(e)
        t = threading.Thread(target=main)
        t.start()
        t.join()
        if isinstance(got[0], Exception):
            raise got[0]
        return got[0]

    run = lambda: backend.run_control(f, -1, bytes(hdr), params, header, abi)  # noqa: E731
    assert on_thread(run) == (ret, err, hdr_out)
    local = f.local_fd
    assert local >= 0 and f.users == 0
    relay_file = os.stat(f"/proc/{backend.relay.pid}/fd/{f.rfd}")
    assert (os.fstat(local).st_rdev, os.fstat(local).st_ino) == (relay_file.st_rdev,
                                                                 relay_file.st_ino)
    with backend.relay.thread_chan.lock:
        assert on_thread(run) == (ret, err, hdr_out)
    assert f.local_fd == local
    # ... while another thread's call goes through the relay, and is NotHere (the general
    # way) while that channel is taken.
    assert on_thread(run, safe=False)[:2] == (ret, err)
    with backend.relay.thread_chan.lock:
        with pytest.raises(NotHere):
            on_thread(run, safe=False)
    assert f.local_fd == local
    # Closed with the file; a closed file's calls go the general way (which refuses them).
    backend.close(f)
    assert f.local_fd == -1
    try:
        now = os.fstat(local)
    except OSError:
        now = None
    assert now is None or (now.st_rdev, now.st_ino) != (relay_file.st_rdev, relay_file.st_ino)
    with pytest.raises(NotHere):
        on_thread(run)


def test_a_relayed_files_duplicate_outlives_a_close_only_while_a_call_is_on_it(backend):
    """The file closed while a lane call holds its duplicate (a FUSE release racing a reader
    thread's call): the duplicate is closed by that call when it ends, never under it (its
    number cannot be reused by another open while the call runs)."""
    f = backend.open(NodeKind.CTL, 0)
    fd = backend._lend(f)
    assert fd is not None and f.users == 1
    backend.close(f)
    assert f.closed and f.local_fd == fd
    os.fstat(fd)  # still ours
    backend._unlend(f)
    assert f.local_fd == -1 and f.users == 0
    with pytest.raises(NotHere):
        backend._lend(f)


def _on_stand_in_nodes(tmp_path, name: str, env: dict, frontend: str, argv: list[str],
                       wrap: tuple = (), lane: str = "control_lane",
                       inspect=None, tenant_policy: str = "",
                       during=None) -> tuple[dict, dict]:
    """A broker on the real backend with stand-in driver nodes (test_upgrade.STAND_IN_NS:
    /dev/null's and /dev/zero's devices as nvidiactl and nvidia0), its environment
    updated with `env` and its command run under `wrap` (nvok_standin.py); tenant t0 (2 GiB
    on GPU 0, and the policy lines `tenant_policy`) runs `argv` through `frontend`. Its last stdout line as JSON, and the broker's
    counters of `lane` after it. `inspect(broker)`: called before the broker stops.
    `during(broker, line)`: called when the tenant prints its first line (which it then
    waits after for a line on stdin: tests/channels_prog.py), with that line as JSON."""
    import json
    import subprocess

    from conftest import DEVBROKER, RunningBroker
    from test_upgrade import STAND_IN_NS

    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[broker]\nbackend = "real"\n\n[tenant.t0]\ngpus = [0]\nmemory_quota = "2GiB"\n'
        + tenant_policy)
    run_dir, stage = tmp_path / f"run-{name}", tmp_path / f"stage-{name}"
    run_dir.mkdir()
    stage.mkdir()
    subprocess.run(["mount", "--bind", str(run_dir), str(run_dir)], check=True)
    subprocess.run(["mount", "--make-shared", str(run_dir)], check=True)

    class StandInBroker(RunningBroker):
        def __init__(self):
            self.run_dir, self.policy = run_dir, policy
            self.log = open(tmp_path / f"broker-{name}.log", "w+")
            self.proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "unchanged", "sh", "-c", STAND_IN_NS,
                 "ns", str(stage), *wrap, *DEVBROKER, "--run-dir", str(run_dir), "run",
                 "--policy", str(policy)],
                stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, **env})
            self._wait_ready()

    b = StandInBroker()
    try:
        b.frontend = frontend
        if during is not None:
            p = b.exec_popen("t0", *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            try:
                first = p.stdout.readline()
                assert first.strip(), p.communicate(timeout=30)[1] + b.output()
                during(b, json.loads(first))
                rest, err = p.communicate("go\n", timeout=120)
            finally:
                if p.poll() is None:
                    p.kill()
            r = subprocess.CompletedProcess(argv, p.returncode, rest, err)
        else:
            r = b.exec("t0", *argv, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr + b.output()
        if inspect is not None:
            inspect(b)
        return json.loads(r.stdout.strip().splitlines()[-1]), b.status()[lane]
    finally:
        b.stop()
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)


def _settled_on_stand_in(tmp_path, prog: str, settled: bool) -> tuple[dict, dict]:
    """tests/`prog` (20 rounds) as a seccomp tenant of a broker whose driver calls meet the
    NV_OK stand-in (nvok_standin.py), settled facts on or off (written at the first
    decision): its JSON line and the control lane's counters."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    return _on_stand_in_nodes(tmp_path, f"{Path(prog).stem}{int(settled)}",
                              {"DEVBROKER_SETTLED": "1" if settled else "0",
                               "DEVBROKER_SETTLE_FIRST": "1"},
                              "seccomp", [sys.executable, str(here / prog), "20"],
                              wrap=(sys.executable, str(here / "nvok_standin.py")))


def _detached_record(b) -> dict:
    """The listener's `tenant-detached` audit record (its counters), which comes when the
    tenant is gone; {} after 5 s without one."""

    for _ in range(100):
        done = [r for r in b.audit() if r.get("event") == "tenant-detached"]
        if done:
            return done[-1]
        time.sleep(0.05)
    return {}


@pytest.mark.parametrize("frontend", ["seccomp", "fuse"])
def test_header_only_lane_calls_on_stand_in_driver_files(tmp_path, frontend):
    """A broker on the real backend with stand-in driver nodes (test_upgrade.STAND_IN_NS:
    /dev/null's and /dev/zero's devices as nvidiactl and nvidia0): a tenant's plain escapes
    (NUMA_INFO, WAIT_OPEN_COMPLETE, the version check) go through the lane — the native loop's driver call on
    the broker's duplicate of the tenant's own file (seccomp), or the relay (FUSE) — and
    get the stand-in's answer (ENOTTY), exactly as with the lane off; an RM_FREE without a
    client of the tenant's goes the general way (refused there)."""
    import sys
    from pathlib import Path

    prog = str(Path(__file__).resolve().parent / "real_lane_prog.py")

    readers: list = []

    def thread_caps(b) -> None:
        # every thread of the broker's process tree: (name, CapEff, CapPrm)
        todo, seen = [b.proc.pid], []
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").iterdir():
                st = dict(ln.split(":\t", 1) for ln in (task / "status").read_text().splitlines()
                          if ":\t" in ln)
                seen.append((st["Name"], int(st["CapEff"], 16), int(st["CapPrm"], 16)))
                todo += [int(c) for c in (task / "children").read_text().split()]
        readers.extend(seen)

    def run(lane: bool) -> tuple[dict, dict]:
        return _on_stand_in_nodes(tmp_path, f"lane{int(lane)}",
                                  {"DEVBROKER_CONTROL_LANE": "1" if lane else "0"}, frontend,
                                  [sys.executable, prog], inspect=thread_caps)

    on, lane_on = run(True)
    off, lane_off = run(False)
    # (RM_FREE of client 0: refused by the broker's general path, with the driver's status
    # for an unknown client in the argument: the ioctl itself returns 0)
    assert on == off == {"NV_ESC_NUMA_INFO": errno.ENOTTY,
                         "NV_ESC_WAIT_OPEN_COMPLETE": errno.ENOTTY,
                         "NV_ESC_CHECK_VERSION_STR": errno.ENOTTY,
                         "NV_ESC_RM_FREE": 0,
                         # REGISTER_FD: the tenant's ctl file reaches the (stand-in) driver
                         # through the lane as through the general path; a pipe is refused
                         # there (EBADF); -1 reaches the driver as sent; no file: EBADF
                         "NV_ESC_REGISTER_FD own-ctl": errno.ENOTTY,
                         "NV_ESC_REGISTER_FD own-ctl arg": True,
                         "NV_ESC_REGISTER_FD pipe": errno.EBADF,
                         "NV_ESC_REGISTER_FD pipe arg": True,
                         "NV_ESC_REGISTER_FD minus-one": errno.ENOTTY,
                         "NV_ESC_REGISTER_FD minus-one arg": True,
                         "NV_ESC_REGISTER_FD no-file": errno.EBADF,
                         "NV_ESC_REGISTER_FD no-file arg": True,
                         # the tenant's own root allocation (continued: the stand-in's
                         # ENOTTY), then a client it never got: refused, the driver's status
                         # for an unknown client (NV_ERR_INVALID_CLIENT), lane on and off
                         # SYS_PARAMS: the host's value answered by the broker (the
                         # native loop itself, lane on), another refused (EPERM)
                         "NV_ESC_SYS_PARAMS host": 0, "NV_ESC_SYS_PARAMS host arg": True,
                         "NV_ESC_SYS_PARAMS other": errno.EPERM,
                         "NV_ESC_SYS_PARAMS other arg": True,
                         "root-alloc": errno.ENOTTY,
                         "control-unknown-client": 0x23}, (on, off)
    # the three plain escapes, and on seccomp (the native loop carries fds) REGISTER_FD of
    # the tenant's own ctl file; the pipe, -1 and the missing file declined to the general way
    # (+ SYS_PARAMS of the host's value: answered by the native loop; declined by FUSE's
    # lane, which does not answer without the driver; another value declined by both)
    assert lane_on["admitted"] == (5 if frontend == "seccomp" else 3), (lane_on, lane_off)
    # (+ the root allocation and the control of the unknown client: declined at admission)
    assert lane_on["declined"] == (7 if frontend == "seccomp" else 9), (lane_on, lane_off)
    assert lane_off["admitted"] == 0, lane_off
    # FUSE: every call the lane admitted ran on the broker's own duplicate of the relay's
    # file (none went through the relay); seccomp has no relayed files.
    assert lane_on["relayed_here"] == (3 if frontend == "fuse" else 0), lane_on
    # The FUSE reader threads, which run lane calls on the broker's own duplicates of the
    # relay's files, hold none of the capabilities the driver checks (CAP_SYS_ADMIN,
    # CAP_SYS_NICE, CAP_PERFMON), neither effective nor permitted; the broker's main
    # thread still holds CAP_SYS_ADMIN (mounts).
    driver_caps = (1 << 21) | (1 << 23) | (1 << 38)
    if frontend == "fuse":
        fuse = [r for r in readers if r[0] == "dvb-fuse-reader"]
        assert fuse and all(not ((eff | prm) & driver_caps) for _n, eff, prm in fuse), readers
    assert any(eff & (1 << 21) for n, eff, _p in readers if n.startswith("python")), readers


@pytest.mark.parametrize("first", [True, False], ids=["settle-first", "settle-second"])
def test_settled_controls_answer_as_the_broker_and_follow_the_books(tmp_path, first):
    """The native loop's settled controls (nativelane.NativeLane.settle), end to end: a
    broker on the real backend whose driver calls meet a stand-in that answers NV_OK to
    everything (nvok_standin.py), a seccomp tenant (tests/settled_prog.py) sending the same
    controls 20 times each. With settled controls on, the loop admits most of each run by
    itself (the counts below) and the tenant sees exactly what it sees with them
    off (DEVBROKER_SETTLED=0): every call NV_OK, FB_GET_INFO_V2 patched with the quota as
    total and free memory; after a 64 MiB allocation the settled answer shows 64 MiB less
    free (a change of charged memory makes the patch values stale), after its free the
    whole quota again — also after a second 64 MiB allocation whose free the loop settled
    (a settled free's books follow it). The free removes that object's facts only: the
    client's control is settled from its first call after it."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent

    def run(settled: bool) -> tuple[dict, dict]:
        return _on_stand_in_nodes(tmp_path, f"settled{int(settled)}",
                                  {"DEVBROKER_SETTLED": "1" if settled else "0",
                                   "DEVBROKER_SETTLE_FIRST": "1" if first else "0"},
                                  "seccomp",
                                  [sys.executable, str(here / "settled_prog.py"), "20"],
                                  wrap=(sys.executable, str(here / "nvok_standin.py")))

    on, lane_on = run(True)
    off, lane_off = run(False)
    quota_kib = 2 << 20
    assert on == off == {
        "errors": [],
        "root": errno.ENOTTY,  # (the tenant's own call, on the stand-in node)
        "device": [0, 0], "subdevice": [0, 0], "memory": [0, 0], "free": 0,
        "fb_before": [[quota_kib, quota_kib]],
        "fb_holding": [[quota_kib, quota_kib - (64 << 10)]],
        "fb_after": [[quota_kib, quota_kib]],
        "memory2": [0, 0], "free2": 0,
        "fb_holding2": [[quota_kib, quota_kib - (64 << 10)]],
        "fb_after2": [[quota_kib, quota_kib]],
        # (a second root client on the same file: the broker allocates it, handlers.rm_alloc)
        "root2": 0, "client2": [0, 0], "device2": [0, 0], "subdevice2": [0, 0],
        "arch": [[0, 0]] * 4,
        "fb_new_subdevice": [[quota_kib, quota_kib]],
        "pci_own": [[0, 0]],
        "pci_foreign": [[0, 0x1F]],  # (NV_ERR_INVALID_ARGUMENT: not the tenant's GPU)
        "last": 0x23,  # (NV_ERR_INVALID_CLIENT: the general path's refusal)
    }, (on, off)
    # Each run of 20: the broker decides the first (its control's and its object's facts
    # are written down then, NativeLane.worth_settling), the loop the other 19; FB info's
    # runs after the allocation and after the free: the first call decided again (the
    # memory its answer shows changed), the other 19 settled; the client's control after
    # the free of another object: all 5 settled (what the free removed was not the
    # client); MC_GET_ARCH_INFO once on the first subdevice (decided: its control's fact),
    # then on the second subdevice: all three settled (that object's fact was written when
    # the broker booked the subdevice, NativeLane.object_put);
    # GET_PCI_INFO for the tenant's GPU: the first decided (the GPU ids given to the
    # loop), 19 settled; for another GPU: none (the loop's check sends each the general
    # way, which refuses it). With DEVBROKER_SETTLE_FIRST=0 a decision is written down the
    # second time it is made, on whatever object: one fewer settled in each run of 20, and
    # the second subdevice's control settled from its second call (its object's fact is
    # there from the booking, its control's is written at its first call there: the
    # control's second admission in the broker).
    # With settle-first, the second client's subdevice allocation is settled too (its
    # device's fact from the booking, the subdevice class's from the first client's).
    # The second 64 MiB round: its two FB info runs 19 settled each (the first call of each
    # decided: the charge moved), and its free the loop's — the free's decision written
    # down at the first free, the memory's fact at its booking — whose books show the
    # whole quota free again (fb_after2).
    # NVML's memory query on the second client's new subdevice: all 20 the loop's, the
    # quota view's values written with the subdevice's fact at its booking
    # (SeccompSupervisor._booked) and FB info's control fact long there.
    assert lane_on["settled"] == (19 + 19 + 19 + 19 + 5 + 3 + 19 + 1 if first
                                  else 18 + 18 + 19 + 19 + 5 + 2 + 18) + 19 + 19 + 1 + 20, lane_on
    assert lane_off["settled"] == 0, lane_off
    # every call counted as admitted either way (a settled call is an admitted one)
    assert lane_on["admitted"] == lane_off["admitted"], (lane_on, lane_off)


@pytest.mark.parametrize("first", [True, False], ids=["settle-first", "settle-second"])
def test_settled_allocations_are_booked_and_stop_short_of_the_object_limit(tmp_path, first):
    """The native loop's settled allocations (ControlLane.settleable, native/lane.c
    settled_admit for an RM_ALLOC layout) and the object facts written at booking
    (NativeLane.object_put), end to end: a broker on the real backend whose driver calls
    meet a stand-in that answers NV_OK to everything (nvok_standin.py), a seccomp tenant
    (tests/settled_alloc_prog.py) with limits.rm_objects = 100 allocating copy-engine
    objects under its device, under each new object, then until the broker refuses one,
    then freeing all. The tenant sees exactly what it sees with settled decisions off
    (DEVBROKER_SETTLED=0): every allocation NV_OK up to the limit, the next refused with the
    general path's NV_ERR_INSUFFICIENT_RESOURCES after as many as with them off, and every
    free NV_OK — so each settled allocation was booked (the broker frees only what its books
    hold), in the tenant's object count too."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent

    def run(settled: bool) -> tuple[dict, dict]:
        return _on_stand_in_nodes(tmp_path, f"salloc{int(settled)}{int(first)}",
                                  {"DEVBROKER_SETTLED": "1" if settled else "0",
                                   "DEVBROKER_SETTLE_FIRST": "1" if first else "0"},
                                  "seccomp",
                                  [sys.executable, str(here / "settled_alloc_prog.py"), "12"],
                                  wrap=(sys.executable, str(here / "nvok_standin.py")),
                                  tenant_policy="limits = { rm_objects = 100 }\n")

    on, lane_on = run(True)
    off, lane_off = run(False)
    ok = [0, 0]
    # the books held the client and the device: 98 objects more, the 99th refused
    assert on == off == {"root": errno.ENOTTY, "adopt": ok, "device": ok,
                         "under_device": [ok] * 12, "under_new": [ok] * 12,
                         "controls": [ok],
                         # system memory with its address pointer set: the general path's
                         # NV_ERR_NOT_SUPPORTED (a buffer behind the pointer), on and off
                         "sysmem": [ok] * 4 + [[0, 0x56]],
                         "until_refused": [70, [0, 0x1A]],  # NV_ERR_INSUFFICIENT_RESOURCES
                         "frees": [ok], "made": 98,
                         "last": [0, 0x23]}, (on, off)  # (NV_ERR_INVALID_CLIENT)
    # Settled: under the device, the first decided (a device's decision is written at its
    # first admission) or the first two (settle-second), the rest by the loop; under each
    # new object, all of them (its object's fact from the booking, the class's from the
    # first round; the controls before them on the device: all but the first (or first
    # two) settled); system memory with a NULL address: all but the first (first two) —
    # the loop repeats its one check, the pointer NULL, on its private copy — and the one
    # with an address set the broker's; then more until the loop's allowance runs out —
    # the limit less 64 and the objects held, refreshed at each booking: settled
    # allocations stop once the tenant holds 36 objects (34 after the client and device:
    # the loop's 32 or 30, the broker's first ones) — and the broker decides the rest and
    # the refusal.
    # The frees, last: the first decided by the broker (the free's decision is written down
    # at its first admission), one more when the loop's credit of the tenant's pace (64
    # tokens taken ahead) ran out, the other 96 by the loop (settled frees: each object's
    # fact from its booking), the books following each (`made` and every free NV_OK).
    # System memory is the broker's since its size is booked as pinned host memory (the
    # lanes decline the class): of the allocations above, 7 (settle-second: 6) fewer are
    # the loop's — the system-memory ones it settled, and four of the until-refused ones.
    assert lane_on["settled"] == (34 - 2 + 11 - 7 if first else 34 - 4 + 10 - 6) + 96, lane_on
    assert lane_off["settled"] == 0, lane_off
    assert lane_on["admitted"] == lane_off["admitted"], (lane_on, lane_off)


@pytest.mark.parametrize("gate", [True, False], ids=["awaited", "not-awaited"])
def test_a_free_racing_an_allocations_booking_finds_it_booked(tmp_path, gate):
    """Allocations booked after the answer (native/lane.c FINISH_AFTER: the loop's settled
    allocations, and with DEVBROKER_BOOK_AFTER=1 the broker's own) with two listener
    threads: one tenant thread allocates copy-engine objects, another frees each the moment
    the first has its answer, 100 times, each booking held up 5 ms (test switches below;
    50 ms without the wait).
    Every free is NV_OK — its decision, on the other listener thread, waited for the
    booking (NativeLane.await_bookings). With that wait taken out
    (DEVBROKER_TEST_NO_BOOKING_WAIT=1), frees are refused by the general path (the object
    not yet in the books): what the wait is for."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {"DEVBROKER_SECCOMP_THREADS": "2", "DEVBROKER_BOOK_AFTER": "1",
           "DEVBROKER_TEST_BOOKING_DELAY_MS": "5"}
    if not gate:
        env["DEVBROKER_TEST_NO_BOOKING_WAIT"] = "1"
        # (a window the freeing thread cannot miss: with 5 ms, a loaded machine once
        # scheduled every free after its booking, and nothing was refused)
        env["DEVBROKER_TEST_BOOKING_DELAY_MS"] = "50"
    out, lane = _on_stand_in_nodes(tmp_path, f"race{int(gate)}", env, "seccomp",
                                   [sys.executable, str(here / "settled_alloc_prog.py"),
                                    "100", "race"],
                                   wrap=(sys.executable, str(here / "nvok_standin.py")))
    assert out["race_count"] == 100, out
    if gate:
        assert out["race_allocs"] == out["race_frees"] == [[0, 0]], (out, lane)
    else:  # (refusals of the general path, deciding on books without the new object)
        assert out["race_allocs"] != [[0, 0]] or out["race_frees"] != [[0, 0]], (out, lane)


def test_settled_continuations_answer_as_the_broker_and_follow_the_books(tmp_path):
    """The native loop's settled continuations (nativelane.NativeLane.settle_continue;
    native/lane.c struct dvb_cont_fact), end to end: a broker on the real backend (its own
    driver calls meet the NV-OK stand-in, nvok_standin.py), a seccomp tenant
    (tests/continued_prog.py) sending UVM commands ten times each on its UVM file, whose
    continued calls reach the stand-in node (ENOTTY). The UVM rows the kernel runs unasked
    (rules.kernel_commands: `devbroker exec` puts them in the filter with the real backend)
    reach the node without the broker, also when they name a client that is not the
    tenant's (ENOTTY where the broker would have refused: the real driver's check is the
    one that holds for them), and are counted nowhere in the broker. With settled continuations on, the
    loop continues every call after the first of each (file, command, client handles) by
    itself, and the tenant sees exactly what it sees with them off (DEVBROKER_SETTLED=0):
    a command naming nothing and one naming the tenant's client continued (ENOTTY), one
    naming a client not the tenant's refused by the broker every time (the driver's status
    for an unknown client); after the tenant freed its client, the command naming it is
    refused (the free made the fact stale), the one naming nothing still settled; a command
    without an argument (UVM_DEINITIALIZE) is the lane's and settled like the others.
    RM_MAP_MEMORY (its decision names the client's device and memory and an fd): settled
    for the tenant's memory objects through its GPU file or no file; memory the books do
    not hold, and a file that is not one of the tenant's NVIDIA files, are the broker's
    (refused) every time. ALLOC_OS_EVENT / FREE_OS_EVENT (a client handle and an fd) the
    same: settled on the tenant's GPU file, the broker's on any other file."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent

    def run(settled: bool) -> tuple[dict, dict]:
        return _on_stand_in_nodes(tmp_path, f"continued{int(settled)}",
                                  {"DEVBROKER_SETTLED": "1" if settled else "0"}, "seccomp",
                                  [sys.executable, str(here / "continued_prog.py"), "10"],
                                  wrap=(sys.executable, str(here / "nvok_standin.py")),
                                  lane="continue_lane")

    sections = []

    def oci_section(b):  # what a container of tenant t0 would get (devbroker oci-seccomp)
        import json
        import subprocess

        from conftest import DEVBROKER

        r = subprocess.run([*DEVBROKER, "--run-dir", str(b.run_dir), "oci-seccomp",
                            "--frontend", "seccomp", "--tenant", "t0"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        sections.append(json.loads(r.stdout))

    on, lane_on = _on_stand_in_nodes(tmp_path, "continued1", {"DEVBROKER_SETTLED": "1"},
                                     "seccomp",
                                     [sys.executable, str(here / "continued_prog.py"), "10"],
                                     wrap=(sys.executable, str(here / "nvok_standin.py")),
                                     lane="continue_lane", inspect=oci_section)
    off, lane_off = run(False)
    # The container section for the same tenant cuts the same rows out of what it notifies:
    # CREATE_RANGE_GROUP and REGISTER_CHANNEL reach the kernel unasked, REGISTER_GPU and
    # UVM_INITIALIZE (its block) still stop at the broker.
    # (SCMP_CMP_MASKED_EQ: "value" is the mask, "valueTwo" the datum)
    notified = [(r["args"][0]["value"], r["args"][0]["valueTwo"])
                for r in sections[0]["syscalls"] if r["names"] == ["ioctl"]]

    def notifies(cmd):
        return any(cmd & mask == value for mask, value in notified)

    uvm = {s.name: c for c, s in rm_escape_abi().uvm_cmds.items()}
    assert not notifies(uvm["UVM_CREATE_RANGE_GROUP"]) and not notifies(uvm["UVM_REGISTER_CHANNEL"])
    assert notifies(uvm["UVM_REGISTER_GPU"]) and notifies(uvm["UVM_INITIALIZE"])
    invalid_client = 0x23  # NV_ERR_INVALID_CLIENT
    assert on == off == {
        "root": errno.ENOTTY, "adopted": [0, 0],
        "initialize": [[errno.ENOTTY, 0]],
        "range_group": [[errno.ENOTTY, 0]],
        "channel_foreign": [[errno.ENOTTY, 0]],
        "register_own": [[errno.ENOTTY, 0]],
        "register_foreign": [[0, invalid_client]],
        "device": 0, "memory": [0],
        # RM_MAP_MEMORY: the tenant's memory through its GPU file, and with no file,
        # continued (ENOTTY); memory the books do not hold refused by the broker
        # (NV_ERR_INVALID_OBJECT_HANDLE), a file not one of the tenant's NVIDIA files too
        # (NV_ERR_INVALID_ARGUMENT) — every time, with settled decisions on and off
        "map_own": [[[errno.ENOTTY, 0]]] * 3, "map_no_file": [[errno.ENOTTY, 0]],
        "map_unknown_memory": [[0, 0x33]], "map_null_file": [[0, 0x1F]],
        # OS events on the tenant's GPU file continued (ENOTTY); on /dev/null refused by
        # the broker (NV_ERR_INVALID_ARGUMENT) every time
        "event_own": [[errno.ENOTTY, 0]], "event_free_own": [[errno.ENOTTY, 0]],
        "event_null_file": [[0, 0x1F]],
        "free": 0,
        "register_freed": [[0, invalid_client]],
        "initialize_after": [[errno.ENOTTY, 0]],
        "range_group_after": [[errno.ENOTTY, 0]],
        "deinitialize": [errno.ENOTTY],
        "last": invalid_client,
    }, (on, off)
    # ten of each: the first decided by the broker (written down after its answer), nine
    # by the loop; after the free, the three naming nothing settled, the three naming the
    # freed client refused (not counted as continued at all); DEINITIALIZE (no argument):
    # the lane's too, four of five settled; RM_MAP_MEMORY: the first decided, the other
    # eleven of the tenant's memory (each object's fact written when the broker booked it,
    # the GPU file's mapping fact at its install) and the three with no file by the loop;
    # memory not in the books and the foreign file: the broker's every time; the OS events
    # on the GPU file (a client handle and an fd whose file has a mapping fact): the first
    # of each decided, four by the loop; on /dev/null, the broker's every time. The memory
    # here is system memory, which the general path books (its size is pinned host memory:
    # the lanes decline the class) without an object fact: its RM_MAP_MEMORY (the eleven
    # and the three) are the broker's every time now.
    assert lane_on["settled"] == 9 + 9 + 3 + 4 + 4 + 4, lane_on
    assert lane_off["settled"] == 0, lane_off
    # every continued call counted as admitted either way (and the tenant's own root
    # client, continued by the lane: ContinueLane.root_alloc)
    assert lane_on["roots"] == lane_off["roots"] == 1, (lane_on, lane_off)
    assert lane_on["admitted"] == lane_off["admitted"] == (
        10 + 10 + 3 + 5 + 12 + 3 + 5 + 5 + 1), (lane_on, lane_off)


def rm_escape_abi():
    from devbroker.abi import registry

    return registry.get("580.159.04")


_BURST_OF_OPENS = r"""
import json, os, time
first = os.open("/dev/nvidiactl", os.O_RDWR)  # (no spares yet: made on the open, tidied)
time.sleep(0.05)
burst = [os.open("/dev/nvidiactl", os.O_RDWR) for _ in range(10)]
names = [os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) for fd in [first] + burst]
time.sleep(0.2)  # the listener is quiet: its tidy
print(json.dumps({"names": names}))
"""


def test_the_native_listener_tidies_private_nodes_when_quiet(tmp_path):
    """A burst of NVIDIA opens through the native loop leaves the tidy of the broker's
    private nodes (unlink the opened ones, make spares) for when the listener has been
    quiet for a moment (DVB_QUIET; PrivateNodes.running_low says when it cannot wait):
    after the burst and a pause, every node the tenant opened is unlinked and nvidiactl has
    its SPARE spares again; the tenant's files stay open and distinct."""
    import sys
    from pathlib import Path

    from devbroker.backends.tenantfile import PrivateNodes

    seen = {}

    def look(b):
        d = Path(f"/proc/{b.proc.pid}/root") / str(b.run_dir).lstrip("/") / "private-nodes"
        seen["nodes"] = sorted(os.listdir(d))

    out, _lane = _on_stand_in_nodes(tmp_path, "quiet", {}, "seccomp",
                                    [sys.executable, "-c", _BURST_OF_OPENS], inspect=look)
    names = out["names"]
    assert len(set(names)) == 11, names  # one private node per open
    assert not set(names) & set(seen["nodes"]), (names, seen)  # all unlinked
    ctl = [n for n in seen["nodes"] if ".nvidiactl." in n]
    assert len(ctl) == PrivateNodes.SPARE, seen


def test_mapping_facts_and_files_not_the_brokers_are_let_through_by_the_native_loop(tmp_path):
    """The native loop's answers to file mappings (native/lane.c answer_mmap): a real ctl or
    GPU file the broker installed has a mapping fact from its open
    (SeccompSupervisor._native_map_fact: Broker.map_check_now's decision for such a file),
    and the loop lets its mappings through itself; a regular file (none of the broker's) is
    let through too; a memfd and the nvidia-uvm file (whose mappings count against the
    managed-memory allowance) go to the Python listener. The tenant (tests/mapped_prog.py,
    on stand-in nodes) sees the same with the facts on and off (DEVBROKER_SETTLED=0): the
    stand-in ctl and UVM files refuse to be mapped (ENODEV, the kernel's), the GPU file,
    the regular file and the memfd map with their contents."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent

    def run(settled: bool) -> tuple[dict, dict]:
        got = {}

        def look(b):
            got.update(_detached_record(b))

        out, _lane = _on_stand_in_nodes(tmp_path, f"mapped{int(settled)}",
                                        {"DEVBROKER_SETTLED": "1" if settled else "0"},
                                        "seccomp", [sys.executable, str(here / "mapped_prog.py")],
                                        inspect=look)
        return out, got

    on, st_on = run(True)
    off, st_off = run(False)
    assert on == off == {
        "nvidiactl": [["errno", errno.ENODEV]],
        "nvidia0": [["ok", "00000000"]],
        "nvidia-uvm": [["errno", errno.ENODEV]],
        "regular": [["ok", on["regular-head"]]],
        "regular-head": on["regular-head"],
        "memfd": [["ok", "01020304"]],
    }, (on, off)
    # the ctl and GPU files' five mappings each, by their facts; none with the facts off
    assert st_on["mmaps_settled"] == 10 and st_off["mmaps_settled"] == 0, (st_on, st_off)
    # (every mapping of the broker's files counted either way: the five of nvidia-uvm too)
    assert st_on["mmaps"] == st_off["mmaps"] == 15, (st_on, st_off)
    # the regular file's mappings (and the interpreter's own) let through by the loop,
    # counted as continued either way
    assert st_on["mmaps_continued"] >= 5 and st_off["mmaps_continued"] >= 5


def test_prepared_opens_are_the_brokers_files_with_the_openers_flags(tmp_path):
    """Prepared opens (native/lane.c answer_prepared_open, SeccompSupervisor._prepare_opens):
    after a tenant's first open of /dev/nvidiactl and a quiet moment, its next opens of that
    path are answered by the native loop with files the broker opened ahead — each a file
    of its own (its own inode), a session of the broker's (an RM_FREE of client 0 on it is
    refused by the broker's general path: status in the argument, ioctl 0; an unknown file
    would get the stand-in's ENOTTY), close-on-exec exactly when asked; an O_NONBLOCK or a
    relative open goes the Python way. The same answers with prepared opens off; every
    session, used or not, released when the tenant ends."""
    import json
    import sys
    from pathlib import Path

    prog = str(Path(__file__).resolve().parent / "opens_prog.py")

    def run(on: bool, tenant_policy: str = "") -> tuple[dict, dict]:
        name = f"opens{int(on)}{len(tenant_policy)}"
        out, _lane = _on_stand_in_nodes(tmp_path, name,
                                        {"DEVBROKER_PREPARED_OPENS": "1" if on else "0"},
                                        "seccomp", [sys.executable, prog],
                                        tenant_policy=tenant_policy)
        audit = (tmp_path / f"run-{name}" / "audit.log").read_text().splitlines()
        ends = [json.loads(line) for line in audit if '"tenant-detached"' in line]
        assert len(ends) == 1, audit
        return out, ends[0]

    on, st_on = run(True)
    off, st_off = run(False)
    # a tenant within 32 files of its open-file limit gets none prepared (they would count
    # against its own opens), and its opens are the same
    near, st_near = run(True, "limits = { open_files = 33 }\n")
    assert st_near["prepared"] == st_near["opens_prepared"] == 0 and st_near["opens"] == 11
    for out in (on, off, near):
        files = [out["first"], *out["ctl"], out["nonblock"], out["relative"]]
        assert len({f["ino"] for f in files}) == len(files)  # a file of its own each
        assert all(f["rm_free"] == 0 for f in files), files  # the broker's sessions
        assert out["null"]["rm_free"] == errno.ENOTTY  # (what a file not its own gets)
        assert out["first"]["cloexec"]
        assert [f["cloexec"] for f in out["ctl"]] == [f["want_cloexec"] for f in out["ctl"]]
        assert not any(f["nonblock"] for f in [out["first"], *out["ctl"], out["relative"]])
        assert out["nonblock"]["nonblock"]
    # all eight after the quiet moment were prepared (12 per ctl path); none with them off
    assert st_on["opens_prepared"] == 8 and st_on["opens"] == st_off["opens"] == 11
    assert st_off["opens_prepared"] == st_off["prepared"] == 0
    # every session ended when its file did: the ones used, and the prepared ones left over
    # (closed by the broker when the tenant's last task went)
    made = st_on["opens"] - st_on["opens_prepared"] + st_on["prepared"]
    assert st_on["prepared_dropped"] == st_on["prepared"] - 8 > 0
    assert st_on["released_on_last_close"] == made and st_on["released_at_shutdown"] == 0
    assert st_off["released_on_last_close"] == 11 and st_off["released_at_shutdown"] == 0


def test_a_continue_decisions_read_stalled_on_the_tenants_page_is_answered_efault(tmp_path):
    """The native loop's callbacks read tenant memory through the memory gate (a continue
    decision's argument, a checked call's parameters, embedded buffers): a read held by a
    userfaultfd page the tenant never serves is answered EFAULT by the listener's watchdog
    at the gate's deadline, as an access of the loop's own C is — not left waiting for the
    tenant — and the tenant's next call is answered as usual (the continue lane's
    ENOTTY from the stand-in node)."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    # The tenant's root has no CAP_SYS_PTRACE in its sandbox: a userfaultfd that also
    # catches the kernel's faults needs unprivileged ones allowed, for this test only
    # (as test_fastlane's stalled-read test does).
    knob = Path("/proc/sys/vm/unprivileged_userfaultfd")
    if not knob.exists():
        pytest.skip("no userfaultfd in this kernel")
    before = knob.read_text().strip()
    knob.write_text("1")
    try:
        out, _lane = _on_stand_in_nodes(tmp_path, "uffd", {}, "seccomp",
                                        [sys.executable, str(here / "uffd_uvm_prog.py")],
                                        wrap=(sys.executable, str(here / "nvok_standin.py")),
                                        lane="continue_lane")
    finally:
        knob.write_text(before)
    assert out["uffd"], out
    # (answered at all: a read left waiting for the tenant never answers, and the exec
    # above times out; how long it took is in `out`, not asserted)
    assert out["stalled"][0] == errno.EFAULT, out
    assert out["plain"][0] == errno.ENOTTY, out


def test_a_continued_os_descriptor_allocation_puts_the_process_under_the_quota_watch(tmp_path):
    """The quota watch (broker/quotawatch.py) wired end to end on the real backend: a
    seccomp tenant's NV_ESC_RM_ALLOC_MEMORY of an OS descriptor (class 0x71, which the kernel
    runs in the tenant after the broker decided it: the stand-in node answers ENOTTY) puts
    its process under the watch, which reads the driver's per-process accounting through the
    relay — GET_PID_INFO's block built at the ABI tables' offsets, here answered by the
    NV-OK stand-in as sent: 0 bytes — and says what it read against the books, once. No
    violation. After the process is gone the next look forgets it (status: nothing watched).
    The H200 run reads the real driver's figures this way (docs/hardware.md, `-s15full`)."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    seen: dict = {}

    def inspect(b):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen["status"] = b.status().get("quota_watch")
            if seen["status"] and seen["status"]["watching"] == 0:
                break
            time.sleep(0.2)
        seen["audit"] = b.audit()

    out, clane = _on_stand_in_nodes(tmp_path, "watch", {}, "seccomp",
                                    [sys.executable, str(here / "quota_watch_prog.py"), "1.5"],
                                    wrap=(sys.executable, str(here / "nvok_standin.py")),
                                    inspect=inspect, lane="continue_lane")
    # the OS descriptor's NVOS02 is the general steps' (its size is pinned host memory,
    # which the continue lane declines to book), which armed the watch; the lane's one
    # admission is the tenant's own root client (ContinueLane.root_alloc)
    assert clane["admitted"] == 1 and clane["roots"] == 1 and clane["settled"] == 0, clane
    # the root allocation and the OS descriptor ran in the tenant (the stand-in: ENOTTY);
    # the adoption's control and the device are the broker's (the NV-OK stand-in)
    assert out == {"root": errno.ENOTTY, "adopted": [0, 0], "device": 0,
                   "os_descriptor": errno.ENOTTY}, out
    st = seen["status"]
    # a look 50 ms after the call and another within the next second, while it stayed 1.5 s
    assert st is not None and st["looks"] >= 2 and st["killed"] == 0, st
    assert st["watching"] == 0, st  # the process exited: forgotten at the next look
    notes = [r.get("message", "") for r in seen["audit"] if r.get("event") == "notice"]
    watch = [m for m in notes if m.startswith("quota watch")]
    assert len(watch) == 1 and "the driver accounts {0: 0} bytes per GPU" in watch[0] \
        and "of tenant t0" in watch[0], notes
    assert not [r for r in seen["audit"] if r.get("event") == "violation"]


def test_settled_embedded_lists_answer_as_the_broker(tmp_path):
    """A control with embedded buffers settled (fastlane._embedded_only, native/lane.c
    settled_embed): CUDA's FIFO_GET_CHANNELLIST, 20 per init, whose check in Python was all
    that kept each call ~120 µs over the driver's 4 µs on the H200. A seccomp tenant on the
    NV_OK stand-in (tests/settled_embedded_prog.py) sends it 20 times with two lists of
    three handles, then with a NULL output list, an output list in unmapped memory, and
    lists past what the loop carries. With settled controls on and off the tenant sees the
    same: every list call NV_OK with its lists as sent (the broker's copies written back),
    its parameter block still holding its own pointers; the unmapped list EFAULT (the read
    fails in the loop, the general path reads again and answers); the large lists the
    general path's. With them on, the loop answers 19 of the 20 and the common call after
    the others (the fact still stands after a declined one)."""
    on, lane_on = _settled_on_stand_in(tmp_path, "settled_embedded_prog.py", True)
    off, lane_off = _settled_on_stand_in(tmp_path, "settled_embedded_prog.py", False)
    assert on == off == {
        "errors": [],
        "root": errno.ENOTTY,  # (the tenant's own call, on the stand-in node)
        "device": [0, 0],
        "lists": [[0, 0, True, True]],
        "null_list": [0, 0],
        "unmapped_list": [errno.EFAULT, 0],
        "big": [0, 0, True, True],
        "again": [0, 0, True],
        "last": 0x23,  # (NV_ERR_INVALID_CLIENT: the general path's refusal)
    }, (on, off)
    # 19 of the first 20, the NULL list (its fact: the same control on the same object)
    # and the last one; the unmapped list and the large ones go the general way
    assert lane_on["settled"] == 19 + 1 + 1, lane_on
    assert lane_off["settled"] == 0, lane_off
    # (the unmapped list: with them off, declined after its check, when the read failed)
    assert lane_on["admitted"] == lane_off["admitted"], (lane_on, lane_off)


def test_settled_id_lists_are_filtered_as_the_broker_filters_them(tmp_path):
    """A post-hook given as data to the native loop (rewrite.IdFilter, native/lane.c
    apply_id_filter): GET_PROBED_IDS and GET_ATTACHED_IDS, whose answers the broker cuts
    down to the tenant's GPUs (NVML sends them ~5 times per init, CUDA 7; ~235 and ~90 µs
    each over the driver's 5 with the hook in Python on the H200). A seccomp tenant on the
    NV_OK stand-in (tests/settled_ids_prog.py: the stand-in leaves the lists as the
    tenant filled them) sends each 20 times, another GPU's id before its own. With settled
    controls on and off the answers are the same: only the tenant's id (0x6) listed, then
    INVALID_GPU_ID; its flag moved with it (580's gpuFlags), the others 0; no GPU
    excluded. With them on, the loop answers 19 of each 20."""
    on, lane_on = _settled_on_stand_in(tmp_path, "settled_ids_prog.py", True)
    off, lane_off = _settled_on_stand_in(tmp_path, "settled_ids_prog.py", False)
    invalid = 0xFFFFFFFF
    assert on == off == {
        "errors": [],
        "root": errno.ENOTTY,  # (the tenant's own call, on the stand-in node)
        "probed": [[0, 0, [0x6, invalid, invalid], [invalid] * 3, [0x22, 0, 0]]],
        "attached": [[0, 0, [0x6, invalid, invalid]]],
        "last": 0x23,  # (NV_ERR_INVALID_CLIENT: the general path's refusal)
    }, (on, off)
    assert lane_on["settled"] == 19 + 19, lane_on
    assert lane_off["settled"] == 0, lane_off
    assert lane_on["admitted"] == lane_off["admitted"], (lane_on, lane_off)


def test_settled_id_info_flags_and_attach_lists_answer_as_the_broker(tmp_path):
    """A post-hook and a pre-hook given as data to the native loop. The post-hook
    (rewrite.IdFlag, native/lane.c apply_id_flag): GET_ID_INFO and GET_ID_INFO_V2, whose IN_USE flag the broker rewrites
    to whether the tenant itself holds a device object of that GPU (NVML sends five per
    init, each on a new client; ~150 µs over the driver's few with the hook in Python on
    the H200). A seccomp tenant on the NV_OK stand-in (tests/settled_flags_prog.py: the
    stand-in leaves gpuFlags as the tenant filled it, always the opposite of the right
    answer) asks 20 times each before it allocates a device, while it holds it, and after
    it freed it. With settled controls on and off the answers are the same: clear, set,
    clear; another GPU's id refused. With them on, the loop answers all but the first of
    the 120 — the flag's values follow the device's booking and free without a call
    going to Python (SeccompSupervisor._device_ids_after_books). The pre-hook
    (rewrite.IdListCheck, native/lane.c settled_list_check): ATTACH_IDS and DETACH_IDS
    (NVML: one each per init, ~150 and ~330 µs over the driver on the H200), whose list
    must name only the tenant's GPUs: with its own id, settled from the second call; with
    another GPU's id refused, and "all probed" rewritten, by the broker every time."""
    on, lane_on = _settled_on_stand_in(tmp_path, "settled_flags_prog.py", True)
    off, lane_off = _settled_on_stand_in(tmp_path, "settled_flags_prog.py", False)
    invalid = 0xFFFFFFFF
    assert on == off == {
        "root": errno.ENOTTY,  # (the tenant's own call, on the stand-in node)
        "adopt": [0, 0],
        "before_v1": [[0, 0, 0]], "before_v2": [[0, 0, 0]],
        "other_gpu": [0, 0x1F, 0],  # (NV_ERR_INVALID_ARGUMENT: the general path's refusal)
        "device": [0, 0],
        "holding_v1": [[0, 0, 1]], "holding_v2": [[0, 0, 1]],
        "free": [0, 0],
        "after_v1": [[0, 0, 0]], "after_v2": [[0, 0, 0]],
        # (the driver reads a list up to its first INVALID_GPU_ID: what follows is not judged)
        "attach": [[0, 0, [0x6, invalid, 0x7]]], "detach": [[0, 0, [0x6, invalid, 0x7]]],
        # (NV_ERR_INSUFFICIENT_PERMISSIONS, every time: restrict_attach_ids' refusal)
        "attach_other": [[0, 0x1B, [0x6, 0x7, invalid]]],
        # ("all probed" is the tenant's GPUs: the broker's rewrite, every time)
        "attach_all": [[0, 0, [0x6, invalid, invalid]]],
    }, (on, off)
    # (the adoption's SYSTEM_GET_FEATURES is a hub's first control: settled from then on,
    # but sent once; each flag or list control's first call is the broker's, and the
    # refused and rewritten lists are the broker's every time)
    assert lane_on["settled"] == 120 - 2 + 2 * 19, lane_on
    assert lane_off["settled"] == 0, lane_off
    # (a call naming another GPU: the lane admits and refuses it each time with settled
    # decisions off; with them on, where its control's fact stands — the other GPU's
    # GET_ID_INFO, and ATTACH_IDS from its second call — the loop's own check fails and
    # it hands the call to the general path, which refuses it: 1 + 19 fewer admissions)
    assert lane_on["admitted"] == lane_off["admitted"] - 20, (lane_on, lane_off)


def test_settled_escapes_answer_as_the_broker_on_freshly_opened_files(tmp_path):
    """Settled escapes (native/lane.c struct dvb_escape_fact, NativeLane.settle_escape):
    NVML and CUDA make their version check and SYS_PARAMS on an nvidiactl, and
    WAIT_OPEN_COMPLETE and NUMA_INFO on a GPU file, each opened just before (~110–180 µs
    each over the driver on the H200 with the broker deciding every one). A seccomp tenant
    on the NV_OK stand-in (tests/settled_escapes_prog.py) does that 20 times on fresh files,
    with also a version the broker does not know and a SYS_PARAMS with another memory
    block size, and WAIT_OPEN_COMPLETE on /dev/zero (the stand-in GPU node's device, not a
    file of the broker's). With settled decisions on and off the answers are the same — the
    argument as sent, 0; SYS_PARAMS with the other size refused (EPERM) and /dev/zero's
    ENOTTY every time. With them on,
    the loop admits each of the six the broker admits from the second or third round on
    (written down at the ioctl's second admission: NativeLane.worth_settling), on files it
    never saw before
    but whose mapping facts say they are the tenant's — REGISTER_FD too, each round naming
    its new nvidiactl by another number (its fd field is not part of the match; the loop
    checks the file it names by its own duplicate)."""
    on, lane_on = _settled_on_stand_in(tmp_path, "settled_escapes_prog.py", True)
    off, lane_off = _settled_on_stand_in(tmp_path, "settled_escapes_prog.py", False)
    assert on == off, (on, off)
    assert set(on) == {"version", "version_unknown", "sys_params", "sys_params_other",
                       "wait_open", "numa_info", "wait_open_not_ours", "register_fd",
                       "register_fd_not_ours"}, on
    # (REGISTER_FD: the tenant's own ctl fd number back in every round, each round's
    # number another; naming /dev/zero refused by the broker every time)
    assert on["register_fd"] == [[0, True]], on
    assert on["register_fd_not_ours"][0][0] != 0, on
    for label, answers in on.items():
        assert len(answers) == 1, (label, answers)
    assert on["sys_params_other"][0][0] == errno.EPERM, on
    # (the same node's device, the same argument, but no mapping fact: not the loop's)
    assert on["wait_open_not_ours"][0][0] == errno.ENOTTY, on
    for label in ("version", "version_unknown", "sys_params", "wait_open", "numa_info"):
        assert on[label][0][0] == 0, (label, on[label])
    # (written at an escape's second admission: the version check asking the unknown
    # version is the ioctl's second admission in round 1, so its fact is there from round
    # 2 on — 19; the other five from round 3 — 18 each; a REGISTER_FD refused by its check
    # writes nothing). A fact is written after its call is answered, so the tenant's next
    # call of the same kind can come first on a busy machine and go the general way: that
    # costs a few settles (106 of 109 seen in full suite runs), never a check.
    assert 5 * 18 + 19 - 6 <= lane_on["settled"] <= 5 * 18 + 19, lane_on
    assert lane_off["settled"] == 0, lane_off
    assert lane_on["admitted"] == lane_off["admitted"], (lane_on, lane_off)


def test_a_root_client_the_tenant_allocates_itself_is_continued_by_the_lane(tmp_path):
    """NVML's root client, one per init on an nvidiactl opened just before: the continue
    lane continues it from the loop's question (ContinueLane.root_alloc: handlers.rm_alloc's
    root branch, ~230–300 µs over the driver the general way on the H200) instead of the
    loop handing the call to the general steps. A seccomp tenant on the NV_OK stand-in
    (tests/roots_prog.py), three rounds: its own root client on a fresh nvidiactl
    (continued: the stand-in node's ENOTTY), a control naming it (adopted: NV_OK), a second
    root client on the same file (the broker's to allocate: NV_OK) and a control on it.
    The answers are the Python listener's (DEVBROKER_NATIVE_LANE=0, which decides each the
    general way); with the native loop the continue lane took the three first roots."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent

    def run(native: bool) -> tuple[dict, dict]:
        return _on_stand_in_nodes(tmp_path, f"roots{int(native)}",
                                  {"DEVBROKER_NATIVE_LANE": "1" if native else "0"},
                                  "seccomp", [sys.executable, str(here / "roots_prog.py")],
                                  wrap=(sys.executable, str(here / "nvok_standin.py")),
                                  lane="continue_lane")

    native, lane_native = run(True)
    python, lane_python = run(False)
    assert native == python == {"rounds": [[errno.ENOTTY, [0, 0], [0, 0], [0, 0]]] * 3}, \
        (native, python)
    assert lane_native["roots"] == 3, lane_native
    assert lane_python["roots"] == 0, lane_python


def test_node_wide_continuations_hold_for_the_tenants_fresh_uvm_files(tmp_path):
    """Continuation facts of a node (native/lane.c DVB_NODE_WIDE, NativeLane.settle_continue
    with node_wide): NVML opens /dev/nvidia-uvm twice on each init and sends
    UVM_INITIALIZE, UVM_MM_INITIALIZE and UVM_DEINITIALIZE on those new files (~100–140 µs
    each over the driver on the H200 with the broker deciding every one: a fact per file
    is never used twice). A uvm file now gets a file fact at its install
    (NativeLane.settle_file: the tenant's, in its opener's sandbox; no mapping fact, its
    mappings stay the broker's), and a continuation that reads no object of the file's own
    is written for the node. A seccomp tenant (tests/uvm_fresh_prog.py), 20 rounds on fresh
    files, UVM_MM_INITIALIZE naming its other uvm file and naming /dev/zero, UVM_INITIALIZE
    on /dev/null (the stand-in uvm node's device, not a file of the broker's): the same
    answers with settled decisions on and off (continued: the stand-in node's ENOTTY;
    /dev/zero refused by the broker every time; /dev/null the kernel's), and with them on the loop continues each
    of the three from the round after the broker wrote it down."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent

    def run(settled: bool) -> tuple[dict, dict]:
        return _on_stand_in_nodes(tmp_path, f"uvmfresh{int(settled)}",
                                  {"DEVBROKER_SETTLED": "1" if settled else "0"}, "seccomp",
                                  [sys.executable, str(here / "uvm_fresh_prog.py"), "20"],
                                  wrap=(sys.executable, str(here / "nvok_standin.py")),
                                  lane="continue_lane")

    on, lane_on = run(True)
    off, lane_off = run(False)
    assert on == off, (on, off)
    assert on["initialize"] == on["mm_initialize"] == on["deinitialize"] == [errno.ENOTTY], on
    assert on["mm_initialize_not_ours"] and errno.ENOTTY not in on["mm_initialize_not_ours"], on
    assert on["initialize_not_ours"] == [errno.ENOTTY], on  # (the kernel's, on /dev/null)
    # (the first of each decided by the broker and written down after its answer; the
    # other 19 of each the loop's, on files it never saw before; none on /dev/null, of
    # the uvm node's device but with no file fact)
    assert lane_on["settled"] == 3 * 19, lane_on
    assert lane_off["settled"] == 0, lane_off
    assert lane_on["admitted"] == lane_off["admitted"], (lane_on, lane_off)


def test_card_info_is_answered_again_by_the_loop_from_the_brokers_answer(tmp_path):
    """An answer fact (rules.EscapeRule.answer_kept, native/lane.c answer_admit): CARD_INFO,
    whose answer is the driver's table of the host's GPUs cut down to the tenant's (NVML
    sends it twice per init, CUDA three times; ~400 µs over the driver's few on the H200
    through the general path). A seccomp tenant on the NV_OK stand-in
    (tests/card_info_prog.py: the stand-in leaves the table as the tenant filled it) sends
    it 20 times on one nvidiactl and once on a second one. With settled facts on and off
    the answers are the same: its own GPU's entry with the BAR addresses cleared, the other
    GPU's entry empty. With them on, the loop answers 19 of the first 20 and the call on
    the second file (a file of the tenant's by its mapping fact), none with them off."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent

    def run(settled: bool) -> tuple[dict, dict]:
        got = {}

        def look(b):
            got.update(_detached_record(b))

        out, _lane = _on_stand_in_nodes(tmp_path, f"card{int(settled)}",
                                        {"DEVBROKER_SETTLED": "1" if settled else "0"},
                                        "seccomp",
                                        [sys.executable, str(here / "card_info_prog.py"), "20"],
                                        wrap=(sys.executable, str(here / "nvok_standin.py")),
                                        inspect=look)
        return out, got

    on, st_on = run(True)
    off, st_off = run(False)
    own = [0, 1, 0, 0, 0, 1 << 30, True]  # (valid, minor 0, both BARs cleared; entry 1 empty)
    assert on == off == {"answers": [own], "second_file": own}, (on, off)
    assert st_on.get("answers_settled") == 19 + 1, st_on
    assert st_off.get("answers_settled") == 0, st_off


@pytest.mark.parametrize("priority", ["normal", "low"])
def test_channel_groups_get_their_share_in_the_lane_and_channels_do_not_settle(tmp_path,
                                                                              priority):
    """A channel group's allocation in the native loop (fastlane.LANE_RUN_AFTER_HOOKS,
    ControlLane.run_after): the loop runs the driver call, and the broker books the group
    and sets its compute share (compute.after_alloc: SET_TIMESLICE, SET_INTERLEAVE_LEVEL on
    the tenant's file) before the tenant has the handle — as the general path does. A broker
    on the real backend whose driver calls meet the NV_OK stand-in (nvok_standin.py), a
    seccomp tenant (tests/channels_prog.py) making 4 channel groups with two GPFIFO channels
    each and waiting while the test reads the broker's books: the tenant's answers and the
    books' groups with their values are the same with the control lane off
    (DEVBROKER_CONTROL_LANE=0, every allocation the general way's), and the lane admitted
    the groups. A channel is admitted by the lane but never settled, for either tenant: its
    parent must be a channel group (rules.ClassRule.parents), and the loop's facts know the
    parent's handle, not its class (a settled channel under the device would run in a group
    the driver makes itself, outside the compute share). Each channel gets a
    copy engine object and a GET_WORK_SUBMIT_TOKEN, as CUDA's do: both settle from the
    third channel on, for either tenant."""
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent

    def run(lane: bool) -> tuple[dict, dict, dict]:
        books: dict = {}

        def during(b, first) -> None:
            books["ready"] = first.get("ready")
            # (the other groups' smaller parts are set by a task of the broker's after each
            # new group: looked at once they are all the same)
            for _ in range(200):
                groups = b.tenant("t0")["compute"]["channel_groups"]
                if len({g["timeslice_us"] for g in groups}) == 1:
                    break
                time.sleep(0.05)
            books["groups"] = sorted((g["handle"], g["timeslice_us"], g["interleave"],
                                      g.get("error")) for g in groups)
            # (a group the hook failed to set would be set by the background task later:
            # the hook's own failures are in the audit)
            books["errors"] = [r["reason"] for r in b.audit() if r.get("event") == "error"]

        env = {"DEVBROKER_SETTLE_FIRST": "1", "DEVBROKER_CONTROL_LANE": "1" if lane else "0"}
        got, counters = _on_stand_in_nodes(
            tmp_path, f"chan{int(lane)}{priority}", env, "seccomp",
            [sys.executable, str(here / "channels_prog.py"), "4"],
            wrap=(sys.executable, str(here / "nvok_standin.py")),
            tenant_policy=f'priority = "{priority}"\n', during=during)
        return got, counters, books

    on, lane_on, books_on = run(True)
    off, lane_off, books_off = run(False)
    ok = [0, 0]
    assert on == off == {"root": errno.ENOTTY, "adopt": ok, "device": ok, "groups": [ok] * 4,
                         "channels": [ok] * 8, "copies": [ok] * 8, "tokens": [ok] * 8,
                         "frees": [ok]}, (on, off)
    level = {"normal": "MEDIUM", "low": "LOW"}[priority]
    # the tenant's whole slice (8,192 µs alone on the GPU) shared by its four groups
    want = [(0xC1A60000 + i, 2048, level, None) for i in range(4)]
    assert books_on == books_off == {"ready": True, "groups": want, "errors": []}, (
        books_on, books_off)
    # the device, the groups, the channels and the copy engines through the lane (settled
    # ones included)
    assert lane_on["allocations"] == 1 + 4 + 8 + 8, lane_on
    # Settled: no channel; the copy engines and the
    # GET_WORK_SUBMIT_TOKENs — one per channel, so each on an object that gets it once —
    # from the third channel on (6 + 6): the class's or control's fact written at its
    # second admission on whatever object, the channel's object fact at its booking
    # (NativeLane.worth_settling); and of the four frees of the groups, the last three.
    assert lane_on["settled"] == 6 + 6 + 3, lane_on
    assert lane_off["admitted"] == 0, lane_off
