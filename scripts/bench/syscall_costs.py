#!/usr/bin/env python3
"""What the primitives of the broker's hot path cost on this host, from Python (one line of
JSON): the system calls a seccomp listener makes per control (statx of /proc/<tid>/fd/<n>,
process_vm_readv, pidfd_getfd + close, NOTIF_ID_VALID-sized ioctls) and Python's own per-call
overhead. Hosts differ by 2x and more in syscall cost (mitigations, virtualisation, CPU); the
lane's per-phase counters (SupervisorStats.lane_ns_*) are read against these.

    python3 scripts/bench/syscall_costs.py [--n 20000]
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import signal
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from devbroker.broker import procmem  # noqa: E402
from devbroker.broker.procinfo import stat_nosync  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    a = ap.parse_args()
    pid = os.getpid()
    buf = ctypes.create_string_buffer(4096)
    addr = ctypes.addressof(buf)
    fd = os.open("/dev/null", os.O_RDWR)
    pfd = os.pidfd_open(pid)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    arg = bytearray(32)
    out = {}

    def t(name, f):
        f()
        t0 = time.perf_counter_ns()
        for _ in range(a.n):
            f()
        out[name] = round((time.perf_counter_ns() - t0) / a.n / 1000, 2)

    def enotty():
        try:
            fcntl.ioctl(fd, 0xC020462A, arg, True)
        except OSError:
            pass
    t("getpid_us", os.getpid)
    t("statx_proc_fd_us", lambda: stat_nosync(f"/proc/{pid}/fd/{fd}"))
    t("vm_read_32_us", lambda: procmem.vm_read(pid, addr, 32))
    t("vm_write_many_2_us", lambda: procmem.vm_write_many(pid, [(addr, b"x" * 32),
                                                               (addr + 64, b"y" * 32)]))
    t("pidfd_signal_us", lambda: signal.pidfd_send_signal(pfd, 0))
    t("pidfd_getfd_close_us", lambda: os.close(libc.syscall(438, pfd, fd, 0)))
    t("ioctl_enotty_us", enotty)
    t("struct_unpack_us", lambda: struct.unpack_from("=IIIIQII", arg))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
