"""The sandbox's stat shim: make the broker's node files stat() as NVIDIA character devices.

NVML 535 ``stat()``s ``/dev/nvidiactl`` (and ``/dev/nvidia<N>``) before its first ioctl and
gives up ("GPU access blocked by the operating system") unless it is a character device
195:255 (195:N). The FUSE front end's nodes are regular files, and must stay so: a FUSE inode
that claims to be S_IFCHR is opened as the real character device by the kernel.

So the sandbox puts the tenant under a seccomp filter
(:func:`devbroker.sandbox.seccompwire.build_stat_shim_filter`) that sends the stat family
(``stat``, ``lstat``, ``fstat``, ``newfstatat``, ``statx``) to a :class:`StatShim` running in
the ``devbroker exec`` process, outside the tenant's namespaces. For each call the shim

1. reads the path from the tenant (``process_vm_readv``, as ``procmem.vm_read`` but without
   per-call allocations: :class:`PathReader`); a path whose last component is not
   the name of one of the tenant's nodes, or an fd whose ``/proc/<tid>/fd/<fd>`` link does
   not end in one, is CONTINUEd at once (the kernel does the real call: most stats cost
   only the round trip);
2. resolves a candidate as the kernel would for the tenant: relative to
   ``/proc/<tid>/cwd`` or ``/proc/<tid>/fd/<dirfd>``, inside ``/proc/<tid>/root``
   (``openat2(RESOLVE_IN_ROOT)``, ``O_NOFOLLOW`` for lstat/``AT_SYMLINK_NOFOLLOW``), and
   compares ``(st_dev, st_ino)`` with the node files the sandbox bound at ``/dev/nvidia*``;
3. for a node: performs the real ``fstat``/``statx`` on what it resolved, sets the type to
   ``S_IFCHR`` (permission bits kept) and the device number to the node's (nvidiactl
   195:255, nvidia<N> 195:N, nvidia-uvm(-tools) <uvm major>:0/1), writes the struct into the
   tenant (``/proc/<tid>/mem``, opened before ``NOTIF_ID_VALID`` so that a recycled tid can
   never be written) and answers 0. Anything else: CONTINUE.

Faking a stat result grants nothing: the open still reaches the FUSE node and the broker,
and every other decision stays the kernel's. See docs/sandbox.md ("The stat shim").

With ``notify_mmap`` (``devbroker exec`` installs it so) the filter sends file mappings here
too, and one of a broker placeholder (a seccomp tenant's node memfd that reached this tenant
over a socket; the FUSE front end never sees a memfd's mapping) is refused EACCES
(:meth:`StatShim._mmap`); every other mapping is CONTINUEd.

Sans-IO parts (:func:`parse_stat_call`, :func:`plan`, :func:`node_numbers`) are separate
from the loop; this module imports only the standard library and the sans-IO seccomp codec,
because it is loaded into every ``devbroker exec`` / ``python -m devbroker.sandbox``.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import select
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Sequence, TypeGuard

from devbroker.sandbox import seccompwire as w

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
_NODE_NAME = re.compile(r"^nvidia(ctl|[0-9]+|-uvm|-uvm-tools)$")

# ---------------------------------------------------------------------------------------
# sans-IO
# ---------------------------------------------------------------------------------------


def node_numbers(name: str, uvm_major: int) -> tuple[int, int] | None:
    """(major, minor) a node file named ``name`` stands for, or None."""
    m = _NODE_NAME.match(name)
    if not m:
        return None
    tail = m.group(1)
    if tail == "ctl":
        return NVIDIA_MAJOR, NVIDIACTL_MINOR
    if tail == "-uvm":
        return uvm_major, 0
    if tail == "-uvm-tools":
        return uvm_major, 1
    n = int(tail)
    return (NVIDIA_MAJOR, n) if n < NVIDIACTL_MINOR else None


class StatCall(NamedTuple):
    """One stat-family system call, decoded from its seccomp_data (a NamedTuple: it is built
    for every stat the tenant makes)."""

    statx: bool  # struct statx at buf (else struct stat)
    dirfd: int  # AT_FDCWD for stat/lstat
    path_ptr: int | None  # None: fstat(fd) (the fd is dirfd)
    flags: int  # AT_* flags (lstat: AT_SYMLINK_NOFOLLOW; fstat: AT_EMPTY_PATH)
    buf: int
    mask: int = 0  # statx's mask

    @property
    def follow(self) -> bool:
        return not self.flags & w.AT_SYMLINK_NOFOLLOW

    @property
    def size(self) -> int:
        return w.STATX_SIZE if self.statx else w.STAT_SIZE


_NR_STAT, _NR_FSTAT, _NR_LSTAT = w.NR["stat"], w.NR["fstat"], w.NR["lstat"]
_NR_NEWFSTATAT, _NR_STATX = w.NR["newfstatat"], w.NR["statx"]
_NR_MMAP = w.NR["mmap"]


def _c_int(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def parse_raw(nr: int, args: Sequence[int]) -> StatCall | None:
    """Decode stat/lstat/fstat/newfstatat/statx from an x86_64 nr and args."""
    if nr == _NR_NEWFSTATAT:
        return StatCall(False, _c_int(args[0]), args[1], args[3] & 0xFFFFFFFF, args[2])
    if nr == _NR_STATX:
        return StatCall(True, _c_int(args[0]), args[1], args[2] & 0xFFFFFFFF, args[4],
                        args[3] & 0xFFFFFFFF)
    if nr == _NR_STAT:
        return StatCall(False, w.AT_FDCWD, args[0], 0, args[1])
    if nr == _NR_FSTAT:
        return StatCall(False, _c_int(args[0]), None, w.AT_EMPTY_PATH, args[1])
    if nr == _NR_LSTAT:
        return StatCall(False, w.AT_FDCWD, args[0], w.AT_SYMLINK_NOFOLLOW, args[1])
    return None


def parse_stat_call(d: w.SeccompData) -> StatCall | None:
    """Decode stat/lstat/fstat/newfstatat/statx (x86_64); None for anything else."""
    if d.arch != w.AUDIT_ARCH_X86_64:
        return None
    return parse_raw(d.nr, d.args)


@dataclass(frozen=True)
class Continue:
    reason: str


@dataclass(frozen=True)
class FdTarget:
    fd: int


@dataclass(frozen=True)
class PathTarget:
    dirfd: int
    path: bytes
    follow: bool


def needs_path(call: StatCall) -> bool:
    """Whether the path must be read from the tenant before :func:`plan` can decide."""
    return call.path_ptr is not None and call.path_ptr != 0


def plan(call: StatCall, path: bytes | None, names: frozenset[str] | frozenset[bytes]) -> Continue | FdTarget | PathTarget:
    """What to look at for this call: an fd, a path, or nothing (CONTINUE).

    ``path`` is the string read at ``call.path_ptr`` (None when there is none). ``names`` are
    the node file names (``nvidiactl``, ``nvidia0``, …): a path whose last component is not
    one of them cannot name a node (the nodes are bind mounts of those names in a read-only
    /dev; see docs for symlinks), so it is CONTINUEd without any lookup.
    """
    if call.path_ptr is None:
        return FdTarget(call.dirfd)
    if call.path_ptr == 0 or path is None:
        # NULL with AT_EMPTY_PATH means the fd itself (Linux 6.11+); else the kernel's EFAULT
        return FdTarget(call.dirfd) if call.path_ptr == 0 and call.flags & w.AT_EMPTY_PATH \
            else Continue("no path")
    if path == b"":
        return FdTarget(call.dirfd) if call.flags & w.AT_EMPTY_PATH else Continue("empty path")
    if path.rpartition(b"/")[2] not in _as_bytes(names):
        return _NOT_A_NODE
    return PathTarget(call.dirfd, path, call.follow)


_NOT_A_NODE = Continue("not a node name")
class _Continue:
    """StatShim's "let the kernel do it" (_CONTINUE, the one instance)."""


