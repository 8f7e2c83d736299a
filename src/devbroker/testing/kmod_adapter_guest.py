"""Guest-side check of frontends/kmod.py (KmodFrontend) with a stub BrokerInterface.

Needs trio (the guest venv made by scripts/qemu/setup.sh). Prints CHECK lines like
kmod_guest. The stub answers: open -> session 100+n, 'F' ioctl -> argument reversed with
result 7, denied command -> EPERM, map_read -> a recognisable page, release -> recorded.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import sys

import trio

from devbroker.broker.interface import IoctlReply, MapReadReply, OpenReply
from devbroker.frontends.kmod import KmodFrontend
from devbroker.testing.kmod_guest import check, errno_of, in_child, iowr

REV = iowr(0x93, 16)
DENY = iowr(0x4D, 16)


class StubBroker:
    def __init__(self):
        self.opened, self.released, self.n = [], [], 0

    async def open(self, req):
        self.n += 1
        self.opened.append((req.tenant, int(req.node), req.caller.pid == os.getpid()))
        return OpenReply(session=100 + self.n)

    async def ioctl(self, req):
        if req.cmd == DENY:
            return IoctlReply(errno=errno.EPERM)
        return IoctlReply(result=7, arg_out=req.arg[::-1])

    async def map_read(self, req):
        return MapReadReply(data=b"PAGE@%d" % req.offset)

    async def release(self, req):
        self.released.append(req.session)


def tenant() -> dict:
    fd = os.open("/dev/nvidiactl", os.O_RDWR)
    buf = bytearray(range(16))
    out = {"ret": fcntl.ioctl(fd, REV, buf, True), "rev": bytes(buf) == bytes(range(16))[::-1]}
    out["deny"] = errno_of(lambda: fcntl.ioctl(fd, DENY, bytearray(16), True))
    m = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
    out["page"] = m[:6].decode()
    m.close()
    os.close(fd)
    return out


async def main() -> int:
    broker = StubBroker()
    async with KmodFrontend(broker, tenant_of=lambda req: "t1"):
        # A separate process, as tenants are: the mmap holds the caller's mm locked
        # while the broker answers, so a tenant thread of the broker's own process
        # would wait for the broker's own allocations (until timeout_ms).
        st, out = await trio.to_thread.run_sync(in_child, tenant)
        await trio.sleep(0.2)  # the RELEASE notification is asynchronous
    if st != 0:
        out = {"ret": None, "rev": False, "deny": None, "page": None, "error": out}
    check("adapter_ioctl_reply", out["ret"] == 7 and out["rev"], out)
    check("adapter_ioctl_deny", out["deny"] == errno.EPERM, out)
    check("adapter_mmap_map_read", out["page"] == "PAGE@0", out)
    check("adapter_open_release", broker.opened == [("t1", 1, False)] and broker.released == [101],
          (broker.opened, broker.released))  # fmt: skip
    e = errno_of(lambda: os.open("/dev/nvidiactl", os.O_RDWR))
    check("adapter_closed_enodev", e == errno.ENODEV, e)
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main))
