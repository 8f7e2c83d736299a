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

Shared with the CUSE front end (frontends/cuse.py), whose nodes are real character devices
too: :func:`tenant_by_uid` (callers mapped to tenants by the policy's ``uids``) and
:func:`resolve_chardev_fd` (a tenant's fd argument -> broker session: pidfd_getfd, a
device-number check, then the private WHOAMI ioctl on the duplicate, answered by the
front end itself only for the broker's own process; docs/kmod.md "CUSE").
"""
from __future__ import annotations

import errno
import fcntl
import functools
import glob
import logging
import os
import stat
from contextlib import AsyncExitStack
from typing import Any, Callable, Iterable

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
from devbroker.frontends.common import WHOAMI_IOCTL  # the answer is the ioctl's return value
from devbroker.frontends.procmem import pidfd_getfd

log = logging.getLogger(__name__)

CTL_PATH = "/dev/devbroker-ctl"



def tenant_by_uid(policy_of: Callable[[], Any] | Any, default: str | None = None
                  ) -> Callable[[Any], "str | None"]:
    """``tenant_of`` for front ends whose nodes are shared by every tenant (kmod, CUSE).

    ``policy_of`` is the broker (its ``.policy`` is read at each call, so a policy reload
    takes effect at the next open) or a callable returning the policy. The caller (a
    ``Caller`` or a kmodwire ``Request``: anything with ``.uid``) belongs to the one tenant
    whose ``uids`` list its uid; a uid listed by no tenant gets ``default`` (None: the open
    is refused with EACCES), a uid listed by two tenants is refused (ambiguous).
    """
    def current():
        return policy_of() if callable(policy_of) else policy_of.policy

    def tenant_of(who: Any) -> str | None:
        policy = current()
        names = [name for name, t in policy.tenants.items()
                 if who.uid in (getattr(t, "uids", None) or ())]
        if len(names) == 1:
            return names[0]
        if len(names) > 1:
            log.warning("uid %d is listed by tenants %s: refusing", who.uid, names)
            return None
        return default
    return tenant_of


def kmod_node_rdevs(class_dir: str = "/sys/class/devbroker") -> set[int]:
    """Device numbers of the module's tenant nodes (from sysfs: <class>/<node>/dev)."""
    out = set()
    for path in glob.glob(os.path.join(class_dir, "*", "dev")):
        try:
            major, minor = open(path).read().strip().split(":")
            out.add(os.makedev(int(major), int(minor)))
        except (OSError, ValueError):
            continue
    return out


def resolve_chardev_fd(pid: int, fd: int, rdevs: Iterable[int]) -> int | None:
    """Blocking: the broker session behind fd ``fd`` of process ``pid``, or None.

    1. ``pidfd_getfd`` duplicates the tenant's open file (the same ``struct file``).
    2. It must be a character device whose number is one of ``rdevs`` (ours): the WHOAMI
       ioctl is never sent to anybody else's device.
    3. WHOAMI on the duplicate reaches this broker as an ordinary ioctl of that very open
       file; the front end answers with the session id as the return value.
    4. The duplicate is closed (if the tenant closed its fd meanwhile, this is the last
       reference and the front end gets the release, as it should).
    Run it in a worker thread: step 3 is answered by the front end's own event loop.
    """
    try:
        dup = pidfd_getfd(pid, fd)
    except OSError as e:
        log.debug("resolve_fd(%d, %d): %s", pid, fd, e)
        return None
    try:
        st = os.fstat(dup)
        if not stat.S_ISCHR(st.st_mode) or st.st_rdev not in set(rdevs):
            return None
        session = fcntl.ioctl(dup, WHOAMI_IOCTL, 0)
        return session if session > 0 else None
    except OSError as e:
        log.debug("resolve_fd(%d, %d): %s", pid, fd, e)
        return None
    finally:
        os.close(dup)

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

    async def resolve_fd(self, pid: int, fd: int) -> int | None:
        """The broker session behind fd ``fd`` of process ``pid`` (None: not one of ours)."""
        return await trio.to_thread.run_sync(
            resolve_chardev_fd, pid, fd, kmod_node_rdevs())

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
            if req.cmd == WHOAMI_IOCTL and req.tgid == os.getpid():
                self._send(w.reply(req.id, result=session))  # resolve_fd asking
                return
            r = await self.broker.ioctl(IoctlRequest(
                caller, session, req.cmd, arg_ptr=req.arg, arg=req.data or None,
                memory=ProcessMemory(req.tgid),
                resolve_fd=functools.partial(self.resolve_fd, req.tgid)))  # fmt: skip
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
