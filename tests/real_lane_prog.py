"""A tenant program of tests/test_real_lane.py: header-only lane calls on the stand-in
driver nodes (whose ioctls answer ENOTTY): NV_ESC_NUMA_INFO and NV_ESC_WAIT_OPEN_COMPLETE on
/dev/nvidia0 (plain escapes), NV_ESC_RM_FREE on /dev/nvidiactl; prints the errno of each
as one JSON line."""
from __future__ import annotations

import errno
import fcntl
import json
import os

from devbroker.abi import registry

abi = registry.get("580.159.04")
out = {}


def errno_of(fd: int, cmd: int, buf: bytearray) -> int:
    """The ioctl's errno (0: it returned), the argument answered in place."""
    try:
        fcntl.ioctl(fd, cmd, buf, True)
        return 0
    except OSError as e:
        return e.errno or errno.EIO


ctl = os.open("/dev/nvidiactl", os.O_RDWR)
gpu = os.open("/dev/nvidia0", os.O_RDWR)
for name, fd in (("NV_ESC_NUMA_INFO", gpu), ("NV_ESC_WAIT_OPEN_COMPLETE", gpu),
                 ("NV_ESC_CHECK_VERSION_STR", ctl), ("NV_ESC_RM_FREE", ctl)):
    out[name] = errno_of(fd, abi.escape_cmd(name), bytearray(abi.escape(name).size))
# an fd escape (the native loop carries its fd: the broker's duplicate of the tenant's own
# ctl file goes to the driver): the tenant's ctl file, a pipe (not an NVIDIA file: refused
# on the general path), -1 and a number with no file (both the general path's to answer)
r, w = os.pipe()
spec = abi.escape("NV_ESC_REGISTER_FD")
for what, fd in (("own-ctl", ctl), ("pipe", r), ("minus-one", -1), ("no-file", 987)):
    v = spec.params.decode(bytes(spec.size)).replace(ctl_fd=fd)
    buf = bytearray(v.encode())
    out["NV_ESC_REGISTER_FD " + what] = errno_of(gpu, abi.escape_cmd("NV_ESC_REGISTER_FD"), buf)
    # the tenant's own number back in its argument, whatever the driver saw
    out["NV_ESC_REGISTER_FD " + what + " arg"] = spec.params.decode(bytes(buf)).ctl_fd == fd
# SYS_PARAMS: the host's own memory block size (answered by the broker, the driver never
# sees it: the native loop answers it itself) and another value (refused: EPERM)
sysp = abi.escape("NV_ESC_SYS_PARAMS")
try:
    host_block = int(open("/sys/devices/system/memory/block_size_bytes").read().strip(), 16)
except OSError:
    host_block = 0x8000000
for what, size in (("host", host_block), ("other", host_block * 2)):
    buf = bytearray(sysp.params.decode(bytes(sysp.size)).replace(memblock_size=size).encode())
    out["NV_ESC_SYS_PARAMS " + what] = errno_of(ctl, abi.escape_cmd("NV_ESC_SYS_PARAMS"), buf)
    out["NV_ESC_SYS_PARAMS " + what + " arg"] = sysp.params.decode(bytes(buf)).memblock_size == size
# a root client the tenant allocates itself (the broker lets the kernel run it: the
# stand-in answers ENOTTY, so there is no client), then a control naming a client it may
# have made: the native loop asks the broker to adopt it (the driver's probe fails here) and
# the general way then answers, as with the lane off
root = abi.escape("NV_ESC_RM_ALLOC").params
v = root.decode(bytes(root.size)).replace(hClass=0x41)
buf = bytearray(v.encode())
out["root-alloc"] = errno_of(ctl, abi.escape_cmd("NV_ESC_RM_ALLOC", len(buf)), buf)
ctl_hdr = abi.struct("NVOS54_PARAMETERS")
v = ctl_hdr.decode(bytes(ctl_hdr.size)).replace(hClient=0xC1D0BEEF, hObject=0xC1D0BEEF,
                                                cmd=0x201, params=0, paramsSize=0)
buf = bytearray(v.encode())
try:
    fcntl.ioctl(ctl, abi.escape_cmd("NV_ESC_RM_CONTROL", len(buf)), buf, True)
    out["control-unknown-client"] = ctl_hdr.decode(bytes(buf)).status
except OSError as e:
    out["control-unknown-client"] = -(e.errno or errno.EIO)
print(json.dumps(out), flush=True)
