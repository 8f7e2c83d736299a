"""The FUSE reader threads' native loop (native/fuselane.c), as frontends/fuse.py drives it.

Why: on the 2-CPU development machine a FUSE reader thread spent ~150 µs of Python on one
RM control of the emulated backend (segment timings, docs/benchmarks.md "The hot path"):
~30 µs reading and routing the request, ~35 µs reading and writing
the parameter block through the memory gate's effects, ~20 µs sending the reply, ~10 µs
in the effect machinery — around a decision (the control lane's admission, the backend's
run, the books) of ~50 µs. The C loop makes those system calls itself and hands Python
only what needs deciding.

Who does what (nothing new is decided here):
* C reads what /dev/fuse has pending. A node ioctl (its inode registered here with its
  tenant, `FuseNative.node_put`) waits in a queue shared by the front end's threads and is
  handed out one tenant per turn (as limits.FairQueue does for the Python reader); every
  other request comes back to Python whole (`DVBF_REQUEST`), which routes it as before.
* For a node ioctl, `FuseFrontend._native_lane_call` decides: the handle, the caller, the
  control lane's admission (broker/fastlane.py: the same `admit`, `check`, backend run and
  books as the Python reader's lane path), then `read` fetches the parameter block the
  decision names into the thread's private buffer, and `answer` writes the results back and
  replies. Anything the lane does not take is parsed and served by the general steps, in
  the turn the queue gave it.
* Tenant memory: C publishes when an access started; the front end's watchdog claims one
  past the memory gate's deadline (`claim`), answers it EFAULT and counts it stalled; the
  access reports DVBF_LATE when it returns. A reader thread is marked as accessing tenant
  memory for its life (MemoryGate.mark_native), so a fault it takes on this very mount is
  refused at once by another reader.

Off with DEVBROKER_FUSE_NATIVE=0, or when the library cannot be built (devbroker.native logs
why): the Python reader serves as before.
"""
from __future__ import annotations

import ctypes
import logging
import os

from devbroker import native

log = logging.getLogger("devbroker.fuse.native")

ABI = 1  # native/fuselane.c DVBF_ABI
DVBF_NODE_IOCTL, DVBF_REQUEST, DVBF_IDLE, DVBF_WAKE, DVBF_HUP, DVBF_ERROR = range(1, 7)
DVBF_LATE, DVBF_WRITE_FAILED = -2, -3
HDR_MAX = 1024
REQ_MAX = 40 + 32 + HDR_MAX  # fuse_in_header, fuse_ioctl_in, the argument
PARAMS_MAX = 16384
_ARG_AT = 40 + 32  # where a queued ioctl's argument starts in `raw`
COUNTERS = ("read", "queued", "answered", "late")


class FuseCall(ctypes.Structure):
    """native/fuselane.c struct dvbf_call: the request in hand."""
    _fields_ = [("unique", ctypes.c_uint64), ("nodeid", ctypes.c_uint64),
                ("fh", ctypes.c_uint64), ("arg", ctypes.c_uint64),
                ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32), ("pid", ctypes.c_uint32),
                ("cmd", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("in_size", ctypes.c_uint32), ("out_size", ctypes.c_uint32),
                ("len", ctypes.c_uint32), ("tenant", ctypes.c_int32), ("err", ctypes.c_int32),
                ("late_ns", ctypes.c_int64), ("raw", ctypes.c_uint8 * REQ_MAX),
                ("params", ctypes.c_uint8 * PARAMS_MAX)]


_RAW_OFF = FuseCall.raw.offset
_PARAMS_OFF = FuseCall.params.offset


def enabled() -> bool:
    return os.environ.get("DEVBROKER_FUSE_NATIVE", "1") != "0"


def library() -> ctypes.CDLL | None:
    """native/fuselane.c loaded and checked, or None (the Python reader serves)."""
    lib = native.load_checked("fuselane", "dvbf_abi", ABI, "dvbf_call_size",
                              ctypes.sizeof(FuseCall))
    if lib is None or getattr(lib, "_devbroker_checked", False):
        return lib
    vp, i64, u64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t
    lib.dvbf_shared_new.restype = vp
    lib.dvbf_shared_free.argtypes = [vp]
    lib.dvbf_node_put.argtypes = [vp, u64, ctypes.c_int32]
    lib.dvbf_node_drop.argtypes = [vp, u64]
    lib.dvbf_queued.argtypes = [vp]
    lib.dvbf_thread_new.restype = vp
    lib.dvbf_thread_new.argtypes = [vp, ctypes.c_int, ctypes.c_int, sz, i64]
    lib.dvbf_thread_free.argtypes = [vp]
    lib.dvbf_call_of.restype = vp
    lib.dvbf_call_of.argtypes = [vp]
    lib.dvbf_buf_of.restype = vp
    lib.dvbf_buf_of.argtypes = [vp]
    lib.dvbf_fold.argtypes = [vp, ctypes.POINTER(u64)]
    lib.dvbf_next.argtypes = [vp, ctypes.c_int]
    lib.dvbf_mem_since.restype = i64
    lib.dvbf_mem_since.argtypes = [vp]
    lib.dvbf_claim.argtypes = [vp, i64]
    lib.dvbf_read.restype = ctypes.c_ssize_t
    lib.dvbf_read.argtypes = [vp, u64, sz]
    lib.dvbf_error.argtypes = [vp, ctypes.c_int]
    lib.dvbf_answer.argtypes = [vp, ctypes.c_int32, ctypes.c_char_p, sz, u64, ctypes.c_char_p,
                                sz]
    lib._devbroker_checked = True
    return lib


