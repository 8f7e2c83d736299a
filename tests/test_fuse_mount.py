"""Real FUSE mounts: real tenant processes open, ioctl, mmap and poll the node files.

Run as a script (``python tests/test_fuse_mount.py serve MOUNT MARKERS``) it is also the
broker process that the kill/restart tests SIGKILL.
"""
from __future__ import annotations

import errno
import json
import os
import select
import signal
import struct
import sys
import textwrap

import pytest
import trio

from devbroker.abi.nodes import NodeKind
from devbroker.broker.interface import (
    IoctlReply,
    MapReadReply,
    OpenReply,
)
from devbroker.frontends import fusewire as w
from devbroker.frontends.common import WHOAMI_IOCTL
from devbroker.frontends.fuse import FuseFrontend, detach_stale_mount
from devbroker.frontends.fusetree import NodeSpec, TenantTree

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="FUSE mounts need root"),
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing"),
]

F = ord("F")
CMD_XOR = w.ioc(w.IOC_READ | w.IOC_WRITE, F, 0x2A, 16)  # echo: every byte inverted
CMD_SLOW = w.ioc(w.IOC_READ | w.IOC_WRITE, F, 0x50, 8)  # waits until CMD_FAST arrives
CMD_FAST = w.ioc(w.IOC_READ | w.IOC_WRITE, F, 0x51, 8)
CMD_FDARG = w.ioc(w.IOC_READ | w.IOC_WRITE, F, 0xC9, 8)  # {fd:i32, pad} -> session of that fd
CMD_BOOM = w.ioc(w.IOC_READ | w.IOC_WRITE, F, 0x52, 8)  # the broker raises
CMD_UVM = 0x30000001  # a bare UVM-style number: no size, no direction
UVM_SMALL = 0x17


class EchoBroker:
    """A BrokerInterface that does real work on the data it is given, and records it."""

    def __init__(self, marker_dir: str | None = None):
        self.next_session = 100
        self.opens = []
        self.ioctls = []
        self.reads = []
        self.releases = []
        self.fast_seen = trio.Event()
        self.marker_dir = marker_dir

    async def open(self, req):
        self.opens.append(req)
        if req.node is NodeKind.GPU and req.minor == 7:
            return OpenReply(errno=errno.EPERM)
        self.next_session += 1
        return OpenReply(session=self.next_session)

    async def ioctl(self, req):
        self.ioctls.append(req)
        if req.cmd == CMD_XOR:
            return IoctlReply(result=0, arg_out=bytes(b ^ 0xFF for b in req.arg))
        if req.cmd == CMD_SLOW:
            if self.marker_dir:
                open(os.path.join(self.marker_dir, "slow-started"), "w").close()
            await self.fast_seen.wait()
            return IoctlReply(result=1, arg_out=b"slow-ok!")
        if req.cmd == CMD_FAST:
            self.fast_seen.set()
            return IoctlReply(result=2, arg_out=b"fast-ok!")
        if req.cmd == CMD_FDARG:
            (fd,) = struct.unpack_from("<i", req.arg)
            sid = await req.resolve_fd(fd)
            return IoctlReply(arg_out=struct.pack("<iI", fd, 0xFFFFFFFF if sid is None else sid))
        if req.cmd == CMD_BOOM:
            raise RuntimeError("broker bug")
        if req.cmd in (CMD_UVM, UVM_SMALL) and req.arg is None:
            # The UVM path: the argument lives only in the tenant's memory.
            value, _status = struct.unpack("<QI4x", req.memory.read(req.arg_ptr, 16))
            req.memory.write(req.arg_ptr, struct.pack("<QI4x", value * 2, 0x1234))
            return IoctlReply(result=0)
        return IoctlReply(errno=errno.ENOTTY)

    async def map_read(self, req):
        self.reads.append(req)
        text = f"session={req.session} offset={req.offset} len={req.length}".encode()
        return MapReadReply(data=text)

    async def release(self, req):
        self.releases.append(req)


