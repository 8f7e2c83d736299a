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
ctl = os.open("/dev/nvidiactl", os.O_RDWR)
gpu = os.open("/dev/nvidia0", os.O_RDWR)
for name, fd in (("NV_ESC_NUMA_INFO", gpu), ("NV_ESC_WAIT_OPEN_COMPLETE", gpu),
                 ("NV_ESC_CHECK_VERSION_STR", ctl), ("NV_ESC_RM_FREE", ctl)):
    spec = abi.escape(name)
    buf = bytearray(spec.size)
    try:
        fcntl.ioctl(fd, abi.escape_cmd(name), buf, True)
        out[name] = 0
    except OSError as e:
        out[name] = e.errno or errno.EIO
print(json.dumps(out), flush=True)
