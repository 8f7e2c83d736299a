"""The seccomp user-notification front end (for hosts without CUSE and without our module).

A tenant is started under a seccomp filter (:func:`devbroker.sandbox.seccompwire.build_filter`)
whose listener fd belongs to a :class:`SeccompSupervisor` running in the broker's trio loop:

* ``open``/``openat``/``openat2`` of a node path the caller allowed (``/dev/nvidiactl``, …)
  -> ``broker.open``; the supervisor creates a **memfd** placeholder for the session and
  installs it as the syscall's result with ``SECCOMP_IOCTL_NOTIF_ADDFD`` +
  ``SECCOMP_ADDFD_FLAG_SEND``. Any other path is CONTINUEd (the kernel opens it).
* ``ioctl`` with an NVIDIA-looking cmd on a placeholder fd -> ``broker.ioctl`` (argument
  copied in, ``arg_out`` copied back); on any other fd -> CONTINUE.
* file-backed ``mmap`` of a placeholder fd -> ``broker.map_read``; the bytes are written into
  the memfd and the mmap is CONTINUEd, so the tenant maps the memfd natively.
* session end = the memfd inode is evicted (last fd *and* last mapping gone, in any process),
  seen as ``IN_DELETE_SELF`` on an inotify watch; no close() interception.

See docs/seccomp.md for the design, the residual TOCTOU risks and the limits.

Entry points: :func:`run_tenant` (spawn + supervise + wait),
:func:`default_nodes`, :class:`SeccompSupervisor` (``serve(listener_fd)``,
``session_for_fd(pid, fd)``), :func:`tenant_command` (the trampoline argv).
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import functools
import logging
import os
import posixpath
import select
import signal
import socket
import stat as _stat
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import trio

from devbroker.abi.nodes import NodeKind
from devbroker.backends.base import NotHere
from devbroker.broker import laneexec, limits, memgate, rewrite, rules
from devbroker.broker.objects import BOOKS
from devbroker.broker.effects import (
    STATE_LOCK, Await, Blocking, HandOver, RateLimit, ReadMemory, Steps, WriteMemory,
    perform_async, perform_blocking, run_async, run_blocking,
)
from devbroker.broker.procinfo import pid_namespace, stat_nosync as _stat_nosync
from devbroker.broker.interface import (
    BrokerInterface,
    Caller,
    IoctlRequest,
    MapCheckReply,
    MapReadReply,
    MapReadRequest,
    OpenRequest,
    ReleaseRequest,
)
from devbroker.backends.tenantfile import (
    CAP_SYS_ADMIN, drop_driver_capabilities_for_thread, thread_is_driver_safe,
)
from devbroker.frontends import nativelane
from devbroker.sandbox import seccompwire as w
from devbroker.frontends.common import (
    GENERAL as _GENERAL, control_lane_of, start_task, to_trio,
)
from devbroker.frontends.procmem import vm_write_many
from devbroker.sandbox import linux

log = logging.getLogger("devbroker.seccomp")
# NV20_SUBDEVICE_0, and the control NVML sends a new one first (SeccompSupervisor._booked)
SUBDEVICE_CLASS = 0x2080
FB_GET_INFO_V2 = 0x20801303

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.inotify_init1.restype = ctypes.c_int
_libc.inotify_add_watch.restype = ctypes.c_int
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]

# Readable while a live upgrade pauses the supervisors: wakes their threads from poll()
# (one for the process: every supervisor pauses and resumes together).
_HANDOVER_WAKE = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
IN_DELETE_SELF = 0x00000400
IN_IGNORED = 0x00008000
PIDFD_THREAD = os.O_EXCL  # Linux 6.9: a pidfd for a (non-leader) thread
_PAGE = os.sysconf("SC_PAGE_SIZE")
_NR_IOCTL = w.NR["ioctl"]
_NR_OPEN = w.NR["open"]
_NR_OPENS = frozenset({w.NR["open"], w.NR["openat"], w.NR["openat2"]})
_PATH_MAX = 4096


class SeccompError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------
# small syscall helpers (private; procmem covers vm_read/vm_write)
# ---------------------------------------------------------------------------------------


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


class _Undecided(BaseException):
    """A notification's wait for its pace token was ended by a live upgrade: nothing of it
    was decided; the successor (or this supervisor, when the upgrade is called off) decides
    it from the start. A BaseException, so that no step's `except Exception` keeps it."""


def listener_cpus() -> set[int] | None:
    """The CPUs listener threads keep to (DEVBROKER_LISTENER_CPUS="2" or "2,3"; unset: any,
    the kernel's choice). An experiment's knob (docs/benchmarks.md): a thread woken on
    another CPU at every notification runs its Python on cold caches; pinned, it does not,
    but its wake-ups then cross CPUs. A bad value is logged and ignored."""
    spec = os.environ.get("DEVBROKER_LISTENER_CPUS", "").strip()
    if not spec:
        return None
    try:
        cpus = {int(x) for x in spec.split(",") if x.strip()}
        return cpus & os.sched_getaffinity(0) or None
    except ValueError:
        log.warning("DEVBROKER_LISTENER_CPUS=%r: not a list of CPU numbers; ignored", spec)
        return None


def _keep_to_listener_cpus() -> None:
    cpus = listener_cpus()
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)  # (0: this thread only)
        except OSError as e:
            log.warning("listener thread: sched_setaffinity(%s): %s", sorted(cpus), e)


def get_notif_sizes() -> w.NotifSizes:
    """SECCOMP_GET_NOTIF_SIZES, checked against the codec's layouts."""
    buf = ctypes.create_string_buffer(6)
    if _libc.syscall(ctypes.c_long(w.NR["seccomp"]), ctypes.c_long(w.SECCOMP_GET_NOTIF_SIZES),
                     ctypes.c_long(0), buf) != 0:
        _raise_errno("seccomp(SECCOMP_GET_NOTIF_SIZES)")
    return w.NotifSizes.decode(buf.raw).check()


def _pidfd_getfd(tid: int, fd: int) -> int:
    """Duplicate thread tid's fd (pidfd_getfd; PIDFD_THREAD so that any thread id works)."""
    try:
        pidfd = os.pidfd_open(tid, PIDFD_THREAD)
    except OSError:
        pidfd = os.pidfd_open(tid)  # a thread-group leader, on kernels without PIDFD_THREAD
    try:
        return linux.pidfd_getfd(pidfd, fd)
    finally:
        os.close(pidfd)


_libc.ioctl.restype = ctypes.c_int
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]


def _ioctl_int(fd: int, req: int, arg: bytes) -> int:
    """ioctl(2) returning its (non-negative) result; fcntl.ioctl returns the buffer instead."""
    buf = ctypes.create_string_buffer(arg, len(arg))
    r = _libc.ioctl(fd, req, buf)
    if r < 0:
        _raise_errno("ioctl")
    return r


def _vm_read(pid: int, addr: int, n: int) -> bytes:
    from devbroker.frontends.procmem import vm_read

    return vm_read(pid, addr, n)


def _vm_write(pid: int, addr: int, data: bytes) -> None:
    from devbroker.frontends.procmem import vm_write

    vm_write(pid, addr, data)


def read_cstring(pid: int, addr: int, limit: int = _PATH_MAX) -> bytes:
    """A NUL-terminated string from pid's memory, read page by page (never past a page
    that is not needed, so a path at the end of a mapping reads fine)."""
    out = bytearray()
    while len(out) < limit:
        chunk = min(_PAGE - (addr % _PAGE), limit - len(out))
        data = _vm_read(pid, addr, chunk)
        nul = data.find(b"\0")
        if nul >= 0:
            out += data[:nul]
            return bytes(out)
        out += data
        addr += chunk
    raise OSError(errno.ENAMETOOLONG, "path too long")


