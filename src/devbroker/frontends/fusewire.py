"""Sans-IO codec for the FUSE (and CUSE) kernel protocol, major version 7.

Bytes read from /dev/fuse go in through :func:`parse_request` and come out as typed
request dataclasses; replies and notifications are built by the ``encode_*`` functions
and written back by the caller. Nothing here performs I/O, so the FUSE and CUSE front
ends share it and it is tested from bytes alone.

Layouts follow Linux ``include/uapi/linux/fuse.h`` (little-endian, 64-bit aligned).
Malformed input raises :class:`WireError` naming the byte offset and the field; no other
exception escapes the parser.
"""
from __future__ import annotations

import builtins
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

KERNEL_VERSION = 7
# The newest minor whose message layouts this codec knows. Every later addition up to
# here is either a new opcode (decoded as Unknown and refused with ENOSYS) or a field in
# space that used to be padding, so speaking this minor costs nothing on older kernels.
MAX_MINOR = 45
ROOT_ID = 1
MIN_READ_BUFFER = 8192

# --- opcodes ---------------------------------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
GETXATTR = 22
LISTXATTR = 23
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
ACCESS = 34
INTERRUPT = 36
DESTROY = 38
IOCTL = 39
POLL = 40
BATCH_FORGET = 42
READDIRPLUS = 44
CUSE_INIT = 4096

# --- notification codes (sent with unique 0 and the code in the error field) -------------
NOTIFY_POLL = 1
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3
NOTIFY_DELETE = 6

# --- INIT flags (64-bit; bits 32.. travel in flags2 when INIT_EXT is set) ----------------
ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
ABORT_ERROR = 1 << 21
MAX_PAGES = 1 << 22
EXPLICIT_INVAL_DATA = 1 << 25
INIT_EXT = 1 << 30
DIRECT_IO_ALLOW_MMAP = 1 << 36
CUSE_UNRESTRICTED_IOCTL = 1 << 0

# --- OPEN reply flags ------------------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3
FOPEN_STREAM = 1 << 4
FOPEN_NOFLUSH = 1 << 5

# --- IOCTL flags -----------------------------------------------------------------------
IOCTL_COMPAT = 1 << 0
IOCTL_UNRESTRICTED = 1 << 1
IOCTL_RETRY = 1 << 2
IOCTL_32BIT = 1 << 3
IOCTL_DIR = 1 << 4
IOCTL_MAX_IOV = 256

POLL_SCHEDULE_NOTIFY = 1 << 0
GETATTR_FH = 1 << 0
RELEASE_FLUSH = 1 << 0

# SETATTR valid bits
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8
FATTR_LOCKOWNER = 1 << 9
FATTR_CTIME = 1 << 10

# --- structs ---------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
_ENTRY_HEAD = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid nsecs
_ATTR_OUT_HEAD = struct.Struct("<QII")
_INIT_IN = struct.Struct("<IIII")
_INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")  # 64 bytes
_CUSE_INIT_IN = struct.Struct("<IIII")
_CUSE_INIT_OUT = struct.Struct("<IIIIIIII40x")  # 72 bytes
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_FORGET_ONE = struct.Struct("<QQ")
_BATCH_FORGET_IN = struct.Struct("<II")
_GETATTR_IN = struct.Struct("<IIQ")
_SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # 88 bytes
_OPEN_IN = struct.Struct("<II")
_OPEN_OUT = struct.Struct("<QIi")
_READ_IN = struct.Struct("<QQIIQII")  # 40 bytes
_READ_IN_COMPAT = struct.Struct("<QQII")  # 24 bytes, minor < 9
_WRITE_OUT = struct.Struct("<II")
_FLUSH_IN = struct.Struct("<QIIQ")
_RELEASE_IN = struct.Struct("<QIIQ")
_FSYNC_IN = struct.Struct("<QII")
_ACCESS_IN = struct.Struct("<II")
_GETXATTR_IN = struct.Struct("<II")
_GETXATTR_OUT = struct.Struct("<II")
_IOCTL_IN = struct.Struct("<QIIQII")  # 32 bytes
_IOCTL_OUT = struct.Struct("<iIII")
_IOVEC = struct.Struct("<QQ")
_POLL_IN = struct.Struct("<QQII")
_POLL_OUT = struct.Struct("<II")
_STATFS = struct.Struct("<QQQQQIIII24x")  # fuse_kstatfs, 80 bytes
_DIRENT = struct.Struct("<QQII")
_INVAL_INODE = struct.Struct("<Qqq")
_INVAL_ENTRY = struct.Struct("<QII")
_NOTIFY_DELETE = struct.Struct("<QQII")