def tenant_code(body: str) -> str:
    prelude = textwrap.dedent(f"""
        import os, sys, json, fcntl, struct, mmap, select, ctypes, errno, time, threading
        CMD_XOR, CMD_SLOW, CMD_FAST, CMD_FDARG, CMD_BOOM = {CMD_XOR}, {CMD_SLOW}, {CMD_FAST}, {CMD_FDARG}, {CMD_BOOM}
        CMD_UVM, UVM_SMALL = {CMD_UVM}, {UVM_SMALL}
        _libc = ctypes.CDLL(None, use_errno=True)
        def raw_ioctl(fd, cmd, addr):
            # fcntl.ioctl passes an int argument as a C int; a pointer needs the real call
            r = _libc.ioctl(fd, ctypes.c_ulong(cmd), ctypes.c_void_p(addr))
            if r < 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            return r
        def wait_for(path, limit=20):
            end = time.time() + limit
            while not os.path.exists(path):
                if time.time() > end: raise SystemExit("timed out waiting for " + path)
                time.sleep(0.01)
    """)
    return prelude + textwrap.dedent(body)


async def run_tenant(body: str, *, timeout: float = 30) -> dict:
    with trio.fail_after(timeout):
        p = await trio.run_process([sys.executable, "-c", tenant_code(body)], check=False,
                                   capture_stdout=True, capture_stderr=True)
    assert p.returncode == 0, p.stderr.decode()
    return json.loads(p.stdout.decode().strip().splitlines()[-1])


PROC_FILES = {
    "proc/driver/nvidia/version": "NVRM version: NVIDIA UNIX Open Kernel Module  580.159.04\n",
    "proc/driver/nvidia/params": b"ModifyDeviceFiles: 0\n",
    "proc/driver/nvidia/gpus/0000:00:06.0/information": lambda: "Model: \t\t NVIDIA H200\n",
}


@pytest.fixture
async def served(tmp_path):
    broker = EchoBroker()
    mnt = tmp_path / "nodes"
    tenants = {"alpha": TenantTree.standard(2, PROC_FILES), "beta": TenantTree.standard([7])}
    async with FuseFrontend(mnt, broker, tenants) as fe:
        yield fe, broker, str(mnt)


async def test_tree_and_static_files(served):
    fe, broker, mnt = served
    out = await run_tenant(f"""
        m = {mnt!r}
        res = {{"top": sorted(os.listdir(m)), "alpha": sorted(os.listdir(m + "/alpha")),
               "beta": sorted(os.listdir(m + "/beta"))}}
        st = os.stat(m + "/alpha/nvidiactl")
        res["node"] = [oct(st.st_mode), st.st_size, st.st_uid]
        res["version"] = open(m + "/alpha/proc/driver/nvidia/version").read()
        res["info"] = open(m + "/alpha/proc/driver/nvidia/gpus/0000:00:06.0/information").read()
        res["params_size"] = os.stat(m + "/alpha/proc/driver/nvidia/params").st_size
        try:
            open(m + "/alpha/proc/driver/nvidia/params", "w")
        except OSError as e:
            res["write_static"] = e.errno
        try:
            os.stat(m + "/gamma")
        except OSError as e:
            res["missing"] = e.errno
        print(json.dumps(res))
    """)
    assert out["top"] == ["alpha", "beta"]
    assert out["alpha"] == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia1", "nvidiactl", "proc"]
    assert out["beta"] == ["nvidia-uvm", "nvidia-uvm-tools", "nvidia7", "nvidiactl"]
    assert out["node"] == ["0o100666", 1 << 40, 0]
    assert out["version"] == PROC_FILES["proc/driver/nvidia/version"]
    assert out["info"] == "Model: \t\t NVIDIA H200\n"
    assert out["params_size"] == len(b"ModifyDeviceFiles: 0\n")
    assert out["write_static"] == errno.EACCES
    assert out["missing"] == errno.ENOENT
    assert broker.opens == []  # static files and listings never reach the broker


