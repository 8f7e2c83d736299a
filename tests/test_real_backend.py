"""The real backend's sans-IO parts and its relay process, without a GPU.

- relaywire: frames and payloads round-trip; malformed input raises WireError, never more.
- prepare_ioctl/finish_ioctl: fd fields become the relay's fds and come back as the tenant's;
  nested and second-level buffers become relay buffers; unlisted pointers and UVM commands
  that act on the caller's mm are refused before the driver. Checked on arguments taken from
  the H200 recording (tests/data/h200-580.159.04-relay.nvtrace).
- The relay process itself (real process, real syscalls) on /dev/null and /dev/zero: it drops
  every capability, relays ioctl errors and mmap page reads, and exits with its channels.
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct
from pathlib import Path

import pytest
import trio

from devbroker.abi import iowr, nvtrace, registry
from devbroker.abi.nodes import NodeKind
from devbroker.abi.traceview import TraceDecoder
from devbroker.backends import relaywire as w
from devbroker.backends.base import DriverCall
from devbroker.backends.real import (
    RealFile, RelayProcess, Unrelayable, finish_ioctl, gpu_id_of, not_supported,
    parse_information, parse_version, prepare_ioctl,
)

DATA = Path(__file__).parent / "data" / "h200-580.159.04-relay.nvtrace"
ABI = registry.get("580.159.04")


def _file(rfd: int, node=NodeKind.CTL) -> RealFile:
    return RealFile(node, 0, rfd, "/dev/nvidiactl")


def _recorded(name: str):
    dec = TraceDecoder(ABI)
    for r in nvtrace.read_file(str(DATA)):
        ev = dec.decode(r)
        if r.type == nvtrace.RecordType.IOCTL and ev.call_in is not None and ev.call_in.name == name:
            yield r, ev


# --------------------------------------------------------------------------- wire
def test_frames_round_trip_in_pieces():
    req = w.IoctlRequest(5, 0xC030462B, [w.Buffer(bytes(48)), w.Buffer(b"x" * 40, 0, 16)])
    data = w.encode_ioctl(7, req) + w.encode_open(8, "/dev/nvidiactl", os.O_RDWR)
    dec = w.FrameDecoder()
    frames = []
    for i in range(len(data)):  # one byte at a time
        frames += dec.feed(data[i:i + 1])
    assert [(f.type, f.id) for f in frames] == [(w.IOCTL, 7), (w.OPEN, 8)]
    got = w.parse_ioctl(frames[0].payload)
    assert got.fd == 5 and got.cmd == 0xC030462B
    assert [(b.parent, b.ptr_offset, b.data) for b in got.buffers] == \
        [(-1, 0, bytes(48)), (0, 16, b"x" * 40)]
    assert w.parse_open(frames[1].payload) == ("/dev/nvidiactl", os.O_RDWR)
    rep = w.IoctlReply(-1, errno.ENOTTY, 1234, [b"a" * 48, b"b" * 40])
    f = w.FrameDecoder().feed(w.reply_ioctl(7, rep))[0]
    assert w.parse_ioctl_reply(f.payload) == rep


@pytest.mark.parametrize("payload", [
    b"", b"\0" * 11,
    struct.pack("<iII", 3, 0, 0),  # no buffers
    struct.pack("<iII", 3, 0, 1) + struct.pack("<iII", 0, 0, 8) + bytes(8),  # parent != -1
    struct.pack("<iII", 3, 0, 2) + struct.pack("<iII", -1, 0, 8) + struct.pack("<iII", 0, 8, 4)
    + bytes(12),  # pointer outside the parent
    struct.pack("<iII", 3, 0, 2) + struct.pack("<iII", -1, 0, 16) + struct.pack("<iII", 1, 0, 4)
    + bytes(20),  # parent not before it
    struct.pack("<iII", 3, 0, 1) + struct.pack("<iII", -1, 0, 100) + bytes(8),  # short
    struct.pack("<iII", 3, 0, 1) + struct.pack("<iII", -1, 0, 4) + bytes(5),  # trailing
])
def test_malformed_ioctl_requests_are_wire_errors(payload):
    with pytest.raises(w.WireError):
        w.parse_ioctl(payload)


def test_frame_length_bounds():
    with pytest.raises(w.WireError):
        w.FrameDecoder().feed(struct.pack("<I", w.MAX_FRAME + 1))
    with pytest.raises(w.WireError):
        w.FrameDecoder().feed(struct.pack("<I", 2) + b"ab")
    with pytest.raises(w.WireError):
        w.parse_mapread(struct.pack("<iQQI", 3, 0, 0, 10))


# --------------------------------------------------------------------------- re-encoding
def test_map_memory_fd_is_the_relays_and_comes_back_as_the_tenants():
    rec, ev = next(_recorded("NV_ESC_RM_MAP_MEMORY"))
    call = ev.call_in
    tenant_fd = call.value.fd
    target = _file(41)
    prep = prepare_ioctl(_file(40), DriverCall(call, None, {"fd": target}, abi=ABI))
    sent = ABI.decode_ioctl(NodeKind.CTL, call.cmd, prep.request.buffers[0].data).value
    assert sent.fd == 41 and prep.request.fd == 40 and len(prep.request.buffers) == 1
    assert sent.params == call.value.params  # nothing else changed
    out = ABI.decode_ioctl(NodeKind.CTL, call.cmd, rec.out).value
    answer = out.replace(fd=41).encode()  # the driver echoes the relay's fd
    arg, nested = finish_ioctl(prep, w.IoctlReply(0, 0, 0, [answer]))
    back = ABI.decode_ioctl(NodeKind.CTL, call.cmd, arg).value
    assert back.fd == tenant_fd and back.params == out.params and nested is None


def test_register_fd_untranslated_fd_becomes_minus_one():
    _, ev = next(_recorded("NV_ESC_REGISTER_FD"))
    prep = prepare_ioctl(_file(9, NodeKind.GPU), DriverCall(ev.call_in, None, {}, abi=ABI))
    assert struct.unpack("<i", prep.request.buffers[0].data[:4])[0] == -1
    prep = prepare_ioctl(_file(9, NodeKind.GPU),
                         DriverCall(ev.call_in, None, {"ctl_fd": _file(12)}, abi=ABI))
    assert struct.unpack("<i", prep.request.buffers[0].data[:4])[0] == 12


def test_control_params_pointer_becomes_a_relay_buffer():
    for rec, ev in _recorded("NV_ESC_RM_CONTROL"):
        if ev.call_in.value.cmd == 0x20801303 and rec.xin:  # FB_GET_INFO_V2
            break
    call = ev.call_in
    prep = prepare_ioctl(_file(3), DriverCall(call, rec.xin, {}, abi=ABI))
    arg0, nested = prep.request.buffers[0], prep.request.buffers[1]
    assert (nested.parent, nested.ptr_offset, nested.data) == (0, 16, rec.xin)
    assert struct.unpack_from("<Q", arg0.data, 16)[0] == 0  # the relay fills its address
    relay_arg = bytearray(rec.out)
    struct.pack_into("<Q", relay_arg, 16, 0x7F0000001000)
    arg, out_nested = finish_ioctl(prep, w.IoctlReply(0, 0, 0, [bytes(relay_arg), rec.xout]))
    assert arg == rec.out and out_nested == rec.xout


def test_second_level_buffers_the_core_copied_are_relayed_others_refused():
    spec = ABI.control(0x101).params
    strings = ctypes.create_string_buffer(b"abc", 32)
    params = spec.decode(bytes(spec.size)).replace(sizeOfStrings=32,
                                                   pVersionBuffer=ctypes.addressof(strings))
    top = ABI.escape("NV_ESC_RM_CONTROL").params
    v = top.decode(bytes(top.size)).replace(hClient=1, hObject=1, cmd=0x101, params=0x1000,
                                            paramsSize=spec.size)
    call = ABI.decode_ioctl(NodeKind.CTL, iowr(0x2A, top.size), v.encode())
    # The core copies the buffers the ABI marks (handlers.embedded_buffers) into dc.embedded.
    from devbroker.broker.handlers import embedded_buffers

    assert embedded_buffers(ABI, params) == [("pVersionBuffer", 32)]
    embedded = {"pVersionBuffer": bytearray(ctypes.string_at(ctypes.addressof(strings), 32))}
    dc = DriverCall(call, params.encode(), {}, abi=ABI, embedded=embedded)
    prep = prepare_ioctl(_file(3), dc)
    deep = prep.request.buffers[2]
    off = spec.by_name["pVersionBuffer"].offset
    assert (deep.parent, deep.ptr_offset, deep.data[:3], len(deep.data)) == (1, off, b"abc", 32)
    assert prep.deep == [("pVersionBuffer", 2)]
    # the same pointer in a control not listed: refused before the driver
    name_spec = ABI.control(0x20800110).params
    v2 = v.replace(cmd=0x208F0703 if ABI.control(0x208F0703) else 0x20800110)
    call2 = ABI.decode_ioctl(NodeKind.CTL, iowr(0x2A, top.size), v2.encode())
    fake = bytearray(ABI.control(v2.cmd).params.size)
    ptrs = [f for f in ABI.control(v2.cmd).params.fields if f.kind == "ptr"]
    if ptrs:
        struct.pack_into("<Q", fake, ptrs[0].offset, 0xDEAD0000)
        with pytest.raises(Unrelayable):
            prepare_ioctl(_file(3), DriverCall(call2, bytes(fake), {}, abi=ABI))
    del name_spec


def test_other_pointers_and_uvm_va_commands_are_not_relayed():
    top = ABI.escape("NV_ESC_RM_ALLOC").params
    v = top.decode(bytes(top.size)).replace(hRoot=1, hObjectParent=1, hObjectNew=2,
                                            hClass=0x80, pRightsRequested=0x1234)
    call = ABI.decode_ioctl(NodeKind.CTL, iowr(0x2B, top.size), v.encode())
    dc = DriverCall(call, None, {}, abi=ABI)
    with pytest.raises(Unrelayable):
        prepare_ioctl(_file(3), dc)
    res = not_supported(dc)
    assert ABI.decode_ioctl(NodeKind.CTL, call.cmd, res.arg).value.status == 0x56
    uvm = ABI.uvm(0x21)  # UVM_MAP_EXTERNAL_ALLOCATION
    ucall = ABI.decode_ioctl(NodeKind.UVM, 0x21, bytes(uvm.size))
    with pytest.raises(Unrelayable):
        prepare_ioctl(_file(3, NodeKind.UVM), DriverCall(ucall, None, {}, abi=ABI))
    # the mapping cookie the driver handed out is not a pointer it dereferences
    _, ev = next(_recorded("NV_ESC_RM_MAP_MEMORY"))
    c = ev.call_in.replace(params=ev.call_in.value.params.replace(pLinearAddress=0x12078C000))
    prepare_ioctl(_file(3), DriverCall(c, None, {"fd": _file(4)}, abi=ABI))


def test_proc_parsers():
    info = parse_information("Model: \t\t NVIDIA H200\nGPU UUID: \t GPU-d4ad161b\n"
                             "Bus Location: \t 0000:00:06.0\nDevice Minor: \t 0\n")
    assert info["Model"] == "NVIDIA H200" and info["Device Minor"] == "0"
    assert gpu_id_of("0000:00:06.0") == 0x6
    assert parse_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04"
                         "  Release Build  (dvs-builder@U22-I3-AF03-09-1)  Thu Oct 16\n") \
        == "580.159.04"


# --------------------------------------------------------------------------- relay process
@pytest.fixture
def relay():
    r = RelayProcess(2)
    yield r
    r.stop()


def test_relay_drops_every_capability(relay):
    info = relay.info()
    assert info.cap_eff == 0 and info.cap_prm == 0 and info.no_new_privs == 1
    if os.geteuid() == 0:
        assert info.cap_bnd == 0 and info.uid == 65534 and info.gid == 65534
    assert info.pid == relay.pid


def test_relay_ioctl_errno_buffers_and_page_reads(relay):
    fd = relay.open("/dev/null")
    req = w.IoctlRequest(fd, 0xC020462A, [w.Buffer(bytes(32)), w.Buffer(b"params", 0, 16)])
    rep = relay.ioctl(relay.pool[0], req)
    assert (rep.ret, rep.errno) == (-1, errno.ENOTTY)
    assert rep.buffers[1] == b"params" and rep.buffers[0][:16] == bytes(16)
    z = relay.open("/dev/zero")
    assert relay.mapread(z, 8192, 4096, 100) == bytes(100)
    assert relay.mapread(z, 8192, 8000, 400) == bytes(400)  # past the map: zeros
    before = relay.info().open_fds
    relay.close(fd)
    relay.close(z)
    assert relay.info().open_fds == before - 3  # the two fds and the mapping's dup
    with pytest.raises(OSError) as e:
        relay.open("/nonexistent/nvidiactl")
    assert e.value.errno == errno.ENOENT


async def test_relay_async_channels_run_concurrently(relay):
    fd = relay.open("/dev/null")
    req = w.IoctlRequest(fd, 0xC020462A, [w.Buffer(bytes(32))])
    results = []

    async def one():
        results.append(await relay.aioctl(req))

    async with trio.open_nursery() as n:
        for _ in range(8):  # more callers than channels: they wait for one
            n.start_soon(one)
    assert len(results) == 8 and all(r.errno == errno.ENOTTY for r in results)


@pytest.mark.parametrize("channels", [1, 8])  # 8 (the default): one kept for threads
def test_relay_exits_when_the_broker_goes(channels):
    r = RelayProcess(channels)
    pid = r.pid
    r.stop()
    assert r.proc.returncode == 0  # by itself, every channel closed; not killed (-9)
    assert not os.path.exists(f"/proc/{pid}/status") or \
        "zombie" in open(f"/proc/{pid}/status").read()


def test_real_backend_refuses_a_driver_without_tables(tmp_path):
    """An unknown driver may lay its structs out differently; the backend (and so
    `devbroker run --backend real`, which prints this OSError) refuses to start, naming the
    supported versions, before it starts a relay or opens a device."""
    from devbroker.backends.real import RealBackend

    (tmp_path / "version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  999.1.2  Release Build  "
        "(dvs-builder@U22-I3-AF03-09-1)  Sun Jan  1 00:00:00 UTC 2026\nGCC version:  gcc 12\n")
    with pytest.raises(OSError) as e:
        RealBackend(proc=tmp_path, discover=False, relay_uid=None)
    msg = str(e.value)
    assert e.value.errno == errno.ENOTSUP
    assert "999.1.2" in msg and "580.159.04" in msg and "535.309.01" in msg
    assert "docs/abi.md" in msg
    (tmp_path / "version").write_text("garbage\n")
    with pytest.raises(OSError) as e:
        RealBackend(proc=tmp_path, discover=False, relay_uid=None)
    assert e.value.errno == errno.ENOTSUP and "(unreadable)" in str(e.value)