_COMPAT_ENTRY_OUT_SIZE = 120
_COMPAT_ATTR_OUT_SIZE = 96
_COMPAT_STATFS_SIZE = 48


class WireError(ValueError):
    """Malformed FUSE bytes: names where (byte offset from the message start) and what."""

    def __init__(self, offset: int, field: str, reason: str, unique: int | None = None):
        self.offset = offset
        self.field = field
        self.reason = reason
        # The request id when the header itself was readable, so the caller can still
        # answer that request with an error instead of leaving the kernel waiting.
        self.unique = unique
        super().__init__(f"FUSE wire error at offset {offset} ({field}): {reason}")


# --- request types ---------------------------------------------------------------------
@dataclass(frozen=True)
class InHeader:
    length: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int  # the calling thread's id in the mounter's pid namespace (0 for kernel work)
    total_extlen: int = 0


@dataclass(frozen=True)
class Request:
    header: InHeader

    @property
    def unique(self) -> int:
        return self.header.unique

    @property
    def nodeid(self) -> int:
        return self.header.nodeid

    # FORGET, BATCH_FORGET and INTERRUPT take no reply; everything else does.
    expects_reply = True


@dataclass(frozen=True)
class Init(Request):
    major: int
    minor: int
    max_readahead: int = 0
    flags: int = 0  # 64-bit: flags | flags2 << 32 when INIT_EXT is set


@dataclass(frozen=True)
class CuseInit(Request):
    major: int
    minor: int
    flags: int = 0


@dataclass(frozen=True)
class Lookup(Request):
    name: bytes


@dataclass(frozen=True)
class Forget(Request):
    nlookup: int
    expects_reply = False


@dataclass(frozen=True)
class BatchForget(Request):
    items: tuple[tuple[int, int], ...]  # (nodeid, nlookup)
    expects_reply = False


@dataclass(frozen=True)
class GetAttr(Request):
    flags: int = 0
    fh: int = 0


@dataclass(frozen=True)
class SetAttr(Request):
    valid: int
    fh: int
    size: int
    lock_owner: int
    atime: int
    mtime: int
    ctime: int
    atimensec: int
    mtimensec: int
    ctimensec: int
    mode: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Open(Request):
    flags: int
    open_flags: int = 0


@dataclass(frozen=True)
class OpenDir(Request):
    flags: int
    open_flags: int = 0


@dataclass(frozen=True)
class Read(Request):
    fh: int
    offset: int
    size: int
    read_flags: int = 0
    lock_owner: int = 0
    flags: int = 0


@dataclass(frozen=True)
class ReadDir(Request):
    fh: int
    offset: int
    size: int
    read_flags: int = 0
    lock_owner: int = 0
    flags: int = 0


@dataclass(frozen=True)
class ReadDirPlus(ReadDir):
    pass


@dataclass(frozen=True)
class Write(Request):
    fh: int
    offset: int
    size: int
    write_flags: int
    lock_owner: int
    flags: int
    data: bytes


@dataclass(frozen=True)
class Flush(Request):
    fh: int
    lock_owner: int = 0


@dataclass(frozen=True)
class Release(Request):
    fh: int
    flags: int = 0
    release_flags: int = 0
    lock_owner: int = 0


@dataclass(frozen=True)
class ReleaseDir(Release):
    pass


@dataclass(frozen=True)
class Fsync(Request):
    fh: int
    fsync_flags: int = 0


@dataclass(frozen=True)
class StatFs(Request):
    pass


@dataclass(frozen=True)
class Access(Request):
    mask: int


@dataclass(frozen=True)
class GetXattr(Request):
    size: int
    name: bytes


@dataclass(frozen=True)
class ListXattr(Request):
    size: int


