"""The kernel-module front end: serve /dev/devbroker-ctl with a BrokerInterface.

The module (kmod/, docs/kmod.md) turns every open/ioctl/mmap/close on its nodes into a
request record; this adapter decodes them with kmodwire, calls the broker, and writes the
verdict back. It makes no policy decision of its own.

    async with KmodFrontend(broker, tenant_of=lambda req: "default"):
        await trio.sleep_forever()

Closing the control file (leaving the block, or the process dying) makes the module fail
every pending and later call on the nodes at once (EIO; ENODEV for new opens).

Mapping of the wire onto the interface:
- OPEN -> ``broker.open``; the session id is remembered per module file id.
- IOCTL -> ``broker.ioctl`` with the module's single copy of the top-level argument
  ('F' commands) and ``ProcessMemory`` of the caller for nested buffers / UVM arguments
  (the caller is blocked in the ioctl while we read it). ``arg_out`` is the reply data.
- MMAP -> ``broker.map_read`` of the whole range, served as a memfd the module maps in
  place of the node. The tenant's mm is locked for writing during the call: nothing here
  may touch the caller's memory while answering it.
- RELEASE -> ``broker.release`` (a notification; the module does not wait).
The interface has no "pass"; a real-driver backend would add it (kmodwire.pass_).
"""
from __future__ import annotations

import errno
import os
from contextlib import AsyncExitStack
from typing import Callable

import trio

from devbroker.abi.nodes import NodeKind
from devbroker.broker.interface import (
    BrokerInterface,
    Caller,
    IoctlRequest,
    MapReadRequest,
    OpenRequest,
    ProcessMemory,
    ReleaseRequest,
)
from devbroker.frontends import kmodwire as w

CTL_PATH = "/dev/devbroker-ctl"

# Maps a request to its tenant name, or None to refuse the open (EACCES). The module
# reports uid/gid, the cgroup v2 id and the pid-namespace inode; a policy usually keys
# tenants by cgroup (one per container).
TenantOf = Callable[[w.Request], "str | None"]


class KmodFrontend:
    def __init__(self, broker: BrokerInterface, *, tenant_of: TenantOf,
                 ctl_path: str = CTL_PATH):  # fmt: skip
        self.broker = broker
        self.tenant_of = tenant_of
        self.ctl_path = ctl_path
        self._fd = -1
        self._sessions: dict[int, int] = {}  # module file id -> broker session
        self._stack: AsyncExitStack | None = None

    async def __aenter__(self) -> "KmodFrontend":
        # CLOEXEC: a tenant we spawn must not inherit the control file, or our death
        # would not be noticed by the module. EBUSY here means another broker is serving.
        self._fd = os.open(self.ctl_path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        stack = AsyncExitStack()
        await stack.__aenter__()
        stack.callback(self._close)
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)  # runs before the nursery waits
        nursery.start_soon(self._serve, nursery)
        self._stack = stack
        return self

    async def __aexit__(self, *exc) -> bool | None:
        stack, self._stack = self._stack, None
        return await stack.__aexit__(*exc) if stack else None

    def _close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the module fails everything still pending
            self._fd = -1

    async def _serve(self, nursery: trio.Nursery) -> None:
        while True:
            try:
                buf = os.read(self._fd, w.READ_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._fd)
                continue
            req = w.parse_request(buf)
            if req.op == w.Op.RELEASE:
                session = self._sessions.pop(req.file_id, None)
                if session is not None:
                    nursery.start_soon(self.broker.release, ReleaseRequest(session))
            else:
                # One task per call: a slow call (RM_ALLOC can take 50 ms natively) must
                # not hold up other tenants.
                nursery.start_soon(self._handle, req)

    def _send(self, v: w.VerdictRecord) -> bool:
        """Write a verdict; False when the caller is gone (killed or timed out: ENOENT)."""
        try:
            os.write(self._fd, w.encode_verdict(v))
            return True
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            raise

    async def _handle(self, req: w.Request) -> None:
        caller = Caller(pid=req.tgid, tid=req.pid, uid=req.uid, gid=req.gid)
        if req.op == w.Op.OPEN:
            tenant = self.tenant_of(req)
            if tenant is None:
                self._send(w.deny(req.id, errno.EACCES))
                return
            r = await self.broker.open(
                OpenRequest(caller, tenant, NodeKind(req.node), req.minor, req.flags))
            if r.errno:
                self._send(w.deny(req.id, r.errno))
                return
            self._sessions[req.file_id] = r.session
            if not self._send(w.reply(req.id)):
                # The open failed in the tenant after all: no RELEASE will ever come.
                del self._sessions[req.file_id]
                await self.broker.release(ReleaseRequest(r.session))
            return
        session = self._sessions.get(req.file_id)
        if session is None:  # a file this broker never accepted
            self._send(w.deny(req.id, errno.EBADF))
            return
        if req.op == w.Op.IOCTL:
            r = await self.broker.ioctl(IoctlRequest(
                caller, session, req.cmd, arg_ptr=req.arg, arg=req.data or None,
                memory=ProcessMemory(req.tgid)))  # fmt: skip
            if r.errno:
                self._send(w.deny(req.id, r.errno))
            else:
                out = r.arg_out if r.arg_out is not None and len(r.arg_out) == len(req.data) else b""
                self._send(w.reply(req.id, result=r.result, data=out))
        elif req.op == w.Op.MMAP:
            m = await self.broker.map_read(MapReadRequest(caller, session, req.offset, req.length))
            if m.errno:
                self._send(w.deny(req.id, m.errno))
                return
            fd = os.memfd_create("devbroker-map", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, req.length)
                os.pwrite(fd, m.data[: req.length], 0)
                self._send(w.map_file(req.id, fd, 0))  # the module keeps its own reference
            finally:
                os.close(fd)