_CONTINUE = _Continue()


def _all_bytes(names: frozenset[str] | frozenset[bytes]) -> TypeGuard[frozenset[bytes]]:
    return not names or isinstance(next(iter(names)), bytes)


def _as_bytes(names: frozenset[str] | frozenset[bytes]) -> frozenset[bytes]:
    if _all_bytes(names):
        return names
    return frozenset(n.encode() for n in names if isinstance(n, str))


def tenant_path(path: bytes, base: bytes | None, root: bytes) -> bytes | None:
    """path as an absolute path in the tenant's root.

    ``base`` is the directory a relative path starts from (``/proc/<tid>/cwd`` or
    ``/proc/<tid>/fd/<dirfd>`` as read by the supervisor: absolute from the tenant's mount
    namespace root), ``root`` the tenant's root read the same way (``/`` unless chrooted).
    None when it cannot be expressed (a base outside the root, a deleted or non-directory
    base such as ``pipe:[…]``).
    """
    if path.startswith(b"/"):
        return path
    if base is None or not base.startswith(b"/"):
        return None
    if root != b"/":
        if base == root:
            base = b"/"
        elif base.startswith(root + b"/"):
            base = base[len(root):]
        else:
            return None
    return base.rstrip(b"/") + b"/" + path


def proc_devices_view(host_text: str, *, preferred_uvm_major: int = 238) -> tuple[str, int]:
    """The tenant's /proc/devices: the host's, plus ``195 nvidia-frontend`` and
    ``<major> nvidia-uvm`` in the character section unless the host has them (a host with the
    driver keeps its own lines and its own UVM major). Returns (text, uvm major).

    A free major is taken for UVM when the host has none: ``preferred_uvm_major`` (238, as on
    the H200 machine) if free, else the highest free one in the dynamic range 234..254.
    """
    lines = host_text.splitlines()
    try:
        start = lines.index("Character devices:") + 1
    except ValueError:
        lines, start = ["Character devices:"] + lines, 1
    end = start
    while end < len(lines) and lines[end].strip():
        end += 1
    entries: list[tuple[int, str]] = []
    for ln in lines[start:end]:
        parts = ln.split(None, 1)
        if len(parts) == 2 and parts[0].isdigit():
            entries.append((int(parts[0]), parts[1]))
    used = {maj for maj, _ in entries}
    uvm = next((maj for maj, name in entries if name == "nvidia-uvm"), None)
    if uvm is None:
        free = [m for m in range(254, 233, -1) if m not in used and m != NVIDIA_MAJOR]
        uvm = preferred_uvm_major if preferred_uvm_major not in used else (free[0] if free else 0)
        if not uvm:
            raise ValueError("no free character major for nvidia-uvm")
        entries.append((uvm, "nvidia-uvm"))
    if NVIDIA_MAJOR not in used:
        entries.append((NVIDIA_MAJOR, "nvidia-frontend"))
    entries.sort(key=lambda e: e[0])  # stable: the host's order within one major is kept
    body = [f"{maj:3d} {name}" for maj, name in entries]
    out = lines[:start] + body + lines[end:]
    return "\n".join(out) + "\n", uvm


