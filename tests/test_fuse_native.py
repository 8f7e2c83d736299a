"""native/fuselane.c (the FUSE reader threads' native loop) through frontends/fusenative.py,
on real file descriptors and real memory: FUSE requests as the kernel lays them out, written
into a SOCK_SEQPACKET socket (one read, one request, as /dev/fuse gives them), the replies
read back from its peer, the parameter block read from and written into this process with
process_vm_readv/writev.

What must hold (the Python reader's rules, frontends/fuse.py):
1. Node ioctls are handed out one tenant per turn, the oldest of a tenant first, after
   everything pending was read (limits.FairQueue's order).
2. Anything else (another opcode, an ioctl on an inode that is no node, one too large to
   queue) comes back to Python whole, as read.
3. `read` copies the block at the address the decision names; `answer` writes the results
   there and replies with the result and the header; a block that cannot be written is
   answered EFAULT; `error` answers an errno.
4. The wake eventfd and the end of the file are reported; the watchdog's claim takes only
   an access in progress.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct

import pytest

from devbroker.frontends import fusenative as fn

IN_HEADER = struct.Struct("<IIQQIIIHH")  # struct fuse_in_header
IOCTL_IN = struct.Struct("<QIIQII")  # struct fuse_ioctl_in
OUT_HEADER = struct.Struct("<IiQ")  # struct fuse_out_header
IOCTL_OUT = struct.Struct("<iIII")  # struct fuse_ioctl_out
FUSE_IOCTL, FUSE_LOOKUP = 39, 1
CMD = 0xC020462A  # NV_ESC_RM_CONTROL's number (32-byte argument)


def ioctl_request(unique: int, nodeid: int, arg: bytes = bytes(32), *, fh: int = 7,
                  cmd: int = CMD, pid: int | None = None, flags: int = 0) -> bytes:
    body = IOCTL_IN.pack(fh, flags, cmd, 0x1000, len(arg), len(arg)) + arg
    return IN_HEADER.pack(IN_HEADER.size + len(body), FUSE_IOCTL, unique, nodeid, 0, 0,
                          os.getpid() if pid is None else pid, 0, 0) + body


@pytest.fixture
def loop():
    """A shared state with nodes 100 (tenant a) and 200 (tenant b), and one thread reading
    `kernel`'s peer; `kernel` is where the requests come from and the replies go."""
    shared = fn.FuseNative.create()
    assert shared is not None, f"the native FUSE loop did not load: {fn.describe()}"
    shared.node_put(100, "a")
    shared.node_put(200, "b")
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    wake = os.eventfd(0, os.EFD_NONBLOCK)
    t = shared.thread(ours.fileno(), wake, 1 << 17, 0)
    yield shared, t, kernel, wake
    t.free()
    shared.free()
    ours.close()
    kernel.close()
    os.close(wake)


def test_node_ioctls_are_handed_out_one_tenant_per_turn(loop):
    shared, t, kernel, _wake = loop
    for unique, node in ((1, 100), (2, 100), (3, 100), (4, 200), (5, 100), (6, 200)):
        kernel.send(ioctl_request(unique, node))
    order = []
    for _ in range(6):
        assert t.next() == fn.DVBF_NODE_IOCTL
        order.append((t.call.unique, t.call.tenant))
        assert t.raw() == ioctl_request(t.call.unique, t.call.nodeid)
    # a, then b, in turns; each tenant's own in the order sent
    assert [u for u, _ in order] == [1, 4, 2, 6, 3, 5]
    assert shared.queued() == 0


def test_a_request_sent_meanwhile_gets_the_next_turn(loop):
    """A quiet tenant's request that arrives while another tenant's are queued is served
    before the rest of them: read first, then the turn."""
    _shared, t, kernel, _wake = loop
    for unique in (1, 2, 3, 4):
        kernel.send(ioctl_request(unique, 100))
    assert t.next() == fn.DVBF_NODE_IOCTL and t.call.unique == 1
    kernel.send(ioctl_request(9, 200))
    got = []
    for _ in range(4):
        assert t.next() == fn.DVBF_NODE_IOCTL
        got.append(t.call.unique)
    assert got == [9, 2, 3, 4]


def test_the_call_carries_the_requests_fields(loop):
    _shared, t, kernel, _wake = loop
    arg = bytes(range(32))
    kernel.send(ioctl_request(77, 200, arg, fh=0x1234, pid=4321, flags=2))
    assert t.next() == fn.DVBF_NODE_IOCTL
    c = t.call
    assert (c.unique, c.nodeid, c.fh, c.pid, c.cmd, c.flags, c.in_size, c.out_size) == (
        77, 200, 0x1234, 4321, CMD, 2, 32, 32)
    assert t.arg() == arg


