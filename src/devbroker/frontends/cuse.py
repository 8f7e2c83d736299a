"""CUSE front end: the broker's nodes as character devices served through /dev/cuse.

One CUSE connection per node (``/dev/nvidiactl``, ``/dev/nvidia<n>``, ``/dev/nvidia-uvm``,
``/dev/nvidia-uvm-tools``). Every byte goes through the sans-IO codec in
:mod:`devbroker.frontends.fusewire` (CUSE_INIT, OPEN, IOCTL with FUSE_IOCTL_RETRY, RELEASE,
POLL); this module only moves bytes and maps them onto :class:`BrokerInterface`.

    async with CuseFrontend(broker, tenant_of=tenant_by_uid(broker), gpus=[0, 1]) as fe:
        await trio.sleep_forever()

The nodes are real character devices (``stat`` says S_IFCHR with the device number
we ask for; in a machine without the NVIDIA driver, major 195 like the real nodes: NVML
535 refuses any node that does not stat as char 195:255, docs/sandbox.md). They are
shared by every tenant, so callers are mapped to tenants by ``tenant_of(caller)`` at open
(see :func:`devbroker.frontends.kmod.tenant_by_uid`). Leaving the block closes the
/dev/cuse descriptors: the kernel removes the nodes and fails the calls of open files.

Ioctls are *unrestricted* (CUSE_UNRESTRICTED_IOCTL): the kernel first sends the bare
command and pointer. For NVIDIA's ``'F'`` commands the adapter answers FUSE_IOCTL_RETRY with
one in and one out iovec of ``_IOC_SIZE(cmd)`` bytes at the pointer; the kernel copies the
argument from the caller and re-sends the ioctl with it, and the bytes of the final reply
land back in the caller's buffer (the broker's ``arg_out``). Raw UVM numbers carry no size:
``arg=None`` and the broker reads/writes the argument itself through ``ProcessMemory``.

CUSE has no mmap (``cuse_fops`` has none: ``mmap`` fails with ENODEV) — docs/kmod.md says
what that costs NVML.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import select
import stat
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Callable, Sequence

import trio

from devbroker.abi.ioc import ioc_type
from devbroker.abi.nodes import NodeKind
from devbroker.broker import memgate
from devbroker.broker.interface import (
    BrokerInterface,
    Caller,
    IoctlRequest,
    OpenRequest,
    ProcessMemory,
    ReleaseRequest,
)
from devbroker.frontends import fusewire as w
from devbroker.frontends.fuse import _tgid_of
from devbroker.frontends.common import WHOAMI_IOCTL, sanitize_errno
from devbroker.frontends.kmod import resolve_chardev_fd

log = logging.getLogger(__name__)

CUSE_PATH = "/dev/cuse"
NVIDIA_MAJOR = 195
CTL_MINOR = 255
# One request plus its largest payload: an 'F' argument is at most 16383 bytes, and the
# kernel refuses a read buffer smaller than FUSE_MIN_READ_BUFFER (8 KiB).
_READ_SIZE = 128 * 1024 + 4096
_MAX_IO = 128 * 1024
_IOC_TYPE_F = ord("F")

TenantOf = Callable[[Caller], "str | None"]


@dataclass(frozen=True)
class CuseNode:
    name: str  # DEVNAME: the node appears as /dev/<name>
    kind: NodeKind
    minor: int  # the broker's minor (GPU index; 0 otherwise)
    dev_major: int  # 0: let the kernel pick one
    dev_minor: int


def standard_nodes(gpus: Sequence[int], *, major: int = NVIDIA_MAJOR, uvm_major: int = 0,
                   prefix: str = "nvidia", uvm: bool = True) -> list[CuseNode]:
    """The real driver's layout: ctl 195:255, GPU n 195:n, UVM on its own major (0, 1)."""
    nodes = [CuseNode(f"{prefix}ctl", NodeKind.CTL, 0, major, CTL_MINOR)]
    nodes += [CuseNode(f"{prefix}{g}", NodeKind.GPU, g, major, g) for g in gpus]
    if uvm:
        nodes += [CuseNode(f"{prefix}-uvm", NodeKind.UVM, 0, uvm_major, 0),
                  CuseNode(f"{prefix}-uvm-tools", NodeKind.UVM_TOOLS, 0, uvm_major, 1)]
    return nodes