@dataclass(frozen=True)
class Ioctl(Request):
    fh: int
    flags: int
    cmd: int
    arg: int  # the caller's argument, a pointer for every command we serve
    in_size: int
    out_size: int
    data: bytes  # in_size bytes: the argument as the kernel copied it in


@dataclass(frozen=True)
class Poll(Request):
    fh: int
    kh: int
    flags: int
    events: int


@dataclass(frozen=True)
class Interrupt(Request):
    target: int  # unique of the request being interrupted
    expects_reply = False


@dataclass(frozen=True)
class Destroy(Request):
    pass


@dataclass(frozen=True)
class Unknown(Request):
    """An opcode this codec does not decode; answer it with ENOSYS."""

    body: bytes


# --- parsing ---------------------------------------------------------------------------
class _Body:
    """A cursor over a request's argument bytes that turns short reads into WireError."""

    def __init__(self, buf: memoryview, start: int, end: int, unique: int):
        self.buf = buf
        self.pos = start
        self.end = end
        self.unique = unique

    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, st: struct.Struct, name: str) -> tuple[Any, ...]:
        if self.remaining() < st.size:
            raise WireError(
                self.pos, name, f"needs {st.size} bytes, {self.remaining()} left", self.unique
            )
        vals = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return vals

    def bytes(self, n: int, name: str) -> bytes:
        if n < 0 or self.remaining() < n:
            raise WireError(self.pos, name, f"needs {n} bytes, {self.remaining()} left", self.unique)
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def rest(self) -> builtins.bytes:
        out = bytes(self.buf[self.pos:self.end])
        self.pos = self.end
        return out

    def cstring(self, name: str) -> builtins.bytes:
        raw = self.buf[self.pos:self.end].tobytes()
        nul = raw.find(b"\0")
        if nul < 0:
            raise WireError(self.pos, name, "not NUL-terminated", self.unique)
        if nul == 0:
            raise WireError(self.pos, name, "empty name", self.unique)
        self.pos += nul + 1
        return raw[:nul]


def parse_header(buf: bytes | bytearray | memoryview) -> InHeader:
    if len(buf) < IN_HEADER.size:
        raise WireError(0, "in_header", f"needs {IN_HEADER.size} bytes, got {len(buf)}")
    length, opcode, unique, nodeid, uid, gid, pid, extlen, _pad = IN_HEADER.unpack_from(buf, 0)
    if length != len(buf):
        raise WireError(0, "len", f"header says {length} bytes, message has {len(buf)}", unique)
    return InHeader(length, opcode, unique, nodeid, uid, gid, pid, extlen)


def parse_request(buf: bytes | bytearray | memoryview, *, minor: int = MAX_MINOR) -> Request:
    """Decode one message read from /dev/fuse (exactly one read(2)'s worth of bytes).

    ``minor`` is the negotiated protocol minor; it only matters for the few requests whose
    layout grew (READ/WRITE/GETATTR before 7.9).
    """
    mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
    h = parse_header(mv)
    end = len(mv)
    if h.total_extlen:
        # Extension records (security context, supplementary groups) trail the
        # arguments; we never ask for them, but skip them rather than misread them.
        end -= h.total_extlen * 8
        if end < IN_HEADER.size:
            raise WireError(32, "total_extlen", f"{h.total_extlen * 8} extension bytes do not fit", h.unique)
    b = _Body(mv, IN_HEADER.size, end, h.unique)
    op = h.opcode
    decoder = _DECODERS.get(op)
    if decoder is None:
        return Unknown(h, b.rest())
    return decoder(h, b, minor)


# A request's decoder: its header, its body, the negotiated protocol minor.
Decoder = Callable[[InHeader, "_Body", int], Request]


def _d_init(h: InHeader, b: _Body, minor: int) -> Request:
    if b.remaining() < 8:
        b.take(_INIT_IN, "fuse_init_in")  # raises with the right offset
    if b.remaining() < _INIT_IN.size:
        major, mnr = b.take(struct.Struct("<II"), "fuse_init_in")
        return Init(h, major, mnr)
    major, mnr, ra, flags = b.take(_INIT_IN, "fuse_init_in")
    if flags & INIT_EXT and b.remaining() >= 4:
        (flags2,) = b.take(_U32, "flags2")
        flags |= flags2 << 32
    b.rest()  # unused[11]
    return Init(h, major, mnr, ra, flags)


