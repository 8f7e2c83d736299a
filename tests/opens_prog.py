"""A tenant program of tests/test_real_lane.py (prepared opens): opens /dev/nvidiactl once,
waits for the broker's quiet moment, opens it eight more times (with and without
O_CLOEXEC), once with O_NONBLOCK and once by a relative path; for each file: its inode,
whether the fd is close-on-exec, the file's O_NONBLOCK, and the errno of an RM_FREE of
client 0 on it (refused by the broker's general path on one of its files; ENOTTY from the
stand-in on any other). Also /dev/null's. One JSON line."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import time

from devbroker.abi import registry

abi = registry.get("580.159.04")
FREE = abi.escape_cmd("NV_ESC_RM_FREE")


_libc = ctypes.CDLL(None, use_errno=True)


def open_(path: str, flags: int) -> int:
    """open(2) with exactly these flags (os.open adds O_CLOEXEC to every open)."""
    fd = _libc.open(path.encode(), flags)
    if fd < 0:
        raise OSError(ctypes.get_errno(), path)
    return fd


def rm_free(fd: int) -> int:
    try:
        fcntl.ioctl(fd, FREE, bytearray(abi.escape("NV_ESC_RM_FREE").size), True)
        return 0
    except OSError as e:
        return e.errno or errno.EIO


def describe(fd: int) -> dict:
    return {"ino": os.fstat(fd).st_ino,
            "cloexec": bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC),
            "nonblock": bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK),
            "rm_free": rm_free(fd)}


out = {"first": describe(os.open("/dev/nvidiactl", os.O_RDWR | os.O_CLOEXEC))}
time.sleep(0.2)  # quiet: the listener may prepare the next opens of that path
out["ctl"] = [dict(describe(open_("/dev/nvidiactl", os.O_RDWR | (os.O_CLOEXEC if i % 2 else 0))),
                   want_cloexec=bool(i % 2)) for i in range(8)]
out["nonblock"] = describe(open_("/dev/nvidiactl", os.O_RDWR | os.O_NONBLOCK))
os.chdir("/dev")
out["relative"] = describe(open_("nvidiactl", os.O_RDWR))
out["null"] = describe(os.open("/dev/null", os.O_RDWR))
print(json.dumps(out), flush=True)