def describe() -> str:
    """Which loop FUSE reader threads run, and why (for the broker's start line)."""
    off = None if enabled() else "DEVBROKER_FUSE_NATIVE=0"
    return native.describe_loop("fuselane", None if off else library(), off, "native reader",
                                "Python reader")


class FuseNative:
    """One front end's native state: its node inodes by tenant and the shared queue."""

    def __init__(self, lib: ctypes.CDLL, ptr: int):
        self.lib = lib
        self.ptr = ptr
        self._tenant_ix: dict[str, int] = {}

    @classmethod
    def create(cls) -> "FuseNative | None":
        if not enabled():
            return None
        lib = library()
        if lib is None:
            return None
        ptr = lib.dvbf_shared_new()
        return cls(lib, ptr) if ptr else None

    def node_put(self, nodeid: int, tenant: str | None) -> None:
        """An ioctl on this inode is queued for `tenant`'s turns (a full table leaves the
        node's requests to the Python reader: still served, in Python's queue)."""
        ix = self._tenant_ix.setdefault(tenant or "", len(self._tenant_ix))
        if self.lib.dvbf_node_put(self.ptr, nodeid, ix) != 0:
            log.warning("native FUSE loop: node table full; inode %d is served by Python",
                        nodeid)

    def node_drop(self, nodeid: int) -> None:
        self.lib.dvbf_node_drop(self.ptr, nodeid)

    def queued(self) -> int:
        """Node ioctls read and waiting for their turn."""
        return self.lib.dvbf_queued(self.ptr)

    def thread(self, fd: int, wake_fd: int, bufsize: int, spin_ns: int) -> "FuseNativeThread":
        ptr = self.lib.dvbf_thread_new(self.ptr, fd, wake_fd, bufsize, spin_ns)
        if not ptr:
            raise MemoryError("native FUSE loop: no memory for a reader thread")
        return FuseNativeThread(self.lib, ptr)

    def free(self) -> None:
        """(Once no thread uses it.)"""
        if self.ptr:
            self.lib.dvbf_shared_free(self.ptr)
            self.ptr = None


class FuseNativeThread:
    """One reader thread's native state; every method but `mem_since` and `claim` is the
    owning thread's."""

    def __init__(self, lib: ctypes.CDLL, ptr: int):
        self.lib = lib
        self.ptr = ptr
        self.base = lib.dvbf_call_of(ptr)
        self.call = FuseCall.from_address(self.base)
        self.buf = lib.dvbf_buf_of(ptr)
        self.tenant = ""  # whose memory the current access touches (for the watchdog)
        self.what: tuple = ("access", 0, 0)  # (kind, bytes, address): describe_access()

    def describe_access(self) -> str:
        """The current access in words (for the audit record of a stalled one)."""
        kind, n, addr = self.what
        return f"{kind} of {n} bytes at {addr:#x} (native FUSE reader)"

    def next(self, read_more: bool = True) -> int:
        return self.lib.dvbf_next(self.ptr, 1 if read_more else 0)

    def request(self) -> bytes:
        """(DVBF_REQUEST) The request read, a copy (the buffer is read into again)."""
        return ctypes.string_at(self.buf, self.call.len)

    def raw(self) -> bytes:
        """(DVBF_NODE_IOCTL) The queued ioctl as read."""
        return ctypes.string_at(self.base + _RAW_OFF, self.call.len)

    def arg(self) -> bytes:
        """(DVBF_NODE_IOCTL) The ioctl's argument: the kernel's copy in the request."""
        return ctypes.string_at(self.base + _RAW_OFF + _ARG_AT, self.call.in_size)

    def read(self, addr: int, n: int) -> bytes | int | None:
        """The n bytes at addr in the caller's memory into the private buffer: the bytes,
        None (unreadable: errno-level failure or short), or DVBF_LATE."""
        got = self.lib.dvbf_read(self.ptr, addr, n)
        if got == DVBF_LATE:
            return DVBF_LATE
        if got != n:
            return None
        return ctypes.string_at(self.base + _PARAMS_OFF, n)

    def answer(self, result: int, out: bytes, addr: int, params: bytes) -> int:
        """Write `params` at addr (none if empty), then reply with result and `out`: 0,
        DVBF_WRITE_FAILED (answered EFAULT) or DVBF_LATE (the watchdog answered)."""
        return self.lib.dvbf_answer(self.ptr, result, out, len(out), addr, params, len(params))

    def error(self, err: int) -> None:
        self.lib.dvbf_error(self.ptr, err)

    def mem_since(self) -> int:
        return self.lib.dvbf_mem_since(self.ptr)

    def claim(self, since: int) -> bool:
        return bool(self.lib.dvbf_claim(self.ptr, since))

    def fold(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * len(COUNTERS))()
        self.lib.dvbf_fold(self.ptr, out)
        return dict(zip(COUNTERS, out))

    def free(self) -> None:
        if self.ptr:
            self.lib.dvbf_thread_free(self.ptr)
            self.ptr = None
