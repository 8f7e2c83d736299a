"""nvtrace (version 1): reader and writer.  Format: docs/nvtrace.md.

A file is a sequence of records: a 64-byte little-endian header and four byte strings
(in, out, xin, xout) whose lengths the header gives.  The reader checks every length
against the bytes that remain *before* slicing, so a corrupt or hostile file yields a
DecodeError naming the offset and field, never a huge allocation or a hang.
The broker's record mode writes the same format through Writer.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Iterable, Iterator

from .errors import DecodeError

MAGIC = 0x5254564E  # "NVTR"
VERSION = 1
_HDR = struct.Struct("<IHHiIiiIIQQIIII")
HEADER_SIZE = _HDR.size  # 64
_HDR_FIELDS = ("magic", "type", "version", "fd", "cmd", "ret", "err", "pid", "tid", "ts_ns",
               "arg", "n_in", "n_out", "n_xin", "n_xout")
_OFF = {n: struct.calcsize("<" + "IHHiIiiIIQQIIII"[:i]) for i, n in enumerate(_HDR_FIELDS)}
# No record of a real trace comes near this; it bounds what a reader will accept per buffer.
MAX_BUFFER = 64 << 20


class RecordType(enum.IntEnum):
    OPEN = 1
    IOCTL = 2
    MMAP = 3
    CLOSE = 4
    DURATION = 6  # follows each ioctl; duration in ns in `arg`


@dataclass
class Record:
    type: int
    fd: int = -1
    cmd: int = 0
    ret: int = 0
    err: int = 0
    pid: int = 0
    tid: int = 0
    ts_ns: int = 0
    arg: int = 0
    in_: bytes = b""
    out: bytes = b""
    xin: bytes = b""
    xout: bytes = b""
    version: int = VERSION
    offset: int = field(default=0, compare=False)  # file offset of the header (reader only)

    @property
    def path(self) -> str:
        """For open records: the NUL-terminated path in `in`."""
        return self.in_.split(b"\0", 1)[0].decode("utf-8", "replace")

    @property
    def mmap_args(self) -> tuple[int, int, int]:
        """For mmap records: (length, flags, offset)."""
        if len(self.in_) < 24:
            raise DecodeError(self.offset + HEADER_SIZE, "in", "mmap record needs 24 bytes")
        return struct.unpack_from("<QQQ", self.in_)

    def encode(self) -> bytes:
        hdr = _HDR.pack(MAGIC, self.type, self.version, self.fd, self.cmd & 0xFFFFFFFF,
                        self.ret, self.err, self.pid, self.tid, self.ts_ns, self.arg,
                        len(self.in_), len(self.out), len(self.xin), len(self.xout))
        return hdr + self.in_ + self.out + self.xin + self.xout


def iter_records(data: bytes | bytearray | memoryview) -> Iterator[Record]:
    """Iterate the records of an in-memory trace."""
    mv = memoryview(data)
    n = len(mv)
    off = 0
    while off < n:
        if n - off < HEADER_SIZE:
            raise DecodeError(off, "header", f"truncated record header: {n - off} of "
                                             f"{HEADER_SIZE} bytes")
        h = _HDR.unpack_from(mv, off)
        if h[0] != MAGIC:
            raise DecodeError(off + _OFF["magic"], "magic", f"bad magic 0x{h[0]:08x}")
        if h[2] != VERSION:
            raise DecodeError(off + _OFF["version"], "version", f"unsupported version {h[2]}")
        p = off + HEADER_SIZE
        bufs = []
        for i, name in enumerate(("n_in", "n_out", "n_xin", "n_xout")):
            ln = h[11 + i]
            if ln > MAX_BUFFER or ln > n - p:
                raise DecodeError(off + _OFF[name], name,
                                  f"length {ln} exceeds the {n - p} bytes left in the file")
            bufs.append(bytes(mv[p:p + ln]))
            p += ln
        yield Record(type=h[1], version=h[2], fd=h[3], cmd=h[4], ret=h[5], err=h[6], pid=h[7],
                     tid=h[8], ts_ns=h[9], arg=h[10], in_=bufs[0], out=bufs[1], xin=bufs[2],
                     xout=bufs[3], offset=off)
        off = p


def read_file(path: str) -> list[Record]:
    """Convenience: read a whole trace file (the only file access in devbroker.abi)."""
    with open(path, "rb") as f:
        return list(iter_records(f.read()))


class Writer:
    """Appends records to a binary stream (the broker's record mode)."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream

    def write(self, rec: Record) -> None:
        self.stream.write(rec.encode())

    def write_all(self, recs: Iterable[Record]) -> None:
        for r in recs:
            self.write(r)


def encode_records(recs: Iterable[Record]) -> bytes:
    return b"".join(r.encode() for r in recs)