async def test_open_ioctl_uvm_mmap_poll_close(served):
    fe, broker, mnt = served
    out = await run_tenant(f"""
        m = {mnt!r}
        res = {{"pid": os.getpid()}}
        fd = os.open(m + "/alpha/nvidia1", os.O_RDWR)
        buf = bytearray(range(16))
        res["xor_result"] = fcntl.ioctl(fd, CMD_XOR, buf, True)
        res["xor"] = list(buf)
        arg = ctypes.create_string_buffer(struct.pack("<QI4x", 21, 0), 16)
        res["uvm_ptr"] = ctypes.addressof(arg)
        res["uvm_result"] = raw_ioctl(fd, CMD_UVM, ctypes.addressof(arg))
        res["uvm"] = list(struct.unpack("<QI4x", arg.raw))
        arg2 = ctypes.create_string_buffer(struct.pack("<QI4x", 5, 0), 16)
        raw_ioctl(fd, UVM_SMALL, ctypes.addressof(arg2))
        res["uvm_small"] = list(struct.unpack("<QI4x", arg2.raw))
        mp = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ)
        res["page0"] = mp[:64].rstrip(b"\\0").decode()
        res["page1"] = mp[4096:4096 + 64].rstrip(b"\\0").decode()
        mp.close()
        p = select.poll(); p.register(fd, select.POLLIN)
        res["poll"] = p.poll(5000)[0][1]
        os.close(fd)
        try:
            os.open(m + "/beta/nvidia7", os.O_RDWR)
        except OSError as e:
            res["denied"] = e.errno
        print(json.dumps(res))
    """)
    pid = out["pid"]
    (o,) = [r for r in broker.opens if r.tenant == "alpha"]
    assert (o.node, o.minor, o.caller.pid, o.caller.tid, o.caller.uid) == (NodeKind.GPU, 1, pid, pid, 0)
    assert o.flags & os.O_ACCMODE == os.O_RDWR
    session = 101  # the first session the broker hands out
    assert out["xor_result"] == 0 and out["xor"] == [b ^ 0xFF for b in range(16)]
    xor_req, uvm_req, small_req = broker.ioctls
    assert (xor_req.session, xor_req.cmd, xor_req.arg) == (session, CMD_XOR, bytes(range(16)))
    assert xor_req.caller.pid == pid
    # bare-number command: no bytes from the kernel, the pointer and the memory instead
    assert uvm_req.cmd == CMD_UVM and uvm_req.arg is None and uvm_req.arg_ptr == out["uvm_ptr"]
    assert out["uvm_result"] == 0 and out["uvm"] == [42, 0x1234]
    assert small_req.arg is None and out["uvm_small"] == [10, 0x1234]
    assert out["page0"] == f"session={session} offset=0 len=4096"
    assert out["page1"] == f"session={session} offset=4096 len=4096"
    assert [(r.session, r.offset, r.length) for r in broker.reads] == [(session, 0, 4096), (session, 4096, 4096)]
    assert out["poll"] & select.POLLIN
    assert [r.session for r in broker.releases] == [session]
    assert out["denied"] == errno.EPERM


async def test_fresh_open_does_not_see_other_contexts_pages(served):
    fe, broker, mnt = served
    out = await run_tenant(f"""
        m = {mnt!r} + "/alpha/nvidiactl"
        pages = []
        fds = []
        for i in range(2):
            fd = os.open(m, os.O_RDWR)
            mp = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
            pages.append(mp[:40].rstrip(b"\\0").decode())
            mp.close()
            os.close(fd)
        # a context opened while another's page is cached and mapped sees its own page
        a = os.open(m, os.O_RDWR); ma = mmap.mmap(a, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
        first_a = ma[:40].rstrip(b"\\0").decode()
        b = os.open(m, os.O_RDWR); mb = mmap.mmap(b, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
        pages.append(mb[:40].rstrip(b"\\0").decode())
        pages.append(first_a)
        print(json.dumps(pages))
    """)
    s = list(range(101, 101 + len(broker.opens)))  # sessions in open order
    assert out[0].startswith(f"session={s[0]} ") and out[1].startswith(f"session={s[1]} ")
    assert out[2].startswith(f"session={s[3]} ") and out[3].startswith(f"session={s[2]} ")