def _d_cuse_init(h: InHeader, b: _Body, minor: int) -> Request:
    major, mnr, _unused, flags = b.take(_CUSE_INIT_IN, "cuse_init_in")
    return CuseInit(h, major, mnr, flags)


def _d_lookup(h: InHeader, b: _Body, minor: int) -> Request:
    return Lookup(h, b.cstring("name"))


def _d_forget(h: InHeader, b: _Body, minor: int) -> Request:
    (n,) = b.take(_U64, "nlookup")
    return Forget(h, n)


def _d_batch_forget(h: InHeader, b: _Body, minor: int) -> Request:
    count, _ = b.take(_BATCH_FORGET_IN, "fuse_batch_forget_in")
    if count * _FORGET_ONE.size > b.remaining():
        raise WireError(b.pos - _BATCH_FORGET_IN.size, "count",
                        f"{count} entries do not fit in {b.remaining()} bytes", h.unique)
    items = tuple(b.take(_FORGET_ONE, f"forget[{i}]") for i in range(count))
    return BatchForget(h, items)


def _d_getattr(h: InHeader, b: _Body, minor: int) -> Request:
    if b.remaining() == 0 and minor < 9:
        return GetAttr(h)
    flags, _dummy, fh = b.take(_GETATTR_IN, "fuse_getattr_in")
    return GetAttr(h, flags, fh)


def _d_setattr(h: InHeader, b: _Body, minor: int) -> Request:
    (valid, _pad, fh, size, lock_owner, atime, mtime, ctime,
     atimensec, mtimensec, ctimensec, mode, _u4, uid, gid, _u5) = b.take(_SETATTR_IN, "fuse_setattr_in")
    return SetAttr(h, valid, fh, size, lock_owner, atime, mtime, ctime,
                   atimensec, mtimensec, ctimensec, mode, uid, gid)


def _d_open(cls: type[Open] | type[OpenDir]) -> Decoder:
    def dec(h: InHeader, b: _Body, minor: int) -> Request:
        flags, open_flags = b.take(_OPEN_IN, "fuse_open_in")
        return cls(h, flags, open_flags)
    return dec


def _read_in(b: _Body, minor: int) -> tuple[int, int, int, int, int, int]:
    if minor < 9:
        fh, off, size, rflags = b.take(_READ_IN_COMPAT, "fuse_read_in")
        return fh, off, size, rflags, 0, 0
    fh, off, size, rflags, owner, flags, _pad = b.take(_READ_IN, "fuse_read_in")
    return fh, off, size, rflags, owner, flags


def _d_read(cls: type[Read] | type[ReadDir]) -> Decoder:
    def dec(h: InHeader, b: _Body, minor: int) -> Request:
        return cls(h, *_read_in(b, minor))
    return dec


def _d_write(h: InHeader, b: _Body, minor: int) -> Request:
    start = b.pos
    fh, off, size, wflags, owner, flags = _read_in(b, minor)
    if b.remaining() != size:
        raise WireError(start + 16, "size",
                        f"says {size} data bytes, message carries {b.remaining()}", h.unique)
    return Write(h, fh, off, size, wflags, owner, flags, b.rest())


def _d_flush(h: InHeader, b: _Body, minor: int) -> Request:
    fh, _unused, _pad, owner = b.take(_FLUSH_IN, "fuse_flush_in")
    return Flush(h, fh, owner)


def _d_release(cls: type[Release] | type[ReleaseDir]) -> Decoder:
    def dec(h: InHeader, b: _Body, minor: int) -> Request:
        if b.remaining() < _RELEASE_IN.size:  # before 7.8: fh and flags only
            fh, flags = b.take(struct.Struct("<QI4x"), "fuse_release_in")
            return cls(h, fh, flags)
        fh, flags, rflags, owner = b.take(_RELEASE_IN, "fuse_release_in")
        return cls(h, fh, flags, rflags, owner)
    return dec


