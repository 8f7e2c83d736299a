"""Property-based fuzzing of the front ends' sans-IO codecs: FUSE/CUSE
(fusewire), the kernel-module protocol (kmodwire) and seccomp notifications (seccompwire).

Each decoder gets arbitrary and structure-aware mutated bytes; the only exceptions allowed
out are the codec's own error types (WireError / ProtocolError), and what decodes must
re-encode to the same bytes where the codec has an encoder. Bounded: a few hundred examples
each, deadline off; the whole file runs in well under 60 s. The ABI decoders have their own
(tests/test_abi_fuzz.py). scripts/fuzz_atheris.py runs the same targets coverage-guided.
"""
from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devbroker.frontends import fusewire as fw
from devbroker.frontends import kmodwire as kw
from devbroker.sandbox import seccompwire as sw

SETTINGS = settings(max_examples=400, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

FUSE_OPCODES = sorted(set(fw._DECODERS) | {0, 1, 9999, 0xFFFFFFFF})


def fuse_msg(opcode: int, body: bytes, *, unique: int = 7, nodeid: int = 1, pid: int = 42,
             extlen: int = 0, length: int | None = None) -> bytes:
    n = fw.IN_HEADER.size + len(body)
    return fw.IN_HEADER.pack(n if length is None else length, opcode, unique, nodeid, 0, 0,
                             pid, extlen, 0) + body


def parse_fuse(data: bytes, minor: int = fw.MAX_MINOR):
    try:
        return fw.parse_request(data, minor=minor)
    except fw.WireError as e:
        assert isinstance(e.offset, int) and e.field and e.reason
        return None


@SETTINGS
@given(st.binary(max_size=512))
def test_fuse_random_bytes(data):
    parse_fuse(data)


@SETTINGS
@given(st.sampled_from(FUSE_OPCODES), st.binary(max_size=300), st.integers(0, 4),
       st.integers(0, fw.MAX_MINOR))
def test_fuse_well_framed_requests(opcode, body, extlen, minor):
    req = parse_fuse(fuse_msg(opcode, body, extlen=extlen), minor)
    if req is not None:
        assert req.unique == 7 and req.nodeid == 1


@SETTINGS
@given(st.sampled_from(FUSE_OPCODES), st.binary(max_size=200),
       st.integers(0, 0xFFFFFFFF))
def test_fuse_lying_length(opcode, body, length):
    parse_fuse(fuse_msg(opcode, body, length=length))


@SETTINGS
@given(st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFF),
       st.integers(0, (1 << 64) - 1), st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFF),
       st.binary(max_size=64))
def test_fuse_ioctl_fields(fh_lo, flags, cmd, arg, in_size, out_size, tail):
    # fuse_ioctl_in: fh u64, flags u32, cmd u32, arg u64, in_size u32, out_size u32
    body = struct.pack("<QIIQII", fh_lo, flags, cmd, arg, in_size, out_size) + tail
    req = parse_fuse(fuse_msg(fw.IOCTL, body))
    if req is not None:
        assert isinstance(req, fw.Ioctl)


@SETTINGS
@given(st.integers(0, 1 << 62), st.binary(max_size=64), st.integers(-4096, 0))
def test_fuse_reply_encoders(unique, data, err):
    out = fw.encode_reply(unique, data)
    assert len(out) == 16 + len(data)
    try:
        fw.encode_error(unique, -err)
        fw.encode_ioctl(unique, err, data)
    except (fw.WireError, ValueError):
        pass


# --------------------------------------------------------------------------- kmodwire
def kmod_request(**over) -> bytes:
    v = {name: 0 for name, _ in kw.REQUEST_FIELDS}
    v.update(magic=kw.REQ_MAGIC, version=kw.PROTO_VERSION, op=int(kw.Op.IOCTL))
    v.update(over)
    return kw._REQ.pack(*(v[name] for name, _ in kw.REQUEST_FIELDS))


