"""The control lane on the real backend's relayed files (FUSE/CUSE/kmod front ends with
`--backend real`, issue 14): `RealBackend.run_control` sends the lane's call through the
relay's channel for front-end threads, built from the private header and parameter block.

No GPU here: the relay runs for real (its own capability-less process) against stand-in
driver nodes — /dev/null's device as nvidiactl, so every ioctl meets the kernel's ENOTTY —
and the lane's answer must be the general path's answer for the same call (the driver's
errno, the header as the tenant sent it), for a control and an allocation header. A busy
thread channel sends the call the general way (NotHere)."""
from __future__ import annotations

import errno
import os
import struct

import pytest

from devbroker.abi import registry
from devbroker.abi.nodes import NodeKind
from devbroker.backends.base import DriverCall, NotHere
from devbroker.broker import fastlane

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod)")

VERSION = "580.159.04"


@pytest.fixture
def backend(tmp_path):
    from devbroker.backends.real import RealBackend

    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    (proc / "gpus").mkdir(parents=True)
    os.mknod(dev / "nvidiactl", 0o666 | 0o020000, os.makedev(1, 3))  # /dev/null's device
    (proc / "version").write_text(
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {VERSION}  Release Build\n")
    b = RealBackend(dev=str(dev), proc=proc, relay_uid=None, channels=2, discover=False,
                    private_dir=tmp_path / "private")
    yield b
    b.stop()


@pytest.mark.parametrize("kind", ["control", "alloc"])
def test_a_lane_call_on_a_relayed_file_answers_as_the_general_path(backend, kind):
    abi = registry.get(VERSION)
    f = backend.open(NodeKind.CTL, 0)
    assert backend.can_run_control(f) and not backend.control_is_plain_ioctl(f)
    header = next(h for h in fastlane.headers_of(abi).values()
                  if h.kind == kind and h.size == (32 if kind == "control" else 48))
    params = bytearray(b"private parameter block".ljust(48, b"."))
    hdr = bytearray(header.size)
    if kind == "control":
        struct.pack_into("<IIIIQI", hdr, 0, 0xC1D00001, 0xC1D00001, 0x20801303, 0,
                         0x7FFF00001000, len(params))
    else:
        struct.pack_into("<IIIIQQI", hdr, 0, 0xC1D00001, 0xC1D00001, 0x5C000001, 0x2080,
                         0x7FFF00001000, 0, 0)
    ret, err, hdr_out = backend.run_control(f, -1, bytes(hdr), params, header, abi)
    call = abi.decode_ioctl(NodeKind.CTL, header.ioctl_cmd, bytes(hdr))
    general = backend.ioctl_blocking(f, DriverCall(call, bytes(params), {}, abi=abi))
    assert (ret, err) == (-1, errno.ENOTTY) == (general.result, general.errno)
    assert hdr_out == bytes(hdr) == general.arg  # the tenant's pointer, as it sent it
    assert params.startswith(b"private parameter block")
    # the thread channel taken (another reader thread's call): the general way
    with backend.relay.thread_chan.lock:
        with pytest.raises(NotHere):
            backend.run_control(f, -1, bytes(hdr), params, header, abi)