async def test_slow_ioctl_does_not_block_another_tenant(served):
    fe, broker, mnt = served
    async with trio.open_nursery() as n:
        results = {}

        async def slow():
            results["slow"] = await run_tenant(f"""
                fd = os.open({mnt!r} + "/alpha/nvidiactl", os.O_RDWR)
                buf = bytearray(8)
                r = fcntl.ioctl(fd, CMD_SLOW, buf, True)
                print(json.dumps([r, bytes(buf).decode()]))
            """)

        n.start_soon(slow)
        with trio.fail_after(20):
            while not any(r.cmd == CMD_SLOW for r in broker.ioctls):
                await trio.sleep(0.01)
        # If requests were served one at a time, the fast call would wait behind the
        # slow one forever and the subprocess timeout would fail the test.
        results["fast"] = await run_tenant(f"""
            fd = os.open({mnt!r} + "/beta/nvidiactl", os.O_RDWR)
            buf = bytearray(8)
            r = fcntl.ioctl(fd, CMD_FAST, buf, True)
            print(json.dumps([r, bytes(buf).decode()]))
        """)
    assert results == {"slow": [1, "slow-ok!"], "fast": [2, "fast-ok!"]}


async def test_broker_exception_is_eio_and_server_survives(served):
    fe, broker, mnt = served
    out = await run_tenant(f"""
        fd = os.open({mnt!r} + "/alpha/nvidiactl", os.O_RDWR)
        res = {{}}
        try:
            fcntl.ioctl(fd, CMD_BOOM, bytearray(8), True)
        except OSError as e:
            res["boom"] = e.errno
        try:
            fcntl.ioctl(fd, 0x4004AB01, bytearray(4), True)
        except OSError as e:
            res["unknown"] = e.errno
        buf = bytearray(16)
        fcntl.ioctl(fd, CMD_XOR, buf, True)
        res["after"] = buf[0]
        print(json.dumps(res))
    """)
    assert out == {"boom": errno.EIO, "unknown": errno.ENOTTY, "after": 0xFF}


