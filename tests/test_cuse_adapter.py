"""frontends/cuse.py without a kernel: the adapter's handlers driven with fusewire bytes over
a SEQPACKET socket pair standing in for /dev/cuse (the host has no CUSE; the guest test,
tests/test_guest_frontends.py, runs the real thing). Also tenant_by_uid."""
from __future__ import annotations

import errno
import os
import socket
import struct
from types import SimpleNamespace

import pytest
import trio

from devbroker.abi.nodes import NodeKind
from devbroker.broker.interface import IoctlReply, OpenReply
from devbroker.frontends import fusewire as w
from devbroker.frontends.cuse import CuseFrontend, _Conn, standard_nodes
from devbroker.frontends.common import WHOAMI_IOCTL
from devbroker.frontends.kmod import tenant_by_uid

F_CMD = w.ioc(w.IOC_READ | w.IOC_WRITE, ord("F"), 0x2A, 32)  # RM_CONTROL-sized
UVM_CMD = 0x30000001


class Stub:
    def __init__(self):
        self.ioctls, self.released = [], []

    async def open(self, req):
        return OpenReply(session=7) if req.caller.uid == 1001 else OpenReply(errno=errno.EACCES)

    async def ioctl(self, req):
        self.ioctls.append(req)
        if req.arg is None:
            return IoctlReply(result=0)
        return IoctlReply(result=3, arg_out=bytes(req.arg)[::-1])

    async def release(self, req):
        self.released.append(req.session)


def _pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return a, b


def _ioctl_req(unique, cmd, *, fh=7, arg=0x1000, data=b"", out_size=0, pid=0, uid=1001):
    body = struct.pack("<QIIQII", fh, w.IOCTL_UNRESTRICTED, cmd, arg, len(data), out_size) + data
    return w.parse_request(w.encode_request(w.IOCTL, unique, body, pid=pid, uid=uid))


def _reply(sock) -> tuple[int, int, bytes]:
    buf = sock.recv(1 << 16)
    length, error, unique = w.parse_out_header(buf)
    return error, unique, buf[16:]


def _frontend(stub):
    fe = CuseFrontend(stub, tenant_of=lambda c: "alice" if c.uid == 1001 else None, gpus=[0])
    kernel, ours = _pair()
    conn = _Conn(fe.nodes[0], fd=ours.detach())
    conn.handles[7] = 7
    return fe, conn, kernel


def test_standard_nodes_layout():
    nodes = {n.name: (n.kind, n.minor, n.dev_major, n.dev_minor) for n in standard_nodes([0, 3])}
    assert nodes == {"nvidiactl": (NodeKind.CTL, 0, 195, 255),
                     "nvidia0": (NodeKind.GPU, 0, 195, 0), "nvidia3": (NodeKind.GPU, 3, 195, 3),
                     "nvidia-uvm": (NodeKind.UVM, 0, 0, 0),
                     "nvidia-uvm-tools": (NodeKind.UVM_TOOLS, 0, 0, 1)}


def test_f_command_retries_then_replies_with_arg_out():
    stub = Stub()
    fe, conn, kernel = _frontend(stub)

    async def main():
        # round 1: bare command -> RETRY with one in and one out iovec of _IOC_SIZE bytes
        await fe._on_ioctl(conn, _ioctl_req(1, F_CMD))
        err, unique, payload = _reply(kernel)
        result, flags, n_in, n_out = struct.unpack_from("<iIII", payload)
        assert (err, unique, flags, n_in, n_out) == (0, 1, w.IOCTL_RETRY, 1, 1)
        assert struct.unpack_from("<QQQQ", payload, 16) == (0x1000, 32, 0x1000, 32)
        assert stub.ioctls == []
        # round 2: the argument arrives; the broker's arg_out is the reply's out data
        data = bytes(range(32))
        await fe._on_ioctl(conn, _ioctl_req(2, F_CMD, data=data, out_size=32))
        err, unique, payload = _reply(kernel)
        assert (err, unique) == (0, 2)
        assert struct.unpack_from("<i", payload)[0] == 3 and payload[16:] == data[::-1]
        [req] = stub.ioctls
        assert (req.cmd, req.arg_ptr, req.arg, req.session) == (F_CMD, 0x1000, data, 7)
        assert req.resolve_fd is not None and req.memory is not None

    trio.run(main)
    os.close(conn.fd)


def test_raw_uvm_command_has_no_retry_and_no_arg():
    stub = Stub()
    fe, conn, kernel = _frontend(stub)

    async def main():
        await fe._on_ioctl(conn, _ioctl_req(5, UVM_CMD))
        err, unique, payload = _reply(kernel)
        assert (err, unique) == (0, 5) and struct.unpack_from("<iI", payload) == (0, 0)
        [req] = stub.ioctls
        assert req.arg is None and req.arg_ptr == 0x1000

    trio.run(main)
    os.close(conn.fd)


def test_whoami_only_answers_the_broker_itself():
    stub = Stub()
    fe, conn, kernel = _frontend(stub)

    async def main():
        await fe._on_ioctl(conn, _ioctl_req(8, WHOAMI_IOCTL, pid=os.getpid()))
        err, unique, payload = _reply(kernel)
        assert (err, struct.unpack_from("<i", payload)[0]) == (0, 7)
        assert stub.ioctls == []
        # from another process it is an ordinary command for the broker to refuse
        await fe._on_ioctl(conn, _ioctl_req(9, WHOAMI_IOCTL, pid=1))
        _reply(kernel)
        assert [r.cmd for r in stub.ioctls] == [WHOAMI_IOCTL]

    trio.run(main)
    os.close(conn.fd)


def test_open_refused_for_unmapped_uid_and_release_answers():
    stub = Stub()
    fe, conn, kernel = _frontend(stub)
    conn.handles.clear()

    def open_req(unique, uid):
        return w.parse_request(w.encode_request(w.OPEN, unique, struct.pack("<II", os.O_RDWR, 0),
                                                uid=uid))

    async def main():
        await fe._on_open(conn, open_req(1, 1003))
        assert _reply(kernel)[0] == -errno.EACCES
        await fe._on_open(conn, open_req(2, 1001))
        err, _, payload = _reply(kernel)
        assert err == 0 and struct.unpack_from("<Q", payload)[0] == 7 and conn.handles == {7: 7}
        rel = w.parse_request(w.encode_request(w.RELEASE, 3, struct.pack("<QIIQ", 7, 0, 0, 0)))
        await fe._on_release(conn, rel)
        assert _reply(kernel)[:2] == (0, 3) and stub.released == [7] and conn.handles == {}

    trio.run(main)
    os.close(conn.fd)


def test_tenant_by_uid():
    pol = SimpleNamespace(tenants={"alice": SimpleNamespace(uids=(1001,)),
                                   "bob": SimpleNamespace(uids=(1002, 1001)),
                                   "carol": SimpleNamespace(uids=(1004,)),
                                   "any": SimpleNamespace(uids=None)})
    broker = SimpleNamespace(policy=pol)
    t = tenant_by_uid(broker)
    who = lambda uid: SimpleNamespace(uid=uid)  # noqa: E731
    assert t(who(1004)) == "carol"
    assert t(who(1002)) == "bob"
    assert t(who(1001)) is None  # listed twice: ambiguous, refused
    assert t(who(5)) is None
    assert tenant_by_uid(broker, default="any")(who(5)) == "any"
    broker.policy = SimpleNamespace(tenants={"dave": SimpleNamespace(uids=(1004,))})
    assert t(who(1004)) == "dave"  # a policy reload is seen at the next open
