"""Random and mutated bytes into the decoders: only DecodeError (or a value) may come out."""
from __future__ import annotations

import struct
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devbroker.abi import DecodeError, NodeKind, iowr, nvtrace, registry
from devbroker.abi.traceview import TraceDecoder

ABI = registry.get("580.159.04")
TRACES = Path(__file__).resolve().parent / "data"  # the H200 recordings, in the checkout
_SEED = []
if (TRACES / "h200-580.159.04-nvml.nvtrace").exists():
    _SEED = (TRACES / "h200-580.159.04-nvml.nvtrace").read_bytes()[:20000]

CMDS = [iowr(nr, size) for nr, size in ((0x2A, 32), (0x2B, 48), (0x2B, 32), (0x29, 16),
                                         (0x4E, 56), (200, 2304), (210, 72), (211, 16))]
SETTINGS = settings(max_examples=1500, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _decode_all(node, cmd, arg):
    try:
        call = ABI.decode_ioctl(node, cmd, arg)
        ref = ABI.nested(call)
        if ref is not None:
            ABI.decode_nested(call, bytes(min(ref.size, 4096)), ref)
        assert call.encode() == arg
    except DecodeError as e:
        assert isinstance(e.offset, int) and e.field and e.reason


@SETTINGS
@given(st.sampled_from(CMDS), st.binary(max_size=300))
def test_random_arguments(cmd, data):
    size = (cmd >> 16) & 0x3FFF
    _decode_all(NodeKind.CTL, cmd, data)  # usually the wrong size
    _decode_all(NodeKind.CTL, cmd, (data * (size // max(len(data), 1) + 1))[:size]
                if data else bytes(size))


@SETTINGS
@given(st.integers(0, 0xFFFFFFFF), st.binary(max_size=2048))
def test_random_commands(cmd, data):
    for node in (NodeKind.CTL, NodeKind.UVM):
        _decode_all(node, cmd, data)


@SETTINGS
@given(st.data())
def test_mutated_traces(data):
    if not _SEED:
        buf = nvtrace.encode_records([nvtrace.Record(type=2, cmd=iowr(0x2A, 32),
                                                     in_=bytes(32), out=bytes(32))])
    else:
        buf = bytearray(_SEED)
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(buf) - 1))
            buf[i] = data.draw(st.integers(0, 255))
        cut = data.draw(st.integers(0, len(buf)))
        buf = bytes(buf[:cut])
    dec = TraceDecoder(ABI)
    try:
        for rec in nvtrace.iter_records(buf):
            dec.decode(rec)  # never raises: errors are recorded on the event
    except DecodeError as e:
        assert e.field


def test_header_length_fields_are_bounded():
    # a length of 4 GiB in a 64-byte file must fail at once, not allocate or loop
    hdr = struct.pack("<IHHiIiiIIQQIIII", nvtrace.MAGIC, 2, 1, 3, 0, 0, 0, 0, 0, 0, 0,
                      0xFFFFFFFF, 0, 0, 0)
    try:
        list(nvtrace.iter_records(hdr))
    except DecodeError as e:
        assert e.field == "n_in"
    else:
        raise AssertionError("no error")