@dataclass
class _Conn:
    node: CuseNode
    fd: int = -1
    minor: int = 0  # negotiated protocol minor
    rdev: int = 0  # the device number the kernel gave the node
    handles: dict[int, int] = field(default_factory=dict)  # fh -> session (fh == session)


class CuseFrontend:
    """Serve ``nodes`` (default: :func:`standard_nodes` of ``gpus``) through /dev/cuse.

    ``tenant_of(caller)`` names the tenant of each open (None: EACCES). ``mode`` is applied
    to each node once the kernel created it (devtmpfs makes CUSE nodes 0600; the real
    nodes are 0666 and the broker decides per call). ``init_timeout`` bounds the wait for
    the kernel's CUSE_INIT and for the node to appear.
    """

    def __init__(self, broker: BrokerInterface, *, tenant_of: TenantOf,
                 gpus: Sequence[int] = (0,), nodes: Sequence[CuseNode] | None = None,
                 major: int = NVIDIA_MAJOR, uvm_major: int = 0, dev_dir: str = "/dev",
                 mode: int | None = 0o666, cuse_path: str = CUSE_PATH,
                 init_timeout: float = 10.0):
        self.broker = broker
        self.tenant_of = tenant_of
        self.nodes = list(nodes) if nodes is not None else standard_nodes(
            gpus, major=major, uvm_major=uvm_major)
        self.dev_dir = dev_dir
        self.mode = mode
        self.cuse_path = cuse_path
        self.init_timeout = init_timeout
        self._conns: list[_Conn] = []
        self._stack: AsyncExitStack | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> "CuseFrontend":
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            stack.callback(self._close_all)
            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)  # runs before the nursery waits
            with trio.fail_after(self.init_timeout):
                uvm_major = 0
                for node in self.nodes:
                    if node.kind in (NodeKind.UVM, NodeKind.UVM_TOOLS) and not node.dev_major \
                            and uvm_major:
                        # The UVM nodes share one major like the real ones (uvm:0, uvm:1).
                        node = CuseNode(node.name, node.kind, node.minor, uvm_major,
                                        node.dev_minor)
                    conn = _Conn(node)
                    # CLOEXEC: no child of the broker may keep a node alive after we die.
                    conn.fd = os.open(self.cuse_path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
                    self._conns.append(conn)
                    await self._init(conn)
                    if node.kind in (NodeKind.UVM, NodeKind.UVM_TOOLS):
                        uvm_major = os.major(conn.rdev)
                    nursery.start_soon(self._serve, conn, nursery)
        except BaseException:
            await stack.__aexit__(None, None, None)
            raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc) -> bool | None:
        stack, self._stack = self._stack, None
        return await stack.__aexit__(*exc) if stack else None

    def _close_all(self) -> None:
        for conn in self._conns:
            if conn.fd >= 0:
                os.close(conn.fd)  # the kernel removes the node, open files fail
                conn.fd = -1

    @property
    def rdevs(self) -> set[int]:
        return {c.rdev for c in self._conns if c.rdev}

    async def _read(self, conn: _Conn) -> bytes | None:
        while conn.fd >= 0:
            try:
                return os.read(conn.fd, _READ_SIZE)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(conn.fd)
                except trio.ClosedResourceError:
                    return None
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.ENOENT:  # a request withdrawn before we read it
                    continue
                if e.errno in (errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
                    return None
                raise
        return None

    async def _init(self, conn: _Conn) -> None:
        buf = await self._read(conn)
        if buf is None:
            raise OSError(errno.ENODEV, f"CUSE connection for {conn.node.name} closed")
        req = w.parse_request(buf)
        if not isinstance(req, w.CuseInit):
            raise OSError(errno.EPROTO, f"expected CUSE_INIT, got {type(req).__name__}")
        if req.major != w.KERNEL_VERSION:
            raise OSError(errno.EPROTO, f"CUSE protocol {req.major}.{req.minor} unsupported")
        conn.minor = min(req.minor, w.MAX_MINOR)
        n = conn.node
        os.write(conn.fd, w.encode_cuse_init(
            req.unique, minor=conn.minor, flags=w.CUSE_UNRESTRICTED_IOCTL & req.flags,
            max_read=_MAX_IO, max_write=_MAX_IO, dev_major=n.dev_major, dev_minor=n.dev_minor,
            dev_info=[f"DEVNAME={n.name}"]))
        # The kernel creates the device (devtmpfs) while it processes our reply; a failure
        # there (the number or the name is taken) aborts the connection instead.
        path = os.path.join(self.dev_dir, n.name)
        while True:
            try:
                st = os.stat(path)
                if stat.S_ISCHR(st.st_mode):
                    break
            except FileNotFoundError:
                pass
            if self._dead(conn):
                raise OSError(errno.EBUSY, f"CUSE could not create {path} "
                              f"({n.dev_major}:{n.dev_minor} or the name is taken?)")
            await trio.sleep(0.01)
        conn.rdev = st.st_rdev
        if self.mode is not None:
            os.chmod(path, self.mode)

    @staticmethod
    def _dead(conn: _Conn) -> bool:
        p = select.poll()
        p.register(conn.fd, select.POLLIN)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))

    # ---- request loop -----------------------------------------------------------------
    async def _serve(self, conn: _Conn, nursery: trio.Nursery) -> None:
        while True:
            buf = await self._read(conn)
            if buf is None:
                log.info("CUSE connection for %s ended", conn.node.name)
                return
            try:
                req = w.parse_request(buf, minor=conn.minor)
            except w.WireError as e:
                log.error("malformed CUSE request: %s", e)
                if e.unique is not None:
                    self._error(conn, e.unique, errno.EIO)
                continue
            handler = self._HANDLERS.get(type(req))
            if handler is None:
                if req.expects_reply:
                    self._error(conn, req.unique, errno.ENOSYS)
                continue
            # One task per request: a slow broker call must not hold up other callers.
            nursery.start_soon(self._run, handler, conn, req)
            await trio.lowlevel.checkpoint()

    async def _run(self, handler, conn: _Conn, req) -> None:
        try:
            await handler(self, conn, req)
        except Exception:
            log.exception("CUSE %s on %s failed", type(req).__name__, conn.node.name)
            if req.expects_reply:
                self._error(conn, req.unique, errno.EIO)

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.fd < 0:
            return
        try:
            os.write(conn.fd, data)
        except OSError as e:
            # ENOENT: the caller was interrupted and the request withdrawn.
            if e.errno != errno.ENOENT:
                log.warning("CUSE reply for %s failed: %s", conn.node.name, e)

    def _error(self, conn: _Conn, unique: int, err: int) -> None:
        # ENOSYS on an ioctl would disable ioctls on the connection for good; errnos
        # outside 1..511 are refused by the kernel (the call would never complete).
        if err == errno.ENOSYS:
            err = errno.ENOTTY
        self._send(conn, w.encode_error(unique, sanitize_errno(err)))

    @staticmethod
    def _caller(h: w.InHeader) -> Caller:
        tid = h.pid
        tgid = _tgid_of(tid) if tid else 0
        return Caller(pid=tgid or tid, tid=tid, uid=h.uid, gid=h.gid)

    # ---- handlers -----------------------------------------------------------------------
    async def _on_open(self, conn: _Conn, req: w.Open) -> None:
        caller = self._caller(req.header)
        tenant = self.tenant_of(caller)
        if tenant is None:
            self._error(conn, req.unique, errno.EACCES)
            return
        n = conn.node
        flags = req.flags & ~(os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_TRUNC)
        rep = await self.broker.open(OpenRequest(caller, tenant, n.kind, n.minor, flags))
        if rep.errno:
            self._error(conn, req.unique, rep.errno)
            return
        if rep.session <= 0 or rep.session >= 1 << 31 or rep.session in conn.handles:
            # fh must be usable as WHOAMI's return value (a positive int).
            log.error("broker returned unusable session id %r", rep.session)
            await self.broker.release(ReleaseRequest(rep.session))
            self._error(conn, req.unique, errno.EIO)
            return
        conn.handles[rep.session] = rep.session
        self._send(conn, w.encode_open(req.unique, rep.session, w.FOPEN_NONSEEKABLE))

    async def _on_release(self, conn: _Conn, req: w.Release) -> None:
        # CUSE's release is synchronous for the closing process: answer promptly.
        session = conn.handles.pop(req.fh, None)
        try:
            if session is not None:
                await self.broker.release(ReleaseRequest(session))
        finally:
            self._send(conn, w.encode_reply(req.unique))

    async def _on_ioctl(self, conn: _Conn, req: w.Ioctl) -> None:
        session = conn.handles.get(req.fh)
        if session is None or req.flags & w.IOCTL_DIR:
            self._error(conn, req.unique, errno.ENOTTY)
            return
        caller = self._caller(req.header)
        if req.cmd == WHOAMI_IOCTL and caller.pid == os.getpid():
            self._send(conn, w.encode_ioctl(req.unique, session))  # resolve_fd asking
            return
        is_f = ioc_type(req.cmd) == _IOC_TYPE_F
        size = w.ioc_size(req.cmd) if is_f else 0
        if size and not req.in_size and not req.out_size:
            # First round of an unrestricted ioctl: ask the kernel for the argument (copied
            # from the caller, faulting with EFAULT there if the pointer is bad) and for
            # the same bytes as the out buffer of the final reply.
            if req.flags & w.IOCTL_32BIT or not req.arg:
                self._error(conn, req.unique, errno.EFAULT if not req.arg else errno.ENOTTY)
                return
            self._send(conn, w.encode_ioctl_retry(req.unique, [(req.arg, size)],
                                                  [(req.arg, size)]))
            return
        arg = req.data if size else None
        memory = ProcessMemory(caller.pid)
        rep = await self.broker.ioctl(IoctlRequest(
            caller, session, req.cmd, req.arg, arg, memory,
            resolve_fd=functools.partial(self.resolve_fd, caller.pid)))
        if rep.errno:
            self._error(conn, req.unique, rep.errno)
            return
        out = b""
        if rep.arg_out is not None:
            if req.out_size:
                out = bytes(rep.arg_out[:req.out_size])
            elif rep.arg_out and req.arg and arg is not None:
                # Through the memory gate (a worker thread, a deadline), as every
                # access to a tenant's memory.
                s = getattr(self.broker, "sessions", {}).get(session)
                tenant = s.tenant.name if s is not None else f"uid {caller.uid}"
                try:
                    await memgate.gate_of(self.broker).write(tenant, memory, req.arg,
                                                             bytes(rep.arg_out))
                except OSError as e:
                    log.info("ioctl %#x of pid %d: result not written back: %s", req.cmd,
                             caller.pid, e)
                    self._error(conn, req.unique, errno.EFAULT)
                    return
        self._send(conn, w.encode_ioctl(req.unique, rep.result, out))

    async def _on_poll(self, conn: _Conn, req: w.Poll) -> None:
        if req.fh not in conn.handles:
            self._error(conn, req.unique, errno.EBADF)
            return
        poll = getattr(self.broker, "poll", None)
        if poll is None:
            # As the FUSE front end: what the driver reports with an OS event pending; a
            # spurious wakeup beats a tenant blocked forever (docs/fuse.md, poll).
            revents = select.POLLIN | select.POLLRDNORM | select.POLLPRI
        else:
            revents = await poll(conn.handles[req.fh], req.events)
        self._send(conn, w.encode_poll(req.unique, revents))

    async def _on_read(self, conn: _Conn, req) -> None:
        # The driver's nodes have no read()/write(); neither do ours.
        self._error(conn, req.unique, errno.EINVAL)

    async def _on_ok(self, conn: _Conn, req) -> None:
        self._send(conn, w.encode_reply(req.unique))

    async def _on_ignore(self, conn: _Conn, req) -> None:
        # INTERRUPT: a broker call runs to completion so the broker's state matches what
        # the tenant can observe; the kernel discards a reply whose caller has gone.
        return

    _HANDLERS = {
        w.Open: _on_open,
        w.Release: _on_release,
        w.Ioctl: _on_ioctl,
        w.Poll: _on_poll,
        w.Read: _on_read,
        w.Write: _on_read,
        w.Flush: _on_ok,
        w.Fsync: _on_ok,
        w.Interrupt: _on_ignore,
        w.Destroy: _on_ignore,
    }

    # ---- fd arguments -------------------------------------------------------------------
    async def resolve_fd(self, pid: int, fd: int) -> int | None:
        """The broker session behind fd ``fd`` of process ``pid``, or None when that fd is
        not an open file of one of our nodes (kmod.resolve_chardev_fd)."""
        return await trio.to_thread.run_sync(resolve_chardev_fd, pid, fd, self.rdevs)
