"""The host mechanisms behind real driver files in the tenant (backends/tenantfile.py), on
real kernel objects: per-thread capability drops, private device nodes (a character device
everyone has stands in for the NVIDIA node: the mechanism does not depend on the driver),
and the inotify event that ends a session when the last reference goes.

The NVIDIA-specific part (CUDA through these files) runs on the lent GPU only:
docs/hardware.md, "The CUDA run"."""
from __future__ import annotations

import ctypes
import os
import stat
import struct
import threading

import pytest
import trio

from devbroker.backends.tenantfile import (
    NoCapsExecutor, PrivateNodes, drop_thread_capabilities, effective_caps_lowered,
    nvidia_majors, thread_caps,
)

pytestmark = pytest.mark.root

STAND_IN = "/dev/zero"  # a character device that also supports mmap


def _status_caps(tid: int) -> tuple[int, int]:
    with open(f"/proc/self/task/{tid}/status") as f:
        d = dict(line.split(":", 1) for line in f if ":" in line)
    return int(d["CapEff"], 16), int(d["CapPrm"], 16)


async def test_executor_threads_hold_no_capability_and_the_broker_thread_keeps_its_own():
    if os.geteuid() != 0 or not thread_caps()[0]:
        pytest.skip("needs a process with capabilities to drop")
    ex = NoCapsExecutor(2)
    try:
        eff, prm = await ex.run(thread_caps)
        assert (eff, prm) == (0, 0)
        tid = await ex.run(threading.get_native_id)
        assert _status_caps(tid) == (0, 0)  # what the kernel says, not only capget
        assert thread_caps()[0] != 0  # the calling (trio) thread is untouched
        with pytest.raises(OSError):  # a worker's exception reaches the waiting task
            await ex.run(os.close, 987654)
    finally:
        ex.stop()


def test_lowered_effective_capabilities_are_restored_after_the_call():
    if os.geteuid() != 0 or not thread_caps()[0]:
        pytest.skip("needs a process with capabilities")
    before = thread_caps()
    with effective_caps_lowered():
        eff, prm = thread_caps()
        assert eff == 0 and prm == before[1]
        assert _status_caps(threading.get_native_id())[0] == 0
    assert thread_caps() == before


def test_a_thread_that_dropped_its_capabilities_cannot_take_them_back():
    out = {}

    def worker():
        drop_thread_capabilities()
        libc = ctypes.CDLL(None, use_errno=True)
        # capset asking for CAP_SYS_ADMIN again (version 3 header, pid 0 = this thread)
        hdr = struct.pack("=Ii", 0x20080522, 0)
        data = struct.pack("=III", 1 << 21, 1 << 21, 0) + struct.pack("=III", 0, 0, 0)
        out["rc"] = libc.capset(hdr, data)
        out["caps"] = thread_caps()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert out["rc"] == -1 and out["caps"] == (0, 0)


def test_private_nodes_give_each_open_an_inode_of_its_own(tmp_path):
    nodes = PrivateNodes(tmp_path / "nodes")
    try:
        fds = [nodes.open(STAND_IN, os.O_RDWR) for _ in range(3)]
        sts = [os.fstat(fd) for fd in fds]
        real = os.stat(STAND_IN)
        assert all(stat.S_ISCHR(st.st_mode) and st.st_rdev == real.st_rdev for st in sts)
        assert len({(st.st_dev, st.st_ino) for st in sts}) == 3  # one identity per open
        assert os.read(fds[0], 4) == b"\0" * 4  # it is the device itself
        # the opened nodes are unlinked by tidy (after the tenant has its answer), which
        # leaves SPARE new nodes of the host path; the next open takes one of them
        opened = set(os.listdir(tmp_path / "nodes"))
        assert len(opened) == 3
        nodes.tidy()
        spares = set(os.listdir(tmp_path / "nodes"))
        assert len(spares) == PrivateNodes.SPARE and not spares & opened
        fd = nodes.open(STAND_IN, os.O_RDWR)
        assert os.fstat(fd).st_rdev == os.stat(STAND_IN).st_rdev
        assert set(os.listdir(tmp_path / "nodes")) == spares  # a spare, opened
        nodes.tidy()
        assert len(set(os.listdir(tmp_path / "nodes")) - spares) == 1  # replaced
        for fd in [*fds, fd]:
            os.close(fd)
    finally:
        nodes.close()
    assert not (tmp_path / "nodes").exists() or os.listdir(tmp_path / "nodes") == []


