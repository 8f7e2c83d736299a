"""Sans-IO tests of the FUSE codec: messages built byte by byte from the fuse.h layouts."""
from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devbroker.frontends import fusewire as w

HDR = struct.Struct("<IIQQIIIHH")  # fuse_in_header, 40 bytes


def msg(opcode: int, body: bytes, *, unique: int = 7, nodeid: int = 1, uid: int = 1000,
        gid: int = 1001, pid: int = 4242, extlen: int = 0) -> bytes:
    return HDR.pack(HDR.size + len(body), opcode, unique, nodeid, uid, gid, pid, extlen, 0) + body


def out(buf: bytes) -> tuple[int, int, int, bytes]:
    length, error, unique = struct.unpack_from("<IiQ", buf)
    assert length == len(buf)
    return length, error, unique, buf[16:]


def test_header_fields():
    r = w.parse_request(msg(w.GETATTR, struct.pack("<IIQ", w.GETATTR_FH, 0, 99), unique=5, nodeid=9))
    assert isinstance(r, w.GetAttr)
    assert r.header == w.InHeader(56, w.GETATTR, 5, 9, 1000, 1001, 4242, 0)
    assert (r.flags, r.fh, r.unique, r.nodeid) == (w.GETATTR_FH, 99, 5, 9)


def test_init_with_flags2():
    body = struct.pack("<IIII", 7, 45, 131072, w.INIT_EXT | w.MAX_PAGES) + struct.pack("<I", 0x10) + bytes(44)
    r = w.parse_request(msg(w.INIT, body))
    assert isinstance(r, w.Init)
    assert (r.major, r.minor, r.max_readahead) == (7, 45, 131072)
    assert r.flags == w.INIT_EXT | w.MAX_PAGES | (0x10 << 32)


def test_init_negotiation_takes_kernel_minor_up_to_ours():
    old = w.Init(w.InHeader(0, w.INIT, 1, 0, 0, 0, 0), 7, 31, 65536, w.MAX_PAGES | w.BIG_WRITES)
    want = w.InitReply(max_readahead=0, flags=w.MAX_PAGES | w.BIG_WRITES | w.PARALLEL_DIROPS, max_pages=32)
    r = w.negotiate_init(old, want)
    assert r.minor == 31 and r.flags == w.MAX_PAGES | w.BIG_WRITES and r.max_pages == 32
    new = w.Init(old.header, 7, 99, 65536, w.BIG_WRITES)
    r = w.negotiate_init(new, want)
    assert r.minor == w.MAX_MINOR and r.max_pages == 0  # MAX_PAGES not offered
    length, err, unique, body = out(w.encode_init(3, r))
    assert (err, unique, len(body)) == (0, 3, 64)
    major, minor, ra, flags, maxbg, cong, max_write = struct.unpack_from("<IIIIHHI", body)
    assert (major, minor, ra, flags, max_write) == (7, w.MAX_MINOR, 0, w.BIG_WRITES, 128 * 1024)
    # older minors get the shorter reply layouts the kernel expects
    assert len(out(w.encode_init(3, w.InitReply(minor=22)))[3]) == 24
    assert len(out(w.encode_init(3, w.InitReply(minor=4)))[3]) == 8


def test_cuse_init_roundtrip():
    r = w.parse_request(msg(w.CUSE_INIT, struct.pack("<IIII", 7, 45, 0, w.CUSE_UNRESTRICTED_IOCTL)))
    assert isinstance(r, w.CuseInit) and r.flags == w.CUSE_UNRESTRICTED_IOCTL
    _, err, _, body = out(w.encode_cuse_init(r.unique, dev_major=195, dev_minor=255, dev_info=["DEVNAME=nvidiactl"]))
    assert err == 0
    fields = struct.unpack_from("<IIIIIIII", body)
    assert fields[0:2] == (7, w.MAX_MINOR) and fields[6:8] == (195, 255)
    assert len(body) == 72 + 18 and body[72:] == b"DEVNAME=nvidiactl\0"