async def test_tree_changes_at_run_time(served):
    fe, broker, mnt = served
    listing = """
        m = {mnt!r}
        def ls(p):
            try:
                return sorted(os.listdir(p))
            except OSError as e:
                return e.errno
        def cat(p):
            try:
                return open(p).read()
            except OSError as e:
                return e.errno
        print(json.dumps([ls(m), ls(m + "/beta"), ls(m + "/gamma"),
                          cat(m + "/alpha/proc/driver/nvidia/params")]))
    """.format(mnt=mnt)
    before = await run_tenant(listing)
    assert before[0] == ["alpha", "beta"] and before[2] == errno.ENOENT
    trees = fe.tenants()
    del trees["beta"]
    trees["gamma"] = TenantTree.standard(1, extra_nodes={"nvidia-caps/nvidia-cap1": NodeSpec(NodeKind.CAP, 1)})
    trees["alpha"] = TenantTree(nodes=trees["alpha"].nodes,
                                files={**trees["alpha"].files, "proc/driver/nvidia/params": "ModifyDeviceFiles: 1\n"})
    alpha_ctl = fe._find("alpha", "nvidiactl").nodeid
    await fe.set_tenants(trees)
    after = await run_tenant(listing)
    assert after[0] == ["alpha", "gamma"]
    assert after[1] == errno.ENOENT
    assert after[2] == ["nvidia-caps", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidiactl"]
    assert after[3] == "ModifyDeviceFiles: 1\n"
    assert fe._find("alpha", "nvidiactl").nodeid == alpha_ctl  # unchanged nodes keep their inode
    # the sync form the daemon uses, with the plain dict description
    fe.set_tree({"delta": {"gpus": [3], "uvm": False, "proc": {"version": b"v\n"}}})
    await trio.sleep(0.1)
    out = await run_tenant(f"""
        m = {mnt!r}
        print(json.dumps([sorted(os.listdir(m)), sorted(os.listdir(m + "/delta")),
                          open(m + "/delta/proc/driver/nvidia/version").read()]))
    """)
    assert out == [["delta"], ["nvidia3", "nvidiactl", "proc"], "v\n"]


async def test_resolve_fd(served):
    fe, broker, mnt = served
    marker_dir = os.path.dirname(mnt)
    async with trio.open_nursery() as n:
        result = {}

        async def tenant():
            result["t"] = await run_tenant(f"""
                ctl = os.open({mnt!r} + "/alpha/nvidiactl", os.O_RDWR)
                gpu = os.open({mnt!r} + "/alpha/nvidia0", os.O_RDWR)
                static = os.open({mnt!r} + "/alpha/proc/driver/nvidia/version", os.O_RDONLY)
                other = os.open("/dev/null", os.O_RDONLY)
                buf = bytearray(struct.pack("<iI", ctl, 0))
                fcntl.ioctl(gpu, CMD_FDARG, buf, True)   # the broker resolves ctl's fd
                via_ioctl = list(struct.unpack("<iI", buf))
                buf = bytearray(struct.pack("<iI", other, 0))
                fcntl.ioctl(gpu, CMD_FDARG, buf, True)
                via_ioctl_other = list(struct.unpack("<iI", buf))
                # the private ioctl is not answered for a tenant: it goes to the broker
                try:
                    fcntl.ioctl(ctl, {WHOAMI_IOCTL}, bytearray(8), True)
                    whoami = 0
                except OSError as e:
                    whoami = e.errno
                with open({marker_dir!r} + "/fds.json", "w") as f:
                    json.dump([os.getpid(), ctl, gpu, static, other], f)
                wait_for({marker_dir!r} + "/done")
                print(json.dumps([via_ioctl, via_ioctl_other, whoami]))
            """)

        n.start_soon(tenant)
        path = os.path.join(marker_dir, "fds.json")
        with trio.fail_after(20):
            while not os.path.exists(path):
                await trio.sleep(0.01)
        await trio.sleep(0.05)
        pid, ctl, gpu, static, other = json.load(open(path))
        sessions = {r.node: s for r, s in zip(broker.opens, range(101, 200))}
        got = [await fe.resolve_fd(pid, fd) for fd in (ctl, gpu, static, other, 999)]
        open(os.path.join(marker_dir, "done"), "w").close()
    assert got == [sessions[NodeKind.CTL], sessions[NodeKind.GPU], None, None, None]
    via_ioctl, via_ioctl_other, whoami = result["t"]
    assert via_ioctl == [ctl, sessions[NodeKind.CTL]]
    assert via_ioctl_other == [other, 0xFFFFFFFF]
    assert whoami == errno.ENOTTY
    assert await fe.resolve_fd(pid, ctl) is None  # the process has exited


# --- broker death and restart: the broker runs in its own process here ---------------------
async def _start_server(mnt: str, markers: str) -> trio.Process:
    proc = await trio.lowlevel.open_process(
        [sys.executable, __file__, "serve", mnt, markers])
    ready = os.path.join(markers, "ready")
    with trio.fail_after(20):
        while not os.path.exists(ready):
            assert proc.poll() is None, "server exited early"
            await trio.sleep(0.01)
    os.unlink(ready)
    return proc


async def test_broker_death_gives_enotconn_and_restart_recovers(tmp_path):
    mnt, markers = str(tmp_path / "nodes"), str(tmp_path)
    server = await _start_server(mnt, markers)
    try:
        async with trio.open_nursery() as n:
            res = {}

            async def idle_tenant():
                res["idle"] = await run_tenant(f"""
                    fd = os.open({mnt!r} + "/alpha/nvidiactl", os.O_RDWR)
                    buf = bytearray(16); fcntl.ioctl(fd, CMD_XOR, buf, True)
                    open({markers!r} + "/idle-ready", "w").close()
                    wait_for({markers!r} + "/killed")
                    out = {{}}
                    try:
                        fcntl.ioctl(fd, CMD_XOR, bytearray(16), True)
                    except OSError as e:
                        out["next_ioctl"] = e.errno
                    try:
                        os.open({mnt!r} + "/alpha/nvidia0", os.O_RDWR)
                    except OSError as e:
                        out["next_open"] = e.errno
                    print(json.dumps(out))
                """)

            async def pending_tenant():
                res["pending"] = await run_tenant(f"""
                    fd = os.open({mnt!r} + "/alpha/nvidia0", os.O_RDWR)
                    try:
                        fcntl.ioctl(fd, CMD_SLOW, bytearray(8), True)
                        print(json.dumps({{"pending": 0}}))
                    except OSError as e:
                        print(json.dumps({{"pending": e.errno}}))
                """)

            n.start_soon(idle_tenant)
            n.start_soon(pending_tenant)
            with trio.fail_after(20):
                while not (os.path.exists(markers + "/idle-ready") and os.path.exists(markers + "/slow-started")):
                    await trio.sleep(0.01)
            server.send_signal(signal.SIGKILL)
            await server.wait()
            open(markers + "/killed", "w").close()
        assert res["idle"] == {"next_ioctl": errno.ENOTCONN, "next_open": errno.ENOTCONN}
        # A call in flight when the server dies is aborted by the kernel (ECONNABORTED).
        assert res["pending"]["pending"] == errno.ECONNABORTED
        with pytest.raises(OSError) as ei:
            os.statvfs(mnt)  # always reaches the (dead) connection, unlike cached stat
        assert ei.value.errno == errno.ENOTCONN

        # Restart over the stale mount: it is detached first, then served afresh.
        broker = EchoBroker()
        async with FuseFrontend(mnt, broker, {"alpha": TenantTree.standard(1)}):
            out = await run_tenant(f"""
                fd = os.open({mnt!r} + "/alpha/nvidiactl", os.O_RDWR)
                buf = bytearray(16); fcntl.ioctl(fd, CMD_XOR, buf, True)
                print(json.dumps(list(buf[:2])))
            """)
            assert out == [0xFF, 0xFF] and len(broker.opens) == 1
            # a second front end on a live mount is refused rather than hijacking it
            with pytest.raises(OSError) as ei:
                async with FuseFrontend(mnt, EchoBroker()):
                    pass
            assert ei.value.errno == errno.EBUSY
        # clean exit: nothing left mounted there
        assert not any(line.split()[4] == mnt for line in open("/proc/self/mountinfo"))
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()
        try:  # never leave a dead mount behind for the next run
            await trio.to_thread.run_sync(detach_stale_mount, mnt)
        except OSError:
            pass


async def test_clean_shutdown_fails_open_files_with_enotconn(tmp_path):
    mnt = str(tmp_path / "nodes")
    fe = FuseFrontend(mnt, EchoBroker(), {"alpha": TenantTree.standard(1)})
    async with trio.open_nursery() as n:
        res = {}

        async def tenant():
            res["t"] = await run_tenant(f"""
                fd = os.open({mnt!r} + "/alpha/nvidiactl", os.O_RDWR)
                open({str(tmp_path)!r} + "/open", "w").close()
                wait_for({str(tmp_path)!r} + "/closed")
                try:
                    fcntl.ioctl(fd, CMD_XOR, bytearray(16), True)
                    print(json.dumps(0))
                except OSError as e:
                    print(json.dumps(e.errno))
            """)

        async with fe:
            n.start_soon(tenant)
            with trio.fail_after(20):
                while not os.path.exists(tmp_path / "open"):
                    await trio.sleep(0.01)
        open(tmp_path / "closed", "w").close()
    assert res["t"] == errno.ENOTCONN


async def _serve_forever(mnt: str, markers: str) -> None:
    broker = EchoBroker(marker_dir=markers)
    async with FuseFrontend(mnt, broker, {"alpha": TenantTree.standard(1)}):
        open(os.path.join(markers, "ready"), "w").close()
        await trio.sleep_forever()


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "serve":
    trio.run(_serve_forever, sys.argv[2], sys.argv[3])
