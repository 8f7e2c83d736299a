#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris / libFuzzer) of devbroker's decoders.

    .venv/bin/pip install atheris          # 3.0 ships manylinux wheels: no clang needed
    .venv/bin/python scripts/fuzz_atheris.py TARGET [libFuzzer flags, e.g. -runs=200000
                                                     -max_total_time=60 CORPUS_DIR]

TARGET: abi (DriverABI.decode_ioctl + nested), fuse (fusewire.parse_request),
kmod (kmodwire.parse_request/parse_verdict), seccomp (seccompwire decoders).
The first bytes of each input choose the node / command where the target needs one.
Only the codec's own error types may come out; anything else is a crash (libFuzzer writes
the input to crash-*). tests/test_fuzz_codecs.py runs the same properties with hypothesis.
"""
from __future__ import annotations

import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import atheris  # noqa: E402

with atheris.instrument_imports():
    from devbroker.abi import DecodeError, NodeKind, iowr, registry
    from devbroker.frontends import fusewire as fw
    from devbroker.frontends import kmodwire as kw
    from devbroker.sandbox import seccompwire as sw

ABI = registry.get("580.159.04")
RM_SIZES = [(0x2A, 32), (0x2B, 48), (0x2B, 32), (0x29, 16), (0x4E, 56), (0x27, 56),
            (200, 72 * 32), (210, 72), (211, 16), (201, 4), (214, 8)]


def t_abi(data: bytes) -> None:
    if len(data) < 3:
        return
    node = (NodeKind.CTL, NodeKind.GPU, NodeKind.UVM)[data[0] % 3]
    if node is NodeKind.UVM:
        cmd = struct.unpack_from("<H", data, 1)[0] % 2048
    else:
        nr, size = RM_SIZES[data[1] % len(RM_SIZES)]
        cmd = iowr(nr, size) if data[2] & 1 else iowr(data[1], data[2] * 4)
    arg = data[3:]
    try:
        call = ABI.decode_ioctl(node, cmd, arg)
        ref = ABI.nested(call)
        if ref is not None:
            ABI.decode_nested(call, bytes(min(ref.size, 4096)), ref)
        assert call.encode() == arg
    except DecodeError:
        pass


def t_fuse(data: bytes) -> None:
    try:
        fw.parse_request(data)
    except fw.WireError:
        pass
    # the same body behind a well-formed header, opcode from the first byte
    if data:
        op = sorted(fw._DECODERS)[data[0] % len(fw._DECODERS)]
        body = data[1:]
        msg = fw.IN_HEADER.pack(fw.IN_HEADER.size + len(body), op, 1, 1, 0, 0, 1, 0, 0) + body
        try:
            fw.parse_request(msg)
        except fw.WireError:
            pass


def t_kmod(data: bytes) -> None:
    for fn in (kw.parse_request, kw.parse_verdict):
        try:
            fn(data)
        except kw.ProtocolError:
            pass
    if len(data) >= kw.REQUEST_SIZE:
        # keep magic/version right so the fuzzer gets past them
        fixed = struct.pack("=IH", kw.REQ_MAGIC, kw.PROTO_VERSION) + data[6:]
        try:
            req = kw.parse_request(fixed)
            assert kw.parse_request(kw.encode_request(req)) == req
        except kw.ProtocolError:
            pass


def t_seccomp(data: bytes) -> None:
    for cls in (sw.NotifSizes, sw.Notif, sw.NotifResp, sw.SeccompData):
        try:
            cls.decode(data)
        except sw.WireError:
            pass
    for dec in (sw.decode_stat, sw.decode_statx):
        try:
            dec(data)
        except sw.WireError:
            pass


TARGETS = {"abi": t_abi, "fuse": t_fuse, "kmod": t_kmod, "seccomp": t_seccomp}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(TARGETS)}}} [libFuzzer flags]")
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
