"""The one interface every front end calls.

Front ends (FUSE, CUSE, the kernel module, seccomp) translate their own wire into these
requests and the replies back into their wire; they make no policy decision of their own.
"""
from __future__ import annotations

import errno as _errno
import os
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from devbroker.abi.nodes import NodeKind
from devbroker.broker.procmem import vm_read, vm_write


@dataclass(frozen=True)
class Caller:
    """Who made the call, as seen from the broker's pid namespace."""

    pid: int  # thread-group id when the front end knows it, else the thread id
    tid: int
    uid: int
    gid: int
    # The caller's pid namespace (procinfo.pid_namespace) when the front end already knows
    # it (seccomp caches it per thread); None: the broker looks it up.
    pidns: str | None = None


class TenantMemory(Protocol):
    """Access to the calling process's address space (for nested buffers)."""

    def read(self, addr: int, length: int) -> bytes: ...

    def write(self, addr: int, data: bytes) -> None: ...


class ProcessMemory:
    """TenantMemory through process_vm_readv/writev (works for FUSE, CUSE and kmod callers).

    Raises OSError (EFAULT for unmapped memory, ESRCH for a vanished process).
    """

    def __init__(self, pid: int):
        self.pid = pid

    def read(self, addr: int, length: int) -> bytes:
        return vm_read(self.pid, addr, length)

    def write(self, addr: int, data: bytes) -> None:
        vm_write(self.pid, addr, data)


@dataclass(frozen=True)
class OpenRequest:
    caller: Caller
    tenant: str  # the node directory the file was opened through
    node: NodeKind
    minor: int  # GPU index for NodeKind.GPU, else 0
    flags: int = os.O_RDWR
    # The front end can install a real driver file in the caller (seccomp's ADDFD): with a
    # backend that hands them out, the reply carries one (OpenReply.install_fd).
    want_file: bool = False
    # Decided ahead for the caller's sandbox (seccomp's prepared opens): the session is
    # nobody's process until the front end names its opener (Broker.opened_by).
    prepared: bool = False


@dataclass(frozen=True)
class OpenReply:
    session: int = 0
    errno: int = 0
    # A driver file (an fd of the broker's) for the front end to install in the caller and
    # then close; -1 when the session is served by the broker alone.
    install_fd: int = -1


@dataclass
class IoctlRequest:
    caller: Caller
    session: int
    cmd: int
    arg_ptr: int  # the tenant's pointer (for nested reads and UVM arguments)
    arg: bytes | None  # top-level argument bytes if the front end already has them
    memory: TenantMemory | None = None
    # Maps one of the caller's fd numbers (an fd argument such as REGISTER_FD's ctl_fd or
    # RM_MAP_MEMORY's fd) to the broker session it refers to, or None when it is not one of
    # ours. Each front end knows how to see the caller's fd table; the broker does not.
    # It answers at once (seccomp: a stat on the caller's own thread) or with an awaitable
    # (FUSE: a lookup on the trio thread).
    resolve_fd: Callable[[int], int | None | Awaitable[int | None]] | None = None
    # For driver files that live in the caller (seccomp front end, real backend): the fd
    # number the ioctl was made on, and a way to get the broker's own duplicate of one of
    # the caller's fds (pidfd_getfd; the broker closes it after the call).
    fd: int = -1
    dup_fd: Callable[[int], int] | None = None
    # Whether the caller is still the one that made the call (seccomp: NOTIF_ID_VALID). The
    # broker calls it after its last read of the caller's memory and fds and before it
    # executes anything on them; False ends the request (ESRCH). None: nothing to confirm.
    confirm: Callable[[], bool] | None = None


class RunInCaller(Exception):
    """Raised inside the broker when a decided call must run in the calling process (the
    driver binds it to the caller's pid or mm); the front end lets the kernel continue it."""


@dataclass
class IoctlReply:
    result: int = 0  # ioctl(2)'s return value when errno == 0
    arg_out: bytes | None = None  # top-level argument after the call (same length as in)
    errno: int = 0
    # The broker decided the call and the caller's own kernel context must run it
    # (seccomp: SECCOMP_USER_NOTIF_FLAG_CONTINUE). Only for files that live in the caller.
    run_in_caller: bool = False


@dataclass(frozen=True)
class MapReadRequest:
    caller: Caller
    session: int
    offset: int
    length: int
    # (st_dev, st_ino) of the mapped file as the front end saw it (seccomp): how the
    # mapping shows in /proc/PID/maps, which managed memory's charge follows (managed.py)
    file_key: tuple[int, int] | None = None


@dataclass
class MapReadReply:
    data: bytes = b""
    errno: int = 0


@dataclass(frozen=True)
class ReleaseRequest:
    session: int


@dataclass
class MapCheckReply:
    errno: int = 0


class BrokerInterface(Protocol):
    async def open(self, req: OpenRequest) -> OpenReply: ...

    async def ioctl(self, req: IoctlRequest) -> IoctlReply: ...

    async def map_read(self, req: MapReadRequest) -> MapReadReply: ...

    async def release(self, req: ReleaseRequest) -> None: ...

    # A front end that installs the backend's tenant files (seccomp) calls this after it has
    # answered such an open: the backend's work for it that the tenant need not wait for.
    # later=True: the front end calls quiet_work() once it has had nothing to answer for a
    # moment, and the backend may keep the work for then (True: it did).
    def after_open_answered(self, later: bool = False) -> bool: ...

    def quiet_work(self) -> None: ...


DENIED = IoctlReply(errno=_errno.EPERM)
