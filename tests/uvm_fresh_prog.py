"""A tenant program of tests/test_real_lane.py's node-wide continuation test, against a
stand-in driver that answers NV_OK to every call the broker makes (nvok_standin.py) and
stand-in nodes whose own ioctls answer the tenant ENOTTY (a continued call reaches the
node: ENOTTY; a refused one gets the broker's answer). N rounds of what NVML does on each
init: open /dev/nvidia-uvm twice, UVM_INITIALIZE on the first, UVM_MM_INITIALIZE on the
second naming the first, UVM_DEINITIALIZE, close both — each call on a file opened just
before. In every round also UVM_MM_INITIALIZE naming /dev/zero (not an NVIDIA file of the
tenant's: refused by the broker every time), and UVM_INITIALIZE on /dev/null, the stand-in
uvm node's own device but not a file of the broker's (left to the kernel: ENOTTY, and
never the loop's by the node's fact). Prints one JSON line: each call's distinct
errnos, in order."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import time

import rm_escape

abi = rm_escape.ABI
N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
UVM = {s.name: (cmd, s) for cmd, s in abi.uvm_cmds.items()}
seen: dict[str, list] = {}


def uvm(label: str, fd: int, name: str, **fields) -> None:
    cmd, spec = UVM[name]
    buf = bytearray(spec.params.decode(bytes(spec.size)).replace(**fields).encode()) \
        if spec.params is not None and spec.size else None
    try:
        if buf is None:
            fcntl.ioctl(fd, cmd, 0)
        else:
            fcntl.ioctl(fd, cmd, buf, True)
        err = 0
    except OSError as e:
        err = e.errno or errno.EIO
    time.sleep(0.002)  # (the broker writes down what it settles after its answer)
    got = seen.setdefault(label, [])
    if err not in got:
        got.append(err)


for _ in range(N):
    a = os.open("/dev/nvidia-uvm", os.O_RDWR)
    b = os.open("/dev/nvidia-uvm", os.O_RDWR)
    zero = os.open("/dev/zero", os.O_RDWR)
    null = os.open("/dev/null", os.O_RDWR)
    uvm("initialize", a, "UVM_INITIALIZE")
    uvm("initialize_not_ours", null, "UVM_INITIALIZE")
    uvm("mm_initialize", b, "UVM_MM_INITIALIZE", uvmFd=a)
    uvm("mm_initialize_not_ours", b, "UVM_MM_INITIALIZE", uvmFd=zero)
    uvm("deinitialize", a, "UVM_DEINITIALIZE")
    for fd in (null, zero, b, a):
        os.close(fd)
print(json.dumps(seen), flush=True)