def _d_fsync(h: InHeader, b: _Body, minor: int) -> Request:
    fh, fflags, _pad = b.take(_FSYNC_IN, "fuse_fsync_in")
    return Fsync(h, fh, fflags)


def _d_access(h: InHeader, b: _Body, minor: int) -> Request:
    mask, _pad = b.take(_ACCESS_IN, "fuse_access_in")
    return Access(h, mask)


def _d_getxattr(h: InHeader, b: _Body, minor: int) -> Request:
    size, _pad = b.take(_GETXATTR_IN, "fuse_getxattr_in")
    return GetXattr(h, size, b.cstring("name"))


def _d_listxattr(h: InHeader, b: _Body, minor: int) -> Request:
    size, _pad = b.take(_GETXATTR_IN, "fuse_getxattr_in")
    return ListXattr(h, size)


def _d_ioctl(h: InHeader, b: _Body, minor: int) -> Request:
    start = b.pos
    fh, flags, cmd, arg, in_size, out_size = b.take(_IOCTL_IN, "fuse_ioctl_in")
    if b.remaining() != in_size:
        raise WireError(start + 24, "in_size",
                        f"says {in_size} bytes, message carries {b.remaining()}", h.unique)
    return Ioctl(h, fh, flags, cmd, arg, in_size, out_size, b.rest())


def encode_ioctl_request(req: Ioctl) -> bytes:
    """The message an IOCTL request was read as (extension records left out): a live
    upgrade hands a request read but not decided to the successor, which parses it again
    and answers it on the same connection (the kernel waits for a reply with its unique)."""
    body = _IOCTL_IN.pack(req.fh, req.flags, req.cmd, req.arg, req.in_size,
                          req.out_size) + req.data
    h = req.header
    return IN_HEADER.pack(IN_HEADER.size + len(body), h.opcode, h.unique, h.nodeid, h.uid,
                          h.gid, h.pid, 0, 0) + body


def _d_poll(h: InHeader, b: _Body, minor: int) -> Request:
    fh, kh, flags, events = b.take(_POLL_IN, "fuse_poll_in")
    return Poll(h, fh, kh, flags, events)


def _d_interrupt(h: InHeader, b: _Body, minor: int) -> Request:
    (target,) = b.take(_U64, "fuse_interrupt_in")
    return Interrupt(h, target)


def _d_empty(cls: type[StatFs] | type[Destroy]) -> Decoder:
    def dec(h: InHeader, b: _Body, minor: int) -> Request:
        return cls(h)
    return dec


_DECODERS: dict[int, Decoder] = {
    INIT: _d_init,
    CUSE_INIT: _d_cuse_init,
    LOOKUP: _d_lookup,
    FORGET: _d_forget,
    BATCH_FORGET: _d_batch_forget,
    GETATTR: _d_getattr,
    SETATTR: _d_setattr,
    OPEN: _d_open(Open),
    OPENDIR: _d_open(OpenDir),
    READ: _d_read(Read),
    READDIR: _d_read(ReadDir),
    READDIRPLUS: _d_read(ReadDirPlus),
    WRITE: _d_write,
    FLUSH: _d_flush,
    RELEASE: _d_release(Release),
    RELEASEDIR: _d_release(ReleaseDir),
    FSYNC: _d_fsync,
    STATFS: _d_empty(StatFs),
    ACCESS: _d_access,
    GETXATTR: _d_getxattr,
    LISTXATTR: _d_listxattr,
    IOCTL: _d_ioctl,
    POLL: _d_poll,
    INTERRUPT: _d_interrupt,
    DESTROY: _d_empty(Destroy),
}


# --- reply values ----------------------------------------------------------------------
@dataclass(frozen=True)
class Attr:
    ino: int
    mode: int
    size: int = 0
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    rdev: int = 0
    blocks: int = 0
    atime: int = 0
    mtime: int = 0
    ctime: int = 0
    atimensec: int = 0
    mtimensec: int = 0
    ctimensec: int = 0
    blksize: int = 4096
    flags: int = 0

    def pack(self) -> bytes:
        return _ATTR.pack(self.ino, self.size, self.blocks, self.atime, self.mtime, self.ctime,
                          self.atimensec, self.mtimensec, self.ctimensec, self.mode,
                          self.nlink, self.uid, self.gid, self.rdev, self.blksize, self.flags)