# ---------------------------------------------------------------------------------------
# system calls (ctypes; no trio, nothing outside the standard library)
# ---------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.ioctl.restype = ctypes.c_int
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]

_NR_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_O_PATH = getattr(os, "O_PATH", 0o10000000)
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PATH_MAX = 4096


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def openat2(dirfd: int, path: bytes, flags: int, resolve: int) -> int:
    how = _OpenHow(flags, 0, resolve)
    fd = _libc.syscall(ctypes.c_long(_NR_OPENAT2), ctypes.c_long(dirfd), ctypes.c_char_p(path),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        raise _errno_error("openat2")
    return int(fd)


def raw_fstat(fd: int) -> bytes:
    """The kernel's struct stat of fd (newfstatat(fd, "", AT_EMPTY_PATH))."""
    buf = ctypes.create_string_buffer(w.STAT_SIZE)
    if _libc.syscall(ctypes.c_long(w.NR["newfstatat"]), ctypes.c_long(fd), ctypes.c_char_p(b""),
                     buf, ctypes.c_long(w.AT_EMPTY_PATH)) != 0:
        raise _errno_error("fstat")
    return buf.raw


def raw_statx(fd: int, flags: int, mask: int) -> bytes:
    """The kernel's struct statx of fd, with the tenant's sync flags and mask."""
    buf = ctypes.create_string_buffer(w.STATX_SIZE)
    if _libc.syscall(ctypes.c_long(w.NR["statx"]), ctypes.c_long(fd), ctypes.c_char_p(b""),
                     ctypes.c_long(w.AT_EMPTY_PATH | (flags & w.AT_STATX_SYNC_TYPE)),
                     ctypes.c_long(mask), buf) != 0:
        raise _errno_error("statx")
    return buf.raw


def get_notif_sizes() -> w.NotifSizes:
    buf = ctypes.create_string_buffer(6)
    if _libc.syscall(ctypes.c_long(w.NR["seccomp"]), ctypes.c_long(w.SECCOMP_GET_NOTIF_SIZES),
                     ctypes.c_long(0), buf) != 0:
        raise _errno_error("seccomp(SECCOMP_GET_NOTIF_SIZES)")
    return w.NotifSizes.decode(buf.raw).check()


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]