def test_private_nodes_run_low_only_near_the_end_of_their_spares(tmp_path):
    """`running_low` (whether the tidy may wait for a quiet listener): a host path opened
    for the first time has no spares (low: the tidy must not wait); after a tidy it has
    SPARE, and it runs low only once fewer than LOW are left; a tidy fills it again."""
    nodes = PrivateNodes(tmp_path / "nodes")
    fds = []
    try:
        fds.append(nodes.open(STAND_IN, os.O_RDWR))
        assert nodes.running_low()  # (its node was made on the open itself)
        nodes.tidy()
        assert not nodes.running_low()
        for _ in range(PrivateNodes.SPARE - PrivateNodes.LOW):
            fds.append(nodes.open(STAND_IN, os.O_RDWR))
        assert not nodes.running_low()  # LOW spares left
        fds.append(nodes.open(STAND_IN, os.O_RDWR))
        assert nodes.running_low()
        nodes.tidy()
        assert not nodes.running_low()
        assert len(os.listdir(tmp_path / "nodes")) == PrivateNodes.SPARE  # opened: unlinked
    finally:
        for fd in fds:
            os.close(fd)
        nodes.close()


def test_private_nodes_drop_spares_of_a_host_node_that_changed(tmp_path):
    """A spare made for a host node that has since become another device (a driver
    reloaded with other numbers) is never opened: tidy drops it and makes new ones."""
    host = tmp_path / "nvidia-standin"
    os.mknod(host, stat.S_IFCHR | 0o600, os.stat("/dev/zero").st_rdev)
    nodes = PrivateNodes(tmp_path / "nodes")
    try:
        os.close(nodes.open(str(host), os.O_RDWR))
        nodes.tidy()
        old = set(os.listdir(tmp_path / "nodes"))
        assert len(old) == PrivateNodes.SPARE
        os.unlink(host)
        os.mknod(host, stat.S_IFCHR | 0o600, os.stat("/dev/null").st_rdev)
        fd = nodes.open(str(host), os.O_RDWR)  # a spare of the old device (taken before
        os.close(fd)                           # tidy looked again: the window is one open)
        nodes.tidy()
        now = set(os.listdir(tmp_path / "nodes"))
        assert len(now) == PrivateNodes.SPARE and not now & old
        fd = nodes.open(str(host), os.O_RDWR)
        assert os.fstat(fd).st_rdev == os.stat("/dev/null").st_rdev
        os.close(fd)
    finally:
        nodes.close()


def test_the_last_reference_of_a_private_node_is_reported_by_inotify(tmp_path):
    """What the seccomp supervisor relies on to end a session: the watch on the unlinked
    inode reports its eviction once the last fd *and* mapping are gone, not before."""
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    nodes = PrivateNodes(tmp_path / "nodes")
    ifd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fd = nodes.open(STAND_IN, os.O_RDWR)
        wd = libc.inotify_add_watch(ifd, f"/proc/self/fd/{fd}".encode(), 0x400)  # DELETE_SELF
        assert wd >= 0
        nodes.tidy()  # (the node unlinked, as after the seccomp front end's answer)
        dup = os.dup(fd)
        m = mmap.mmap(fd, 4096)
        os.close(fd)
        os.close(dup)

        def events():
            try:
                return os.read(ifd, 4096)
            except BlockingIOError:
                return b""

        assert events() == b""  # the mapping still holds the file
        m.close()
        got = events()
        assert got, "no event after the last reference went"
        _wd, mask = struct.unpack_from("=iI", got)
        assert mask & (0x400 | 0x8000)  # IN_DELETE_SELF or IN_IGNORED
    finally:
        os.close(ifd)
        nodes.close()


def test_nvidia_majors_come_from_proc_devices(tmp_path):
    f = tmp_path / "devices"
    f.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n238 nvidia-uvm\n"
                 "241 nvidia-caps\n\nBlock devices:\n195 nvidia-not-a-char\n")
    assert nvidia_majors(str(f)) == {"nvidia-frontend": 195, "nvidia-uvm": 238,
                                     "nvidia-caps": 241}
