"""Tenant programs that leave the broker waiting on a page nobody serves (imported by
tests; each is `python -c PROGRAM DEV_DIR`)."""

# An RM_CONTROL whose parameter block lies in a userfaultfd range the program never serves:
# the broker's read of it blocks in the kernel until the program closes the userfaultfd.
# Prints "calling", then "answered" (with the call's errno) once the broker answers; closes
# the userfaultfd after a line on stdin ("released") and waits for one more line.
STALLER = r"""
import ctypes, errno, fcntl, json, os, struct, sys, time
from devbroker.escape.attacks import (PAGE, SYS_userfaultfd, UFFD_API, UFFDIO_API,
                                      UFFDIO_REGISTER, UFFDIO_REGISTER_MODE_MISSING, libc)
from devbroker.tools.hotpath import OneCall
c = OneCall(sys.argv[1], False)
uffd = libc.syscall(ctypes.c_long(SYS_userfaultfd), ctypes.c_long(os.O_CLOEXEC | os.O_NONBLOCK))
assert uffd >= 0, ctypes.get_errno()
fcntl.ioctl(uffd, UFFDIO_API, bytearray(struct.pack("=QQQ", UFFD_API, 0, 0)), True)
addr = libc.mmap(None, PAGE, 3, 0x22, -1, 0)
fcntl.ioctl(uffd, UFFDIO_REGISTER,
            bytearray(struct.pack("=QQQQ", addr, PAGE, UFFDIO_REGISTER_MODE_MISSING, 0)), True)
c.arg[16:24] = struct.pack("<Q", addr)  # NVOS54.params: the unserved page
print(json.dumps({"what": "calling", "t": time.monotonic()}), flush=True)
try:
    c.call()
    got = {"errno": 0}
except OSError as e:
    got = {"errno": e.errno}
got.update(what="answered", t=time.monotonic())
print(json.dumps(got), flush=True)
sys.stdin.readline()
os.close(uffd)  # the broker's stalled read returns
print(json.dumps({"what": "released"}), flush=True)
sys.stdin.readline()
"""