class PathReader:
    """Reads NUL-terminated paths from a tenant with ``process_vm_readv`` (what
    ``procmem.vm_read`` does, without its per-call allocations: this runs for every stat).

    Reads at most up to the end of the page the string starts in, and only ``first`` bytes
    the first time (most paths are short), so a path at the end of a mapping reads fine."""

    def __init__(self, first: int = 256):
        self.first = first
        self._buf = ctypes.create_string_buffer(_PATH_MAX)
        self._base = ctypes.addressof(self._buf)
        self._local = _IoVec(self._base, 0)
        self._remote = _IoVec(0, 0)
        self._lp, self._rp = ctypes.byref(self._local), ctypes.byref(self._remote)

    def read(self, tid: int, addr: int) -> bytes:
        done = 0
        want = self.first
        while done < _PATH_MAX:
            n = min(want, _PAGE - (addr % _PAGE), _PATH_MAX - done)
            self._local.iov_base, self._local.iov_len = self._base + done, n
            self._remote.iov_base, self._remote.iov_len = addr, n
            got = _libc.process_vm_readv(tid, self._lp, 1, self._rp, 1, 0)
            if got <= 0:
                err = ctypes.get_errno() if got < 0 else errno.EFAULT
                raise OSError(err, os.strerror(err))
            chunk = ctypes.string_at(self._base + done, got)
            nul = chunk.find(b"\0")
            if nul >= 0:
                return ctypes.string_at(self._base, done + nul)
            done += got
            addr += got
            want = _PAGE
        raise OSError(errno.ENAMETOOLONG, "path too long")


# ---------------------------------------------------------------------------------------
# the tenant side: install the filter, hand the listener over
# ---------------------------------------------------------------------------------------

FILTER_FLAGS = w.SECCOMP_FILTER_FLAG_NEW_LISTENER | w.SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV


class _FProg(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_and_send(sock_fd: int, prog: bytes | None = None) -> None:
    """In the tenant command, after no_new_privs and before exec: install the stat shim filter
    with a new listener, send the listener over sock_fd (SCM_RIGHTS; one byte: ``K`` when
    WAIT_KILLABLE_RECV is in effect, ``I`` when this kernel lacks it), close both.

    Between the install and the send no stat may happen (it would wait for a supervisor
    that has no listener yet): everything is prepared before the install.
    """
    if prog is None:
        prog = w.build_stat_shim_filter()
    buf = ctypes.create_string_buffer(prog, len(prog))
    fp = _FProg(len(prog) // 8, ctypes.addressof(buf))
    sock = socket.socket(fileno=sock_fd)
    nr, mode = ctypes.c_long(w.NR["seccomp"]), ctypes.c_long(w.SECCOMP_SET_MODE_FILTER)
    tag = b"K"
    lfd = _libc.syscall(nr, mode, ctypes.c_long(FILTER_FLAGS), ctypes.byref(fp))
    if lfd < 0 and ctypes.get_errno() == errno.EINVAL:
        tag = b"I"  # no SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV (Linux < 5.19)
        lfd = _libc.syscall(nr, mode,
                            ctypes.c_long(FILTER_FLAGS & ~w.SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV),
                            ctypes.byref(fp))
    if lfd < 0:
        err = ctypes.get_errno()
        sock.close()
        hint = " (another seccomp listener is already installed)" if err == errno.EBUSY else ""
        raise OSError(err, f"seccomp(SET_MODE_FILTER, NEW_LISTENER): {os.strerror(err)}{hint}")
    try:
        sock.sendmsg([tag], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("=i", lfd))])
    finally:
        os.close(lfd)
        sock.close()


