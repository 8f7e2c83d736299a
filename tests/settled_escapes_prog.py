"""A tenant program of tests/test_real_lane.py's settled-escape test, against a stand-in
driver that answers every call the broker makes with 0 and leaves the argument as sent
(nvok_standin.py). N rounds of what NVML does on each init: open /dev/nvidiactl, the version
check and SYS_PARAMS on it; open /dev/nvidia0, WAIT_OPEN_COMPLETE and NUMA_INFO on it; close
both — each call on a file opened just before. In every round also a version check asking
a version the broker does not know, and SYS_PARAMS with another memory block size, which
the broker refuses (EPERM) every time, and WAIT_OPEN_COMPLETE on /dev/zero, a file of the
stand-in GPU node's device that is not one of the broker's (the kernel's answer, ENOTTY, every
time). And REGISTER_FD on the GPU file naming the round's nvidiactl (its fd number differs
from round to round: the answer must give the tenant's own number back), and naming
/dev/zero (not a file of the tenant's: refused every time). Prints one JSON line: the distinct (errno, the
argument as the call left it) of each call."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import time

from rm_escape import ABI as abi

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
try:
    HOST_BLOCK = int(open("/sys/devices/system/memory/block_size_bytes").read().strip(), 16)
except OSError:
    HOST_BLOCK = 0x8000000


def call(fd: int, name: str, **fields) -> list:
    spec = abi.escape(name)
    buf = bytearray(spec.params.decode(bytes(spec.size)).replace(**fields).encode())
    try:
        fcntl.ioctl(fd, abi.escape_cmd(name), buf, True)
        err = 0
    except OSError as e:
        err = e.errno or errno.EIO
    return [err, buf.hex()]


version = abi.version.encode()
seen: dict[str, list] = {}
held: list[int] = []
for _ in range(N):
    ctl = os.open("/dev/nvidiactl", os.O_RDWR)
    gpu = os.open("/dev/nvidia0", os.O_RDWR)
    zero = os.open("/dev/zero", os.O_RDWR)
    for label, fd, name, fields in (
            ("version", ctl, "NV_ESC_CHECK_VERSION_STR", {"versionString": version}),
            ("version_unknown", ctl, "NV_ESC_CHECK_VERSION_STR", {"versionString": b"1.2.3"}),
            ("sys_params", ctl, "NV_ESC_SYS_PARAMS", {"memblock_size": HOST_BLOCK}),
            ("sys_params_other", ctl, "NV_ESC_SYS_PARAMS", {"memblock_size": HOST_BLOCK * 2}),
            ("wait_open", gpu, "NV_ESC_WAIT_OPEN_COMPLETE", {}),
            ("numa_info", gpu, "NV_ESC_NUMA_INFO", {"nid": -1}),
            ("wait_open_not_ours", zero, "NV_ESC_WAIT_OPEN_COMPLETE", {}),
            ("register_fd", gpu, "NV_ESC_REGISTER_FD", {"ctl_fd": ctl}),
            ("register_fd_not_ours", gpu, "NV_ESC_REGISTER_FD", {"ctl_fd": zero})):
        r = call(fd, name, **fields)
        time.sleep(0.002)  # (the broker writes down what it settles after its answer)
        if name == "NV_ESC_REGISTER_FD":  # (the number differs by round: as sent, or not)
            sent = abi.escape(name).params.decode(bytes(4)).replace(**fields).encode().hex()
            r = [r[0], r[1] == sent]
        got = seen.setdefault(label, [])
        if r not in got:
            got.append(r)
    os.close(zero)
    os.close(gpu)
    os.close(ctl)
    held.append(os.open("/dev/null", os.O_RDONLY))  # (the next round's numbers: one higher)
print(json.dumps(seen), flush=True)