def _proc_status(tid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{tid}/status", "rb") as f:
        for line in f.read().decode(errors="replace").splitlines():
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


# ---------------------------------------------------------------------------------------
# nodes
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    kind: NodeKind
    minor: int = 0


def default_nodes(gpus: int | Sequence[int] = 1, caps: Sequence[int] = ()) -> dict[str, NodeSpec]:
    """The node paths a tenant may open: nvidiactl, nvidia<i>, nvidia-uvm(-tools), caps.

    For NodeKind.CAP the minor is the capability number (nvidia-cap<N>), so that a broker can
    tell the MIG config capability from the monitor one.
    """
    idx = range(gpus) if isinstance(gpus, int) else gpus
    nodes = {
        "/dev/nvidiactl": NodeSpec(NodeKind.CTL),
        "/dev/nvidia-uvm": NodeSpec(NodeKind.UVM),
        "/dev/nvidia-uvm-tools": NodeSpec(NodeKind.UVM_TOOLS),
    }
    for i in idx:
        nodes[f"/dev/nvidia{i}"] = NodeSpec(NodeKind.GPU, i)
    for c in caps:
        nodes[f"/dev/nvidia-caps/nvidia-cap{c}"] = NodeSpec(NodeKind.CAP, c)
    return nodes


def _normalize(path: str) -> str:
    p = posixpath.normpath(path)
    if p.startswith("//"):
        p = "/" + p.lstrip("/")
    return p


# ---------------------------------------------------------------------------------------
# the supervisor
# ---------------------------------------------------------------------------------------


@dataclass
class Session:
    id: int
    node: NodeKind
    minor: int
    key: tuple[int, int]  # (st_dev, st_ino) of the memfd
    wd: int
    opener: tuple[int, int]  # (tgid, fd) in the opening process, for diagnostics
    released: bool = False
    real: bool = False  # a real driver file (backends/tenantfile.py), not a memfd placeholder
    # its file fact was written for the native loop (a mapping fact, or a uvm file's:
    # `_native_map_fact`): the loop's continuation facts for it may be the node's
    file_fact: bool = False


@dataclass
class SupervisorStats:
    notifications: int = 0
    opens: int = 0
    opens_continued: int = 0
    ioctls: int = 0
    ioctls_continued: int = 0
    mmaps: int = 0
    mmaps_continued: int = 0
    released_on_last_close: int = 0
    released_at_shutdown: int = 0
    released_on_failed_install: int = 0
    stale: int = 0  # notifications whose task died before we answered
    continued_decided: int = 0  # ioctls the broker decided and the tenant's kernel ran
    refused_foreign: int = 0  # NVIDIA files the broker did not give out (refused)
    handed_to_trio: int = 0  # notifications a listener thread handed to the trio thread
    controls_fast: int = 0  # RM controls the broker's control lane admitted (fastlane.py)
    native_answered: int = 0  # notifications answered by the native loop (nativelane.py)
    settled: int = 0  # of its controls, those admitted by a settled decision (no callback)
    continued_settled: int = 0  # of its continued calls, those continued by a settled decision
    mmaps_settled: int = 0  # of its mmaps of our files, those let through by a mapping fact
    uvm_fast: int = 0  # calls its continue lane admitted (CONTINUEd): UVM, RM escapes bound to the caller
    # Time the listener threads spent deciding, by system call (ns; the answer excluded):
    # what a tenant's init pays for the broker, per kind of call.
    ns_open: int = 0
    ns_open_node: int = 0  # of ns_open: the opens of our nodes (driver open, install)
    ns_open_broker: int = 0  # of ns_open_node: the broker's open (policy, session, driver)
    ns_open_install: int = 0  # of ns_open_node: the install (ADDFD, which answers)
    opens_prepared: int = 0  # of opens: answered by the native loop with a prepared open
    ns_open_prepared: int = 0  # of ns_open_node: their time in the loop (ADDFD included)
    prepared: int = 0  # prepared opens made (policy, session, driver file) at quiet moments
    prepared_dropped: int = 0  # of those: closed unused (policy changed, shutdown, ADDFD failed)
    ns_ioctl: int = 0
    ns_mmap: int = 0
    sync_wake_up: bool = False  # the kernel wakes listener and tenant on one CPU (6.6+)
    # Where the control lane's time goes (ns, summed over its calls): the tenant's header
    # and parameters read, the broker's admission, the duplicate of the tenant's file and
    # its check, the driver call, the books and post-hook, the results written back; and
    # for every notification, the receive and the answer's send (which wakes the tenant).
    lane_ns_read: int = 0
    lane_ns_admit: int = 0
    lane_ns_dup: int = 0
    lane_ns_driver: int = 0
    lane_ns_finish: int = 0
    finished_after: int = 0  # of the lane's calls: books written after the answer (FINISH_AFTER)
    answers_settled: int = 0  # of ioctls: answered by the native loop from an answer fact
    lane_ns_write: int = 0
    ns_recv: int = 0
    ns_send: int = 0


class _NotifMemory:
    """TenantMemory of the notifying thread. Reads are confirmed together by the broker
    (IoctlRequest.confirm, before it acts on them). Writes are collected and made at the
    end of the call, together with the argument's (one NOTIF_ID_VALID, so that no write
    reaches a thread that reused the caller's tid, and one process_vm_writev);
    nothing the broker decides depends on them having happened earlier."""

    deferred = True  # writes only queue (effects.perform_blocking: no gate for them)

    def __init__(self, sup: "SeccompSupervisor", tid: int, nid: int):
        self._sup, self._tid, self._nid = sup, tid, nid
        self.pending: list[tuple[int, bytes]] = []

    def read(self, addr: int, length: int) -> bytes:
        return _vm_read(self._tid, addr, length)

    def write(self, addr: int, data: bytes) -> None:
        self.pending.append((addr, bytes(data)))


class _Writes:
    """WriteMemory's target for a call's collected writes: write(_, _) makes them all."""

    __slots__ = ("tid", "writes")

    def __init__(self, tid: int, writes: list[tuple[int, bytes]]):
        self.tid, self.writes = tid, writes

    def write(self, _addr: int, _data: bytes) -> None:
        vm_write_many(self.tid, self.writes)


class _TaskMemory:
    """A thread's memory, read and written with process_vm_readv/writev."""

    __slots__ = ("tid",)

    def __init__(self, tid: int):
        self.tid = tid

    def read(self, addr: int, length: int) -> bytes:
        return _vm_read(self.tid, addr, length)

    def write(self, addr: int, data: bytes) -> None:
        _vm_write(self.tid, addr, data)


class _CString(_TaskMemory):
    """read(addr, limit): the NUL-terminated string at addr (a path)."""

    def read(self, addr: int, length: int) -> bytes:
        return read_cstring(self.tid, addr, length)


# The name every broker gives its placeholders (seccompwire.PLACEHOLDER_PREFIX): a memfd's
# name is fixed at its creation, so a file that shows it is a broker's placeholder (or a
# tenant's own memfd named to look like one, refused all the same: deny by default).
PLACEHOLDER_PREFIX = w.PLACEHOLDER_PREFIX


def _is_placeholder(tid: int, fd: int) -> bool:
    """Whether tid's fd is a broker's node placeholder (any tenant's, any broker's). A link
    that cannot be read counts as one: the mapping is then refused, not let through."""
    try:
        return os.readlink(f"/proc/{tid}/fd/{fd}").startswith(w.PLACEHOLDER_LINK)
    except OSError:
        return True


class SeccompSupervisor:
    """Answers one listener's notifications with a broker (one per tenant process tree)."""

    def __init__(
        self,
        broker: BrokerInterface,
        tenant: str,
        nodes: Mapping[str, NodeSpec | tuple[NodeKind, int]] | None = None,
        *,
        sizes: w.NotifSizes | None = None,
        real_files: bool = False,
    ):
        self.broker = broker
        self.tenant = tenant
        # Ask the broker for real driver files (installed at open; ioctls decided by the
        # broker and executed by it or continued in the tenant; mmaps continued).
        self.real_files = real_files
        from devbroker.backends.tenantfile import nvidia_majors

        # Character majors of NVIDIA drivers: an fd on one of them that is not a file this
        # supervisor installed reached the driver some other way (a racing path, an fd
        # passed from another tenant) and gets no ioctl and no mmap.
        self.nvidia_majors = frozenset({195, *nvidia_majors().values()})
        src = default_nodes() if nodes is None else nodes
        self.nodes: dict[str, NodeSpec] = {}
        for path, spec in src.items():
            if not path.startswith("/"):
                raise ValueError(f"node path {path!r} must be absolute")
            if not isinstance(spec, NodeSpec):
                spec = NodeSpec(*spec)
            self.nodes[_normalize(path)] = spec
        self._basenames = {posixpath.basename(p) for p in self.nodes} | {"", ".", ".."}
        self.sizes = (sizes or get_notif_sizes()).check()
        self.stats = SupervisorStats()
        # The broker's control lane (broker/fastlane.py) and the ioctl numbers it takes;
        # DEVBROKER_CONTROL_LANE=0 sends every control the general way (benchmarks).
        self._lane, self._lane_cmds = control_lane_of(broker)
        # UVM commands the driver binds to the caller (broker/continuelane.py ContinueLane)
        self._clane = getattr(broker, "continue_lane", None) if self._lane is not None else None
        # The native loop (frontends/nativelane.py): with the lanes, unless turned off or
        # unbuildable; created with the first thread, freed by the last one out.
        self._native_lib = (nativelane.library()
                            if self._lane is not None and nativelane.enabled() else None)
        self._native: nativelane.NativeLane | None = None
        self.sessions: dict[tuple[int, int], Session] = {}
        self._kept_rows: dict[tuple, bool] = {}  # (ABI version, node, ioctl) -> _answer_kept
        self._by_wd: dict[int, Session] = {}
        self._listener = -1
        self._lfd = -1  # the threads' duplicate of the listener (serve)
        self._lfd_refs = 1  # the supervisor's own reference, dropped when serve ends
        self._live = 0  # listener threads running
        self._leaving = 0  # threads `_surplus` let go that have not counted themselves out
        self._threads_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._stopping = False
        self._serving: dict[int, list] = {}  # thread id -> [notification, since]
        # thread id -> (thread pidfd, Caller, capability sets): see _caller_caps
        self._callers: dict[int, tuple[int, Caller, int]] = {}
        self._token = None
        self._nursery = None
        self._hup = None
        self._ifd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._ifd < 0:
            _raise_errno("inotify_init1")
        probe = os.memfd_create("devbroker-probe", os.MFD_CLOEXEC)
        try:
            self._memfd_dev = os.fstat(probe).st_dev
        finally:
            os.close(probe)
        self._pending: list[Session] = []
        # Prepared opens (`_prepare_opens`): session id -> (session, host path) of those
        # the native loop holds or answered and this supervisor has not drained yet; the
        # caller whose sandbox they are for (the last opener of one of our nodes) and the
        # node paths the tenant has opened.
        self._prepared: dict[int, tuple[Session, str]] = {}
        self._open_template: Caller | None = None
        self._opened_paths: dict[str, NodeSpec] = {}
        self._changed = trio.Event()
        self.closed = trio.Event()
        self._handover_hold: trio.Event | None = None  # set while a live upgrade pauses
        # Notifications waiting on the trio thread for a token of the tenant's pace, by id:
        # (notification, the wait's cancel scope). Nothing of such a call has been decided
        # or done, so a live upgrade does not wait for them (a tenant with a long queue
        # behind its limit froze every tenant for the whole drain timeout): they are
        # cancelled and go to the successor undecided (`_undecided`), which decides them
        # from the start, as do we if the upgrade is called off.
        self._pace_waiters: dict[int, tuple[w.Notif, trio.CancelScope]] = {}
        self._undecided: list[w.Notif] = []
        self._listener_tids: set[int] = set()  # this supervisor's listener threads

    # -- kernel calls on the listener ---------------------------------------------------

    def id_valid(self, nid: int) -> bool:
        try:
            fcntl.ioctl(self._lfd, w.SECCOMP_IOCTL_NOTIF_ID_VALID, w.encode_id(nid))
            return True
        except OSError as e:
            if e.errno == errno.ENOENT:
                return False
            raise

    def _send(self, resp: w.NotifResp) -> None:
        try:
            fcntl.ioctl(self._lfd, w.SECCOMP_IOCTL_NOTIF_SEND,
                        bytearray(resp.encode(self.sizes)), True)
        except OSError as e:
            if e.errno != errno.ENOENT:  # ENOENT: the task died or was interrupted
                raise
            self.stats.stale += 1

    def _recv_on(self, fd: int) -> w.Notif | None:
        buf = w.recv_buffer(self.sizes)
        try:
            fcntl.ioctl(fd, w.SECCOMP_IOCTL_NOTIF_RECV, buf, True)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EINTR):
                return None
            raise
        return w.Notif.decode(bytes(buf))

    # -- lookups --------------------------------------------------------------------------

    def session_for_fd(self, pid: int, fd: int) -> int | None:
        """The session behind fd in process (or thread) pid, or None when it is not ours.

        For the broker's fd-argument translation (REGISTER_FD, RM_MAP_MEMORY's fd, UVM's
        rmCtrlFd): the numbers a tenant passes are in its own fd table.
        """
        s = self._lookup(pid, fd)
        return s.id if s else None

    def _lookup(self, tid: int, fd: int) -> Session | None:
        return self._lookup_stat(tid, fd)[0]

    def _lookup_stat(self, tid: int, fd: int) -> tuple[Session | None, bool]:
        """(our session behind tid's fd, whether that fd is an NVIDIA device file)."""
        if fd < 0:
            return None, False
        try:
            st = _stat_nosync(f"/proc/{tid}/fd/{fd}")
        except OSError:
            return None, False
        return self._looked(st.st_dev, st.st_ino, st.st_mode, st.st_rdev)

    def _looked(self, dev: int, ino: int, mode: int, rdev: int) -> tuple[Session | None, bool]:
        """`_lookup_stat`'s answer for a file of this identity."""
        s = self.sessions.get((dev, ino))
        if s is not None and not s.released:
            return s, False
        return None, _stat.S_ISCHR(mode) and os.major(rdev) in self.nvidia_majors

    def _look_again(self, tid: int, fd: int) -> tuple[Session | None, bool]:
        """Before an NVIDIA file is refused as one the broker did not give out: the opens
        the native loop answered with prepared files are booked first, and the fd is looked
        at afresh (not through an identity read earlier for this call). A file the broker
        gave out is then found whatever the listener threads were doing: load may delay a
        call, never refuse it."""
        if self._prepared:
            self._drain_opens()
        return self._lookup_stat(tid, fd)

    def _refuse_foreign(self, n: w.Notif, what: str) -> w.NotifResp:
        """An NVIDIA device file this supervisor did not install: no ioctl, no mmap."""
        self.stats.refused_foreign += 1
        audit = getattr(self.broker, "audit", None)
        if audit is not None:
            try:
                caller = self._caller(n.pid)
                pid = caller.pid
            except OSError:
                pid = n.pid
            audit.deny(tenant=self.tenant, pid=pid, what=what,
                       reason="an NVIDIA device file the broker did not give out (opened "
                              "past the broker, or passed from another process)")
        return w.NotifResp.fail(n.id, errno.EPERM)

    def _refuse_placeholder(self, n: w.Notif, fd: int) -> w.NotifResp:
        """A mapping of a broker's placeholder that is not one of this tenant's sessions
        (another tenant's, passed over a socket; any broker's): refused with EACCES, what
        mmap(2) answers for a file the caller may not map, and an audit record."""
        self.stats.refused_foreign += 1
        audit = getattr(self.broker, "audit", None)
        if audit is not None:
            try:
                pid = self._caller(n.pid).pid
            except OSError:
                pid = n.pid
            audit.deny(tenant=self.tenant, pid=pid, what=f"mmap of fd {fd}",
                       reason="a broker file that is not this tenant's (another tenant's "
                              "node placeholder, passed from another process)")
        return w.NotifResp.fail(n.id, errno.EACCES)

    def _caller(self, tid: int) -> Caller:
        return self._caller_caps(tid)[0]

    def _caller_caps(self, tid: int) -> tuple[Caller, int]:
        """The caller, and its effective | permitted | ambient capability sets.

        Read from /proc/<tid>/status (~30 µs, more under load) unless cached. What the
        answer is used for: whether a call the tenant runs itself would be privileged in the
        driver (CAP_SYS_ADMIN), and the caller's identity for the books. A thread is cached
        only when CAP_SYS_ADMIN is in neither its permitted nor its bounding set: it can then
        never have it again (raising needs it in permitted; exec, setuid binaries and file
        capabilities are capped by the bounding set), so the verdict cannot go stale. Its
        tgid and pid namespace never change. Its uid can (a root tenant keeps CAP_SETUID):
        the cached one is the uid it had when first seen, which only the broker's
        "same sandbox" check reads, and for seccomp the tenant is already fixed by the
        listener the call came through. The entry holds a thread pidfd (PIDFD_THREAD): a
        signal-0 check on it (~1 µs) tells that the thread is the same one, never a new thread
        that reused the number."""
        hit = self._callers.get(tid)
        if hit is not None:
            pidfd, caller, caps = hit
            try:
                signal.pidfd_send_signal(pidfd, 0)
                return caller, caps
            except OSError:
                self._callers.pop(tid, None)
                os.close(pidfd)
        st = _proc_status(tid)
        caps = 0
        for k in ("CapEff", "CapPrm", "CapAmb"):
            try:
                caps |= int(st.get(k, "0"), 16)
            except ValueError:
                caps = -1
        uids = st.get("Uid", "0").split()
        gids = st.get("Gid", "0").split()
        caller = Caller(pid=int(st.get("Tgid", tid)), tid=tid, uid=int(uids[0]),
                        gid=int(gids[0]), pidns=pid_namespace(tid))
        try:
            reachable = int(st.get("CapPrm", "0"), 16) | int(st.get("CapBnd", "0"), 16)
        except ValueError:
            reachable = -1
        if caps >= 0 and reachable >= 0 and not reachable & (1 << CAP_SYS_ADMIN):
            try:
                pidfd = os.pidfd_open(tid, PIDFD_THREAD)
            except OSError:
                return caller, caps
            if len(self._callers) >= 4096:  # threads come and go: drop the oldest half
                for old in list(self._callers)[:2048]:
                    os.close(self._callers.pop(old)[0])
            self._callers[tid] = (pidfd, caller, caps)
        return caller, caps

    def _getfd(self, tid: int, fd: int) -> int:
        """Duplicate tid's fd, through the thread pidfd the caller cache holds (no
        pidfd_open per call) or a fresh one."""
        hit = self._callers.get(tid)
        if hit is not None:
            got = _libc.syscall(ctypes.c_long(w.NR["pidfd_getfd"]), ctypes.c_long(hit[0]),
                                ctypes.c_long(fd), ctypes.c_long(0))
            if got >= 0:
                return int(got)
        return _pidfd_getfd(tid, fd)

    # -- main loop ----------------------------------------------------------------------

    shutdown_grace = 5.0  # seconds to wait for the evictions of exiting tenants

    async def _wait_change(self) -> None:
        ev = self._changed = self._changed if not self._changed.is_set() else trio.Event()
        await ev.wait()

    async def serve(self, listener_fd: int) -> None:
        """Answer notifications until no task uses the filter any more, then release every
        session still open. The caller keeps ownership of listener_fd.

        Notifications are received and answered on this listener's own threads
        (:meth:`_thread_main`): a CUDA tenant's ioctl is decided and executed there without
        a trio round trip. What a thread cannot do itself (a rate limit that
        must wait, a broker with async methods only, a relayed page) is handed to the trio
        thread half-done (broker/effects.py HandOver) and answered from there."""
        self._listener = listener_fd
        self._lfd = os.dup(listener_fd)  # the threads' own reference (see _thread_main)
        try:
            # Synchronous wake-ups (see seccompwire): on kernels before 6.6, EINVAL and
            # the ordinary wake-ups.
            # (the flags are the ioctl's argument itself, not a pointer to them)
            if self.sync_wake_up:
                fcntl.ioctl(self._lfd, w.SECCOMP_IOCTL_NOTIF_SET_FLAGS,
                            w.SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP)
                self.stats.sync_wake_up = True
        except OSError:
            pass
        self._token = trio.lowlevel.current_trio_token()
        self._hup = trio.Event()
        try:
            async with trio.open_nursery() as outer:
                self._nursery = outer
                outer.start_soon(self._inotify_loop)
                outer.start_soon(self._watchdog)
                for _ in range(self.threads):
                    self._start_thread()
                undecided, self._undecided = self._undecided, []
                for n in undecided:  # (a predecessor's: see _pace_waiters)
                    outer.start_soon(self._decide_again, n)
                await self._hup.wait()
                self._drop_prepared(everything=True)  # (no caller is left to take them)
                # No task uses the filter any more. On 6.18 that point is reached while the
                # last tasks are still exiting (measured: state R), before their files are
                # put, so keep reading inotify until every session has gone; the grace
                # period only matters for a placeholder fd that escaped to a process outside
                # the filter (SCM_RIGHTS), which the sweep below then releases.
                with trio.move_on_after(self.shutdown_grace):
                    while self.sessions:
                        await self._wait_change()
                outer.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                self._stopping = True
                for s in list(self.sessions.values()):
                    log.warning("seccomp: session %d still referenced at shutdown; releasing",
                                s.id)
                    self.stats.released_at_shutdown += 1
                    await self._release(s)
                trio.lowlevel.notify_closing(self._ifd)
                os.close(self._ifd)
                self._ifd = -1
                self._drop_listener_ref()
                for pidfd, _c, _k in self._callers.values():
                    os.close(pidfd)
                self._callers.clear()
                self.closed.set()

    # -- listener threads -------------------------------------------------------------------

    # Threads answering one listener. One is right for the common case: a second one
    # waiting for the next notification contends for the GIL at every syscall of the first
    # (measured: 140 of 991 samples in pthread_cond_signal with two, Python loop). The
    # watchdog adds threads while all are held up (a slow driver call, a stalled page), so
    # that a tenant's other threads are still answered; extra threads retire when idle.
    # DEVBROKER_SECCOMP_THREADS: another number (an experiment's knob: the native loop's
    # threads wait in C, without the GIL, so a second one takes the next call while the
    # first finishes the broker's work after an answer).
    _threads = os.environ.get("DEVBROKER_SECCOMP_THREADS", "1")
    threads = max(1, min(8, int(_threads))) if _threads.isdigit() else 1
    max_extra_threads = 8
    busy_hold = 0.1  # seconds every thread must have been busy before another is started
    # The watchdog's tick. Every wake-up of the trio thread takes the GIL from a listener
    # thread in the middle of its calls: a 25 ms tick cost 18 % of the trio thread's time
    # in GIL waits under a busy tenant (py-spy), 100 ms is noise.
    watchdog_tick = 0.1

    def _start_thread(self) -> None:
        with self._threads_lock:
            self._lfd_refs += 1
            self._live += 1
        target = self._thread_main
        if self._native_lib is not None:
            try:
                with self._threads_lock:
                    if self._native is None:
                        self._native = self._new_native()
                target = self._native_thread_main
            except (OSError, ValueError) as e:
                log.warning("seccomp: native loop not started (%s); the Python one serves", e)
        t = threading.Thread(target=target, name=f"seccomp-{self.tenant}", daemon=True)
        t.start()

    def _drop_listener_ref(self) -> None:
        with self._threads_lock:
            self._lfd_refs -= 1
            last = self._lfd_refs == 0
        if last:
            os.close(self._lfd)  # no thread can use the number any more
            native, self._native = self._native, None
            if native is not None:
                native.free()

    # How a listener waits for the tenant's next call (docs/benchmarks.md, "How a listener
    # waits"): with synchronous wake-ups the kernel runs listener and tenant on one CPU,
    # which is what a 2-CPU machine wants (RM_CONTROL p50 152 -> 113 µs there); with many
    # CPUs it is better to keep them apart and have the thread look for the next call
    # without sleeping for a while after each answer (H200, 16 CPUs: 128 -> 112 µs, NVML's
    # init sequence 35.3 -> 33.7 ms). Environment overrides: DEVBROKER_SECCOMP_SYNC_WAKE
    # (0/1), DEVBROKER_SECCOMP_SPIN_US.
    _many_cpus = (os.cpu_count() or 1) >= 4
    sync_wake_up = os.environ.get("DEVBROKER_SECCOMP_SYNC_WAKE",
                                  "0" if _many_cpus else "1") != "0"
    spin_s = int(os.environ.get("DEVBROKER_SECCOMP_SPIN_US",
                                "100" if _many_cpus else "0") or 0) / 1e6

    # Allocations' and frees' books written after the tenant has its answer (native/lane.c
    # FINISH_AFTER), where the tenant then runs on another CPU meanwhile: with synchronous
    # wake-ups it runs on the listener's, which books only once the tenant's next call
    # stops it — no gain, a context switch more (this machine, 2 CPUs: an allocation 57 ->
    # 88 µs). DEVBROKER_BOOK_AFTER=0/1: before / after it. (Settled allocations are booked
    # after the answer either way: nothing decided them in Python before it.)
    book_after = os.environ.get("DEVBROKER_BOOK_AFTER",
                                "0" if sync_wake_up else "1") != "0"
    # Settled allocations and the object facts written at booking (`_booked`);
    # DEVBROKER_SETTLED_ALLOCS=0: neither (every allocation the broker's decision).
    settled_allocs = os.environ.get("DEVBROKER_SETTLED_ALLOCS", "1") != "0"

    def _thread_main(self) -> None:
        """Receive and answer notifications until the filter has no users. The threads use
        the supervisor's own duplicate of the listener (closed by the last one out), so a
        thread held up in a tenant's page never answers on an fd number reused meanwhile."""
        me = threading.get_native_id()
        self._listener_tids.add(me)
        _keep_to_listener_cpus()
        if self.real_files:
            # Driver calls for the tenant run on this thread: never with the capabilities
            # the driver checks (tenantfile.DRIVER_CAPS), dropped for the thread's life.
            drop_driver_capabilities_for_thread()
        poller = select.poll()
        poller.register(self._lfd, select.POLLIN)
        poller.register(_HANDOVER_WAKE, select.POLLIN)  # live upgrade: leave poll() now
        spin = self.spin_s
        spin_until = 0.0
        retired = False  # left because `_surplus` said so
        try:
            while not self._stopping:
                n = None
                if not self._recv_lock.acquire(timeout=0.2):
                    continue
                try:
                    if self._stopping:
                        break
                    # Right after an answer the tenant's next call is usually microseconds
                    # away: look for it without sleeping for `spin` seconds (no wake-up
                    # on either side, this thread's caches kept), then sleep in poll().
                    if spin and time.monotonic() < spin_until:
                        events = poller.poll(0)
                        if not events:
                            continue
                    else:
                        events = poller.poll(200)
                    revents = next((ev for fd, ev in events if fd == self._lfd), 0)
                    if not revents:
                        if self._surplus():  # an extra thread retires when idle
                            retired = True
                            break
                        continue
                    if revents & select.POLLIN:
                        t0 = time.perf_counter_ns()
                        n = self._recv_on(self._lfd)
                        self.stats.ns_recv += time.perf_counter_ns() - t0
                    elif revents & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        self._stopping = True
                        self._to_trio(self._hup.set)
                        break
                finally:
                    self._recv_lock.release()
                if n is None:
                    continue
                self.stats.notifications += 1
                self._serving[me] = [n, time.monotonic()]
                try:
                    self._answer_here(n)
                except Exception:  # a bug costs this call (EIO), never the listener thread
                    log.exception("seccomp: answering %s from %d failed", n.syscall, n.pid)
                    self._send_quietly(w.NotifResp.fail(n.id, errno.EIO))
                finally:
                    self._serving.pop(me, None)
                if spin:
                    spin_until = time.monotonic() + spin
                if self._surplus():
                    retired = True
                    break
        except Exception:  # pragma: no cover - a bug must not kill the tenant's service
            log.exception("seccomp: listener thread failed")
        finally:
            self._count_out(retired)
            self._drop_listener_ref()

    def _new_native(self) -> nativelane.NativeLane:
        return nativelane.NativeLane(
            self._native_lib, self, self._lfd, _HANDOVER_WAKE, max(self.sizes.notif, w.SECCOMP_NOTIF_SIZE),
            (_NR_IOCTL, _NR_OPEN, w.NR["openat"], w.NR["openat2"], w.NR["mmap"]),
            (w.SECCOMP_IOCTL_NOTIF_RECV, w.SECCOMP_IOCTL_NOTIF_SEND,
             w.SECCOMP_IOCTL_NOTIF_ID_VALID, w.SECCOMP_IOCTL_NOTIF_ADDFD),
            int(self.spin_s * 1e9), self._basenames, self._lane_cmds)

    def _native_thread_main(self) -> None:
        """`_thread_main` with the waiting, receiving and the lanes' answers in C
        (frontends/nativelane.py): the loop comes back here for every notification it does
        not answer itself, which is then answered exactly as `_thread_main` would."""
        me = threading.get_native_id()
        self._listener_tids.add(me)
        _keep_to_listener_cpus()
        if self.real_files:
            drop_driver_capabilities_for_thread()  # as _thread_main: before any driver call
        nl = self._native
        t = nl.thread()
        t.os_tid = me  # (the watchdog finds the thread's own accesses from Python by it)
        t.driver_safe = thread_is_driver_safe()
        nl.lib.dvb_thread_driver_safe(t.ptr, int(t.driver_safe))  # (settled calls need it)
        memgate.MemoryGate.mark_native(me, self.tenant)
        size = max(self.sizes.notif, w.SECCOMP_NOTIF_SIZE)
        retired = False  # left because `_surplus` said so
        try:
            while not self._stopping:
                rc = t.serve()
                if self._prepared:
                    self._drain_opens()
                if t.adm is not None:  # admitted, never finished: its quota hold goes back
                    self._lane.release(t.adm)
                    t.adm = None
                t.fold(self.stats)
                nl.fold_settled(self._lane, self._clane)
                if t.unfinished is not None:
                    self._settle(t)
                if rc == nativelane.DVB_NOTIF or rc == nativelane.DVB_LATE:
                    nl.await_bookings()  # (as _native_ioctl: the general way decides too)
                    n = w.Notif.decode(t.notif_bytes(size))
                    if rc == nativelane.DVB_LATE:
                        # an access the watchdog answered EFAULT came back: the gate's books;
                        # the call is answered below unless the watchdog's answer was for it
                        t.reported = False
                        self._gate.native_returned(self.tenant, "tenant memory access "
                                                   "(native loop)", nl.lib.dvb_late_ns(t.ptr) / 1e9)
                        if not self.id_valid(n.id):
                            continue
                    self._serving[me] = [n, time.monotonic()]
                    try:
                        self._answer_here(n, lanes=False, looked=self._native_looked(t, n),
                                          path=self._native_path(t, n))
                    except Exception:  # a bug costs this call (EIO), never the listener thread
                        log.exception("seccomp: answering %s from %d failed", n.syscall, n.pid)
                        self._send_quietly(w.NotifResp.fail(n.id, errno.EIO))
                    finally:
                        self._serving.pop(me, None)
                elif rc == nativelane.DVB_WRITE_FAILED:
                    n = w.Notif.decode(t.notif_bytes(size))
                    e = OSError(nl.lib.dvb_err(t.ptr), os.strerror(nl.lib.dvb_err(t.ptr)))
                    self._audit_memory(n.pid, f"ioctl {n.data.arg_u32(1):#x}", e)
                    self._send_quietly(w.NotifResp.fail(n.id, errno.EFAULT))
                elif rc == nativelane.DVB_QUIET:  # no call for 1 ms: the broker's work
                    try:
                        self._prepare_opens()
                        self.broker.quiet_work()
                    except Exception:
                        log.exception("seccomp: the backend's work for a quiet moment failed")
                elif rc == nativelane.DVB_HUP:
                    self._stopping = True
                    self._to_trio(self._hup.set)
                    break
                elif rc == nativelane.DVB_ERROR:
                    err = nl.lib.dvb_err(t.ptr)
                    raise OSError(err, f"seccomp listener: {os.strerror(err)}")
                # DVB_IDLE, DVB_FOLD, DVB_WAKE: the loop's condition and the surplus below
                if self._surplus():
                    retired = True
                    break
        except Exception:  # pragma: no cover - a bug must not kill the tenant's service
            log.exception("seccomp: native listener thread failed")
        finally:
            memgate.MemoryGate.unmark_native(me)
            nl.drop(t)
            self._count_out(retired)
            self._drop_listener_ref()

    @staticmethod
    def _native_path(t: nativelane.NativeThread, n: w.Notif) -> bytes | None:
        """For an open the native loop hands back: the path it read whole (its private copy,
        the NUL dropped) for this very notification; None when it did not."""
        c = t.call
        if (n.data.nr not in _NR_OPENS or not c.path_len
                or (c.id & 0xFFFF_FFFF_FFFF_FFFF) != n.id):
            return None
        return nativelane.NativeLane.path(t)

    def _native_looked(self, t: nativelane.NativeThread, n: w.Notif) -> tuple | None:
        """For an ioctl the native loop hands back: `_lookup_stat`'s answer from the file
        identity the loop read of the same fd for this notification (the fstat of its
        duplicate, or a statx): one system call fewer on the general path, as the Python
        lanes pass theirs on. None for anything else."""
        c = t.call
        if n.data.nr != _NR_IOCTL or not c.mode or (c.id & 0xFFFF_FFFF_FFFF_FFFF) != n.id:
            return None
        return self._looked(c.dev, c.ino, c.mode, c.rdev)

    def _native_ioctl(self, t: nativelane.NativeThread, c: nativelane.Call) -> int:
        """The native loop's question for one ioctl (nativelane.NativeLane._on_ioctl): the
        control lane's admission, the continue lane's decision, or the general path — the
        same choices as `_answer_here`, on the header the loop read privately."""
        t.lane.await_bookings()  # (another thread's answered allocation or free: booked first)
        if t.unfinished is not None:
            self._settle(t)
        if self._prepared:  # (the opener of a file the loop installed: booked first)
            self._drain_opens()
        t.after.clear()  # (the last call's facts, if it went another way: not written)
        if t.adm is not None:  # the last call never reached on_finish (a stale caller)
            self._lane.release(t.adm)
            t.adm = None
        sess = self.sessions.get((c.dev, c.ino))
        if sess is None or sess.released:
            return nativelane.ACT_DECLINE
        if c.hdr_len:
            if c.cmd not in self._lane_cmds:
                return nativelane.ACT_DECLINE
            try:
                caller, _caps = self._caller_caps(c.tid)
            except OSError:
                return nativelane.ACT_DECLINE
            lane = self._lane
            hdr = nativelane.NativeLane.hdr(t)
            # (read before deciding: a change meanwhile makes what is settled stale)
            epochs = BOOKS.now() if t.lane.settled_on else None
            # whether the loop runs the call on its duplicate of the tenant's file; where it
            # does, an allocation's after-hook runs here too, on duplicates of the same file
            # (_native_finish), and only there is the hook offered to the lane
            bs = self.broker.sessions.get(sess.id)
            driver = bool(sess.real and t.driver_safe and bs is not None
                          and self.broker.backend.control_is_plain_ioctl(bs.file))
            adm = lane.admit(sess.id, caller, c.cmd, hdr, max_params=nativelane.PARAMS_MAX,
                             run_hooks=driver)
            if (adm is None and sess.real and sess.node is NodeKind.CTL
                    and self._clane is not None
                    and self._clane.root_alloc(sess.id, caller, c.cmd, hdr)):
                # the first root client on this nvidiactl, allocated by the tenant itself
                # (NVML: one per init, on a fresh file): continued, as the general steps
                # continue it
                return nativelane.ACT_CONTINUE
            if adm is None and sess.real and sess.node is NodeKind.CTL:
                # perhaps a client the tenant allocated itself, named for the first time:
                # adopted here, then admitted again (counted once as declined)
                unknown = lane.unknown_client(sess.id, c.cmd, hdr)
                if unknown is not None and self._native_adopt(c, sess, unknown):
                    adm = lane.admit(sess.id, caller, c.cmd, hdr,
                                     max_params=nativelane.PARAMS_MAX, run_hooks=driver)
            if adm is None:
                return nativelane.ACT_DECLINE
            patch = lane.table_patch(adm) if adm.post is not None else None
            patched = patch is not None and nativelane.NativeLane.set_patch(t, c, patch)
            finish = lane.needs_finish(adm, patched)
            # an allocation's or a free's books need nothing from the answer but the
            # driver's: written after the tenant has it (native/lane.c FINISH_AFTER)
            after = bool(finish and driver and self.book_after and lane.books_only(adm))
            if not finish and not adm.checked:  # (a checked one: once its check passed)
                lane.book(adm)
                t.unfinished, t.done_seen = adm, c.done_count  # its row: _settle
            # (a post-hook as an IdFilter or an IdFlag runs in Python this time, by the loop
            # once settled)
            id_filtered = (adm.post in rewrite.AS_ID_FILTER
                           or (adm.post in rewrite.AS_ID_FLAG and lane.id_flag(adm) is not None))
            # (allocations and frees: their books follow after the answer, FINISH_AFTER)
            books_after = self.settled_allocs and lane.books_only(adm)
            if ((not finish or id_filtered or books_after)
                    and epochs is not None
                    and driver and (adm.post is None or patched or id_filtered)
                    and lane.settleable(adm)
                    and t.lane.worth_settling(
                        adm.header.kind, adm.cmd,
                        getattr(adm.client.objects.get(adm.h_object), "rm_class", None))):
                # (a checked one is written down only if its check passes: _native_check
                # drops what was queued when it declines, t.after)
                self._after(t, c, self._native_settle, t, c, adm, epochs, patch)
            elif (adm.header.kind == "escape" and epochs is not None and t.driver_safe
                    and sess.real and sess.node in (NodeKind.CTL, NodeKind.GPU)
                    and (driver or adm.answered) and lane.settleable_escape(adm)
                    and t.lane.worth_settling("escape", c.cmd, None)):
                # a plain escape on a file opened just before (NVML's and CUDA's version
                # check, SYS_PARAMS, WAIT_OPEN_COMPLETE, NUMA_INFO): the loop admits the same
                # argument again on the tenant's other files of this node
                self._after(t, c, self._native_settle_escape, t, c, adm, epochs, bytes(hdr))
            c.params_ptr, c.params_size = adm.params_ptr, adm.params_size
            c.params_off, c.status_off = adm.header.params_offset, adm.header.status_offset
            c.driver, c.check = int(driver), int(adm.checked)
            c.finish = nativelane.FINISH_AFTER if after else int(finish)
            t.adm, t.adm_epochs = adm, epochs
            if adm.checked:
                return self._native_check_now(t, c, adm)
            return nativelane.ACT_CONTROL
        if self._clane is not None and sess.real and self._clane.candidate(sess.node, c.cmd):
            epochs = BOOKS.now() if t.lane.settled_on else None  # (before deciding)
            seen: list = []
            if self._continue_decision(c.tid, c.cmd, c.argp, sess, seen):
                if epochs is not None:
                    self._after(t, c, self._native_settle_continue, t, c, sess, seen[0],
                                epochs)
                return nativelane.ACT_CONTINUE
        return nativelane.ACT_DECLINE

    @staticmethod
    def _after(t: nativelane.NativeThread, c: nativelane.Call, fn, *args) -> None:
        """Run fn(*args) once the loop has answered this call (on_after): what settled
        controls need written down costs the broker's time, not the tenant's."""
        t.after.append((fn, args))
        c.after = 1

    def _native_after(self, t: nativelane.NativeThread, c: nativelane.Call) -> int:
        """The loop answered the call: write down what it may repeat (`_after`)."""
        pending, t.after = t.after, []
        for fn, args in pending:
            fn(*args)
        return 0

    def _native_settle(self, t: nativelane.NativeThread, c: nativelane.Call, adm,
                       epochs: tuple[int, int, int], patch) -> None:
        """The loop may admit this control again by itself (NativeLane.settle) for a caller
        whose verdict `_caller_caps` keeps (a thread that can never hold CAP_SYS_ADMIN: the
        loop checks it is still that thread with a duplicate of the same pidfd)."""
        hit = self._callers.get(c.tid)
        if hit is None:
            return
        id_list = (self._lane.id_list_check(adm) if adm.pre in rewrite.AS_ID_LIST_CHECK
                   else None)
        ids = (rewrite.tenant_gpu_ids(self.broker, adm.session)
               if adm.gpu_id_off >= 0 or adm.post in rewrite.AS_ID_FILTER or id_list
               else None)
        id_flag = self._lane.id_flag(adm) if adm.post in rewrite.AS_ID_FLAG else None
        if id_flag is not None:
            self._give_device_ids(t, adm.session.tenant)
        try:
            t.lane.settle(adm, c, epochs, patch, hit[1], hit[0],
                          adm.mark[1] if adm.mark is not None else None, self._lane, ids,
                          id_flag, id_list)
        except OSError:  # (no fd for the pidfd's duplicate: not settled, nothing else)
            pass

    def _native_settle_escape(self, t: nativelane.NativeThread, c: nativelane.Call, adm,
                              epochs: tuple[int, int, int], arg: bytes) -> None:
        """The loop may admit this plain escape again by itself for the same argument on the
        tenant's files of this node (NativeLane.settle_escape), for a caller `_caller_caps`
        keeps (never able to hold CAP_SYS_ADMIN; the loop checks it is still that
        thread)."""
        hit = self._callers.get(c.tid)
        if hit is None:
            return
        try:
            t.lane.settle_escape(adm, c, arg, epochs, hit[1], hit[0],
                                 adm.mark[1] if adm.mark is not None else None, self._lane)
        except OSError:  # (no fd for the pidfd's duplicate: not settled, nothing else)
            pass

    def _give_device_ids(self, t: nativelane.NativeThread, tenant) -> None:
        """The loop's copy of the GPUs the tenant holds a device object of (GET_ID_INFO's
        IN_USE flag, rewrite.IdFlag), as of the books' devices epoch, when that moved since
        it was given: after a booking that allocated or freed a device, and when a flag is
        settled. (While the epoch it has is not the books', the loop sends such a call
        here.)"""
        lane = t.lane
        if lane.device_ids_epoch == BOOKS.devices_now() and lane.device_ids_of is tenant:
            return
        with STATE_LOCK:
            epoch = BOOKS.devices_now()
            ids = rewrite.device_gpu_ids(self.broker, tenant)
        if lane.set_device_ids(epoch, ids):
            lane.device_ids_of = tenant  # (a policy change may bring another TenantState)

    def _native_settle_continue(self, t: nativelane.NativeThread, c: nativelane.Call,
                                sess: Session, arg: bytes, epochs: tuple[int, int, int]
                                ) -> None:
        """The loop may continue this command on this file again by itself while the
        client handles it reads hold what the broker checked in `arg`
        (NativeLane.settle_continue), for a caller `_caller_caps` keeps (never able to hold
        CAP_SYS_ADMIN; the loop checks it is still that thread)."""
        hit = self._callers.get(c.tid)
        clane = self._clane
        fields = clane.settle_fields(sess.id, c.cmd) if hit is not None else None
        if fields is None:
            return
        try:
            t.lane.settle_continue(c, fields, arg, epochs, hit[1], hit[0],
                                   clane.row_key(sess.id, c.cmd, arg),
                                   node_wide=sess.file_fact)
        except OSError:  # (no fd for the pidfd's duplicate: not settled, nothing else)
            pass

    def _native_map_fact(self, sess: Session, key: tuple[int, int], caller: Caller,
                         epochs: tuple[int, int, int]) -> None:
        """The native loop may let this ctl or GPU file be mapped without asking
        (NativeLane.settle_mmap): Broker.map_check_now's decision for it is the session's
        own check (open, the caller in its opener's sandbox), which the loop repeats for a
        caller `_caller_caps` keeps. An nvidia-uvm file gets a file fact instead
        (NativeLane.settle_file: its mappings count against the managed-memory allowance,
        so they stay the broker's). Either says the file is the tenant's, in its opener's
        sandbox: the loop's continuation facts of its node then hold for it (a uvm command
        on a file opened just before, as NVML's are)."""
        nl, hit = self._native, self._callers.get(caller.tid)
        bs = self.broker.sessions.get(sess.id) if hit is not None and nl is not None else None
        if bs is None:
            return
        clane = self._clane
        try:
            if sess.node is NodeKind.UVM:
                sess.file_fact = nl.settle_file(key[0], key[1], bs, epochs, hit[1],
                                                caller.tid, hit[0])
            elif sess.node in (NodeKind.CTL, NodeKind.GPU):
                sess.file_fact = nl.settle_mmap(
                    key[0], key[1], bs, epochs, hit[1], caller.tid, hit[0],
                    clane.map_key(sess.id) if clane is not None else None)
        except OSError:  # (no fd for the pidfd's duplicate: not written, nothing else)
            pass

    def _answer_kept(self, sess: Session, cmd: int) -> bool:
        """Whether the broker's answer to this ioctl may be kept for the native loop to give
        again (rules.EscapeRule.answer_kept, on a node its row allows)."""
        bs = self.broker.sessions.get(sess.id)
        if w.IOC_TYPE(cmd) != w.NV_IOCTL_MAGIC or bs is None:
            return False
        abi = self.broker.abi_of(bs)
        key = (abi.version, bs.node, cmd)  # (the rows are fixed for the broker's life)
        kept = self._kept_rows.get(key)
        if kept is None:
            op = abi.escape(w.IOC_NR(cmd))
            row = rules.ESCAPES.get(op.name) if op is not None else None
            kept = self._kept_rows[key] = bool(
                row is not None and row.answer_kept and bs.node in row.nodes)
        return kept

    def _native_answer_fact(self, sess: Session, caller: Caller, tid: int, fd: int, cmd: int,
                            answer: bytes, epochs: tuple[int, int, int]) -> None:
        """The native loop may give this answer again on the tenant's files of this node
        (NativeLane.settle_answer) to callers `_caller_caps` keeps."""
        nl, hit, clane = self._native, self._callers.get(caller.tid), self._clane
        bs = self.broker.sessions.get(sess.id) if hit is not None and nl is not None else None
        if bs is None:
            return
        try:
            rdev = _stat_nosync(f"/proc/{tid}/fd/{fd}").st_rdev
            nl.settle_answer(rdev, cmd, answer, bs, epochs, hit[1], caller.tid, hit[0],
                             clane.row_key(sess.id, cmd, answer) if clane is not None else None)
        except OSError:  # (the file or the pidfd's duplicate gone: not written)
            pass

    def _native_check_now(self, t: nativelane.NativeThread, c: nativelane.Call, adm) -> int:
        """A checked call decided in the admission's own callback: its parameters read once
        here, through the memory gate, into the loop's private block (NativeLane.read_params:
        the loop reads none and the driver gets that block, as when the loop reads them),
        then `_native_check` on that copy. One callback instead of two (a checked call is
        an allocation charged to the quota, a control naming handles or GPU ids, an fd
        escape: ~120 of a CUDA init's and ~12 of an NVML init's calls; a callback costs
        ~45 µs on the H200). A read that fails sends the whole call the general way, which
        reads again and answers, as the loop's own failed read does."""
        size = adm.params_size
        if size:
            if size > nativelane.PARAMS_MAX or self._native.mem_off:
                t.adm = None
                self._lane.release(adm)
                return nativelane.ACT_DECLINE
            try:
                data = self._gate.direct(self.tenant, _vm_read, c.tid, adm.params_ptr, size,
                                         what=f"read of {size} parameter bytes (control lane)")
            except OSError:
                t.adm = None
                self._lane.release(adm)
                return nativelane.ACT_DECLINE
            if len(data) != size:
                t.adm = None
                self._lane.release(adm)
                return nativelane.ACT_DECLINE
            nativelane.NativeLane.read_params(t, data)
        act = self._native_check(t, c)
        if act == nativelane.ACT_CONTROL:
            c.check = 0  # (made: the loop calls no on_check)
        return act

    def _native_check(self, t: nativelane.NativeThread, c: nativelane.Call) -> int:
        """A checked control's parameters, read privately by the native loop: the lane's
        check on that copy (it may rewrite it: the loop then runs the rewritten one)."""
        adm = t.adm
        if adm is None:
            return nativelane.ACT_DECLINE
        if adm.answered:  # (SYS_PARAMS) no driver call: _native_finish answers it
            c.driver = 0
            return nativelane.ACT_CONTROL
        if adm.header.kind == "escape":  # an fd escape (fastlane.fd_escape)
            # (a backend that does not run it as a plain ioctl here: the general way)
            if not (self._native_fds(t, c, adm) if c.driver
                    else self._lane.fd_target(adm, None)):
                t.adm = None
                return nativelane.ACT_DECLINE
            if not c.finish:
                self._lane.book(adm)
                t.unfinished, t.done_seen = adm, c.done_count  # its row: _settle
            return nativelane.ACT_CONTROL
        params = nativelane.NativeLane.params(t)
        if not self._lane.check(adm, params, embedded_ok=bool(c.driver)):
            t.adm = None
            return nativelane.ACT_DECLINE
        if adm.embedded and not self._native_embedded(t, c, adm, params):
            self._lane.sent_back(adm)
            t.adm = None
            return nativelane.ACT_DECLINE
        if adm.pre is not None or adm.embedded:
            nativelane.NativeLane.set_params(t, bytes(params))
        if not c.finish:
            self._lane.book(adm)
            t.unfinished, t.done_seen = adm, c.done_count  # its row: _settle
        return nativelane.ACT_CONTROL

    def _native_embedded(self, t: nativelane.NativeThread, c: nativelane.Call, adm,
                         params: bytearray) -> bool:
        """A checked control's embedded buffers (ControlLane.check listed them): each read
        once from the tenant into a copy of the broker's, whose address replaces the
        tenant's pointer in the private parameters (`params`); the loop puts the tenant's
        pointers back after the driver call and writes the copies back on NV_OK. False
        when a read fails (the general way reads again and answers)."""
        t.embedded = []
        for k, (off, ptr, size) in enumerate(adm.embedded):
            try:
                data = self._gate.direct(self.tenant, _vm_read, c.tid, ptr, size,
                                         what=f"read of {size} embedded bytes at {ptr:#x}"
                                         ) if size else b""
            except OSError:
                t.embedded = []
                return False
            buf = ctypes.create_string_buffer(data, max(size, 1))
            t.embedded.append(buf)
            addr = ctypes.addressof(buf)
            c.embed_off[k], c.embed_ptr[k], c.embed_addr[k], c.embed_len[k] = off, ptr, addr, size
            params[off:off + 8] = addr.to_bytes(8, "little")
        c.embed_n = len(adm.embedded)
        return True

    def _native_adopt(self, c: nativelane.Call, sess: Session, client: int) -> bool:
        """The broker adopts a root client the tenant allocated itself on this file, on a
        duplicate of the very file the loop identified (Broker.adopt_client_here); False
        leaves the call to the general way, which tries again and answers."""
        try:
            dup = self._getfd(c.tid, c.fd)
        except OSError:
            return False
        try:
            st = os.fstat(dup)
            return ((st.st_dev, st.st_ino) == sess.key
                    and self.broker.adopt_client_here(sess.id, client, dup))
        except OSError:
            return False
        finally:
            os.close(dup)

    def _native_fds(self, t: nativelane.NativeThread, c: nativelane.Call, adm) -> bool:
        """An fd escape's fds (REGISTER_FD's ctl_fd): each duplicated from the calling
        thread's table, the session found from the *duplicate's* identity (no second
        lookup a racing thread could redirect), `ControlLane.fd_target` asked, and the
        duplicate's number put in the private header the driver gets (the loop puts the
        tenant's number back in the answer and closes the duplicates). False: the general
        way, which decides it from the start (the duplicates made here closed first)."""
        offsets = adm.header.fd_offsets
        if len(offsets) > nativelane.FD_MAX:
            return False
        hdr = bytearray(nativelane.NativeLane.hdr(t))
        dups: list[int] = []
        done = False
        try:
            for k, off in enumerate(offsets):
                fd = int.from_bytes(hdr[off:off + 4], "little", signed=True)
                if fd < 0:  # (-1: "no file", which the general path passes on as sent)
                    return self._lane.fd_target(adm, None)
                dup = self._getfd(c.tid, fd)
                dups.append(dup)
                st = os.fstat(dup)
                sess = self.sessions.get((st.st_dev, st.st_ino))
                if not self._lane.fd_target(adm, None if sess is None or sess.released
                                            else sess.id):
                    return False
                hdr[off:off + 4] = dup.to_bytes(4, "little", signed=True)
                c.fd_off[k], c.fd_orig[k], c.fd_dup[k] = off, fd, dup
            done = True
        except OSError:  # (no such fd in the caller's table: the general way says so)
            return self._lane.fd_target(adm, None)
        finally:
            if not done:
                for d in dups:
                    os.close(d)
        nativelane.NativeLane.set_hdr(t, bytes(hdr))
        c.fd_n = len(dups)  # (the loop closes them now, whatever happens to the call)
        return True

    def _native_finish(self, t: nativelane.NativeThread, c: nativelane.Call) -> int:
        """After the native loop's driver call (or instead of it, for a backend that does
        not run controls as a plain ioctl): the lane's books and post-hook; 1 done, 0 the
        backend cannot run it here (the general way)."""
        if c.finish == nativelane.FINISH_AFTER and nativelane.BOOKING_DELAY_S:
            time.sleep(nativelane.BOOKING_DELAY_S)  # (a test's switch: a slow booking)
        adm, t.adm = t.adm, None
        if c.settled >= 0:
            # A settled allocation: the loop admitted it by itself, so `adm` is not this
            # call's — it is what the last call the broker decided left (a control with
            # nothing to finish keeps it until the next decision) and is let go as
            # `_native_ioctl` lets it go. The books follow the driver's answer.
            if adm is not None:
                self._lane.release(adm)
            return self._book_settled(t, c) if c.finish == nativelane.FINISH_AFTER else -1
        if adm is None:
            return -1
        NL = nativelane.NativeLane
        hdr, params = NL.hdr(t), NL.params(t)
        if adm.answered:  # the broker's own answer: the argument as sent, 0
            ret, err, hdr_out = 0, 0, hdr
            c.ret, c.err = 0, 0
            NL.set_hdr_out(t, hdr_out)
        elif c.driver:
            ret, err, hdr_out = c.ret, c.err, NL.hdr_out(t)
        else:
            try:
                ret, err, hdr_out = self.broker.backend.run_control(
                    adm.session.file, -1, hdr, params, adm.header, adm.abi)
            except NotHere:
                t.unfinished = None  # the general way counts it
                return 0
            c.ret, c.err = ret, err
            NL.set_hdr_out(t, hdr_out)
            if not c.finish:
                NL.set_params(t, bytes(params))  # the loop applies the patch, if any
                return 1
        out = self._lane.finish(adm, hdr, NL.params_in(t), ret, err, hdr_out, params)
        if not err and c.driver and self._lane.runs_hook(adm):
            # a channel group's compute share, before the tenant has the handle (the loop
            # answers after this returns), as the general path sets it
            self._lane.run_after(adm, hdr_out, NL.params_in(t), self._hook_request(c, adm),
                                 self._perform_here)
        if not err and c.finish != nativelane.FINISH_AFTER:  # (after: already answered)
            NL.set_params(t, out)
        h = adm.header
        if (adm.alloc is not None and c.driver and not err and h.status_offset >= 0
                and hdr_out[h.status_offset:h.status_offset + 4] == bytes(4)):  # NV_OK
            handle = int.from_bytes(hdr_out[h.new_offset:h.new_offset + 4], "little")
            self._booked(t, c, adm.session, adm.client.handle, handle, t.adm_epochs)
        self._device_ids_after_books(t, adm.session.tenant)
        return 1

    def _device_ids_after_books(self, t: nativelane.NativeThread, tenant) -> None:
        """After books that may have allocated or freed a device object: the loop's copy of
        the GPUs the tenant holds a device of follows at once (`_give_device_ids`), so that
        NVML's GET_ID_INFO right after a device allocation or free stays the loop's. Only
        once a flag was settled for this tenant (nothing to follow before)."""
        if (t.lane.device_ids_of is tenant
                and t.lane.device_ids_epoch != BOOKS.devices_now()):
            self._give_device_ids(t, tenant)

    def _hook_request(self, c: nativelane.Call, adm) -> IoctlRequest:
        """The request an after-hook's own driver calls run under (ControlLane.run_after):
        on duplicates of the file the call was made on, through the calling thread's pidfd,
        with the caller confirmed (NOTIF_ID_VALID) before each — the general path's means,
        for the call the loop is still answering."""
        tid, nid = int(c.tid), c.id & 0xFFFF_FFFF_FFFF_FFFF  # (an unsigned id)
        try:
            caller = self._caller_caps(tid)[0]  # (cached since this call's admission)
        except OSError:
            caller = adm.session.caller  # (gone: confirm fails before any driver call)
        return IoctlRequest(caller=caller, session=adm.session.id, cmd=int(c.cmd),
                            arg_ptr=int(c.argp), arg=None, fd=int(c.fd),
                            dup_fd=lambda fd: self._getfd(tid, fd),
                            confirm=lambda: self.id_valid(nid))

    def _book_settled(self, t: nativelane.NativeThread, c: nativelane.Call) -> int:
        """After the answer to an allocation the loop admitted as settled: the new object
        into the books (ControlLane.book_settled) on NV_OK; its request was counted with
        the settled calls' rows."""
        NL = nativelane.NativeLane
        hdr_out = NL.hdr_out(t)
        sess = self.sessions.get((c.dev, c.ino))
        if c.err or sess is None or c.status_off < 0 or hdr_out[
                c.status_off:c.status_off + 4] != bytes(4):
            return 1
        epochs = BOOKS.now()  # (before booking: what the object's fact stands on)
        got = self._lane.book_settled(sess.id, hdr_out, c.cmd)
        if got is not None:
            self._booked(t, c, *got, epochs)
        bs = self.broker.sessions.get(sess.id)
        if bs is not None:  # (a settled free of a device: the IN_USE flag's copy follows)
            self._device_ids_after_books(t, bs.tenant)
        return 1

    def _booked(self, t: nativelane.NativeThread, c: nativelane.Call, s, client: int,
                handle: int, epochs: tuple[int, int, int] | None) -> None:
        """The broker booked an object the tenant allocated on the session `s` (the
        broker's): the loop's allowance of settled allocations refreshed, and the object's
        fact written (NativeLane.object_put) when it is in the books, on one of the
        tenant's GPUs and the file usable with it — as of `epochs`, read before the
        allocation was decided or booked — so that controls and allocations on it may be
        settled from their first call."""
        nl = t.lane
        if not nl.settled_on or not self.settled_allocs:
            return
        tenant = s.tenant
        nl.alloc_credit(tenant)
        if epochs is None:
            return
        patch = None
        with STATE_LOCK:
            cl = tenant.clients.get(client)
            obj = cl.objects.get(handle) if cl is not None else None
            usable = (obj is not None and (obj.gpu is None or obj.gpu in tenant.gpus)
                      and not (s.node is NodeKind.GPU and s.minor not in tenant.gpus))
            abi = self.broker.abi_of(s) if usable else None
            if usable and obj.rm_class == SUBDEVICE_CLASS and self.broker.recorder is None:
                # NVML asks a new subdevice for its memory first (FB_GET_INFO_V2): the
                # quota view's values now, as of the charge epoch read with them
                op = abi.control(FB_GET_INFO_V2)
                got = (rewrite.fb_info_patch(s, obj.gpu, op.params)
                       if op is not None and op.params is not None else None)
                if got is not None:
                    patch = (FB_GET_INFO_V2, BOOKS.now()[1], got)
        if usable:  # (c: the call on that very file, its dev and inode)
            nl.object_put(epochs, c.dev, c.ino, s, client, handle, abi, patch)

    def _settle(self, t: nativelane.NativeThread) -> None:
        """The row of the control the loop answered last without on_finish (the loop kept
        its errno and end time); a control it sent the general way instead has its row
        there."""
        adm, t.unfinished = t.unfinished, None
        c = t.call
        if c.done_count != t.done_seen:
            self._lane.answered(adm, c.done_err, c.done_ns)

    @property
    def listener_loop(self) -> str:
        """"native" when this listener's threads run the C loop, else "python"."""
        return "native" if self._native_lib is not None else "python"

    @property
    def live_threads(self) -> int:
        return self._live

    def _surplus(self) -> bool:
        """More threads free to answer than `threads` (threads held up in a slow call or a
        stalled page do not count: they are why the others were started): then the calling
        thread leaves, and is counted as leaving under the lock in the same step as the
        decision, so that the next thread to ask sees one fewer. (Without that, two extra
        threads coming back from a stall together both saw a surplus and both left, and
        nothing answered the tenant any more: found in CI, the escape harness's tenant hung
        after `uffd-ptr`.)"""
        if self._live <= self.threads:  # the common case, asked after every answer
            return False
        now = time.monotonic()
        held = sum(1 for _n, since in list(self._serving.values())
                   if now - since > self.busy_hold)
        with self._threads_lock:
            if self._live - self._leaving - held > self.threads:
                self._leaving += 1
                return True
            return False

    def _count_out(self, retired: bool) -> None:
        """(A listener thread's last step.) No longer live; nor leaving, if it retired
        because `_surplus` said so."""
        self._listener_tids.discard(threading.get_native_id())
        with self._threads_lock:
            self._live -= 1
            if retired:
                self._leaving -= 1

    def _to_trio(self, fn, *args) -> bool:
        return to_trio(self._token, fn, *args)

    def _start_or_fail(self, n, fn, *args) -> None:
        """(Trio thread.) A task finishing notification n. When the supervisor is stopping
        (its nursery closed to new tasks: the tenant's last task is exiting while a thread
        hands n over) n is answered EIO instead."""
        if not start_task(self._nursery, fn, *args):
            self._send_quietly(w.NotifResp.fail(n.id, errno.EIO))

    def _start_quietly(self, fn, *args) -> None:
        """(Trio thread.) A background task, none once the supervisor is stopping (what is
        left then is released by the shutdown's sweep)."""
        start_task(self._nursery, fn, *args)

    def _answer_here(self, n: w.Notif, lanes: bool = True, looked: tuple | None = None,
                     path: bytes | None = None) -> None:
        """Decide one notification on this thread; hand it to trio when it must wait.
        lanes=False: the native loop already offered it to the lanes (and `looked` is its
        fd lookup, when it made one)."""
        if lanes:
            resp, looked = self._python_lanes(n)
            if resp is not _GENERAL:
                self._send_quietly(resp)
                return
        nr = n.data.nr
        if nr == _NR_IOCTL:
            steps = self._ioctl_steps(n, looked)
        elif nr in _NR_OPENS:
            steps = self._open_steps(n, path)
        else:
            steps = self._steps_for(n)
        if steps is None:
            self._send_quietly(w.NotifResp.cont(n.id))
            return
        opens_before = self.stats.opens
        t0 = time.perf_counter_ns()
        try:
            resp = run_blocking(steps, self._perform_here)
        except HandOver as h:
            self.stats.handed_to_trio += 1
            if not self._to_trio(self._start_or_fail, n, self._finish_on_trio, n,
                                 h.steps, h.pending):
                self._send_quietly(w.NotifResp.fail(n.id, errno.EIO))
            return
        except Exception:
            log.exception("seccomp: handling %s from %d failed", n.syscall, n.pid)
            resp = w.NotifResp.fail(n.id, errno.EIO)
        spent = time.perf_counter_ns() - t0
        nr = n.data.nr
        if nr == w.NR["ioctl"]:
            self.stats.ns_ioctl += spent
        elif nr == w.NR["mmap"]:
            self.stats.ns_mmap += spent
        else:
            self.stats.ns_open += spent
            if self.stats.opens != opens_before:  # one of our nodes (install included)
                self.stats.ns_open_node += spent
        self._send_quietly(resp)

    def _python_lanes(self, n: w.Notif) -> tuple[w.NotifResp | None | object, tuple | None]:
        """The Python listener's short cuts (the native loop has its own, in C): the control
        lane, the continue lane, the quick open. (The answer — None: the task is gone,
        nothing to send — or `_GENERAL`; the fd lookup when one was made, for the general
        steps to reuse.)"""
        d = n.data
        t0 = time.perf_counter_ns()
        if d.nr == _NR_IOCTL:
            cmd = d.arg_u32(1)
            if cmd not in self._lane_cmds and self._clane is None:
                return _GENERAL, None
            looked = self._lookup_stat(n.pid, d.arg_int(0))
            sess, resp = looked[0], _GENERAL
            if sess is not None:
                if cmd in self._lane_cmds:
                    resp = self._control_lane(n, sess)
                elif (self._clane is not None and sess.real
                      and self._clane.candidate(sess.node, cmd)):
                    resp = self._continue_lane(n, sess)
            if resp is not _GENERAL:
                self.stats.ns_ioctl += time.perf_counter_ns() - t0
            return resp, looked
        if d.nr in _NR_OPENS:
            resp = self._open_quick(n)
            if resp is None:
                return _GENERAL, None
            self.stats.ns_open += time.perf_counter_ns() - t0
            return resp, None
        return _GENERAL, None

    def _perform_here(self, eff):
        return perform_blocking(eff, self._gate)

    async def _perform_async(self, eff, n: w.Notif | None = None):
        if n is not None and isinstance(eff, RateLimit):
            if self._handover_hold is not None:
                raise _Undecided  # (a live upgrade is pausing: no wait starts now)
            with trio.CancelScope() as scope:
                self._pace_waiters[n.id] = (n, scope)
                try:
                    return await eff.limiter.acquire()
                finally:
                    self._pace_waiters.pop(n.id, None)
            raise _Undecided  # (cancelled by pause_for_handover)
        return await perform_async(eff, self._gate)

    async def _finish_on_trio(self, n: w.Notif, steps: Steps, pending=None) -> None:
        try:
            resp = await run_async(steps, functools.partial(self._perform_async, n=n),
                                   pending)
        except _Undecided:
            self._undecided.append(n)  # (its steps were closed: nothing was held)
            return
        except Exception:
            log.exception("seccomp: handling %s from %d failed", n.syscall, n.pid)
            resp = w.NotifResp.fail(n.id, errno.EIO)
        self._send_quietly(resp)

    async def _decide_again(self, n: w.Notif) -> None:
        """A notification a live upgrade found waiting for its pace token (ours, or the
        predecessor's): decided from the start on the trio thread."""
        steps = self._steps_for(n)
        if steps is None:
            self._send_quietly(w.NotifResp.cont(n.id))
            return
        await self._finish_on_trio(n, steps)

    def _send_quietly(self, resp: w.NotifResp | None) -> None:
        if resp is None:
            return
        t0 = time.perf_counter_ns()
        try:
            self._send(resp)
        except OSError:
            log.exception("seccomp: answering notification %d failed", resp.id)
        self.stats.ns_send += time.perf_counter_ns() - t0

    def _steps_for(self, n: w.Notif) -> Steps | None:
        nr = n.data.nr
        if nr in (w.NR["open"], w.NR["openat"], w.NR["openat2"]):
            return self._open_steps(n)
        if nr == w.NR["ioctl"]:
            return self._ioctl_steps(n)
        if nr == w.NR["mmap"]:
            return self._mmap_steps(n)
        return None

    async def _watchdog(self) -> None:
        """Keeps the listener answering while its threads are held up: an access to the
        tenant's memory past the memory gate's deadline is answered with EFAULT and audited
        (the thread stays in the kernel, counted as stalled); when every thread has been busy
        for busy_hold (a slow driver call, a stalled page), another thread is started."""
        while True:
            await trio.sleep(self.watchdog_tick)
            # (a native loop's thread reads tenant memory from Python too, inside its
            # callbacks — a checked call's parameters, a continue decision's argument, an
            # embedded buffer — for the notification the loop is answering)
            native = self._native
            in_callbacks = ({t.os_tid: t for t in list(native.threads.values())}
                            if native is not None else {})
            for tid, tenant, what in self._gate.sweep(set(self._serving) | set(in_callbacks)):
                held = self._serving.get(tid)
                if held is not None:
                    nid, pid = held[0].id, held[0].pid
                else:
                    _busy, _mem, nid, pid = in_callbacks[tid].watch()
                    nid &= 0xFFFF_FFFF_FFFF_FFFF
                    if not nid:
                        continue
                self._audit_memory(pid, what, OSError(
                    errno.EFAULT, f"{what} did not complete within {self._gate.deadline:g} s "
                                  "(the page waits on something outside the broker); its "
                                  "thread is left to the kernel"))
                self._send_quietly(w.NotifResp.fail(nid, errno.EFAULT))
            now = time.monotonic()
            busy = [since for _n, since in list(self._serving.values())]
            if native is not None:
                try:
                    busy += self._watch_native(native, now)
                except Exception:  # pragma: no cover - the watchdog must go on watching
                    log.exception("seccomp: watching the native loop failed")
            with self._threads_lock:
                live = self._live
            if (not self._stopping and busy and len(busy) >= live
                    and now - max(busy) > self.busy_hold
                    and live < self.threads + self.max_extra_threads):
                self._start_thread()
            elif not self._stopping and live == 0:
                # No thread reads this tenant's calls (one ended on a bug, say): they would
                # wait for ever. Another is started, and said.
                log.warning("seccomp %s: no listener thread left; starting one", self.tenant)
                self._start_thread()

    def _watch_native(self, native: nativelane.NativeLane, now: float) -> list[float]:
        """The watchdog's look at the native loop's threads: an access to the tenant's
        memory past the gate's deadline is answered EFAULT, audited and counted as stalled
        (the loop reports its return); while the tenant has stalled accesses, the loop
        leaves every call to the Python listener and its gate. Returns when each busy
        thread started its call (monotonic seconds)."""
        gate = self._gate
        now_ns = int(now * 1e9)
        out = []
        for t in list(native.threads.values()):
            busy, mem, nid, tid = t.watch()
            nid &= 0xFFFF_FFFF_FFFF_FFFF  # (an unsigned id, carried in an int64)
            if busy:
                out.append(busy / 1e9)
            if mem and not t.reported and now_ns - mem > gate.deadline * 1e9:
                t.reported = True
                t.abandon()
                n = gate.native_stalled(self.tenant)
                what = "tenant memory access (native loop)"
                self._audit_memory(tid, what, OSError(
                    errno.EFAULT, f"{what} did not complete within {gate.deadline:g} s (the "
                                  "page waits on something outside the broker); its thread "
                                  f"is left to the kernel ({n} stalled for this tenant)"))
                self._send_quietly(w.NotifResp.fail(nid, errno.EFAULT))
        native.set_mem_off(gate.stalled.get(self.tenant, 0) > 0)
        return out

    # -- open -----------------------------------------------------------------------------

    def _open_quick(self, n: w.Notif) -> w.NotifResp | None:
        """CONTINUE for an open whose path plainly names none of our nodes, decided from one
        read of the path's first bytes (never past their page); None: the general steps
        decide (ours, a long or unreadable path, a name that needs resolving). A CUDA
        process opens ~2,800 files (libraries, /proc, /sys) and ~50 NVIDIA nodes; the
        decision for the others is the general one (basename not one of the nodes'), and
        what a racing thread can do with a continued open is the same (docs/seccomp.md)."""
        d = n.data
        ptr = d.args[0] if d.nr == _NR_OPEN else d.args[1]
        try:
            raw = self._gate.direct(self.tenant, _vm_read, n.pid, ptr,
                                    min(_PAGE - ptr % _PAGE, 256), what="read of an open path")
        except OSError:
            return None
        end = raw.find(b"\0")
        if end < 0:
            return None
        name = raw[:end].rpartition(b"/")[2].decode("utf-8", "surrogateescape")
        if name in self._basenames:
            return None
        limiter = self._limiter()
        if limiter is not None and not limiter.try_acquire():
            return None  # (the general steps wait for the pace)
        self.stats.opens_continued += 1
        return w.NotifResp.cont(n.id)

    def _limiter(self):
        return getattr(getattr(self.broker, "tenants", {}).get(self.tenant), "limiter", None)

    def _paced_cont(self, n: w.Notif) -> Steps:
        """CONTINUE for a notification the broker's core never sees (an open of another
        file, an mmap of one), after a token of the tenant's pace: each one costs the
        broker a receive, a read and an answer, so a tenant looping on them is paced like
        one looping on ioctls (unpaced, a tenant paced at 100/s made 41k opens/s).
        The native loop takes these tokens from its credit and hands a call back here when
        it has none; the credit is topped up again after the wait."""
        limiter = self._limiter()
        if limiter is not None and not limiter.try_acquire() and not (
                self._on_listener_thread() and limiter.acquire_within(self.PACE_HERE_S)):
            yield RateLimit(limiter)
        if self._native is not None:
            self._native.top_up_pace(getattr(self.broker, "tenants", {}).get(self.tenant))
        return w.NotifResp.cont(n.id)

    # The longest a paced call that needs no decision waits for its token on its own
    # listener thread (`_paced_cont`): a tenant's own thread, so only the tenant waits; a
    # longer wait goes to trio, where a live upgrade's pause can set it aside.
    PACE_HERE_S = 0.05

    def _on_listener_thread(self) -> bool:
        return threading.get_native_id() in self._listener_tids



    def _open_steps(self, n: w.Notif, path_read: bytes | None = None) -> Steps:
        """An open of a path whose basename may be one of our nodes. path_read: the path as
        the native loop already read it into its own buffer for this notification (then
        not read again; the same private copy)."""
        d, tid = n.data, n.pid
        if d.nr == w.NR["open"]:
            dirfd, path_ptr, flags = w.AT_FDCWD, d.args[0], d.arg_u32(1)
        elif d.nr == w.NR["openat"]:
            dirfd, path_ptr, flags = d.arg_int(0), d.args[1], d.arg_u32(2)
        else:  # openat2(dirfd, path, struct open_how *how, size)
            dirfd, path_ptr = d.arg_int(0), d.args[1]
            try:
                how = yield ReadMemory(_TaskMemory(tid), d.args[2], 8, self.tenant,
                                       "read of open_how")
                flags = struct.unpack("=Q", how)[0] & 0xFFFFFFFF
            except OSError:
                return (yield from self._paced_cont(n))  # the kernel will report the bad pointer
        try:
            # An effect like every tenant-memory access: the path may lie in a page that
            # only faults in with someone's help.
            raw = path_read if path_read is not None else (
                yield ReadMemory(_CString(tid), path_ptr, _PATH_MAX, self.tenant,
                                 "read of an open path"))
        except OSError:
            return (yield from self._paced_cont(n))
        path = raw.decode("utf-8", "surrogateescape")
        if posixpath.basename(path) not in self._basenames:
            self.stats.opens_continued += 1
            return (yield from self._paced_cont(n))
        try:
            if path.startswith("/"):
                full = path
            elif dirfd == w.AT_FDCWD:
                full = os.readlink(f"/proc/{tid}/cwd") + "/" + path
            else:
                full = os.readlink(f"/proc/{tid}/fd/{dirfd}") + "/" + path
        except OSError:
            return (yield from self._paced_cont(n))
        spec = self.nodes.get(_normalize(full))
        if spec is None:
            self.stats.opens_continued += 1
            return (yield from self._paced_cont(n))
        caller = self._caller(tid)
        if not self.id_valid(n.id):  # the path bytes were read from the right task
            self.stats.stale += 1
            return None
        self.stats.opens += 1
        req = OpenRequest(caller=caller, tenant=self.tenant, node=spec.kind, minor=spec.minor,
                          flags=flags, want_file=self.real_files)
        open_now = getattr(self.broker, "open_now", None)
        limiter = getattr(getattr(self.broker, "tenants", {}).get(self.tenant), "limiter", None)
        if open_now and limiter is not None and not limiter.try_acquire():
            yield RateLimit(limiter)  # opens are paced like ioctls
        nl = self._native
        epochs = BOOKS.now() if nl is not None and nl.settled_on else None  # (before deciding)
        t0 = time.perf_counter_ns()
        reply = open_now(req) if open_now else (yield Await(self.broker.open, (req,)))
        t1 = time.perf_counter_ns()
        self.stats.ns_open_broker += t1 - t0
        if reply.errno:
            return w.NotifResp.fail(n.id, reply.errno)
        self._install(n, caller, spec, reply.session, flags, posixpath.basename(full),
                      reply.install_fd, epochs)
        self.stats.ns_open_install += time.perf_counter_ns() - t1
        if reply.install_fd >= 0 and nl is not None and nl.settled_on and self.prepared_opens:
            # the next opens of this node may be prepared ones (`_prepare_opens`)
            self._open_template = caller
            self._opened_paths[_normalize(full)] = spec
            nl.when_quiet()
        return None

    # Prepared opens kept in the native loop per node path, by kind: a CUDA init opens
    # nvidiactl 30 times, its GPU's node 18 and nvidia-uvm 4, NVML 6 files per init (native/
    # lane.c holds OPEN_SLOTS in all; with 12 / 8 / 4 the loop answered 34–40 of a CUDA
    # init's 52 on the H200, the others came in bursts between two quiet moments).
    PREPARED_PER_PATH = {NodeKind.CTL: 16, NodeKind.GPU: 12, NodeKind.UVM: 4}
    # DEVBROKER_PREPARED_OPENS=0: every open of our nodes is decided when it is made
    prepared_opens = os.environ.get("DEVBROKER_PREPARED_OPENS", "1") != "0"

    def _prepare_opens(self) -> None:
        """At a quiet moment of the native loop: decide ahead the next opens of the node
        paths the tenant has opened through this listener — the broker's own open (policy,
        session, driver file through a private node) for the sandbox of the last opener
        of one (`_open_template`), the session's inotify watch and mapping fact, as
        `_install` does — and leave each in the loop (NativeLane.open_put), which answers
        an open of that path from a caller it knows in that sandbox with the file
        (native/lane.c answer_prepared_open, docs/seccomp.md "Prepared opens"). Stops at
        the first notification waiting (the tenant comes first) or refusal. The broker
        counts such an open when it is made (its call counters' "open" row); the tenant's
        process is named when the loop has installed it (`_drain_opens`)."""
        nl, caller = self._native, self._open_template
        if (nl is None or not nl.settled_on or caller is None or self._stopping
                or getattr(self.broker, "recorder", None) is not None):
            return
        self._drain_opens()
        self._drop_prepared(everything=False)  # (decided under a policy since changed)
        hit = self._callers.get(caller.tid)
        tenant = getattr(self.broker, "tenants", {}).get(self.tenant)
        if hit is None or tenant is None:
            return  # (the caller's thread is gone: the next open names another)
        limit = limits.of(tenant).open_files
        if len(tenant.sessions) + nativelane.OPEN_SLOTS >= limit:
            # near its limit of open files the prepared ones would count against the
            # tenant's own opens: given back (a tenant far from it never gets here)
            self._drop_prepared(everything=True)
            return
        held: dict[str, int] = {}
        for _sess, path in list(self._prepared.values()):  # (another thread may drain)
            held[path] = held.get(path, 0) + 1
        poller = select.poll()
        poller.register(self._lfd, select.POLLIN)
        for path, spec in list(self._opened_paths.items()):
            while (held.get(path, 0) < self.PREPARED_PER_PATH.get(spec.kind, 0)
                   and len(self._prepared) < nativelane.OPEN_SLOTS
                   and len(tenant.sessions) + nativelane.OPEN_SLOTS < limit):
                if poller.poll(0):
                    return  # a notification waits: serve it (the rest at the next quiet)
                if not self._prepare_one(nl, caller, spec, path, tenant):
                    return
                held[path] = held.get(path, 0) + 1

    def _prepare_one(self, nl: nativelane.NativeLane, caller: Caller, spec: NodeSpec,
                     path: str, tenant) -> bool:
        """One prepared open of `path` (`_prepare_opens`); False: none was made."""
        req = OpenRequest(caller=caller, tenant=self.tenant, node=spec.kind, minor=spec.minor,
                          flags=os.O_RDWR | os.O_CLOEXEC, want_file=True, prepared=True)
        epochs = BOOKS.now()  # (before deciding: a policy change meanwhile voids it)
        reply = self.broker.open_now(req)
        if reply.errno or reply.install_fd < 0:
            if reply.install_fd >= 0:
                os.close(reply.install_fd)
            return False  # (refused now: the tenant's own open is refused with its record)
        fd = reply.install_fd
        try:
            sess = self._watched_session(fd, reply.session, spec, (0, -1), True)
        except OSError:  # no watch: nothing would end the session, so it ends here
            os.close(fd)
            self.broker.release_now(ReleaseRequest(session=reply.session))
            return False
        key = sess.key
        bs = self.broker.sessions.get(reply.session)
        if bs is not None:  # (a file fact for every node: ctl, GPU, uvm)
            self._native_map_fact(sess, key, caller, epochs)
        if bs is None or not nl.open_put(epochs, path, fd, bs, tenant, reply.session):
            os.close(fd)  # (its inotify watch releases the session: the file is gone)
            self.stats.prepared += 1
            self.stats.prepared_dropped += 1
            return False
        self._prepared[reply.session] = (sess, path)
        self.stats.prepared += 1
        return True

    def _drain_opens(self) -> None:
        """Book the opens the native loop answered with prepared files: the opener's
        process is the session's (Broker.opened_by: its ABI, the tenant's process list)
        and the fd number its opener's; a prepared file the loop gave up (ADDFD failed) was
        closed there, and its inotify watch releases the session."""
        nl = self._native
        if nl is None:
            return
        for sid, tid, newfd in nl.open_drain():
            entry = self._prepared.pop(sid, None)
            if entry is None:
                continue
            sess = entry[0]
            if newfd < 0:
                self.stats.prepared_dropped += 1
                continue
            try:
                caller = self._caller(tid)
            except OSError:  # (gone already: its sandbox was checked in the loop)
                continue
            sess.opener = (caller.pid, newfd)
            self.broker.opened_by(sid, caller)

    def _drop_prepared(self, everything: bool) -> None:
        """Take prepared opens back from the native loop and close their files (their
        inotify watches release the sessions): every one, or those decided under a policy
        that has changed since (the loop never uses those)."""
        nl = self._native
        if nl is None:
            return
        self._drain_opens()
        for sid, fd in nl.open_take(everything):
            os.close(fd)
            if self._prepared.pop(sid, None) is not None:
                self.stats.prepared_dropped += 1

    def _watched_session(self, fd: int, sid: int, spec: NodeSpec, opener: tuple[int, int],
                         real: bool) -> Session:
        """The front end's session of the file `fd` (the broker's session `sid`): known by
        its inode, ended by the inotify watch on it (IN_DELETE_SELF: the last reference,
        fd or mapping, in any process, is gone). Raises OSError when the watch cannot be
        made (nothing is registered then)."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        wd = _libc.inotify_add_watch(self._ifd, f"/proc/self/fd/{fd}".encode(), IN_DELETE_SELF)
        if wd < 0:
            _raise_errno("inotify_add_watch")
        sess = Session(sid, spec.kind, spec.minor, key, wd, opener, real=real)
        self.sessions[key] = sess
        self._by_wd[wd] = sess
        return sess

    def _install(self, n: w.Notif, caller: Caller, spec: NodeSpec, sid: int,
                 flags: int, name: str, real_fd: int = -1, epochs=None) -> None:
        """Install the session's file as the open's result: the real driver file the broker
        opened (an inode of its own, see tenantfile.PrivateNodes) or a memfd placeholder.
        epochs: the books' words read before the broker decided the open (with the native
        loop: a real ctl or GPU file's mappings are then left to it, `_native_map_fact`)."""
        real = real_fd >= 0
        memfd = real_fd if real else os.memfd_create(f"{PLACEHOLDER_PREFIX}{name}",
                                                      os.MFD_CLOEXEC)
        try:
            sess = self._watched_session(memfd, sid, spec, (caller.pid, -1), real)
            key = sess.key
            addfd = w.NotifAddfd(
                id=n.id, srcfd=memfd, flags=w.SECCOMP_ADDFD_FLAG_SEND,
                newfd_flags=os.O_CLOEXEC if flags & os.O_CLOEXEC else 0,
            )
            try:
                newfd = _ioctl_int(self._lfd, w.SECCOMP_IOCTL_NOTIF_ADDFD, addfd.encode())
            except OSError as e:
                self._forget(sess)
                self.stats.released_on_failed_install += 1
                self._to_trio(self._start_quietly, self._release, sess)
                if e.errno == errno.ENOENT:
                    self.stats.stale += 1
                else:
                    self._send(w.NotifResp.fail(n.id, e.errno))
                return
            sess.opener = (caller.pid, newfd)
        finally:
            os.close(memfd)  # the tenant's reference is now the only one
        if real and epochs is not None:  # (a file fact for every node: ctl, GPU, uvm)
            self._native_map_fact(sess, key, caller, epochs)
        if real:  # the tenant has its file: the backend's deferred work for the open
            try:
                # (with the native loop, it may wait until the listener is quiet: DVB_QUIET)
                nl = self._native
                if self.broker.after_open_answered(later=nl is not None):
                    nl.when_quiet()
            except Exception:
                log.exception("seccomp: the backend's work after an open failed")

    def _unregister(self, sess: Session) -> bool:
        """Take `sess` out of the lookups — only if they still name it: a file that reuses its
        identity or watch number (a later session, registered before this one's release
        was read off the inotify queue under load) must stay known, or its calls would be
        refused as another NVIDIA file's. Whether the watch was its."""
        if self.sessions.get(sess.key) is sess:
            del self.sessions[sess.key]
        if self._by_wd.get(sess.wd) is sess:
            del self._by_wd[sess.wd]
            return True
        return False

    def _forget(self, sess: Session) -> None:
        if self._unregister(sess) and self._ifd >= 0:
            _libc.inotify_rm_watch(self._ifd, sess.wd)

    async def _release(self, sess: Session) -> None:
        if sess.released:
            return
        sess.released = True
        self._unregister(sess)
        # (its settled facts; a later file with the same identity only learns its own again)
        BOOKS.removed(BOOKS.FILE, dev=sess.key[0], ino=sess.key[1])
        self._changed.set()
        with trio.CancelScope(shield=True):
            try:
                await self.broker.release(ReleaseRequest(session=sess.id))
            except Exception:
                log.exception("seccomp: broker.release(%d) failed", sess.id)

    # -- session lifetime -------------------------------------------------------------------

    def _read_inotify(self) -> list[tuple[int, int]]:
        out = []
        try:
            buf = os.read(self._ifd, 65536)
        except BlockingIOError:
            return out
        off = 0
        while off + 16 <= len(buf):
            wd, mask, _cookie, ln = struct.unpack_from("=iIII", buf, off)
            out.append((wd, mask))
            off += 16 + ln
        return out

    def _note_events(self, evs: list[tuple[int, int]]) -> None:
        for wd, mask in evs:
            if mask & (IN_DELETE_SELF | IN_IGNORED):
                sess = self._by_wd.pop(wd, None)
                if sess is not None and not sess.released:
                    self._pending.append(sess)

    async def _release_pending(self) -> None:
        while self._pending:
            sess = self._pending.pop(0)
            if not sess.released:
                self.stats.released_on_last_close += 1
                await self._release(sess)

    async def _inotify_loop(self) -> None:
        while True:
            await trio.lowlevel.wait_readable(self._ifd)
            if self._handover_hold is not None:  # live upgrade: the queue is the successor's
                await self._handover_hold.wait()
                continue
            self._note_events(self._read_inotify())
            await self._release_pending()

    # -- ioctl ------------------------------------------------------------------------------

    def _ioctl_steps(self, n: w.Notif,
                     looked: tuple[Session | None, bool] | None = None) -> Steps:
        d, tid = n.data, n.pid
        fd, cmd, argp = d.arg_int(0), d.arg_u32(1), d.args[2]
        sess, nvidia = looked if looked is not None else self._lookup_stat(tid, fd)
        if sess is None and nvidia:
            sess, nvidia = self._look_again(tid, fd)
        if sess is None:
            if nvidia:
                return self._refuse_foreign(n, f"ioctl {cmd:#x} on fd {fd}")
            self.stats.ioctls_continued += 1
            return (yield from self._paced_cont(n))
        size = w.IOC_SIZE(cmd) if w.IOC_TYPE(cmd) == w.NV_IOCTL_MAGIC else 0
        # (read before deciding: an answer the loop may keep is written down for this epoch)
        epochs = (BOOKS.now() if size and sess.real and self._native is not None
                  and self._native.settled_on else None)
        arg: bytes | None = None
        memory = _NotifMemory(self, tid, n.id)
        if size:
            try:
                arg = yield ReadMemory(_TaskMemory(tid), argp, size, self.tenant,
                                       f"read of ioctl {cmd:#x}'s argument")
            except memgate.MemoryAccessRefused as e:
                self._audit_memory(tid, f"ioctl {cmd:#x}", e)
                return w.NotifResp.fail(n.id, errno.EFAULT)
            except OSError as e:
                return w.NotifResp.fail(n.id, errno.EFAULT if e.errno != errno.ESRCH else e.errno)
        caller, caps = self._caller_caps(tid)
        self.stats.ioctls += 1

        def resolve_fd(fd: int, _tid: int = tid) -> int | None:
            # fd arguments (REGISTER_FD, RM_MAP_MEMORY's fd, UVM rmCtrlFd) are numbers in
            # the calling thread's fd table
            return self.session_for_fd(_tid, fd)

        def dup_fd(fd: int, _tid: int = tid) -> int:
            # The broker's own reference to the tenant's file, for a call it executes (the
            # broker confirms the caller after its last dup: see confirm).
            return self._getfd(_tid, fd)

        def confirm(_nid: int = n.id) -> bool:
            # Called by the broker after its last read of the caller's memory and fd table
            # and before it acts on them: while the notification is pending, the thread is
            # the one that made the call, so every read and dup before reached that thread
            # (its tid cannot have been reused). One check instead of one per read.
            return self.id_valid(_nid)

        req = IoctlRequest(caller=caller, session=sess.id, cmd=cmd, arg_ptr=argp, arg=arg,
                           memory=memory, resolve_fd=resolve_fd, fd=fd,
                           dup_fd=dup_fd if sess.real else None, confirm=confirm)
        steps = getattr(self.broker, "ioctl_steps", None)
        if steps is not None:
            reply = yield from steps(req)
        else:
            reply = yield Await(self.broker.ioctl, (req,))
        if reply.errno:
            # (writes the broker made before failing, if any, are dropped with the call:
            # the driver's own failures leave the caller's buffers as they were)
            return w.NotifResp.fail(n.id, reply.errno)
        if reply.run_in_caller:
            if not sess.real:
                log.error("seccomp: broker asked to continue a call on a placeholder")
                return w.NotifResp.fail(n.id, errno.EIO)
            if caps & (1 << CAP_SYS_ADMIN) or caps < 0:
                # The driver would see a privileged caller (capable(CAP_SYS_ADMIN) of the
                # task that runs the ioctl): never on a tenant's behalf.
                return self._refuse_privileged(n, caller, cmd)
            self.stats.continued_decided += 1
            return w.NotifResp.cont(n.id)
        writes = memory.pending
        if reply.arg_out is not None:
            out = bytes(reply.arg_out)
            if arg is not None and len(out) != len(arg):
                log.error("seccomp: broker returned %d bytes for a %d-byte argument (cmd %#x)",
                          len(out), len(arg), cmd)
                return w.NotifResp.fail(n.id, errno.EIO)
            writes.append((argp, out))
            if epochs is not None and len(writes) == 1 and self._answer_kept(sess, cmd):
                self._native_answer_fact(sess, caller, tid, fd, cmd, out, epochs)
        if writes:
            if not self.id_valid(n.id):
                self.stats.stale += 1
                return None
            try:
                yield WriteMemory(_Writes(tid, writes), argp, b"", self.tenant,
                                  f"write of ioctl {cmd:#x}'s results")
            except memgate.MemoryAccessRefused as e:
                self._audit_memory(tid, f"ioctl {cmd:#x}", e)
                return w.NotifResp.fail(n.id, errno.EFAULT)
            except OSError as e:
                self._audit_memory(tid, f"ioctl {cmd:#x}", e)
                return w.NotifResp.fail(n.id, errno.EFAULT)
        return w.NotifResp.ok(n.id, reply.result)

    def _control_lane(self, n: w.Notif, sess: Session) -> w.NotifResp | None | object:
        """An RM control the broker's control lane admits, run by the lane's executor
        (broker/laneexec.py) and answered here in a dozen system calls; `_GENERAL` for
        every other call (the general steps then decide it from the start, refusals and
        audit records included); None when the caller went away (nothing to answer).

        This is the executor's adapter: the header and the parameter block are read once
        into the broker's memory, and the driver reads only those copies, so a racing
        tenant thread that rewrites its own memory after the read changes nothing the
        driver sees. The driver runs on the broker's duplicate of the tenant's file,
        checked to be the session's file (a racing dup2 cannot put another file there),
        after the notification is confirmed current (the thread that called is the one
        whose memory and fd table were read). Nothing is continued: the kernel re-reads
        nothing."""
        d, tid = n.data, n.pid
        fd, cmd, argp = d.arg_int(0), d.arg_u32(1), d.args[2]
        gate, clock, stats = self._gate, time.perf_counter_ns, self.stats
        t0 = clock()
        try:
            caller, _caps = self._caller_caps(tid)
            hdr = gate.direct(self.tenant, _vm_read, tid, argp, w.IOC_SIZE(cmd),
                              what=f"read of ioctl {cmd:#x}'s argument")
        except OSError:
            return _GENERAL  # the general path reads again and answers with its record
        spent = [clock() - t0, 0, 0]  # reads, the duplicate, the driver

        def read(ptr: int, size: int) -> bytes:
            t = clock()
            try:
                return gate.direct(self.tenant, _vm_read, tid, ptr, size,
                                   what=f"read of {size} bytes at {ptr:#x}")
            finally:
                spent[0] += clock() - t

        def run(eff: laneexec.RunDriver):
            t3 = clock()
            dup = -1
            try:
                if sess.real:
                    try:
                        dup = self._getfd(tid, fd)
                        held = _stat_nosync(fd=dup)
                    except OSError:
                        return _GENERAL
                    if (held.st_dev, held.st_ino) != sess.key:
                        return _GENERAL  # another file at that number now: the general way
                if not self.id_valid(n.id):
                    return laneexec.GONE
                t4 = clock()
                got = self.broker.backend.run_control(eff.adm.session.file, dup, eff.hdr,
                                                      eff.params, eff.adm.header, eff.adm.abi)
                spent[1] += t4 - t3
                spent[2] += clock() - t4
                return got
            except NotHere:
                return _GENERAL
            finally:
                if dup >= 0:
                    os.close(dup)

        got = laneexec.run_here(laneexec.lane_steps(self._lane, sess.id, caller, cmd, hdr),
                                read, run)
        if got is laneexec.GONE:
            stats.stale += 1
            return None
        if got is _GENERAL:
            return _GENERAL
        t6 = clock()
        stats.ioctls += 1
        stats.controls_fast += 1
        stats.lane_ns_read += spent[0]
        stats.lane_ns_dup += spent[1]
        stats.lane_ns_driver += spent[2]
        # (the Python loop counts the admission, the check and the books together)
        stats.lane_ns_admit += t6 - t0 - sum(spent)
        if got.err:  # the driver's failure: the tenant's buffers stay as they were
            return w.NotifResp.fail(n.id, got.err)
        if not self.id_valid(n.id):
            stats.stale += 1
            return None
        adm = got.adm
        try:
            gate.direct(self.tenant, vm_write_many, tid,
                        ([(adm.params_ptr, got.out)] if adm.params_size else [])
                        + [(argp, got.hdr_out)],
                        what=f"write of ioctl {cmd:#x}'s results")
        except OSError as e:
            self._audit_memory(tid, f"ioctl {cmd:#x}", e)
            return w.NotifResp.fail(n.id, errno.EFAULT)
        stats.lane_ns_write += clock() - t6
        return w.NotifResp.ok(n.id, got.ret)

    def _continue_lane(self, n: w.Notif, sess: Session) -> w.NotifResp | object:
        """A call the broker's continue lane admits (a UVM command, an RM escape the driver
        binds to the caller): CONTINUE; `_GENERAL` for everything else (the general steps
        decide it from the start, refusals and audit records included)."""
        d = n.data
        if self._continue_decision(n.pid, d.arg_u32(1), d.args[2], sess):
            return w.NotifResp.cont(n.id)
        return _GENERAL

    def _continue_decision(self, tid: int, cmd: int, argp: int, sess: Session,
                           seen: list | None = None) -> bool:
        """Whether the continue lane (broker/continuelane.py ContinueLane) admits this call (a
        UVM command, an RM escape the driver binds to the caller): its argument read once
        into the broker, its client handles, objects and fds checked (an fd number is
        resolved in the calling thread's table, as the general steps do), the caller
        without CAP_SYS_ADMIN (else the general steps refuse it: privileged in the driver).
        Both listeners (Python and native) ask here; `seen` gets the argument as read
        (what a settled continuation is written from)."""
        lane = self._clane
        size = lane.arg_size(sess.id, cmd)
        if size is None:
            return False
        try:
            caller, caps = self._caller_caps(tid)
            if caps & (1 << CAP_SYS_ADMIN) or caps < 0:
                return False
            arg = self._gate.direct(self.tenant, _vm_read, tid, argp, size,
                                    what=f"read of ioctl {cmd:#x}'s argument (continue lane)"
                                    ) if size else b""
        except OSError:
            return False
        if not lane.admit(sess.id, caller, cmd, arg,
                          resolve_fd=lambda fd, _tid=tid: self.session_for_fd(_tid, fd)):
            return False
        if seen is not None:
            seen.append(arg)
        self.stats.ioctls += 1
        self.stats.continued_decided += 1
        self.stats.uvm_fast += 1
        return True

    # -- mmap -------------------------------------------------------------------------------

    @functools.cached_property
    def _gate(self) -> memgate.MemoryGate:
        return memgate.gate_of(self.broker)  # the broker's, for its life

    def _audit_memory(self, tid: int, what: str, e: OSError) -> None:
        """A tenant-memory access the gate refused (deadline, stall limit, a page of the
        broker's own mount): the broker never saw the call, so the record is written here."""
        audit = getattr(self.broker, "audit", None)
        if audit is not None:
            audit.deny(tenant=self.tenant, pid=tid, what=what,
                       reason=f"tenant memory access failed: {e.strerror or e}")

    def _refuse_privileged(self, n: w.Notif, caller: Caller, cmd: int) -> w.NotifResp:
        audit = getattr(self.broker, "audit", None)
        if audit is not None:
            audit.deny(tenant=self.tenant, pid=caller.pid, what=f"ioctl {cmd:#x}",
                       reason="the tenant holds CAP_SYS_ADMIN: a call it runs itself would be "
                              "privileged in the driver")
        return w.NotifResp.fail(n.id, errno.EPERM)

    def _mmap_steps(self, n: w.Notif) -> Steps:
        d, tid = n.data, n.pid
        length, fd, offset = d.args[1], d.arg_int(4), d.args[5]
        sess, nvidia = self._lookup_stat(tid, fd)
        if sess is None and nvidia:
            sess, nvidia = self._look_again(tid, fd)
        if sess is None:
            if nvidia:
                return self._refuse_foreign(n, f"mmap of fd {fd}")
            if _is_placeholder(tid, fd):
                return self._refuse_placeholder(n, fd)
            self.stats.mmaps_continued += 1
            return (yield from self._paced_cont(n))
        caller = self._caller(tid)
        if not self.id_valid(n.id):
            self.stats.stale += 1
            return None
        self.stats.mmaps += 1
        req = MapReadRequest(caller=caller, session=sess.id, offset=offset, length=length,
                             file_key=sess.key)
        if sess.real or sess.node is NodeKind.UVM:
            # The driver maps its own pages; it checks the file's mapping context (made by a
            # decided RM_MAP_MEMORY) and, for nvidia-uvm, the caller's mm. The broker only
            # decides whether this file may be mapped at all (managed memory: see policy).
            # Paced like every other notification (map_read paces the emulated ones).
            limiter = self._limiter()
            if limiter is not None and not limiter.try_acquire():
                yield RateLimit(limiter)
            check_now = getattr(self.broker, "map_check_now", None)
            if check_now is not None:
                rep = check_now(req)
            elif hasattr(self.broker, "map_check"):
                rep = yield Await(self.broker.map_check, (req,))
            else:
                rep = MapCheckReply()
            if rep.errno:
                return w.NotifResp.fail(n.id, rep.errno)
            if sess.real:
                return w.NotifResp.cont(n.id)
        if sess.node is NodeKind.UVM:
            # A managed range, charged above: the emulated driver's pages are zeros until
            # written (nothing to read: the placeholder is only sized)
            reply = MapReadReply()
        else:
            reply = yield Await(self.broker.map_read, (req,))
        if reply.errno:
            return w.NotifResp.fail(n.id, reply.errno)
        # Blocking work with the memory gate's deadline: the fd may have been swapped for a
        # file whose fstat and close wait on a file system the tenant serves.
        try:
            return (yield Blocking(self._fill_placeholder,
                                   (n, tid, fd, sess, offset, length, reply.data),
                                   self.tenant, f"mmap of fd {fd}"))
        except memgate.MemoryAccessRefused as e:
            self._audit_memory(tid, f"mmap of fd {fd}", e)
            return w.NotifResp.fail(n.id, errno.EIO)

    @staticmethod
    def _fill_placeholder(n: w.Notif, tid: int, fd: int, sess: Session, offset: int,
                          length: int, data: bytes) -> w.NotifResp:
        try:
            f = _pidfd_getfd(tid, fd)
        except OSError as e:
            return w.NotifResp.fail(n.id, e.errno or errno.EBADF)
        try:
            st = os.fstat(f)
            if (st.st_dev, st.st_ino) != sess.key:
                # the fd was swapped under us: let the kernel map whatever it is now
                return w.NotifResp.cont(n.id)
            end = offset + length
            end = (end + _PAGE - 1) // _PAGE * _PAGE
            try:
                if st.st_size < end:
                    os.ftruncate(f, end)
                data = bytes(data[:length])
                if data:
                    os.pwrite(f, data, offset)
            except OSError as e:
                return w.NotifResp.fail(n.id, e.errno or errno.ENOMEM)
        finally:
            os.close(f)  # if the tenant closed its fd meanwhile, this evicts: released
        return w.NotifResp.cont(n.id)

    # -- live upgrade (src/devbroker/upgrade.py drives these) -----------------------------
    #
    # The running broker pauses every supervisor (no notification is received any more; the
    # ones received are answered), exports each one's state with its listener and inotify
    # fds, and, once the successor has adopted them, detaches (its sessions are the
    # successor's: the old process's shutdown must not release them). Notifications the
    # kernel queues meanwhile wait there for the successor's threads; inotify events queued
    # meanwhile (a session's last close) wait in the inotify instance, which passes too, for
    # the successor to read: its watches and their numbers are the instance's, not the
    # process's.

    HANDOVER_FORMAT = 1

    def _handed_tasks(self) -> list:
        """Notifications handed to the trio thread and not answered yet, and releases of
        sessions under way (tasks of serve()'s nursery)."""
        if self._nursery is None:
            return []
        return [t for t in self._nursery.child_tasks
                if t.name.endswith(("._finish_on_trio", "._release", "._decide_again"))]

    async def pause_for_handover(self) -> None:
        """Stop receiving notifications; return once every one received has been answered
        and the books of session ends are up to date. Undone by resume_after_handover."""
        if self._handover_hold is not None:
            return
        self._handover_hold = trio.Event()  # the inotify loop stops reading
        while self._nursery is None and not self.closed.is_set():
            await trio.sleep(0.002)  # attached a moment ago: serve() has not started yet
        # The listener threads leave their loops after answering what they hold (woken
        # from poll() by _HANDOVER_WAKE). The watchdog starts no thread while _stopping is
        # set.
        self._stopping = True
        os.eventfd_write(_HANDOVER_WAKE, 1)
        while self._live:
            await trio.sleep(0.002)
        self._drop_prepared(everything=True)  # (their sessions end here, not in the successor)
        if self._token is not None:
            # What the threads handed to trio before leaving was queued before this.
            flushed = trio.Event()
            self._token.run_sync_soon(flushed.set)
            await flushed.wait()
        while self._pending or self._handed_tasks():
            for _n, scope in list(self._pace_waiters.values()):
                scope.cancel()  # undecided: handed over (module doc of _pace_waiters)
            await trio.sleep(0.002)

    def resume_after_handover(self) -> None:
        """The upgrade was called off: serve on from where the pause stopped."""
        hold, self._handover_hold = self._handover_hold, None
        if hold is None:
            return
        hold.set()
        try:
            os.eventfd_read(_HANDOVER_WAKE)
        except BlockingIOError:
            pass
        if self.closed.is_set() or self._nursery is None:
            return
        self._stopping = False
        for _ in range(self.threads):
            self._start_thread()
        undecided, self._undecided = self._undecided, []
        for n in undecided:
            self._nursery.start_soon(self._decide_again, n)

    def export_for_handover(self) -> tuple[dict, list[int]]:
        """(state, [listener fd, inotify fd]) of a paused supervisor. The fds stay this
        supervisor's; the caller sends duplicates (SCM_RIGHTS)."""
        if self._handover_hold is None or self._live:
            raise RuntimeError("export_for_handover: the supervisor is not paused")

        def session(s: Session) -> list:
            return [s.id, int(s.node), s.minor, list(s.key), s.wd, list(s.opener), s.real]

        return {
            "format": self.HANDOVER_FORMAT,
            "tenant": self.tenant,
            "nodes": [[p, int(spec.kind), spec.minor] for p, spec in self.nodes.items()],
            "real_files": self.real_files,
            "stats": dataclasses.asdict(self.stats),
            "sessions": [session(s) for s in self.sessions.values() if not s.released],
            # received, not decided (waiting for the pace when the pause began): the
            # successor answers them by id on the same listener
            "undecided": [n.encode(self.sizes).hex() for n in self._undecided],
        }, [self._lfd, self._ifd]

    @classmethod
    def adopt(cls, broker: BrokerInterface, state: dict, inotify_fd: int, *,
              sizes: w.NotifSizes | None = None) -> "SeccompSupervisor":
        """A supervisor with a predecessor's sessions and inotify instance (owned from now
        on), to be served with serve(listener) like a new one."""
        if state.get("format") != cls.HANDOVER_FORMAT:
            raise ValueError(f"seccomp supervisor hand-over format {state.get('format')} "
                             f"(this one reads {cls.HANDOVER_FORMAT})")
        nodes = {p: NodeSpec(NodeKind(k), m) for p, k, m in state["nodes"]}
        sup = cls(broker, state["tenant"], nodes, sizes=sizes,
                  real_files=bool(state["real_files"]))
        os.close(sup._ifd)
        sup._ifd = inotify_fd
        for sid, node, minor, key, wd, opener, real in state["sessions"]:
            s = Session(sid, NodeKind(node), minor, (key[0], key[1]), wd,
                        (opener[0], opener[1]), real=bool(real))
            sup.sessions[s.key] = s
            sup._by_wd[s.wd] = s
        sup._undecided = [w.Notif.decode(bytes.fromhex(x))
                          for x in state.get("undecided", ())]
        known = {f.name for f in dataclasses.fields(SupervisorStats)}
        for k, v in state["stats"].items():
            if k in known:
                setattr(sup.stats, k, v)
        return sup

    def detach_after_handover(self) -> None:
        """The successor serves this listener now: when this process's serve() ends it
        releases nothing (the sessions live on in the successor)."""
        self.sessions = {}
        self._by_wd = {}
        self._pending = []
        self._undecided = []  # (the successor's to answer)