def recv_listener(sock: socket.socket, stop_fd: int = -1) -> tuple[int, bool] | None:
    """The listener the tenant sent (and whether WAIT_KILLABLE_RECV is in effect), or None
    if the tenant side closed the socket without sending one or stop_fd became readable."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    if stop_fd >= 0:
        poller.register(stop_fd, select.POLLIN)
    while True:
        ready = dict(poller.poll())
        if stop_fd in ready:
            return None
        if ready:
            break
    msg, anc, _flags, _addr = sock.recvmsg(1, socket.CMSG_SPACE(4 * 4))
    fds: list[int] = []
    for level, typ, data in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            n = len(data) // 4
            fds.extend(struct.unpack(f"={n}i", data[: 4 * n]))
    for extra in fds[1:]:
        os.close(extra)
    if not fds:
        return None
    return fds[0], msg == b"K"


# ---------------------------------------------------------------------------------------
# the supervisor
# ---------------------------------------------------------------------------------------


def node_table(tenant_dir: Path, names: list[str], uvm_major: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(st_dev, st_ino) of each node file -> (major, minor) it stands for."""
    out = {}
    for name in names:
        nums = node_numbers(name, uvm_major)
        if nums is None:
            continue
        st = os.stat(Path(tenant_dir) / name)
        out[(st.st_dev, st.st_ino)] = nums
    return out


@dataclass
class ShimStats:
    notifications: int = 0
    faked: int = 0
    continued: int = 0  # answered CONTINUE (the kernel did the real call)
    looked_up: int = 0  # candidates resolved (node-named paths, node-looking fds)
    stale: int = 0  # the caller went away before the answer
    errors: int = 0  # unexpected failures (answered CONTINUE)
    refused_maps: int = 0  # mappings of a broker placeholder refused (EACCES)


