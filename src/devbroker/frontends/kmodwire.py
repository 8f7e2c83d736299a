"""Sans-IO codec for the kernel module's control protocol (kmod/devbroker_proto.h).

Bytes in, records out; never a syscall. The layouts below mirror the C header field by
field; tests/test_kmod_proto.py compiles a probe against the header and checks every
offset and size, so the two cannot drift apart silently.

    req = parse_request(os.read(ctl_fd, READ_SIZE))
    os.write(ctl_fd, encode_verdict(reply(req.id, data=new_arg)))
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from devbroker.abi.ioc import ioc_size, ioc_type

PROTO_VERSION = 1
REQ_MAGIC = 0x51524244  # "DBRQ"
VERDICT_MAGIC = 0x44524244  # "DBRD"
ARG_TYPE = ord("F")  # only 'F' ioctls carry their top-level argument bytes
MAX_ARG = 16384
MMAP_SHARED = 0x1


class Op(enum.IntEnum):
    OPEN = 1
    IOCTL = 2
    MMAP = 3
    RELEASE = 4  # notification: no verdict


class Verdict(enum.IntEnum):
    REPLY = 1
    DENY = 2
    PASS = 3


# (name, struct code) in header order; "=" layout has no implicit padding, and neither
# has the C struct (the header keeps every field naturally aligned).
REQUEST_FIELDS = [
    ("magic", "I"), ("version", "H"), ("op", "H"), ("id", "Q"), ("file_id", "Q"),
    ("pid", "I"), ("tgid", "I"), ("uid", "I"), ("gid", "I"),
    ("cgroup_id", "Q"), ("pidns_ino", "Q"), ("node", "I"), ("minor", "I"),
    ("flags", "I"), ("cmd", "I"), ("arg", "Q"), ("offset", "Q"), ("length", "Q"),
    ("arg_size", "I"), ("reserved", "I"),
]  # fmt: skip
VERDICT_FIELDS = [
    ("magic", "I"), ("version", "H"), ("verdict", "H"), ("id", "Q"), ("result", "q"),
    ("offset", "Q"), ("fd", "i"), ("error", "I"), ("data_size", "I"), ("reserved", "I"),
]  # fmt: skip
_REQ = struct.Struct("=" + "".join(c for _, c in REQUEST_FIELDS))
_VERDICT = struct.Struct("=" + "".join(c for _, c in VERDICT_FIELDS))
REQUEST_SIZE = _REQ.size
VERDICT_SIZE = _VERDICT.size
READ_SIZE = REQUEST_SIZE + MAX_ARG  # a read(2) buffer that always fits one record


def field_offsets(fields: list[tuple[str, str]]) -> dict[str, tuple[int, int]]:
    """name -> (offset, size) as this codec lays the record out."""
    out, off = {}, 0
    for name, code in fields:
        size = struct.calcsize("=" + code)
        out[name] = (off, size)
        off += size
    return out


class ProtocolError(ValueError):
    pass


@dataclass(frozen=True)
class Request:
    op: Op
    id: int
    file_id: int
    pid: int
    tgid: int
    uid: int
    gid: int
    cgroup_id: int
    pidns_ino: int
    node: int  # devbroker.abi.nodes.NodeKind value
    minor: int
    flags: int  # OPEN: open(2) flags; MMAP: MMAP_SHARED
    cmd: int  # IOCTL: command; MMAP: PROT_* bits
    arg: int  # IOCTL: the tenant's pointer
    offset: int  # MMAP
    length: int  # MMAP
    data: bytes  # IOCTL: the top-level argument ('F' commands), else b""


def parse_request(buf: bytes) -> Request:
    """Decode one record as returned by one read(2) of /dev/devbroker-ctl."""
    if len(buf) < REQUEST_SIZE:
        raise ProtocolError(f"short request: {len(buf)} < {REQUEST_SIZE} bytes")
    v = dict(zip((n for n, _ in REQUEST_FIELDS), _REQ.unpack_from(buf)))
    if v["magic"] != REQ_MAGIC:
        raise ProtocolError(f"bad magic {v['magic']:#x}")
    if v["version"] != PROTO_VERSION:
        raise ProtocolError(f"protocol version {v['version']}, this codec speaks {PROTO_VERSION}")
    if len(buf) != REQUEST_SIZE + v["arg_size"]:
        raise ProtocolError(f"record is {len(buf)} bytes, header says {REQUEST_SIZE}+{v['arg_size']}")
    try:
        op = Op(v["op"])
    except ValueError:
        raise ProtocolError(f"unknown op {v['op']}") from None
    return Request(
        op=op, data=bytes(buf[REQUEST_SIZE:]),
        **{k: v[k] for k in ("id", "file_id", "pid", "tgid", "uid", "gid", "cgroup_id",
                             "pidns_ino", "node", "minor", "flags", "cmd", "arg", "offset",
                             "length")},
    )  # fmt: skip


def encode_request(req: Request) -> bytes:
    """The module's side, for tests: the bytes read(2) would return for `req`."""
    return (
        _REQ.pack(
            REQ_MAGIC, PROTO_VERSION, req.op, req.id, req.file_id, req.pid, req.tgid, req.uid,
            req.gid, req.cgroup_id, req.pidns_ino, req.node, req.minor, req.flags, req.cmd,
            req.arg, req.offset, req.length, len(req.data), 0,
        )  # fmt: skip
        + req.data
    )