# ---------------------------------------------------------------------------------------
# launching a tenant
# ---------------------------------------------------------------------------------------

# The trampoline runs in the child with `python -I -S -c`: it imports nothing but the
# standard library, installs the filter (no_new_privs first), hands the listener to the
# parent over the socket (SCM_RIGHTS) and execs the tenant. Between the install and the
# exec it must open no file: every open would wait for a supervisor that has not got the
# listener yet.
_TRAMPOLINE = r"""
import array, ctypes, os, socket, sys
sock_fd, prog, flags, argv = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
class FProg(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
def die(msg, code=126):
    os.write(2, ("devbroker seccomp trampoline: %s\n" % msg).encode()); os._exit(code)
buf = ctypes.create_string_buffer(prog, len(prog))
fp = FProg(len(prog) // 8, ctypes.addressof(buf))
sock = socket.socket(fileno=sock_fd)
fds = array.array("i")
if libc.prctl(38, 1, 0, 0, 0) != 0:
    die("PR_SET_NO_NEW_PRIVS: " + os.strerror(ctypes.get_errno()))
tag = b"K"
lfd = libc.syscall(ctypes.c_long(317), ctypes.c_long(1), ctypes.c_long(flags), ctypes.byref(fp))
if lfd < 0 and ctypes.get_errno() == 22 and flags & 32:
    tag = b"I"  # no SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV on this kernel
    lfd = libc.syscall(ctypes.c_long(317), ctypes.c_long(1), ctypes.c_long(flags & ~32), ctypes.byref(fp))
if lfd < 0:
    die("seccomp(SET_MODE_FILTER): " + os.strerror(ctypes.get_errno()))
fds.append(lfd)
sock.sendmsg([tag], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
os.close(lfd)
sock.close()
try:
    os.execvp(argv[0], argv)
except OSError as e:
    die("exec %s: %s" % (argv[0], e.strerror), 127)
"""