def test_lookup_getxattr_names():
    assert w.parse_request(msg(w.LOOKUP, b"nvidiactl\0")).name == b"nvidiactl"
    r = w.parse_request(msg(w.GETXATTR, struct.pack("<II", 64, 0) + b"security.selinux\0"))
    assert (r.size, r.name) == (64, b"security.selinux")
    assert w.parse_request(msg(w.LISTXATTR, struct.pack("<II", 0, 0))).size == 0


def test_forgets():
    r = w.parse_request(msg(w.FORGET, struct.pack("<Q", 3), nodeid=12))
    assert isinstance(r, w.Forget) and r.nlookup == 3 and not r.expects_reply
    body = struct.pack("<II", 2, 0) + struct.pack("<QQ", 5, 1) + struct.pack("<QQ", 6, 2)
    r = w.parse_request(msg(w.BATCH_FORGET, body))
    assert r.items == ((5, 1), (6, 2)) and not r.expects_reply


def test_open_read_write_release_flush_fsync():
    assert w.parse_request(msg(w.OPEN, struct.pack("<II", 0o2, 0))).flags == 0o2
    assert isinstance(w.parse_request(msg(w.OPENDIR, struct.pack("<II", 0, 0))), w.OpenDir)
    read = struct.pack("<QQIIQII", 11, 8192, 4096, 0, 0, 0o2, 0)
    r = w.parse_request(msg(w.READ, read))
    assert (r.fh, r.offset, r.size, r.flags) == (11, 8192, 4096, 0o2)
    assert type(w.parse_request(msg(w.READDIR, read))) is w.ReadDir
    assert type(w.parse_request(msg(w.READDIRPLUS, read))) is w.ReadDirPlus
    r = w.parse_request(msg(w.WRITE, struct.pack("<QQIIQII", 11, 0, 3, 0, 0, 0, 0) + b"abc"))
    assert (r.fh, r.size, r.data) == (11, 3, b"abc")
    r = w.parse_request(msg(w.RELEASE, struct.pack("<QIIQ", 11, 2, w.RELEASE_FLUSH, 77)))
    assert (r.fh, r.flags, r.release_flags, r.lock_owner) == (11, 2, w.RELEASE_FLUSH, 77)
    assert type(w.parse_request(msg(w.RELEASEDIR, struct.pack("<QIIQ", 1, 0, 0, 0)))) is w.ReleaseDir
    assert w.parse_request(msg(w.FLUSH, struct.pack("<QIIQ", 11, 0, 0, 5))).lock_owner == 5
    assert w.parse_request(msg(w.FSYNC, struct.pack("<QII", 11, 1, 0))).fsync_flags == 1
    assert w.parse_request(msg(w.ACCESS, struct.pack("<II", 4, 0))).mask == 4
    assert isinstance(w.parse_request(msg(w.STATFS, b"")), w.StatFs)
    assert isinstance(w.parse_request(msg(w.DESTROY, b"")), w.Destroy)
    assert w.parse_request(msg(w.INTERRUPT, struct.pack("<Q", 99))).target == 99


def test_setattr():
    body = struct.pack("<IIQQQQQQIIIIIIII", w.FATTR_SIZE | w.FATTR_FH, 0, 3, 0, 0, 1, 2, 3, 4, 5, 6, 0o644, 0, 10, 20, 0)
    r = w.parse_request(msg(w.SETATTR, body))
    assert (r.valid, r.fh, r.size, r.atime, r.mtime, r.mode, r.uid, r.gid) == (
        w.FATTR_SIZE | w.FATTR_FH, 3, 0, 1, 2, 0o644, 10, 20)


def test_ioctl_and_poll():
    cmd = w.ioc(w.IOC_READ | w.IOC_WRITE, ord("F"), 0x2A, 32)
    body = struct.pack("<QIIQII", 5, 0, cmd, 0x7FFF0000, 32, 32) + bytes(range(32))
    r = w.parse_request(msg(w.IOCTL, body))
    assert (r.fh, r.cmd, r.arg, r.in_size, r.out_size, r.data) == (5, cmd, 0x7FFF0000, 32, 32, bytes(range(32)))
    assert w.ioc_size(cmd) == 32 and w.ioc_dir(cmd) == 3
    r = w.parse_request(msg(w.POLL, struct.pack("<QQII", 5, 123, w.POLL_SCHEDULE_NOTIFY, 1)))
    assert (r.fh, r.kh, r.flags, r.events) == (5, 123, w.POLL_SCHEDULE_NOTIFY, 1)