class StatShim:
    """Answers one listener's stat notifications (one per ``devbroker exec``).

    ``nodes`` maps the node files' ``(st_dev, st_ino)`` to the ``(major, minor)`` to report;
    ``names`` are their file names as bound in the tenant's /dev.

    One thread, one notification at a time: every stat of the tenant tree waits here, so
    the common case (not a node) is kept to a decode, a path read and a CONTINUE.
    """

    # seccomp_notif: id, pid, flags, then seccomp_data: nr, arch, ip, args[6]
    _NOTIF = struct.Struct("=QIIiIQ6Q")
    _RESP = struct.Struct("=QqiI")

    def __init__(self, nodes: Mapping[tuple[int, int], tuple[int, int]],
                 names: Sequence[str] | frozenset[str], *,
                 sizes: w.NotifSizes | None = None, log: Callable[[str], None] | None = None,
                 on_refused_map: Callable[[int, int], None] | None = None):
        # on_refused_map(tid, fd): told of each refused mapping (the audit record), from the
        # shim's thread; must not raise
        self.on_refused_map = on_refused_map
        self.nodes = dict(nodes)
        self.names = frozenset(names)
        self._bnames = frozenset(n.encode() for n in self.names)
        self.sizes = (sizes or get_notif_sizes()).check()
        self.stats = ShimStats()
        self._listener = -1
        self._log = log or (lambda msg: print(f"devbroker stat shim: {msg}", file=sys.stderr))
        self._logged = 0
        self._paths = PathReader()
        self._recv_buf = bytearray(max(self.sizes.notif, w.SECCOMP_NOTIF_SIZE))
        self._zero = bytes(len(self._recv_buf))
        self._resp_buf = bytearray(max(self.sizes.resp, w.SECCOMP_NOTIF_RESP_SIZE))

    # -- listener ------------------------------------------------------------------------

    def id_valid(self, nid: int) -> bool:
        try:
            fcntl.ioctl(self._listener, w.SECCOMP_IOCTL_NOTIF_ID_VALID, w.encode_id(nid))
            return True
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            raise

    def _send(self, resp: w.NotifResp) -> None:
        self._send_raw(resp.id, resp.val, resp.error, resp.flags)

    def _send_raw(self, nid: int, val: int, error: int, flags: int) -> None:
        self._RESP.pack_into(self._resp_buf, 0, nid, val, error, flags)
        try:
            fcntl.ioctl(self._listener, w.SECCOMP_IOCTL_NOTIF_SEND, self._resp_buf, True)
        except OSError as e:
            if e.errno != errno.ENOENT:  # the task died or was interrupted
                raise
            self.stats.stale += 1

    def serve(self, listener: int, stop_fd: int = -1) -> None:
        """Answer notifications until no task uses the filter (POLLHUP) or stop_fd becomes
        readable. The caller keeps ownership of listener."""
        self._listener = listener
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        if stop_fd >= 0:
            poller.register(stop_fd, select.POLLIN)
        buf, zero, unpack = self._recv_buf, self._zero, self._NOTIF.unpack_from
        recv = w.SECCOMP_IOCTL_NOTIF_RECV
        cont = w.SECCOMP_USER_NOTIF_FLAG_CONTINUE
        while True:
            try:
                events = poller.poll()
            except InterruptedError:
                continue
            for fd, ev in events:
                if fd == stop_fd:
                    return
                if not ev & select.POLLIN:
                    if ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        return
                    continue
                buf[:] = zero  # RECV wants a zeroed buffer
                try:
                    fcntl.ioctl(listener, recv, buf, True)
                except OSError as e:
                    if e.errno in (errno.ENOENT, errno.EINTR):
                        continue  # the caller went away meanwhile
                    raise
                nid, tid, _flags, nr, arch, _ip, *args = unpack(buf)
                answer = self._answer(nid, tid, nr, arch, args)
                if answer is None:
                    continue
                if isinstance(answer, _Continue):
                    self._send_raw(nid, 0, 0, cont)
                else:
                    self._send_raw(nid, 0, -answer if answer else 0, 0)

    # -- one notification ---------------------------------------------------------------

    def handle(self, n: w.Notif) -> w.NotifResp | None:
        """The answer to n (None when it must not be answered: the caller went away)."""
        d = n.data
        answer = self._answer(n.id, n.pid, d.nr, d.arch, d.args)
        if answer is None:
            return None
        if isinstance(answer, _Continue):
            return w.NotifResp.cont(n.id)
        return w.NotifResp.fail(n.id, answer) if answer else w.NotifResp.ok(n.id, 0)

    def _answer(self, nid: int, tid: int, nr: int, arch: int,
                args: Sequence[int]) -> _Continue | int | None:
        """_CONTINUE, 0 (faked: answer 0), a positive errno, or None (do not answer)."""
        st = self.stats
        st.notifications += 1
        answer: _Continue | int | None
        try:
            call = parse_raw(nr, args) if arch == w.AUDIT_ARCH_X86_64 else None
            if nr == _NR_MMAP and arch == w.AUDIT_ARCH_X86_64:
                answer = self._mmap(tid, _c_int(args[4]))
            elif call is None:
                answer = _CONTINUE
            else:
                answer = self._stat(nid, tid, call)
        except Exception as e:  # noqa: BLE001 - fail open: the kernel does the real stat
            st.errors += 1
            if self._logged < 5:
                self._logged += 1
                self._log(f"{w.NR_NAME.get(nr, nr)} from {tid} failed ({e!r}); "
                          "letting the kernel answer")
            answer = _CONTINUE
        if isinstance(answer, _Continue):
            st.continued += 1
        return answer

    def _mmap(self, tid: int, fd: int) -> _Continue | int:
        """A file mapping (filter with notify_mmap): refused EACCES when the file is a broker
        placeholder (a seccomp tenant's node file that reached this tenant over a socket:
        its pages are that tenant's), else CONTINUE. The kernel looks the fd up again after
        a CONTINUE: a thread that swaps a placeholder onto the number meanwhile is not
        stopped (docs/security.md)."""
        if fd < 0:
            return _CONTINUE
        try:
            link = os.readlink(f"/proc/{tid}/fd/{fd}")
        except OSError:
            return _CONTINUE  # (no such fd: the kernel answers EBADF itself)
        if not link.startswith(w.PLACEHOLDER_LINK):
            return _CONTINUE
        self.stats.refused_maps += 1
        if self.on_refused_map is not None:
            self.on_refused_map(tid, fd)
        return errno.EACCES

    def _stat(self, nid: int, tid: int, call: StatCall) -> _Continue | int | None:
        # the cheap tests first: most stats are of files that are not nodes
        path = None
        if call.path_ptr:
            try:
                path = self._paths.read(tid, call.path_ptr)
            except OSError:
                return _CONTINUE  # the kernel reports EFAULT/ENAMETOOLONG itself
            if path and path.rpartition(b"/")[2] not in self._bnames:
                return _CONTINUE
        target = plan(call, path, self._bnames)
        if isinstance(target, Continue):
            return _CONTINUE
        if isinstance(target, FdTarget) and not self._fd_may_be_node(tid, target.fd):
            return _CONTINUE
        self.stats.looked_up += 1
        try:
            fd = self._open_target(tid, target)
        except OSError:
            return _CONTINUE
        try:
            st = os.fstat(fd)
            nums = self.nodes.get((st.st_dev, st.st_ino))
            if nums is None:
                return _CONTINUE
            raw = raw_statx(fd, call.flags, call.mask) if call.statx else raw_fstat(fd)
        except OSError:
            return _CONTINUE
        finally:
            os.close(fd)
        out = (w.fake_chr_statx if call.statx else w.fake_chr_stat)(raw, *nums)
        # /proc/<tid>/mem is bound to the task's memory when opened; NOTIF_ID_VALID afterwards
        # proves the task was still the notifying one then, so a recycled tid is never written.
        try:
            mem = os.open(f"/proc/{tid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            self.stats.stale += 1
            return None
        try:
            if not self.id_valid(nid):
                self.stats.stale += 1
                return None
            try:
                if os.pwrite(mem, out, call.buf) != len(out):
                    return errno.EFAULT
            except (OSError, OverflowError):
                return errno.EFAULT
        finally:
            os.close(mem)
        self.stats.faked += 1
        return 0

    @staticmethod
    def _link(path: str) -> bytes | None:
        try:
            return os.readlink(path.encode())
        except OSError:
            return None

    def _fd_may_be_node(self, tid: int, fd: int) -> bool:
        """Cheap pre-check for fstat: does the fd's path end in a node name? (readlink of
        the magic link reads no file system; sockets/pipes read ``socket:[…]``.)"""
        if fd < 0:
            return False  # AT_FDCWD: the cwd is a directory; else EBADF
        link = self._link(f"/proc/{tid}/fd/{fd}")
        return link is not None and link.rpartition(b"/")[2] in self._bnames

    def _open_target(self, tid: int, target: FdTarget | PathTarget) -> int:
        """An O_PATH fd on what the call names, as the tenant would resolve it."""
        flags = _O_PATH | os.O_CLOEXEC
        if isinstance(target, FdTarget):
            # the magic link opens the tenant's file itself (no lookup, no FUSE open)
            return os.open(f"/proc/{tid}/fd/{target.fd}", flags)
        root = self._link(f"/proc/{tid}/root")
        if root is None:
            raise OSError(errno.ESRCH, "no root")
        base = None
        if not target.path.startswith(b"/"):
            base = self._link(f"/proc/{tid}/cwd" if target.dirfd == w.AT_FDCWD
                              else f"/proc/{tid}/fd/{target.dirfd}")
        full = tenant_path(target.path, base, root)
        if full is None:
            raise OSError(errno.ENOENT, "cannot resolve")
        if not target.follow:
            flags |= os.O_NOFOLLOW
        rootfd = os.open(f"/proc/{tid}/root", _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return openat2(rootfd, full, flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        finally:
            os.close(rootfd)
