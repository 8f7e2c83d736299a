"""The relay protocol between the broker (RealBackend) and its relay process (sans-IO).

The real backend never calls the driver itself: a relay process that holds no capabilities
opens the host's /dev/nvidia* nodes and runs every ioctl and mmap (docs/real-backend.md
says why). Broker and relay talk over socketpairs, one request at a time per channel, in
length-prefixed frames:

    frame   = u32 length (of what follows) | u8 type | u32 request id | payload
    replies carry type | 0x80; an ERROR reply (0xFF) carries a UTF-8 message.

Requests and their payloads (little-endian):

    OPEN     u32 flags | path bytes                 -> i32 fd | i32 errno
    CLOSE    i32 fd                                 -> i32 errno
    IOCTL    i32 fd | u32 cmd | u32 nbuf | nbuf x buffer header | buffer bytes...
             buffer header = i32 parent | u32 ptr_offset | u32 length
             (buffer 0 is the ioctl argument, parent -1; buffer k>0 is placed in the
             relay's memory and its address written as a u64 at ptr_offset of buffer
             `parent`, which must come before it)
                                                    -> i32 ret | i32 errno | u64 ns |
                                                       u32 nbuf | nbuf x u32 length | bytes
    MAPREAD  i32 fd | u64 map_length | u64 offset | u32 length
                                                    -> i32 errno | bytes
    INFO     (empty)                                -> u32 pid | u32 uid | u32 gid |
                                                       u32 open fds | u64 CapEff | u64 CapPrm |
                                                       u64 CapBnd | u32 no_new_privs

Nothing here does I/O: encoders return bytes, FrameDecoder takes bytes and yields frames,
parsers check every length against the bytes that are there and raise WireError.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

OPEN, CLOSE, IOCTL, MAPREAD, INFO, KEEP = 1, 2, 3, 4, 5, 6
REPLY = 0x80
ERROR = 0xFF
NAMES = {OPEN: "OPEN", CLOSE: "CLOSE", IOCTL: "IOCTL", MAPREAD: "MAPREAD", INFO: "INFO",
         KEEP: "KEEP"}

# Bounds: an ioctl argument is at most 16 KiB (_IOC_SIZE is 14 bits); nested buffers are
# bounded by the broker (1 MiB); a page read by the FUSE read size. Nothing legitimate comes
# near MAX_FRAME, so a bigger length is a broken peer, not a big request.
MAX_FRAME = 8 << 20
MAX_BUFFERS = 16
MAX_MAP = 1 << 30

_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<BI")
_BUFHDR = struct.Struct("<iII")


class WireError(ValueError):
    """A malformed frame or payload."""


# --------------------------------------------------------------------------- frames
def frame(mtype: int, rid: int, payload: bytes = b"") -> bytes:
    body = _HEAD.pack(mtype, rid & 0xFFFFFFFF) + payload
    if len(body) > MAX_FRAME:
        raise WireError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


@dataclass
class Frame:
    type: int
    id: int
    payload: bytes


class FrameDecoder:
    """Feed bytes as they arrive; take complete frames out."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        out: list[Frame] = []
        while True:
            if len(self._buf) < 4:
                return out
            (n,) = _LEN.unpack_from(self._buf)
            if n < _HEAD.size or n > MAX_FRAME:
                raise WireError(f"frame length {n} out of range")
            if len(self._buf) < 4 + n:
                return out
            t, rid = _HEAD.unpack_from(self._buf, 4)
            out.append(Frame(t, rid, bytes(self._buf[4 + _HEAD.size:4 + n])))
            del self._buf[:4 + n]

    @property
    def pending(self) -> int:
        return len(self._buf)


def _need(payload: bytes, off: int, n: int, what: str) -> None:
    if n < 0 or off + n > len(payload):
        raise WireError(f"{what}: needs {n} bytes at {off}, payload has {len(payload)}")


# --------------------------------------------------------------------------- requests
@dataclass
class Buffer:
    data: bytes
    parent: int = -1  # index of the buffer holding the pointer to this one; -1: the argument
    ptr_offset: int = 0  # where in the parent the u64 address goes


@dataclass
class IoctlRequest:
    fd: int
    cmd: int
    buffers: list[Buffer] = field(default_factory=list)  # [0] is the argument


def encode_open(rid: int, path: str, flags: int) -> bytes:
    return frame(OPEN, rid, struct.pack("<I", flags) + path.encode())


def parse_open(p: bytes) -> tuple[str, int]:
    _need(p, 0, 4, "OPEN")
    (flags,) = struct.unpack_from("<I", p)
    path = p[4:]
    if not path or b"\0" in path:
        raise WireError("OPEN: bad path")
    return path.decode("utf-8", "strict"), flags


def encode_close(rid: int, fd: int) -> bytes:
    return frame(CLOSE, rid, struct.pack("<i", fd))


def parse_close(p: bytes) -> int:
    _need(p, 0, 4, "CLOSE")
    return int(struct.unpack_from("<i", p)[0])


def encode_ioctl(rid: int, req: IoctlRequest) -> bytes:
    if not req.buffers or req.buffers[0].parent != -1:
        raise WireError("IOCTL: buffer 0 must be the argument")
    heads = b"".join(_BUFHDR.pack(b.parent, b.ptr_offset, len(b.data)) for b in req.buffers)
    body = b"".join(b.data for b in req.buffers)
    return frame(IOCTL, rid, struct.pack("<iII", req.fd, req.cmd & 0xFFFFFFFF,
                                         len(req.buffers)) + heads + body)