def test_unknown_opcode_is_typed():
    r = w.parse_request(msg(47, b"\x01\x02"))
    assert isinstance(r, w.Unknown) and r.body == b"\x01\x02" and r.header.opcode == 47
    _, err, unique, _ = out(w.encode_error(r.unique, 38))
    assert (err, unique) == (-38, r.unique)


def test_extension_bytes_are_skipped():
    body = b"name\0\0\0\0" + struct.pack("<II", 16, 32) + bytes(8)
    r = w.parse_request(msg(w.LOOKUP, body, extlen=2))
    assert r.name == b"name"


@pytest.mark.parametrize("data, field, offset", [
    (b"\x00" * 10, "in_header", 0),
    (HDR.pack(100, w.LOOKUP, 1, 1, 0, 0, 0, 0, 0) + b"x\0", "len", 0),
    (msg(w.LOOKUP, b"unterminated"), "name", 40),
    (msg(w.LOOKUP, b"\0"), "name", 40),
    (msg(w.OPEN, b"\x00" * 4), "fuse_open_in", 40),
    (msg(w.READ, b"\x00" * 30), "fuse_read_in", 40),
    (msg(w.WRITE, struct.pack("<QQIIQII", 1, 0, 9, 0, 0, 0, 0) + b"abc"), "size", 56),
    (msg(w.IOCTL, struct.pack("<QIIQII", 1, 0, 1, 0, 8, 8) + b"abc"), "in_size", 64),
    (msg(w.BATCH_FORGET, struct.pack("<II", 1000, 0) + bytes(16)), "count", 40),
    (msg(w.FORGET, b"\x01"), "nlookup", 40),
    (msg(w.INIT, b"\x07\x00"), "fuse_init_in", 40),
    (msg(w.LOOKUP, b"a\0", extlen=100), "total_extlen", 32),
])
def test_malformed_is_wire_error(data, field, offset):
    with pytest.raises(w.WireError) as ei:
        w.parse_request(data)
    assert ei.value.field == field and ei.value.offset == offset
    assert field in str(ei.value) and str(offset) in str(ei.value)


