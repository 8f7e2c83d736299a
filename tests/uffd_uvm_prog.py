"""A tenant program of tests/test_real_lane.py: a UVM command (UVM_INITIALIZE, the continue
lane's; not one of the rows the kernel runs unasked, rules.kernel_commands) whose argument lies in a userfaultfd page the tenant never serves, so the
broker's read of it (the native loop's callback, through the memory gate) waits for the
tenant; then the same command with its argument in ordinary memory. Prints one JSON line:
each call's errno (0: it returned) and seconds."""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import struct
import time

from devbroker.escape.attacks import (PAGE, SYS_userfaultfd, UFFD_API, UFFDIO_API,
                                      UFFDIO_REGISTER, UFFDIO_REGISTER_MODE_MISSING)
from rm_escape import ABI as abi

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
CMD = next(c for c, s in abi.uvm_cmds.items() if s.name == "UVM_INITIALIZE")


def call(fd: int, addr: int) -> tuple[int, float]:
    t0 = time.monotonic()
    r = libc.ioctl(fd, ctypes.c_ulong(CMD), ctypes.c_void_p(addr))
    err = ctypes.get_errno() if r < 0 else 0
    return err, round(time.monotonic() - t0, 2)


u = os.open("/dev/nvidia-uvm", os.O_RDWR)
uffd = libc.syscall(ctypes.c_long(SYS_userfaultfd), ctypes.c_long(os.O_CLOEXEC | os.O_NONBLOCK))
out: dict = {"uffd": uffd >= 0}
if uffd >= 0:
    fcntl.ioctl(uffd, UFFDIO_API, bytearray(struct.pack("=QQQ", UFFD_API, 0, 0)), True)
    addr = libc.mmap(None, PAGE, 3, 0x22, -1, 0)
    fcntl.ioctl(uffd, UFFDIO_REGISTER,
                bytearray(struct.pack("=QQQQ", addr, PAGE, UFFDIO_REGISTER_MODE_MISSING, 0)),
                True)
    out["stalled"] = call(u, addr)
    os.close(uffd)  # (wakes the broker's read, which then fails)
plain = ctypes.create_string_buffer(64)
out["plain"] = call(u, ctypes.addressof(plain))
print(json.dumps(out), flush=True)