def parse_ioctl(p: bytes) -> IoctlRequest:
    _need(p, 0, 12, "IOCTL")
    fd, cmd, n = struct.unpack_from("<iII", p)
    if not 1 <= n <= MAX_BUFFERS:
        raise WireError(f"IOCTL: {n} buffers")
    off = 12
    _need(p, off, n * _BUFHDR.size, "IOCTL buffer headers")
    heads = [_BUFHDR.unpack_from(p, off + i * _BUFHDR.size) for i in range(n)]
    off += n * _BUFHDR.size
    bufs: list[Buffer] = []
    for i, (parent, ptr_off, ln) in enumerate(heads):
        _need(p, off, ln, f"IOCTL buffer {i}")
        if i == 0:
            if parent != -1:
                raise WireError("IOCTL: buffer 0 must have parent -1")
        else:
            if not 0 <= parent < i:
                raise WireError(f"IOCTL: buffer {i} names parent {parent}")
            if ptr_off + 8 > len(bufs[parent].data) or ptr_off % 8:
                raise WireError(f"IOCTL: buffer {i} pointer at {ptr_off} outside its parent "
                                f"of {len(bufs[parent].data)} bytes (or misaligned)")
        bufs.append(Buffer(p[off:off + ln], parent, ptr_off))
        off += ln
    if off != len(p):
        raise WireError(f"IOCTL: {len(p) - off} trailing bytes")
    return IoctlRequest(fd, cmd, bufs)


def encode_mapread(rid: int, fd: int, map_length: int, offset: int, length: int) -> bytes:
    return frame(MAPREAD, rid, struct.pack("<iQQI", fd, map_length, offset, length))


def parse_mapread(p: bytes) -> tuple[int, int, int, int]:
    _need(p, 0, 24, "MAPREAD")
    fd, maplen, offset, length = struct.unpack_from("<iQQI", p)
    if not 0 < maplen <= MAX_MAP or offset > maplen or length > MAX_MAP:
        raise WireError(f"MAPREAD: map {maplen} offset {offset} length {length}")
    return fd, maplen, offset, length


def encode_info(rid: int) -> bytes:
    return frame(INFO, rid)


def encode_keep(rid: int) -> bytes:
    """KEEP (live upgrade): the relay outlives the broker that started it (no SIGKILL at
    its parent's death); it still exits when its last channel closes. Reply: u32 errno."""
    return frame(KEEP, rid)


def reply_keep(rid: int, err: int) -> bytes:
    return frame(KEEP | REPLY, rid, struct.pack("<I", err))


def parse_keep_reply(p: bytes) -> int:
    _need(p, 0, 4, "keep reply")
    return int(struct.unpack_from("<I", p)[0])


# --------------------------------------------------------------------------- replies
@dataclass
class IoctlReply:
    ret: int
    errno: int
    ns: int
    buffers: list[bytes]


@dataclass
class Info:
    pid: int
    uid: int
    gid: int
    open_fds: int
    cap_eff: int
    cap_prm: int
    cap_bnd: int
    no_new_privs: int


def reply_open(rid: int, fd: int, err: int) -> bytes:
    return frame(OPEN | REPLY, rid, struct.pack("<ii", fd, err))


def parse_open_reply(p: bytes) -> tuple[int, int]:
    _need(p, 0, 8, "OPEN reply")
    return struct.unpack_from("<ii", p)


def reply_close(rid: int, err: int) -> bytes:
    return frame(CLOSE | REPLY, rid, struct.pack("<i", err))


def parse_close_reply(p: bytes) -> int:
    _need(p, 0, 4, "CLOSE reply")
    return int(struct.unpack_from("<i", p)[0])


def reply_ioctl(rid: int, rep: IoctlReply) -> bytes:
    head = struct.pack("<iiQI", rep.ret, rep.errno, rep.ns, len(rep.buffers))
    lens = b"".join(struct.pack("<I", len(b)) for b in rep.buffers)
    return frame(IOCTL | REPLY, rid, head + lens + b"".join(rep.buffers))


def parse_ioctl_reply(p: bytes) -> IoctlReply:
    _need(p, 0, 20, "IOCTL reply")
    ret, err, ns, n = struct.unpack_from("<iiQI", p)
    if n > MAX_BUFFERS:
        raise WireError(f"IOCTL reply: {n} buffers")
    off = 20
    _need(p, off, 4 * n, "IOCTL reply lengths")
    lens = struct.unpack_from(f"<{n}I", p, off)
    off += 4 * n
    bufs = []
    for i, ln in enumerate(lens):
        _need(p, off, ln, f"IOCTL reply buffer {i}")
        bufs.append(p[off:off + ln])
        off += ln
    if off != len(p):
        raise WireError(f"IOCTL reply: {len(p) - off} trailing bytes")
    return IoctlReply(ret, err, ns, bufs)


def reply_mapread(rid: int, err: int, data: bytes = b"") -> bytes:
    return frame(MAPREAD | REPLY, rid, struct.pack("<i", err) + data)


def parse_mapread_reply(p: bytes) -> tuple[int, bytes]:
    _need(p, 0, 4, "MAPREAD reply")
    return int(struct.unpack_from("<i", p)[0]), p[4:]


_INFO = struct.Struct("<IIIIQQQI")


def reply_info(rid: int, info: Info) -> bytes:
    return frame(INFO | REPLY, rid, _INFO.pack(info.pid, info.uid, info.gid, info.open_fds,
                                               info.cap_eff, info.cap_prm, info.cap_bnd,
                                               info.no_new_privs))


def parse_info_reply(p: bytes) -> Info:
    _need(p, 0, _INFO.size, "INFO reply")
    return Info(*_INFO.unpack_from(p))


def reply_error(rid: int, message: str) -> bytes:
    return frame(ERROR, rid, message.encode("utf-8", "replace")[:4096])
