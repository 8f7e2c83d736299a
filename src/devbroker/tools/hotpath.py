"""Tenant-side programs of the hot-path benchmark (scripts/bench_hotpath.py).

Every program times one call: RM_CONTROL NV2080_CTRL_CMD_FB_GET_INFO_V2 (NVML's memory query)
asking for three entries, as a raw ioctl on nvidiactl with the argument built once. Setup is
the NVML-style sequence of devbroker.tools.probe (version check, root client, attached ids,
device, subdevice) and is not timed.

    python -m devbroker.tools.hotpath latency --n N [--dev DIR] [--raw]
    python -m devbroker.tools.hotpath throughput --procs P --seconds S [--dev DIR] [--raw]
    python -m devbroker.tools.hotpath quiet --n N --interval S [--dev DIR] [--wait]
    python -m devbroker.tools.hotpath flood --procs P [--dev DIR]

--raw (the floor): no setup; the same ioctl number and argument on DIR/nvidiactl of a server
that answers every ioctl as it came (scripts/bench/fuse_echo.c). Each program prints one JSON
line: `latency` and `quiet` the calls' times in ns; `throughput` the calls made by all its
processes in the window and the window's length; `flood` prints {"what": "flood-start"} once
every process is calling and runs until stdin closes or SIGTERM.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import signal
import sys
import time

from devbroker.abi import iowr

FB_GET_INFO_V2 = 0x20801303
# TOTAL_RAM_SIZE, HEAP_SIZE, HEAP_FREE: what NVML's nvmlDeviceGetMemoryInfo asks for
FB_INDICES = (0x08, 0x09, 0x16)


class OneCall:
    """An open nvidiactl and one prepared FB_GET_INFO_V2 call on it."""

    def __init__(self, dev: str, raw: bool, gpu_id: int | None = None):
        from devbroker.tools.probe import Client

        if raw:
            # The floor: nothing to set up; the server never looks at the argument.
            self.fd = os.open(f"{dev}/nvidiactl", os.O_RDWR | os.O_CLOEXEC)
            self.keep = self.params = ctypes.create_string_buffer(4096)
            self.arg = bytearray(32)
            self.cmd = iowr(0x2A, len(self.arg))  # NV_ESC_RM_CONTROL's number and size
            return
        c = self.client = Client(dev=dev)
        c.check_version()
        c.open_root()
        # gpu_id: a driver stand-in that echoes its argument cannot list attached GPUs
        gid = gpu_id if gpu_id is not None else c.attached_ids()[0]
        g = c.open_gpu(gid)
        p = c.params(FB_GET_INFO_V2)
        entries = list(p.fbInfoList)
        for i, idx in enumerate(FB_INDICES):
            entries[i] = entries[i].replace(index=idx)
        p = p.replace(fbInfoListSize=len(FB_INDICES), fbInfoList=entries)
        self.params = ctypes.create_string_buffer(p.encode(), p.spec.size)
        v = c.new("NVOS54_PARAMETERS", hClient=c.hclient, hObject=g["hsubdevice"],
                  cmd=FB_GET_INFO_V2, params=ctypes.addressof(self.params),
                  paramsSize=p.spec.size)
        self.arg = bytearray(v.encode())
        self.cmd = c.abi.escape_cmd("NV_ESC_RM_CONTROL", len(self.arg))
        self.fd = c.ctl
        self.check()  # one answered call before anything is timed

    def check(self) -> None:
        self.call()
        status = int.from_bytes(self.arg[28:32], "little")  # NVOS54.status
        if status != 0:
            raise SystemExit(f"FB_GET_INFO_V2 answered status {status:#x}")

    def call(self) -> None:
        fcntl.ioctl(self.fd, self.cmd, self.arg, True)


def _out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def latency(dev: str, n: int, raw: bool, gpu_id: int | None) -> int:
    c = OneCall(dev, raw, gpu_id)
    for _ in range(min(200, n)):  # warm: caches on both sides
        c.call()
    lat = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        c.call()
        lat.append(clock() - t0)
    _out(what="latency", ns=lat)
    return 0


def _children(procs: int, body) -> list[int]:
    pids = []
    for i in range(procs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = body(i)
            finally:
                os._exit(code)
        pids.append(pid)
    return pids


def throughput(dev: str, procs: int, seconds: float, raw: bool = False) -> int:
    """procs processes, each with its own client, calling as fast as answered; counted over
    the same window (after every process is ready)."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()

    def body(_i: int) -> int:
        c = OneCall(dev, raw)
        os.write(ready_w, b"r")
        os.read(go_r, 1)
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            for _ in range(50):
                c.call()
            n += 50
        os.write(done_w, n.to_bytes(8, "little"))
        return 0

    pids = _children(procs, body)
    for _ in range(procs):
        if os.read(ready_r, 1) != b"r":
            raise SystemExit("a caller did not start")
    t0 = time.monotonic()
    os.write(go_w, b"g" * procs)
    total = 0
    for _ in range(procs):
        total += int.from_bytes(os.read(done_r, 8), "little")
    wall = time.monotonic() - t0
    ok = all(os.waitpid(p, 0)[1] == 0 for p in pids)
    _out(what="throughput", procs=procs, calls=total, seconds=wall, ok=ok)
    return 0 if ok else 1


def quiet(dev: str, n: int, interval: float, wait: bool) -> int:
    """One call every `interval` seconds (a tenant that is not busy), n times."""
    c = OneCall(dev, False)
    for _ in range(20):
        c.call()
    if wait:
        _out(what="ready")
        sys.stdin.readline()
    lat = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        c.call()
        lat.append(clock() - t0)
        time.sleep(interval)
    _out(what="quiet", ns=lat)
    return 0


def flood(dev: str, procs: int) -> int:
    """procs busy callers until stdin closes (or SIGTERM)."""
    ready_r, ready_w = os.pipe()

    def body(_i: int) -> int:
        c = OneCall(dev, False)
        os.write(ready_w, b"r")
        while True:
            c.call()

    pids = _children(procs, body)
    for _ in range(procs):
        os.read(ready_r, 1)
    _out(what="flood-start")
    try:
        sys.stdin.read()
    except KeyboardInterrupt:
        pass
    finally:
        for p in pids:
            os.kill(p, signal.SIGKILL)
        for p in pids:
            os.waitpid(p, 0)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devbroker.tools.hotpath")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("latency", "throughput", "quiet", "flood"):
        p = sub.add_parser(name)
        p.add_argument("--dev", default="/dev")
        if name in ("latency", "quiet"):
            p.add_argument("--n", type=int, default=2000)
        if name in ("throughput", "flood"):
            p.add_argument("--procs", type=int, default=1)
        if name == "throughput":
            p.add_argument("--seconds", type=float, default=2.0)
        if name in ("latency", "throughput"):
            p.add_argument("--raw", action="store_true")
        if name == "latency":
            p.add_argument("--gpu-id", type=lambda x: int(x, 0),
                           help="the GPU's id, for a stand-in driver that cannot list them")
        if name == "quiet":
            p.add_argument("--interval", type=float, default=0.002)
            p.add_argument("--wait", action="store_true")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if a.cmd == "latency":
        return latency(a.dev, a.n, a.raw, a.gpu_id)
    if a.cmd == "throughput":
        return throughput(a.dev, a.procs, a.seconds, a.raw)
    if a.cmd == "quiet":
        return quiet(a.dev, a.n, a.interval, a.wait)
    return flood(a.dev, a.procs)


if __name__ == "__main__":
    sys.exit(main())