@SETTINGS
@given(st.binary(max_size=kw.REQUEST_SIZE + 128))
def test_kmod_random_bytes(data):
    try:
        kw.parse_request(data)
    except kw.ProtocolError:
        pass
    try:
        kw.parse_verdict(data)
    except kw.ProtocolError:
        pass


@SETTINGS
@given(st.integers(0, 12), st.integers(0, 0xFFFFFFFF), st.integers(0, 300),
       st.binary(max_size=300), st.integers(0, 0xFFFF))
def test_kmod_framed_requests(op, cmd, arg_size, data, version):
    raw = kmod_request(op=op, cmd=cmd, arg_size=arg_size,
                       version=kw.PROTO_VERSION if version % 3 else version) + data
    try:
        req = kw.parse_request(raw)
    except kw.ProtocolError:
        return
    assert len(req.data) == arg_size
    assert kw.parse_request(kw.encode_request(req)) == req


@SETTINGS
@given(st.integers(0, 0xFFFFFFFF))
def test_kmod_arg_size(cmd):
    n = kw.arg_size(cmd)
    assert 0 <= n <= kw.MAX_ARG or n == 0


# --------------------------------------------------------------------------- seccompwire
@SETTINGS
@given(st.binary(max_size=256))
def test_seccomp_decoders(data):
    for cls in (sw.NotifSizes, sw.Notif, sw.NotifResp):
        try:
            cls.decode(data)
        except sw.WireError:
            pass
    try:
        sw.SeccompData.decode(data)
    except sw.WireError:
        pass
    for dec in (sw.decode_stat, sw.decode_statx):
        try:
            dec(data)
        except sw.WireError:
            pass


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=23))
def test_seccomp_addfd_decode_short(data):
    # Found by this fuzzer (struct.error before the length check): now a typed WireError.
    with pytest.raises(sw.WireError):
        sw.NotifAddfd.decode(data)


@SETTINGS
@given(st.binary(min_size=0, max_size=300), st.integers(0, 4095), st.integers(0, (1 << 20) - 1))
def test_seccomp_fake_stat(data, major, minor):
    for fake, dec in ((sw.fake_chr_stat, sw.decode_stat), (sw.fake_chr_statx, sw.decode_statx)):
        try:
            out = fake(data, major, minor)
        except sw.WireError:
            continue
        assert len(out) == len(data)
        st_ = dec(out)
        assert (st_.mode & 0o170000) == 0o020000
        assert (st_.rdev_major, st_.rdev_minor) == (major, minor)


@SETTINGS
@given(st.integers(0, 0x7FFFFFFF), st.integers(0, 0xFFFFFFFF), st.integers(0, (1 << 64) - 1),
       st.lists(st.integers(0, (1 << 64) - 1), min_size=6, max_size=6))
def test_seccomp_filter_on_random_syscalls(nr, arch, ip, args):
    prog = sw.build_filter()
    data = sw.SeccompData(nr, arch, ip, tuple(args))
    action = sw.run_filter(prog, data)
    assert sw.action_name(action)
    # Never ALLOW an open-family syscall of x86_64: those must reach the supervisor.
    if arch == sw.AUDIT_ARCH_X86_64 and nr in (2, 257, 437):
        assert action == sw.SECCOMP_RET_USER_NOTIF


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 0xFFFF).filter(lambda v: v not in {int(x) for x in kw.Verdict}))
def test_kmod_verdict_unknown_code(code):
    v = {name: 0 for name, _ in kw.VERDICT_FIELDS}
    v.update(magic=kw.VERDICT_MAGIC, version=kw.PROTO_VERSION, verdict=code)
    raw = kw._VERDICT.pack(*(v[name] for name, _ in kw.VERDICT_FIELDS))
    try:
        kw.parse_verdict(raw)
    except ValueError as e:
        if isinstance(e, kw.ProtocolError):
            return
        raise