def test_wire_error_keeps_unique_when_header_readable():
    with pytest.raises(w.WireError) as ei:
        w.parse_request(msg(w.OPEN, b"", unique=31))
    assert ei.value.unique == 31


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 60))
def test_fuzz_never_raises_anything_but_wire_error(tail, opcode):
    for data in (tail, msg(opcode, tail), msg(w.CUSE_INIT if opcode == 60 else opcode, tail)[: 40 + len(tail) // 2]):
        try:
            w.parse_request(data)
        except w.WireError:
            pass


def test_reply_encoders():
    attr = w.Attr(ino=5, mode=0o100666, size=1 << 40, uid=0, gid=0, mtime=100)
    _, err, unique, body = out(w.encode_entry(9, 5, attr, entry_valid=1.5, attr_valid=0.25))
    assert (err, unique, len(body)) == (0, 9, 40 + 88)
    nodeid, gen, ev, av, evn, avn = struct.unpack_from("<QQQQII", body)
    assert (nodeid, ev, evn, av, avn) == (5, 1, 500_000_000, 0, 250_000_000)
    ino, size = struct.unpack_from("<QQ", body, 40)
    mode = struct.unpack_from("<I", body, 40 + 60)[0]
    assert (ino, size, mode) == (5, 1 << 40, 0o100666)
    assert len(out(w.encode_entry(9, 5, attr, minor=8))[3]) == 120
    _, _, _, body = out(w.encode_attr(1, attr, attr_valid=2))
    assert struct.unpack_from("<QI", body) == (2, 0) and len(body) == 16 + 88
    _, _, _, body = out(w.encode_open(1, 0xABC, w.FOPEN_DIRECT_IO))
    assert struct.unpack("<QIi", body) == (0xABC, w.FOPEN_DIRECT_IO, 0)
    assert out(w.encode_data(1, b"hello"))[3] == b"hello"
    assert struct.unpack("<II", out(w.encode_xattr_size(1, 12))[3]) == (12, 0)
    _, _, _, body = out(w.encode_statfs(1, w.StatFsOut(files=3)))
    assert len(body) == 80 and struct.unpack_from("<QQQQQII", body)[3:7] == (3, 0, 4096, 255)
    assert len(out(w.encode_statfs(1, w.StatFsOut(), minor=3))[3]) == 48
    assert struct.unpack("<II", out(w.encode_poll(1, 0x41))[3]) == (0x41, 0)
    assert struct.unpack("<II", out(w.encode_write(1, 10))[3]) == (10, 0)


def test_ioctl_replies_plain_and_retry():
    _, _, _, body = out(w.encode_ioctl(4, 0, b"\x01\x02"))
    assert struct.unpack_from("<iIII", body) == (0, 0, 0, 0) and body[16:] == b"\x01\x02"
    _, _, _, body = out(w.encode_ioctl(4, -5))
    assert struct.unpack_from("<i", body) == (-5,)
    _, _, _, body = out(w.encode_ioctl_retry(4, [(0x1000, 32)], [(0x1000, 32), (0x2000, 8)]))
    assert struct.unpack_from("<iIII", body) == (0, w.IOCTL_RETRY, 1, 2)
    assert [struct.unpack_from("<QQ", body, 16 + 16 * i) for i in range(3)] == [(0x1000, 32), (0x1000, 32), (0x2000, 8)]
    with pytest.raises(ValueError):
        w.encode_ioctl_retry(4, [(0, 1)] * 200, [(0, 1)] * 57)


def test_error_range_is_enforced():
    for bad in (0, -1, 512, 100000):
        with pytest.raises(ValueError):
            w.encode_error(1, bad)


def test_readdir_packing_and_limit():
    ents = [w.DirEntry(1, b".", 4, 1), w.DirEntry(1, b"..", 4, 2), w.DirEntry(7, b"nvidiactl", 8, 3)]
    reply, n = w.encode_readdir(2, ents, 4096)
    _, _, _, body = out(reply)
    assert n == 3
    pos, names = 0, []
    while pos < len(body):
        ino, off, namelen, typ = struct.unpack_from("<QQII", body, pos)
        names.append((ino, off, body[pos + 24:pos + 24 + namelen], typ))
        pos += (24 + namelen + 7) & ~7
    assert names == [(1, 1, b".", 4), (1, 2, b"..", 4), (7, 3, b"nvidiactl", 8)]
    reply, n = w.encode_readdir(2, ents, 60)  # room for two 32-byte records? no: 32 + 32 > 60
    assert n == 1
    entry = w.pack_entry(7, w.Attr(ino=7, mode=0o100666))
    reply, n = w.encode_readdirplus(2, [(ents[2], entry)], 4096)
    body = out(reply)[3]
    assert n == 1 and struct.unpack_from("<Q", body)[0] == 7
    assert body[128 + 24:128 + 24 + 9] == b"nvidiactl" and len(body) % 8 == 0


def test_notifications():
    length, code, unique, body = out(w.encode_notify_inval_inode(9, 0, 0))
    assert (code, unique) == (w.NOTIFY_INVAL_INODE, 0) and struct.unpack("<Qqq", body) == (9, 0, 0)
    _, code, _, body = out(w.encode_notify_inval_entry(1, b"tenantA"))
    assert code == w.NOTIFY_INVAL_ENTRY and struct.unpack_from("<QII", body) == (1, 7, 0) and body[16:] == b"tenantA\0"
    _, code, _, body = out(w.encode_notify_poll(0xDEAD))
    assert code == w.NOTIFY_POLL and struct.unpack("<Q", body) == (0xDEAD,)
    _, code, _, body = out(w.encode_notify_delete(1, 5, b"x"))
    assert code == w.NOTIFY_DELETE and struct.unpack_from("<QQII", body) == (1, 5, 1, 0)


def test_request_encoder_roundtrip():
    raw = w.encode_request(w.LOOKUP, 77, b"proc\0", nodeid=3, uid=5, gid=6, pid=7)
    r = w.parse_request(raw)
    assert (r.unique, r.nodeid, r.header.uid, r.header.gid, r.header.pid, r.name) == (77, 3, 5, 6, 7, b"proc")