@dataclass(frozen=True)
class DirEntry:
    ino: int
    name: bytes
    type: int  # DT_* (S_IFMT >> 12)
    off: int  # the offset the kernel passes back to continue after this entry


@dataclass(frozen=True)
class StatFsOut:
    blocks: int = 0
    bfree: int = 0
    bavail: int = 0
    files: int = 0
    ffree: int = 0
    bsize: int = 4096
    namelen: int = 255
    frsize: int = 4096


@dataclass(frozen=True)
class InitReply:
    """What the server agrees to; :func:`negotiate_init` fills it from the kernel's offer."""

    major: int = KERNEL_VERSION
    minor: int = MAX_MINOR
    max_readahead: int = 0
    flags: int = 0
    max_background: int = 64
    congestion_threshold: int = 48
    max_write: int = 128 * 1024
    time_gran: int = 1
    max_pages: int = 32
    map_alignment: int = 0
    max_stack_depth: int = 0
    request_timeout: int = 0


def _secs(t: float) -> tuple[int, int]:
    if t < 0:
        t = 0.0
    s = int(t)
    return s, int(round((t - s) * 1e9)) % 1_000_000_000


def _check_unique(unique: int) -> None:
    if not 0 <= unique < 1 << 64:
        raise ValueError(f"unique {unique!r} out of range")


def encode_reply(unique: int, payload: bytes = b"") -> bytes:
    """A successful reply: out header followed by payload."""
    _check_unique(unique)
    return OUT_HEADER.pack(OUT_HEADER.size + len(payload), 0, unique) + payload


def encode_error(unique: int, errno: int) -> bytes:
    """An error reply. The kernel rejects values outside 1..511 (and the request would then
    never complete), so those are refused here rather than written."""
    _check_unique(unique)
    if not 0 < errno < 512:
        raise ValueError(f"errno {errno!r} cannot travel in a FUSE reply")
    return OUT_HEADER.pack(OUT_HEADER.size, -errno, unique)


def negotiate_init(req: Init, want: InitReply) -> InitReply:
    """The INIT answer for the kernel's offer: its minor up to ours, flags both sides know.

    A kernel with a newer major gets our major back (it then re-sends INIT); one with an
    older major cannot be served and the caller should fail the mount.
    """
    if req.major > KERNEL_VERSION:
        return InitReply(major=KERNEL_VERSION, minor=MAX_MINOR)
    minor = min(req.minor, want.minor, MAX_MINOR)
    flags = want.flags & req.flags
    if minor >= 36 and flags >> 32:
        flags |= INIT_EXT & req.flags
    return InitReply(
        major=KERNEL_VERSION,
        minor=minor,
        max_readahead=min(want.max_readahead, req.max_readahead),
        flags=flags,
        max_background=want.max_background,
        congestion_threshold=want.congestion_threshold,
        max_write=want.max_write,
        time_gran=want.time_gran,
        max_pages=want.max_pages if flags & MAX_PAGES else 0,
        map_alignment=want.map_alignment,
        max_stack_depth=want.max_stack_depth,
        request_timeout=want.request_timeout,
    )


def encode_init(unique: int, r: InitReply) -> bytes:
    full = _INIT_OUT.pack(r.major, r.minor, r.max_readahead, r.flags & 0xFFFFFFFF,
                          r.max_background, r.congestion_threshold, r.max_write, r.time_gran,
                          r.max_pages, r.map_alignment, (r.flags >> 32) & 0xFFFFFFFF,
                          r.max_stack_depth, r.request_timeout)
    # The kernel checks the reply length against the layout of the minor we answer with.
    if r.minor < 5:
        size = 8
    elif r.minor < 23:
        size = 24
    else:
        size = _INIT_OUT.size
    return encode_reply(unique, full[:size])