@dataclass(frozen=True)
class VerdictRecord:
    verdict: Verdict
    id: int
    result: int = 0
    offset: int = 0
    fd: int = -1
    error: int = 0
    data: bytes = b""


def encode_verdict(v: VerdictRecord) -> bytes:
    """The bytes to write(2), in one call, to answer request v.id."""
    if len(v.data) > MAX_ARG:
        raise ProtocolError(f"verdict data {len(v.data)} > {MAX_ARG} bytes")
    head = _VERDICT.pack(
        VERDICT_MAGIC, PROTO_VERSION, v.verdict, v.id, v.result, v.offset, v.fd, v.error,
        len(v.data), 0,
    )  # fmt: skip
    return head + v.data


def parse_verdict(buf: bytes) -> VerdictRecord:
    if len(buf) < VERDICT_SIZE:
        raise ProtocolError("short verdict")
    f = dict(zip((n for n, _ in VERDICT_FIELDS), _VERDICT.unpack_from(buf)))
    if f["magic"] != VERDICT_MAGIC or f["version"] != PROTO_VERSION:
        raise ProtocolError("bad verdict magic/version")
    if len(buf) != VERDICT_SIZE + f["data_size"]:
        raise ProtocolError("verdict length does not match data_size")
    try:
        kind = Verdict(f["verdict"])
    except ValueError:
        raise ProtocolError(f"unknown verdict code {f['verdict']}") from None
    return VerdictRecord(
        kind, f["id"], f["result"], f["offset"], f["fd"], f["error"],
        bytes(buf[VERDICT_SIZE:]),
    )  # fmt: skip


# Verdict constructors (what a broker loop writes back).
def reply(req_id: int, result: int = 0, data: bytes = b"") -> VerdictRecord:
    """Success: ioctl returns `result` after `data` is copied over the tenant's argument."""
    return VerdictRecord(Verdict.REPLY, req_id, result=result, data=data)


def deny(req_id: int, errno: int) -> VerdictRecord:
    return VerdictRecord(Verdict.DENY, req_id, error=errno)


def pass_(req_id: int, data: bytes = b"", fd: int = -1) -> VerdictRecord:
    """Perform the call on the real driver: OPEN needs `fd` naming the real node; IOCTL may
    carry the decided argument bytes, written back before the driver reads them."""
    return VerdictRecord(Verdict.PASS, req_id, data=data, fd=fd)


def map_file(req_id: int, fd: int, offset: int = 0) -> VerdictRecord:
    """MMAP: map `fd` (e.g. a memfd holding emulated pages) from byte `offset`."""
    return VerdictRecord(Verdict.REPLY, req_id, fd=fd, offset=offset)


def arg_size(cmd: int) -> int:
    """How many argument bytes the module copies into an IOCTL request for `cmd`."""
    return ioc_size(cmd) if ioc_type(cmd) == ARG_TYPE else 0
