"""Reading and writing another process's memory, and borrowing its file descriptors.

Every front end reaches nested ioctl buffers through these calls: a tenant's pointer is
only ever dereferenced here, by the kernel, with the tenant's own page tables, so an
unmapped address becomes EFAULT instead of a crash in the broker.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading

from devbroker.sandbox import linux

# A nested NVIDIA argument is at most a few MiB (RM control parameter blocks, UVM
# ranges are described, not copied). Anything far larger is a bug or an attack, and is
# refused before it can make the broker allocate it.
MAX_TRANSFER = 64 << 20
_ADDR_LIMIT = 1 << 64


_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [
    ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
    ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong,
]
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = _libc.process_vm_readv.argtypes
_libc.syscall.restype = ctypes.c_long


def _check_range(pid: int, addr: int, n: int) -> None:
    if not isinstance(n, int) or n < 0 or n > MAX_TRANSFER:
        raise OSError(errno.EINVAL, f"refusing a transfer of {n!r} bytes")
    if not isinstance(pid, int) or pid <= 0:
        raise OSError(errno.ESRCH, f"no such process {pid!r}")
    if not isinstance(addr, int) or addr < 0 or addr + n > _ADDR_LIMIT:
        raise OSError(errno.EFAULT, f"bad address {addr!r}+{n}")


def _transfer(fn, pid: int, addr: int, buf, n: int) -> None:
    # process_vm_* may stop early at a page that faults; keep going from there so a
    # transfer spanning mappings works, and report EFAULT only when no progress is made.
    done = 0
    base = ctypes.addressof(buf)
    while done < n:
        local = _IoVec(base + done, n - done)
        remote = _IoVec(addr + done, n - done)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got == 0:
            raise OSError(errno.EFAULT, os.strerror(errno.EFAULT))
        done += got


class _ThreadBuffers(threading.local):
    """Each thread's own staging buffer and I/O vectors, built once: the hot path's
    transfers (an ioctl header, a control's parameter block, their write-back) are small,
    and building ctypes objects per transfer cost more than the system call."""

    SIZE = 64 << 10

    def __init__(self) -> None:
        self.buf = ctypes.create_string_buffer(self.SIZE)
        self.base = ctypes.addressof(self.buf)
        self.local = (_IoVec * 2)()
        self.remote = (_IoVec * 2)()
        self.local_at = ctypes.addressof(self.local)
        self.remote_at = ctypes.addressof(self.remote)


_tls = _ThreadBuffers()
# The same calls with plain addresses (no per-call pointer conversion: ~0.7 µs each)
_by_addr = ctypes.CDLL(None, use_errno=True)
_readv_at, _writev_at = _by_addr.process_vm_readv, _by_addr.process_vm_writev
for _f in (_readv_at, _writev_at):
    _f.restype = ctypes.c_ssize_t
    _f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]


def vm_read(pid: int, addr: int, n: int) -> bytes:
    """Read exactly n bytes at addr in process pid (OSError: EFAULT, ESRCH, EPERM, EINVAL)."""
    _check_range(pid, addr, n)
    if n == 0:
        return b""
    if n <= _ThreadBuffers.SIZE:
        t = _tls
        local, remote = t.local[0], t.remote[0]
        local.iov_base, local.iov_len = t.base, n
        remote.iov_base, remote.iov_len = addr, n
        if _readv_at(pid, t.local_at, 1, t.remote_at, 1, 0) == n:
            return ctypes.string_at(t.base, n)
        # short or failed (a page that faults, a range over two mappings): the careful way
    buf = ctypes.create_string_buffer(n)
    _transfer(_libc.process_vm_readv, pid, addr, buf, n)
    return buf.raw


def vm_write(pid: int, addr: int, data: bytes) -> None:
    """Write all of data at addr in process pid (OSError: EFAULT, ESRCH, EPERM, EINVAL)."""
    data = bytes(data)
    _check_range(pid, addr, len(data))
    if not data:
        return
    buf = ctypes.create_string_buffer(data, len(data))
    _transfer(_libc.process_vm_writev, pid, addr, buf, len(data))


def vm_write_many(pid: int, writes: list[tuple[int, bytes]]) -> None:
    """Several writes into process pid with one process_vm_writev (a call's nested results
    and its argument: one system call instead of two). If the kernel stops short (a page
    that faults), the writes are redone one by one so that the failing one raises."""
    writes = [(a, bytes(d)) for a, d in writes if d]
    if not writes:
        return
    if len(writes) == 1:
        vm_write(pid, *writes[0])
        return
    for a, d in writes:
        _check_range(pid, a, len(d))
    total = sum(len(d) for _a, d in writes)
    if len(writes) == 2 and total <= _ThreadBuffers.SIZE:  # a call's results and argument
        t = _tls
        at = t.base
        for i, (a, d) in enumerate(writes):
            ctypes.memmove(at, d, len(d))
            lo, re = t.local[i], t.remote[i]
            lo.iov_base, lo.iov_len = at, len(d)
            re.iov_base, re.iov_len = a, len(d)
            at += len(d)
        if _writev_at(pid, t.local_at, 2, t.remote_at, 2, 0) == total:
            return
        for a, d in writes:  # partial or failed: find the write that fails, in order
            vm_write(pid, a, d)
        return
    bufs = [ctypes.create_string_buffer(d, len(d)) for _a, d in writes]
    local = (_IoVec * len(writes))(*[_IoVec(ctypes.addressof(b), len(d))
                                     for b, (_a, d) in zip(bufs, writes)])
    remote = (_IoVec * len(writes))(*[_IoVec(a, len(d)) for a, d in writes])
    total = sum(len(d) for _a, d in writes)
    got = _libc.process_vm_writev(pid, local, len(writes), remote, len(writes), 0)
    if got == total:
        return
    for a, d in writes:  # partial or failed: find the write that fails, in order
        vm_write(pid, a, d)


def pidfd_getfd(pid: int, fd: int) -> int:
    """Duplicate process pid's file descriptor fd into this process (close-on-exec).

    Needs ptrace access to pid (root has it). Raises OSError: ESRCH (no process),
    EBADF (no such fd), EPERM.
    """
    if not isinstance(fd, int) or fd < 0 or fd > 0x7FFFFFFF:
        raise OSError(errno.EBADF, f"bad fd {fd!r}")
    pidfd = os.pidfd_open(pid)
    try:
        return linux.pidfd_getfd(pidfd, fd)
    finally:
        os.close(pidfd)
