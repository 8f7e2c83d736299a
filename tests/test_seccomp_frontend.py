"""Real processes under the seccomp front end, answered by a small in-test broker."""
from __future__ import annotations

import errno
import json
import os
import signal
import struct
import sys
import textwrap

import pytest
import trio

from devbroker.abi.nodes import NodeKind
from devbroker.broker.interface import (
    DENIED,
    IoctlReply,
    IoctlRequest,
    MapReadReply,
    MapReadRequest,
    OpenReply,
    OpenRequest,
    ReleaseRequest,
)
from devbroker.frontends import seccomp as sc
from devbroker.sandbox import seccompwire as w

pytestmark = pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                                reason="x86_64 Linux only")


def F(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


XFORM = F(0xD2, 16)  # answered with transformed bytes
DENY = F(0x4D, 8)  # refused with EPERM
RESULT = F(0xD6, 4)  # answered with a non-zero ioctl result and no arg_out
WHO = F(0xD7, 8)  # answers the caller's (pid, session)
WAIT_RELEASES = F(0xEF, 4)  # blocks until the broker has seen arg releases; answers the count
READY = F(0xEE, 4)  # tells the test the tenant is ready to be killed
RESOLVE = F(0xC9, 8)  # REGISTER_FD-like: the broker resolves two fd numbers of the caller
UVM_CMD = 75  # a raw UVM-style command: no size, the broker reads/writes through memory


class FakeBroker:
    def __init__(self):
        self.next = 100
        self.opens: list[OpenRequest] = []
        self.sessions: dict[int, OpenRequest] = {}
        self.ioctls: list[IoctlRequest] = []
        self.released: list[int] = []
        self.ready = trio.Event()
        self._changed = trio.Event()

    async def open(self, req: OpenRequest) -> OpenReply:
        self.opens.append(req)
        if req.node == NodeKind.UVM_TOOLS:
            return OpenReply(errno=errno.EACCES)
        self.next += 1
        self.sessions[self.next] = req
        return OpenReply(session=self.next)

    async def ioctl(self, req: IoctlRequest) -> IoctlReply:
        self.ioctls.append(req)
        assert req.session in self.sessions and req.session not in self.released
        if req.cmd == XFORM:
            return IoctlReply(arg_out=bytes(b ^ 0x20 for b in req.arg)[::-1])
        if req.cmd == DENY:
            return DENIED
        if req.cmd == RESULT:
            return IoctlReply(result=7)
        if req.cmd == WHO:
            return IoctlReply(arg_out=struct.pack("=II", req.caller.pid, req.session))
        if req.cmd == UVM_CMD:
            assert req.arg is None
            (v,) = struct.unpack("=Q", req.memory.read(req.arg_ptr, 8))
            req.memory.write(req.arg_ptr + 8, struct.pack("=Q", v * 3))
            return IoctlReply()
        if req.cmd == WAIT_RELEASES:
            (want,) = struct.unpack("=I", req.arg)
            with trio.fail_after(20):
                while len(self.released) < want:
                    await self._changed.wait()
            return IoctlReply(arg_out=struct.pack("=I", len(self.released)))
        if req.cmd == RESOLVE:
            fds = struct.unpack("=ii", req.arg)
            got = [req.resolve_fd(fd) for fd in fds]  # seccomp answers at once
            return IoctlReply(arg_out=struct.pack("=ii", *[g if g is not None else -1 for g in got]))
        if req.cmd == READY:
            self.ready.set()
            return IoctlReply()
        return IoctlReply(errno=errno.ENOTTY)

    async def map_read(self, req: MapReadRequest) -> MapReadReply:
        if self.sessions[req.session].node != NodeKind.GPU:
            return MapReadReply(errno=errno.EINVAL)
        return MapReadReply(data=f"page of session {req.session} @{req.offset}".encode())

    async def release(self, req: ReleaseRequest) -> None:
        assert req.session not in self.released
        self.released.append(req.session)
        self._changed.set()
        self._changed = trio.Event()


PRELUDE = textwrap.dedent(
    f"""
    import ctypes, errno, fcntl, json, os, struct, sys, termios
    XFORM, DENY, RESULT, WHO, WAIT, READY, UVM, RESOLVE = {XFORM}, {DENY}, {RESULT}, {WHO}, {WAIT_RELEASES}, {READY}, {UVM_CMD}, {RESOLVE}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    def err(fn, *a):
        try:
            fn(*a)
            return 0
        except OSError as e:
            return e.errno
    def wait_releases(fd, n):
        b = bytearray(struct.pack("=I", n))
        fcntl.ioctl(fd, WAIT, b, True)
        return struct.unpack("=I", b)[0]
    res = {{}}
    """
)


async def run(code: str, broker: FakeBroker, tmp_path, *, on_start=None, **kw):
    """Run a tenant snippet; it sees sys.argv[1] == a scratch path; returns (rc, res, handle)."""
    out = tmp_path / "out.json"
    script = PRELUDE + textwrap.dedent(code) + f"\njson.dump(res, open({str(out)!r}, 'w'))\n"
    argv = [sys.executable, "-c", script, str(tmp_path / "scratch")]
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(
            lambda task_status: sc.run_tenant(
                argv, broker=broker, tenant="t1", task_status=task_status, **kw
            )
        )
        if on_start is not None:
            await on_start(handle)
    res = json.loads(out.read_text()) if out.exists() else {}
    return handle.returncode, res, handle


async def test_ioctls_reach_the_broker(tmp_path):
    b = FakeBroker()
    rc, res, h = await run(
        """
        fd = os.open("/dev/nvidiactl", os.O_RDWR)
        buf = bytearray(b"abcdefghijklmnop")
        res["xform"] = [fcntl.ioctl(fd, XFORM, buf, True), buf.decode()]
        res["deny"] = err(fcntl.ioctl, fd, DENY, bytearray(8), True)
        res["result"] = fcntl.ioctl(fd, RESULT, bytearray(4), True)
        res["unknown"] = err(fcntl.ioctl, fd, F_UNKNOWN := (3 << 30) | (8 << 16) | (0x46 << 8) | 0x99, bytearray(8), True)
        res["efault"] = err(fcntl.ioctl, fd, XFORM, 8)  # pointer 8 is unmapped
        uvm = os.open("/dev/nvidia-uvm", os.O_RDWR | os.O_CLOEXEC)
        ub = ctypes.create_string_buffer(16)
        struct.pack_into("=Q", ub, 0, 0x1234)
        res["uvm"] = [libc.ioctl(uvm, ctypes.c_ulong(UVM), ub), struct.unpack_from("=Q", ub, 8)[0]]
        raw = libc.open(b"/dev/nvidia-uvm", os.O_RDWR)  # os.open always adds O_CLOEXEC
        res["cloexec"] = [bool(fcntl.fcntl(raw, fcntl.F_GETFD) & fcntl.FD_CLOEXEC),
                          bool(fcntl.fcntl(uvm, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)]
        res["tools"] = err(os.open, "/dev/nvidia-uvm-tools", os.O_RDWR)
        res["unlisted"] = err(os.open, "/dev/nvidia7", os.O_RDWR)
        os.chdir("/dev")
        rel = os.open("nvidia0", os.O_RDONLY)
        d = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        at = os.open("dev/../dev//nvidiactl", os.O_RDWR, dir_fd=d)
        # openat2 (no Python wrapper): struct open_how {u64 flags, mode, resolve}
        how = ctypes.create_string_buffer(struct.pack("=QQQ", os.O_RDWR, 0, 0), 24)
        libc.syscall.restype = ctypes.c_long
        o2 = libc.syscall(ctypes.c_long(437), ctypes.c_long(-100), b"/dev/nvidia-uvm", how, ctypes.c_long(24))
        b = bytearray(8)
        who = []
        for f in (fd, rel, at, o2):
            fcntl.ioctl(f, WHO, b, True)
            who.append(struct.unpack("=II", b))
        res["who"] = who
        res["pid"] = os.getpid()
        rb = bytearray(struct.pack("=ii", at, 0))  # one of ours, and stdin
        fcntl.ioctl(fd, RESOLVE, rb, True)
        res["resolved"] = list(struct.unpack("=ii", rb))
        """,
        b,
        tmp_path,
    )
    assert rc == 0, res
    assert res["xform"] == [0, "PONMLKJIHGFEDCBA"]
    assert res["deny"] == errno.EPERM
    assert res["result"] == 7
    assert res["unknown"] == errno.ENOTTY
    assert res["efault"] == errno.EFAULT
    assert res["uvm"] == [0, 0x1234 * 3]
    assert res["cloexec"] == [False, True]
    assert res["tools"] == errno.EACCES
    assert res["unlisted"] == errno.ENOENT  # CONTINUEd: the kernel found no such file
    kinds = [(o.node, o.minor, o.tenant) for o in b.opens]
    assert kinds == [
        (NodeKind.CTL, 0, "t1"), (NodeKind.UVM, 0, "t1"), (NodeKind.UVM, 0, "t1"),
        (NodeKind.UVM_TOOLS, 0, "t1"),
        (NodeKind.GPU, 0, "t1"), (NodeKind.CTL, 0, "t1"), (NodeKind.UVM, 0, "t1"),
    ]
    assert b.opens[0].caller.pid == res["pid"]
    sessions = [s for _, s in res["who"]]
    assert len(set(sessions)) == 4 and set(sessions) <= set(b.sessions)
    assert len(b.sessions) == 6
    assert all(pid == res["pid"] for pid, _ in res["who"])
    assert res["resolved"] == [res["who"][2][1], -1]
    # every session the tenant opened was released once it exited, through the
    # last-reference detection (not the shutdown sweep)
    assert sorted(b.released) == sorted(b.sessions)
    st = h.supervisor.stats
    assert st.released_at_shutdown == 0 and st.released_on_last_close == len(b.sessions)
    assert h.killable_wait


async def test_other_fds_keep_working(tmp_path):
    blksize = os.statvfs(sys.executable).f_bsize
    b = FakeBroker()
    rc, res, h = await run(
        """
        m, s = os.openpty()
        res["tcgets"] = len(termios.tcgetattr(s))
        r, wr = os.pipe()
        os.write(wr, b"xyz")
        n = bytearray(4)
        fcntl.ioctl(r, termios.FIONREAD, n, True)
        res["fionread"] = struct.unpack("=i", n)[0]
        # an 'F' ioctl and a UVM-range ioctl on fds that are not ours: the filter sends them
        # to the supervisor, which CONTINUEs them to the kernel
        res["pipe_F"] = err(fcntl.ioctl, r, (3 << 30) | (8 << 16) | (0x46 << 8) | 1, bytearray(8), True)
        f = os.open(sys.executable, os.O_RDONLY)
        bs = bytearray(4)
        fcntl.ioctl(f, 2, bs, True)  # FIGETBSZ
        res["figetbsz"] = struct.unpack("=i", bs)[0]
        # a plain file mmap (CONTINUEd) and an anonymous one (never notified)
        mm = libc.mmap(None, 4096, 1, 2, f, 0)
        res["elf"] = ctypes.string_at(mm, 4).hex()
        res["anon"] = libc.mmap(None, 4096, 3, 0x22, -1, 0) not in (None, 2**64 - 1)
        res["mknod_chr"] = err(os.mknod, sys.argv[1] + ".chr", 0o20666, os.makedev(195, 255))
        res["mknod_blk"] = err(os.mknod, sys.argv[1] + ".blk", 0o60666, os.makedev(7, 0))
        res["mknod_fifo"] = err(os.mknod, sys.argv[1] + ".fifo", 0o10666, 0)
        res["mknodat_chr"] = err(lambda: os.mknod("x.chr", 0o20666, os.makedev(195, 0), dir_fd=os.open(os.path.dirname(sys.argv[1]), os.O_RDONLY)))
        res["chr_exists"] = os.path.exists(sys.argv[1] + ".chr")
        """,
        b,
        tmp_path,
    )
    assert rc == 0, res
    assert res["tcgets"] == 7
    assert res["fionread"] == 3
    assert res["pipe_F"] == errno.ENOTTY
    assert res["figetbsz"] == blksize
    assert res["elf"] == "7f454c46"
    assert res["anon"] is True
    assert res["mknod_chr"] == errno.EPERM
    assert res["mknod_blk"] == errno.EPERM
    assert res["mknodat_chr"] == errno.EPERM
    assert res["mknod_fifo"] == 0
    assert res["chr_exists"] is False
    assert b.opens == [] and b.ioctls == []
    st = h.supervisor.stats
    assert st.ioctls_continued >= 2 and st.mmaps_continued >= 1 and st.opens_continued >= 1



@pytest.mark.parametrize("in_kernel", [False, True])
async def test_in_kernel_commands_never_reach_the_supervisor(tmp_path, in_kernel):
    """A real-file tenant's in-kernel UVM rows (FilterOptions.kernel_ioctls, loaded into the
    kernel here): the kernel runs those numbers without a notification, on any fd, while
    every other NVIDIA-looking number still stops at the supervisor. FIGETBSZ is 2, a UVM
    raw number: listed, its five calls are never notified; not listed, each one is (and is
    CONTINUEd: the answer is the same)."""
    blksize = os.statvfs(sys.executable).f_bsize
    b = FakeBroker()
    rc, res, h = await run(
        """
        f = os.open(sys.executable, os.O_RDONLY)
        got = set()
        for _ in range(5):
            bs = bytearray(4)
            fcntl.ioctl(f, 2, bs, True)  # FIGETBSZ
            got.add(struct.unpack("=i", bs)[0])
        res["figetbsz"] = sorted(got)
        r, wr = os.pipe()
        res["pipe_3"] = err(fcntl.ioctl, r, 3, bytearray(8), True)  # UVM number 3: not listed
        """,
        b,
        tmp_path,
        opts=w.FilterOptions(kernel_ioctls=(2,) if in_kernel else ()),
    )
    assert rc == 0, res
    assert res["figetbsz"] == [blksize]
    assert res["pipe_3"] == errno.ENOTTY
    assert b.ioctls == []
    # notified and CONTINUEd: the unlisted number once, FIGETBSZ five times unless listed
    assert h.supervisor.stats.ioctls_continued == (1 if in_kernel else 6)


async def test_mmap_of_a_node_is_served(tmp_path):
    b = FakeBroker()
    rc, res, h = await run(
        """
        g = os.open("/dev/nvidia0", os.O_RDWR)
        a = libc.mmap(None, 4096, 1, 1, g, 0)  # PROT_READ, MAP_SHARED
        res["page"] = ctypes.string_at(a, 32).rstrip(b"\\0").decode()
        w = libc.mmap(None, 8192, 3, 1, g, 0)  # read-write, two pages
        ctypes.memmove(w + 4096, b"tenant", 6)
        res["rw"] = ctypes.string_at(w, 24).rstrip(b"\\0").decode()
        res["shared"] = ctypes.string_at(a, 4096) == ctypes.string_at(w, 4096)
        c = os.open("/dev/nvidiactl", os.O_RDWR)
        libc.mmap.restype = ctypes.c_long
        r = libc.mmap(None, 4096, 1, 1, c, 0)
        res["ctl_map"] = [r, ctypes.get_errno()]
        fcntl.ioctl(c, WHO, bytearray(8), True)  # the fd still works after the failed mmap
        """,
        b,
        tmp_path,
    )
    assert rc == 0, res
    gpu = next(sid for sid, o in b.sessions.items() if o.node == NodeKind.GPU)
    assert res["page"] == f"page of session {gpu} @0"
    assert res["rw"] == f"page of session {gpu} @0"
    assert res["shared"] is True
    assert res["ctl_map"] == [-1, errno.EINVAL]
    assert h.supervisor.stats.mmaps == 3


async def test_mmap_of_a_placeholder_not_its_own_is_refused(tmp_path):
    """A tenant maps what a file IS: its own session's placeholder, or a file that is no
    broker's. Another tenant's placeholder (passed over a socket: a memfd by the broker's
    name, as the one made here stands for) is refused EACCES; a memfd of its own is not."""
    b = FakeBroker()
    rc, res, h = await run(
        """
        libc.mmap.restype = ctypes.c_long
        def map_of(fd):
            r = libc.mmap(None, 4096, 3, 1, fd, 0)  # PROT_RW, MAP_SHARED
            return ctypes.get_errno() if r == -1 else ctypes.string_at(r, 19).decode()
        foreign = os.memfd_create("devbroker:nvidia0")
        os.pwrite(foreign, b"ALICE-PAGE-CONTENTS", 0)
        os.ftruncate(foreign, 4096)
        res["foreign"] = map_of(foreign)
        mine = os.memfd_create("scratch")
        os.pwrite(mine, b"MY-OWN-PAGE-CONTENT", 0)
        os.ftruncate(mine, 4096)
        res["mine"] = map_of(mine)
        g = os.open("/dev/nvidia0", os.O_RDWR)
        res["own_node"] = map_of(g)
        """,
        b,
        tmp_path,
    )
    assert rc == 0, res
    assert res["foreign"] == errno.EACCES
    assert res["mine"] == "MY-OWN-PAGE-CONTENT"
    assert res["own_node"].startswith("page of session")
    assert h.supervisor.stats.refused_foreign == 1


async def test_sessions_end_with_the_last_reference(tmp_path):
    b = FakeBroker()
    rc, res, h = await run(
        """
        ctl = os.open("/dev/nvidiactl", os.O_RDWR)
        p = os.open("/dev/nvidia0", os.O_RDWR)
        os.close(p)
        res["after_close"] = wait_releases(ctl, 1)
        # a dup keeps the open file alive
        a = os.open("/dev/nvidia0", os.O_RDWR)
        a2 = os.dup(a)
        os.close(a)
        b = bytearray(8)
        fcntl.ioctl(a2, WHO, b, True)
        res["dup_session"] = struct.unpack("=II", b)[1]
        # a child inherits it too; the child's ioctls name the child as caller
        pid = os.fork()
        if pid == 0:
            fcntl.ioctl(a2, WHO, b, True)
            os._exit(0 if struct.unpack("=II", b)[0] == os.getpid() else 1)
        res["child"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        os.close(a2)
        res["after_dup_close"] = wait_releases(ctl, 2)
        # a mapping keeps it alive after the last close; munmap ends it
        m = os.open("/dev/nvidia0", os.O_RDWR)
        addr = libc.mmap(None, 4096, 1, 1, m, 0)
        os.close(m)
        q = os.open("/dev/nvidia1", os.O_RDWR)  # a probe: its release is queued after m's
        os.close(q)
        res["mapped"] = wait_releases(ctl, 3)
        fcntl.ioctl(ctl, WHO, b, True)
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap(addr, 4096)
        res["unmapped"] = wait_releases(ctl, 4)
        """,
        b,
        tmp_path,
        nodes=sc.default_nodes(2),
    )
    assert rc == 0, res
    sess = list(b.sessions)
    ctl, p, a, m, q = sess
    assert res["after_close"] == 1 and b.released[0] == p
    assert res["dup_session"] == a and res["child"] == 0
    assert res["after_dup_close"] == 2 and b.released[1] == a
    assert res["mapped"] == 3 and b.released[2] == q  # m survived its close (still mapped)
    assert res["unmapped"] == 4 and b.released[3] == m
    assert b.released[4] == ctl  # at exit
    assert h.supervisor.stats.released_at_shutdown == 0


async def test_sigkill_releases_every_session(tmp_path):
    b = FakeBroker()

    async def kill_when_ready(handle: sc.Tenant) -> None:
        with trio.fail_after(30):
            await b.ready.wait()
        assert b.released == []
        handle.process.send_signal(signal.SIGKILL)

    rc, res, h = await run(
        """
        fds = [os.open(p, os.O_RDWR) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm")]
        addr = libc.mmap(None, 4096, 1, 1, fds[1], 0)
        os.close(fds[1])
        parent = os.getpid()
        r, w = os.pipe()
        pid = os.fork()  # a child that inherits every fd and dies with its parent
        if pid == 0:
            libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
            if os.getppid() != parent:
                os._exit(0)
            os.write(w, b"x")
            import time
            while True:
                time.sleep(1)
        os.read(r, 1)
        fcntl.ioctl(fds[0], READY, bytearray(4), True)
        import time
        time.sleep(600)
        """,
        b,
        tmp_path,
        on_start=kill_when_ready,
    )
    assert rc == -signal.SIGKILL
    assert len(b.sessions) == 3
    assert sorted(b.released) == sorted(b.sessions)
    assert h.supervisor.stats.released_at_shutdown == 0


async def test_threads_call_concurrently(tmp_path):
    b = FakeBroker()
    rc, res, h = await run(
        """
        import threading
        bad = []
        def worker(i):
            fd = os.open("/dev/nvidiactl", os.O_RDWR)
            for j in range(25):
                src = ("%02d-%02d-abcdefghij" % (i, j)).encode()
                buf = bytearray(src)
                fcntl.ioctl(fd, XFORM, buf, True)
                if bytes(buf) != bytes(c ^ 0x20 for c in src)[::-1]:
                    bad.append((i, j))
            os.close(fd)
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        res["bad"] = bad
        """,
        b,
        tmp_path,
    )
    assert rc == 0 and res["bad"] == []
    assert len(b.sessions) == 4 and sorted(b.released) == sorted(b.sessions)
    assert len({r.caller.tid for r in b.ioctls}) == 4
    assert len({r.caller.pid for r in b.ioctls}) == 1


async def test_cancelling_the_supervisor_kills_the_tenant(tmp_path):
    b = FakeBroker()
    with trio.move_on_after(30) as outer:
        async with trio.open_nursery() as nursery:
            h = await nursery.start(
                lambda task_status: sc.run_tenant(
                    [sys.executable, "-c", PRELUDE + textwrap.dedent(
                        f"""
                        fd = os.open("/dev/nvidiactl", os.O_RDWR)
                        fcntl.ioctl(fd, READY, bytearray(4), True)
                        import time
                        time.sleep(600)
                        """)],
                    broker=b, tenant="t1", task_status=task_status,
                )
            )
            await b.ready.wait()
            nursery.cancel_scope.cancel()
    assert not outer.cancelled_caught
    assert h.process.returncode == -signal.SIGKILL
    assert sorted(b.released) == sorted(b.sessions) and len(b.sessions) == 1


class _BuggyLane:
    """A control lane with a bug: admission raises."""

    def ioctl_cmds(self, versions):
        return frozenset({F(0x2A, 32)})  # NV_ESC_RM_CONTROL

    def admit(self, *args):
        raise RuntimeError("a bug in the control lane")


async def test_a_bug_costs_one_call_not_the_listener(tmp_path):
    """An exception while a listener thread answers a notification answers that call EIO
    and leaves the thread serving (before, it ended the thread and the tenant hung)."""
    b = FakeBroker()
    b.control_lane = _BuggyLane()
    rc, res, h = await run(
        f"""
        fd = os.open("/dev/nvidiactl", os.O_RDWR)
        res["buggy"] = err(fcntl.ioctl, fd, {F(0x2A, 32)}, bytearray(32), True)
        buf = bytearray(b"abcdefghijklmnop")
        res["after"] = [fcntl.ioctl(fd, XFORM, buf, True), buf.decode()]
        res["again"] = err(fcntl.ioctl, fd, {F(0x2A, 32)}, bytearray(32), True)
        """,
        b,
        tmp_path,
    )
    assert rc == 0, res
    assert res["buggy"] == errno.EIO and res["again"] == errno.EIO, res
    assert res["after"] == [0, "PONMLKJIHGFEDCBA"]


def test_extra_listener_threads_coming_back_together_leave_one_to_answer():
    """The watchdog starts extra listener threads while every thread is held up (a tenant's
    stalled page); when the stall clears they come back together and each asks
    `_surplus` whether to retire. Before a thread had counted itself out, the next one saw
    the same surplus: with one base thread and one extra both left, and the tenant's next
    call waited forever (the escape harness's tenant hung in CI after `uffd-ptr`). Each
    thread asks here from its own OS thread, before either has counted itself out."""
    import threading

    sup = sc.SeccompSupervisor.__new__(sc.SeccompSupervisor)
    sup.threads, sup._serving, sup._threads_lock = 1, {}, threading.Lock()
    sup._listener_tids = set()
    for live, leave in ((2, 1), (3, 2), (1, 0)):
        sup._live, sup._leaving = live, 0
        said = []
        for _ in range(live):  # every live thread asks, none has left yet
            t = threading.Thread(target=lambda: said.append(sup._surplus()))
            t.start()
            t.join()
        assert said.count(True) == leave, (live, said)
        for retired in said:  # those told to retire count themselves out on their way
            if retired:
                sup._count_out(True)
        assert sup._live == sup.threads and sup._leaving == 0


def test_a_late_release_leaves_a_file_that_reuses_the_identity_known():
    """Under load a tenant's own file was refused as "an NVIDIA device
    file the broker did not give out". The release of a closed session, read late off the
    inotify queue, took whatever session its identity (st_dev, st_ino) or watch number
    named out of the lookups: a later file of the tenant's registered meanwhile with the
    same identity was then unknown, and its calls refused. A release now takes out only its
    own session. (Real supervisor state, its own release path, no listener threads.)"""
    from devbroker.abi.nodes import NodeKind

    class Broker:
        released = []

        async def release(self, req):
            self.released.append(req.session)

    sup = sc.SeccompSupervisor.__new__(sc.SeccompSupervisor)
    sup.sessions, sup._by_wd, sup._ifd = {}, {}, -1
    sup._changed, sup.broker = trio.Event(), Broker()
    old = sc.Session(1, NodeKind.GPU, 0, (0x2A, 77), 5, (100, 9), real=True)
    new = sc.Session(2, NodeKind.GPU, 0, (0x2A, 77), 6, (100, 9), real=True)
    sup.sessions[old.key] = old
    sup._by_wd[old.wd] = old
    sup._by_wd.pop(old.wd)  # (the event was read: _note_events)
    sup.sessions[new.key] = new  # a new file with the same identity is registered
    sup._by_wd[new.wd] = new
    trio.run(sup._release, old)
    assert Broker.released == [1] and old.released
    assert sup.sessions.get(new.key) is new and sup._by_wd.get(new.wd) is new
    assert sup._looked(0x2A, 77, 0o20666, os.makedev(195, 0)) == (new, False)