def encode_cuse_init(unique: int, *, major: int = KERNEL_VERSION, minor: int = MAX_MINOR,
                     flags: int = CUSE_UNRESTRICTED_IOCTL, max_read: int = 128 * 1024,
                     max_write: int = 128 * 1024, dev_major: int = 0, dev_minor: int = 0,
                     dev_info: Sequence[str] | bytes = ()) -> bytes:
    """CUSE_INIT reply; dev_info is e.g. ["DEVNAME=nvidiactl"] (NUL-separated on the wire)."""
    if isinstance(dev_info, (bytes, bytearray)):
        info = bytes(dev_info)
    else:
        info = b"".join(s.encode() + b"\0" for s in dev_info)
    if len(info) > 4096:
        raise ValueError("CUSE device info exceeds 4096 bytes")
    body = _CUSE_INIT_OUT.pack(major, minor, 0, flags, max_read, max_write, dev_major, dev_minor)
    return encode_reply(unique, body + info)


def pack_entry(nodeid: int, attr: Attr, *, generation: int = 0, entry_valid: float = 1.0,
               attr_valid: float = 1.0) -> bytes:
    es, ens = _secs(entry_valid)
    as_, ans = _secs(attr_valid)
    return _ENTRY_HEAD.pack(nodeid, generation, es, as_, ens, ans) + attr.pack()


def encode_entry(unique: int, nodeid: int, attr: Attr, *, generation: int = 0,
                 entry_valid: float = 1.0, attr_valid: float = 1.0, minor: int = MAX_MINOR) -> bytes:
    body = pack_entry(nodeid, attr, generation=generation, entry_valid=entry_valid,
                      attr_valid=attr_valid)
    if minor < 9:
        body = body[:_COMPAT_ENTRY_OUT_SIZE]
    return encode_reply(unique, body)


def encode_negative_entry(unique: int, entry_valid: float) -> bytes:
    """A cacheable "no such name" (nodeid 0) — ENOENT with a lifetime."""
    return encode_entry(unique, 0, Attr(ino=0, mode=0), entry_valid=entry_valid, attr_valid=0)


def encode_attr(unique: int, attr: Attr, *, attr_valid: float = 1.0, minor: int = MAX_MINOR) -> bytes:
    s, ns = _secs(attr_valid)
    body = _ATTR_OUT_HEAD.pack(s, ns, 0) + attr.pack()
    if minor < 9:
        body = body[:_COMPAT_ATTR_OUT_SIZE]
    return encode_reply(unique, body)


def encode_open(unique: int, fh: int, open_flags: int = 0, backing_id: int = 0) -> bytes:
    return encode_reply(unique, _OPEN_OUT.pack(fh, open_flags, backing_id))


def encode_data(unique: int, data: bytes) -> bytes:
    """Reply to READ / GETXATTR (value) / LISTXATTR (names): the bytes themselves."""
    return encode_reply(unique, bytes(data))


def encode_write(unique: int, size: int) -> bytes:
    return encode_reply(unique, _WRITE_OUT.pack(size, 0))


def encode_xattr_size(unique: int, size: int) -> bytes:
    """Reply to a GETXATTR/LISTXATTR size probe (request size 0)."""
    return encode_reply(unique, _GETXATTR_OUT.pack(size, 0))


def encode_statfs(unique: int, st: StatFsOut, *, minor: int = MAX_MINOR) -> bytes:
    body = _STATFS.pack(st.blocks, st.bfree, st.bavail, st.files, st.ffree, st.bsize,
                        st.namelen, st.frsize, 0)
    if minor < 4:
        body = body[:_COMPAT_STATFS_SIZE]
    return encode_reply(unique, body)


def encode_ioctl(unique: int, result: int, data: bytes = b"") -> bytes:
    """Final ioctl reply: result is ioctl(2)'s return value, data fills the out buffer."""
    if not -(1 << 31) <= result < 1 << 31:
        raise ValueError(f"ioctl result {result} does not fit in 32 bits")
    return encode_reply(unique, _IOCTL_OUT.pack(result, 0, 0, 0) + bytes(data))


def encode_ioctl_retry(unique: int, in_iovs: Iterable[tuple[int, int]],
                       out_iovs: Iterable[tuple[int, int]]) -> bytes:
    """Ask the kernel to re-issue an unrestricted (CUSE) ioctl with these caller buffers:
    it copies the in iovecs from the caller into the retried request and scatters the
    retried reply's data over the out iovecs."""
    ins = list(in_iovs)
    outs = list(out_iovs)
    if len(ins) + len(outs) > IOCTL_MAX_IOV:
        raise ValueError(f"{len(ins) + len(outs)} iovecs exceed {IOCTL_MAX_IOV}")
    vecs = b"".join(_IOVEC.pack(base, length) for base, length in ins + outs)
    return encode_reply(unique, _IOCTL_OUT.pack(0, IOCTL_RETRY, len(ins), len(outs)) + vecs)