FILTER_FLAGS = w.SECCOMP_FILTER_FLAG_NEW_LISTENER | w.SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV


def tenant_command(argv: Sequence[str], sock_fd: int, *,
                   opts: w.FilterOptions = w.FilterOptions(),
                   python: str = sys.executable) -> list[str]:
    """The argv that runs ``argv`` under the filter, sending the listener over sock_fd."""
    if not argv:
        raise ValueError("empty argv")
    return [python, "-I", "-S", "-c", _TRAMPOLINE, str(sock_fd),
            w.build_filter(opts).hex(), str(FILTER_FLAGS), *argv]


async def _recv_listener(sock: socket.socket) -> tuple[int, bool]:
    tsock = trio.socket.from_stdlib_socket(sock)
    msg, ancdata, _flags, _addr = await tsock.recvmsg(16, socket.CMSG_SPACE(4 * 4))
    fds: list[int] = []
    for level, typ, data in ancdata:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            n = len(data) // 4
            fds.extend(struct.unpack(f"={n}i", data[: 4 * n]))
    if not fds:
        raise SeccompError("the tenant trampoline sent no listener (see its stderr)")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0], msg == b"K"


@dataclass
class Tenant:
    """What :func:`run_tenant` hands to ``nursery.start``."""

    process: trio.Process
    supervisor: SeccompSupervisor
    killable_wait: bool  # WAIT_KILLABLE_RECV in effect (no restarted notifications)
    returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid


async def run_tenant(
    argv: Sequence[str],
    *,
    broker: BrokerInterface,
    tenant: str,
    nodes: Mapping[str, NodeSpec | tuple[NodeKind, int]] | None = None,
    opts: w.FilterOptions | None = None,
    real_files: bool = False,
    task_status=trio.TASK_STATUS_IGNORED,
    **process_kw,
) -> int:
    """Run argv under the seccomp front end and serve it until it and all its descendants
    are gone; return its exit status (negative signal number when killed).

    ``nodes`` maps absolute paths (as the tenant names them) to node kinds; default
    :func:`default_nodes`. ``process_kw`` goes to :func:`trio.lowlevel.open_process`
    (env, cwd, stdin, stdout, stderr, pass_fds, …). With ``nursery.start(run_tenant, …)``
    the started value is a :class:`Tenant` (process handle, supervisor, stats).
    ``real_files``: the broker's backend hands out real driver files (the real backend).
    ``opts``: the filter; default the one `devbroker exec` installs, with the broker's
    in-kernel UVM rows for this tenant when the files are real (Broker.kernel_ioctls).
    """
    if opts is None:
        kernel = getattr(broker, "kernel_ioctls", None)
        opts = w.FilterOptions(kernel_ioctls=kernel(tenant) if real_files and kernel else ())
    sup = SeccompSupervisor(broker, tenant, nodes, real_files=real_files)
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        pass_fds = tuple(process_kw.pop("pass_fds", ())) + (child.fileno(),)
        proc = await trio.lowlevel.open_process(
            tenant_command(argv, child.fileno(), opts=opts), pass_fds=pass_fds, **process_kw
        )
        child.close()
        try:
            with trio.CancelScope(shield=True):
                listener, killable = await _recv_listener(parent)
        except BaseException:
            with trio.CancelScope(shield=True):
                proc.kill()
                await proc.wait()
            raise
    finally:
        child.close()
        parent.close()
    handle = Tenant(proc, sup, killable)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sup.serve, listener)
            task_status.started(handle)
            try:
                handle.returncode = await proc.wait()
            except BaseException:
                with trio.CancelScope(shield=True):
                    proc.kill()
                    await proc.wait()
                raise
    finally:
        os.close(listener)
    return handle.returncode