def test_other_requests_come_back_whole(loop):
    shared, t, kernel, _wake = loop
    lookup = IN_HEADER.pack(IN_HEADER.size + 6, FUSE_LOOKUP, 11, 1, 0, 0, 1, 0, 0) + b"alice\0"
    not_a_node = ioctl_request(12, 300)
    too_large = ioctl_request(13, 100, bytes(fn.HDR_MAX + 8), cmd=0xC0000000)
    for req in (lookup, not_a_node, too_large):
        kernel.send(req)
        assert t.next() == fn.DVBF_REQUEST
        assert t.request() == req
    assert shared.queued() == 0
    shared.node_drop(100)
    dropped = ioctl_request(14, 100)
    kernel.send(dropped)
    assert t.next() == fn.DVBF_REQUEST and t.request() == dropped


def test_read_answer_and_error_move_the_block_and_reply(loop):
    _shared, t, kernel, _wake = loop
    block = ctypes.create_string_buffer(b"parameters as sent".ljust(64, b"."), 64)
    addr = ctypes.addressof(block)
    kernel.send(ioctl_request(21, 100))
    assert t.next() == fn.DVBF_NODE_IOCTL
    assert t.read(addr, 64) == block.raw
    assert t.answer(5, b"header after".ljust(32, b"\0"), addr,
                    b"results".ljust(64, b"!")) == 0
    assert block.raw == b"results".ljust(64, b"!")
    reply = kernel.recv(4096)
    n, err, unique = OUT_HEADER.unpack_from(reply)
    assert (n, err, unique) == (len(reply), 0, 21)
    assert IOCTL_OUT.unpack_from(reply, OUT_HEADER.size) == (5, 0, 0, 0)
    assert reply[OUT_HEADER.size + IOCTL_OUT.size:] == b"header after".ljust(32, b"\0")

    kernel.send(ioctl_request(22, 100))
    assert t.next() == fn.DVBF_NODE_IOCTL
    t.error(errno.EPERM)
    assert OUT_HEADER.unpack(kernel.recv(4096)) == (OUT_HEADER.size, -errno.EPERM, 22)


def test_an_unreadable_or_unwritable_block_is_never_answered_as_done(loop):
    _shared, t, kernel, _wake = loop
    kernel.send(ioctl_request(31, 100))
    assert t.next() == fn.DVBF_NODE_IOCTL
    assert t.read(0x10, 64) is None  # (page 0: never mapped)
    assert t.answer(0, bytes(32), 0x10, bytes(64)) == fn.DVBF_WRITE_FAILED
    assert OUT_HEADER.unpack(kernel.recv(4096)) == (OUT_HEADER.size, -errno.EFAULT, 31)
    assert t.read(0x10, fn.PARAMS_MAX + 1) is None  # (larger than the private buffer)


def test_wake_end_and_claim(loop):
    _shared, t, kernel, wake = loop
    os.eventfd_write(wake, 1)
    assert t.next() == fn.DVBF_WAKE
    os.eventfd_read(wake)
    assert t.mem_since() == 0 and not t.claim(12345)  # (no access in progress)
    assert t.next(read_more=False) == fn.DVBF_IDLE
    kernel.close()
    assert t.next() == fn.DVBF_HUP
    assert t.call.err == errno.ENODEV


def test_malformed_and_random_requests_are_handed_back_whole(loop):
    """What C queues is only a well-formed node ioctl (its lengths agree, no extensions,
    small enough); anything else comes back to Python byte for byte, whose parser says
    what is wrong with it. 3,000 requests: random bytes, and ioctls with one field off."""
    import random

    shared, t, kernel, _wake = loop
    rng = random.Random(14)
    good = ioctl_request(1, 100)
    cases = []
    for _ in range(1000):
        cases.append(rng.randbytes(rng.randrange(1, 300)))
    for _ in range(2000):
        req = bytearray(good)
        at = rng.choice([0, 4, 16, 36, 48, 64, 68]) + rng.randrange(4)
        req[at] = rng.randrange(256)  # (len, opcode, nodeid, extlen, in/out sizes...)
        if rng.random() < 0.3:
            req = req[:rng.randrange(1, len(req))]
        cases.append(bytes(req))
    queued = 0
    for req in cases:
        kernel.send(req)
        r = t.next()
        assert r in (fn.DVBF_REQUEST, fn.DVBF_NODE_IOCTL), r
        if r == fn.DVBF_REQUEST:
            assert t.request() == req
            continue
        queued += 1
        got = t.raw()
        assert got == req
        h = IN_HEADER.unpack_from(got)
        io = IOCTL_IN.unpack_from(got, IN_HEADER.size)
        # queued only when well-formed: a FUSE_IOCTL on a node, lengths that agree
        assert h[1] == FUSE_IOCTL and h[0] == len(got) and h[7] == 0
        assert h[3] in (100, 200)
        assert io[4] == len(got) - IN_HEADER.size - IOCTL_IN.size <= fn.HDR_MAX
    assert shared.queued() == 0
    assert queued > 100  # (the cases with a harmless change: the unique, fh, pid, arg...)