def encode_poll(unique: int, revents: int) -> bytes:
    return encode_reply(unique, _POLL_OUT.pack(revents, 0))


def _align8(n: int) -> int:
    return (n + 7) & ~7


def pack_dirent(e: DirEntry) -> bytes:
    rec = _DIRENT.pack(e.ino, e.off, len(e.name), e.type) + e.name
    return rec + b"\0" * (_align8(len(rec)) - len(rec))


def encode_readdir(unique: int, entries: Iterable[DirEntry], max_size: int) -> tuple[bytes, int]:
    """Pack as many entries as fit in max_size; returns (reply, entries packed)."""
    out = bytearray()
    n = 0
    for e in entries:
        rec = pack_dirent(e)
        if len(out) + len(rec) > max_size:
            break
        out += rec
        n += 1
    return encode_reply(unique, bytes(out)), n


def encode_readdirplus(unique: int, entries: Iterable[tuple[DirEntry, bytes]],
                       max_size: int) -> tuple[bytes, int]:
    """Like encode_readdir, each entry preceded by its packed entry_out (see pack_entry;
    nodeid 0 for entries the kernel must not look up, such as "." and "..")."""
    out = bytearray()
    n = 0
    for e, entry_out in entries:
        rec = entry_out + _DIRENT.pack(e.ino, e.off, len(e.name), e.type) + e.name
        rec += b"\0" * (_align8(len(rec)) - len(rec))
        if len(out) + len(rec) > max_size:
            break
        out += rec
        n += 1
    return encode_reply(unique, bytes(out)), n


# --- notifications (server → kernel, unsolicited) ---------------------------------------
def _notify(code: int, payload: bytes) -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + len(payload), code, 0) + payload


def encode_notify_inval_inode(nodeid: int, offset: int = 0, length: int = 0) -> bytes:
    """Drop cached attributes of nodeid and, for offset >= 0, its cached pages from offset
    (length 0 or less: to the end). offset < 0 drops attributes only."""
    return _notify(NOTIFY_INVAL_INODE, _INVAL_INODE.pack(nodeid, offset, length))


def encode_notify_inval_entry(parent: int, name: bytes, flags: int = 0) -> bytes:
    return _notify(NOTIFY_INVAL_ENTRY, _INVAL_ENTRY.pack(parent, len(name), flags) + name + b"\0")


def encode_notify_delete(parent: int, child: int, name: bytes) -> bytes:
    return _notify(NOTIFY_DELETE, _NOTIFY_DELETE.pack(parent, child, len(name), 0) + name + b"\0")


def encode_notify_poll(kh: int) -> bytes:
    return _notify(NOTIFY_POLL, _U64.pack(kh))


# --- helpers for tests and clients: the request side of the wire ---------------------------
def encode_request(opcode: int, unique: int, body: bytes = b"", *, nodeid: int = 0,
                   uid: int = 0, gid: int = 0, pid: int = 0) -> bytes:
    """Build a request message as the kernel would (for tests and fuzzing)."""
    return IN_HEADER.pack(IN_HEADER.size + len(body), opcode, unique, nodeid, uid, gid, pid, 0, 0) + body


def parse_out_header(buf: bytes) -> tuple[int, int, int]:
    """(len, error, unique) of a reply/notification, for tests."""
    if len(buf) < OUT_HEADER.size:
        raise WireError(0, "out_header", f"needs {OUT_HEADER.size} bytes, got {len(buf)}")
    return OUT_HEADER.unpack_from(buf, 0)


# ioctl numbers: the asm-generic arithmetic (abi/ioc.py), here for the wire's callers
from devbroker.abi.ioc import IOC_NONE, IOC_READ, IOC_WRITE, ioc, ioc_dir, ioc_size  # noqa: E402,F401
