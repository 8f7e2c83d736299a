"""Is a root client's RM_FREE slower when another process makes it (issue 14: through the
native loop NVML's three root frees cost ~320 µs each over the driver's ~360 µs)?

One plain process on the H200, no broker: N times, a root client with a device and a
subdevice under it (NVML's shape) is freed (a) by the process that allocated it, (b) by a
forked child on the inherited file (as the broker frees it on its duplicate of the tenant's
file), (c) by the same process after a child made two controls on it; and the time of one
control (SYSTEM_GET_FEATURES) by the owner, and by the child the first and second time.
Prints one JSON line with the p50/min of each (µs).
    python3 scripts/gpu/free_probe.py [N]"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import statistics
import struct
import sys
import time

KEEP = []


def iowr(nr, size):
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


def ioctl(fd, nr, buf):
    b = bytearray(buf)
    fcntl.ioctl(fd, iowr(nr, len(b)), b, True)
    return bytes(b)


def alloc(fd, root, parent, new, cls, params=None):
    p = 0
    if params is not None:
        cb = ctypes.create_string_buffer(bytes(params), len(params))
        KEEP.append(cb)
        p = ctypes.addressof(cb)
    out = ioctl(fd, 0x2B, struct.pack("<IIIIQQIII4x", root, parent, new, cls, p, 0, 0, 0, 0))
    r = struct.unpack("<IIIIQQIII4x", out)
    return r[2], r[8]


def control(fd, client, obj, cmd, params):
    cb = ctypes.create_string_buffer(bytes(params), len(params))
    out = ioctl(fd, 0x2A, struct.pack("<IIIIQII", client, obj, cmd, 0, ctypes.addressof(cb),
                                      len(params), 0))
    return struct.unpack("<IIIIQII", out)[6], bytes(cb.raw)


def free(fd, client, parent, obj):
    t0 = time.perf_counter_ns()
    st = struct.unpack("<IIII", ioctl(fd, 0x29, struct.pack("<IIII", client, parent, obj, 0)))[3]
    return st, (time.perf_counter_ns() - t0) / 1e3


def timed_control(ctl, client) -> float:
    """One SYSTEM_GET_FEATURES on the client (µs)."""
    t0 = time.perf_counter_ns()
    control(ctl, client, client, 0x1F0, bytes(4))
    return (time.perf_counter_ns() - t0) / 1e3


def in_child(fn):
    """fn() in a forked child (another process on the same open file); its JSON result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, json.dumps(fn()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    got = json.loads(os.read(r, 200))
    os.close(r)
    os.close(w)
    return got


def client_with_device(ctl, inst):
    hc, st = alloc(ctl, 0, 0, 0, 0x41)
    hd, _ = alloc(ctl, hc, hc, 0, 0x80, struct.pack("<I52x", inst))
    alloc(ctl, hc, hd, 0, 0x2080, struct.pack("<I", 0))
    return hc


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    ctl = os.open("/dev/nvidiactl", os.O_RDWR)
    hc, _ = alloc(ctl, 0, 0, 0, 0x41)
    _st, ids = control(ctl, hc, hc, 0x201, bytes([0xFF]) * 128)
    gid = struct.unpack("<32I", ids)[0]
    _st, info = control(ctl, hc, hc, 0x205, struct.pack("<I28x", gid))
    inst = struct.unpack_from("<I", info, 8)[0]
    gpu = os.open("/dev/nvidia0", os.O_RDWR)
    ioctl(gpu, 201, struct.pack("<i", ctl))
    out = {}
    same, cross, after_child = [], [], []
    own_first, child_first, child_second = [], [], []
    for _ in range(n):
        c = client_with_device(ctl, inst)
        st, us = free(ctl, c, c, c)
        same.append(us)
        c = client_with_device(ctl, inst)
        cross.append(in_child(lambda: free(ctl, c, c, c)[1]))
        c = client_with_device(ctl, inst)
        own_first.append(timed_control(ctl, c))
        first, second = in_child(lambda: [timed_control(ctl, c), timed_control(ctl, c)])
        child_first.append(first)
        child_second.append(second)
        st, us = free(ctl, c, c, c)
        after_child.append(us)
    for k, v in (("same_process", same), ("forked_child", cross),
                 ("same_after_child_control", after_child),
                 ("control_by_owner", own_first), ("control_by_child_first", child_first),
                 ("control_by_child_second", child_second)):
        out[k] = {"p50_us": round(statistics.median(v), 1), "min_us": round(min(v), 1)}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
