"""Tenant-side programs the end-to-end tests run inside `devbroker exec`.

Each sub-command does real syscalls on /dev/nvidia* and prints one JSON object per line.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import sys

from devbroker.abi import iowr
from devbroker.abi import status as nvs
from devbroker.tools.probe import Client, NvError


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def refusals() -> None:
    """A refused escape (errno), a refused class and a refused control (driver status)."""
    c = Client()
    c.check_version()
    c.open_root()
    gpu_id = c.attached_ids()[0]
    g = c.open_gpu(gpu_id)
    # NV_ESC_RM_ACCESS_REGISTRY: refused as an escape -> EPERM, like the driver refuses
    reg = c.abi.escape("NV_ESC_RM_ACCESS_REGISTRY").params
    buf = bytearray(reg.size)
    try:
        fcntl.ioctl(c.ctl, iowr(0x4D, reg.size), buf, True)
        out(what="registry", errno=0)
    except OSError as e:
        out(what="registry", errno=e.errno)
    # the debugger class 0x83de -> NV_ERR_INSUFFICIENT_PERMISSIONS in the status field
    try:
        c.alloc(g["hsubdevice"], 0x83DE)
        out(what="debugger", status=0)
    except NvError as e:
        out(what="debugger", status=e.status)
    # an ECC configuration control -> NV_ERR_INSUFFICIENT_PERMISSIONS
    cmd = 0x20800134
    spec = c.abi.control(cmd)
    params = spec.params.decode(bytes(spec.size)) if spec and spec.params else None
    try:
        if params is None:
            raise NvError("no params", nvs.NV_ERR_NOT_SUPPORTED)
        c.control(g["hsubdevice"], cmd, params)
        out(what="ecc", status=0)
    except NvError as e:
        out(what="ecc", status=e.status)


def hold(size: str) -> None:
    """Allocate device memory, report, and hold it until stdin closes or we are killed."""
    from devbroker.tools.probe import parse_size

    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    c.alloc_device_memory(g["hdevice"], parse_size(size))
    out(what="holding", pid=os.getpid(), client=c.hclient, memory=c.memory(g["hsubdevice"]))
    sys.stdin.read()


def ioctl_after_line() -> None:
    """Open the nodes, say ready, wait for a line, then try a control: report the errno."""
    c = Client()
    c.check_version()
    c.open_root()
    out(what="ready")
    sys.stdin.readline()
    try:
        c.attached_ids()
        out(what="after", errno=0)
    except OSError as e:
        out(what="after", errno=e.errno)


def foreign_client(handle: str) -> None:
    """Use another tenant's client handle: the broker must refuse it."""
    c = Client()
    c.check_version()
    c.open_root()
    mine = c.hclient
    c.hclient = int(handle, 0)
    try:
        c.attached_ids()
        out(what="foreign", status=0)
    except NvError as e:
        out(what="foreign", status=e.status)
    c.hclient = mine


def cuda_rules() -> None:
    """Calls CUDA makes whose treatment is decided case by case (broker/allow.py): PERF_BOOST
    (CUDA's own boost reaches the driver, any other is answered by the broker), a debugger
    object on the tenant's own context or on none, an OS event whose notifier is not one."""
    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    for name, flags, duration in (("boost-other", 0x01, 10), ("boost-cuda", 0x12, 0xFFFFFFFF)):
        try:
            c.control(g["hsubdevice"], 0x2080200A,
                      c.params(0x2080200A, flags=flags, duration=duration))
            out(what=name, status=0)
        except NvError as e:
            out(what=name, status=e.status)
    for name, app, obj in (("debugger-own", c.hclient, g["hsubdevice"]),
                           ("debugger-none", 0, 0)):
        try:
            c.alloc(g["hdevice"], 0x83DE, c.new("NV83DE_ALLOC_PARAMETERS", hAppClient=app,
                                                hClass3dObject=obj))
            out(what=name, status=0)
        except NvError as e:
            out(what=name, status=e.status)
    try:
        c.alloc(g["hsubdevice"], 0x79, c.new("NV0005_ALLOC_PARAMETERS", hParentClient=c.hclient,
                                             hSrcResource=g["hsubdevice"], hClass=0x78,
                                             notifyIndex=1, data=3))
        out(what="event-kernel-callback", status=0)
    except NvError as e:
        out(what="event-kernel-callback", status=e.status)


def own_mount_ptr() -> None:
    """Nested pointers into untouched pages mapped from the broker's own
    FUSE mount (this tenant's /dev/nvidia0; /proc/driver/nvidia/version, now a copy in the
    sandbox's tmpfs, is an ordinary read-only page). Each call runs
    on a thread with a watchdog, so a broker that hangs shows as "hang" instead of hanging
    this program. Reports one line per attempt, then "done" and waits for a line on stdin
    (still holding the mappings) before one more ordinary call."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]

    def watched(fn):
        box = {}

        def run():
            try:
                box["r"] = fn()
            except NvError as e:
                box["r"] = {"status": e.status}
            except OSError as e:
                box["r"] = {"errno": e.errno}

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(30)
        return box.get("r", {"hang": True})

    c = Client()
    c.check_version()
    c.open_root()
    hsub = c.open_gpu(c.attached_ids()[0])["hsubdevice"]
    uvm = os.open("/dev/nvidia-uvm", os.O_RDWR)
    pages = {}
    for name, path, flags, mflags in (("gpu", "/dev/nvidia0", os.O_RDWR, 0x01),
                                      ("version", "/proc/driver/nvidia/version", os.O_RDONLY,
                                       0x02)):
        fd = os.open(path, flags)
        pages[name] = libc.mmap(None, 4096, 1, mflags, fd, 0)  # PROT_READ, never touched
        os.close(fd)
    spec = c.abi.control(0x20800110)  # GET_NAME_STRING: a parameter block the broker reads
    for name, addr in pages.items():
        def control(addr=addr):
            v = c.new("NVOS54_PARAMETERS", hClient=c.hclient, hObject=hsub, cmd=0x20800110,
                      params=addr, paramsSize=spec.size)
            buf = bytearray(v.encode())
            fcntl.ioctl(c.ctl, iowr(0x2A, len(buf)), buf, True)
            return {"status": v.spec.decode(bytes(buf)).status}

        def uvm_init(addr=addr):
            if libc.ioctl(uvm, 0x30000001, addr) != 0:
                return {"errno": ctypes.get_errno()}
            return {"errno": 0}

        out(what=f"control-{name}", pid=os.getpid(), **watched(control))
        out(what=f"uvm-{name}", pid=os.getpid(), **watched(uvm_init))
    out(what="done")
    sys.stdin.readline()
    out(what="after", **watched(lambda: {"ids": len(c.attached_ids())}))


def hold_aligned(size: str, alignment: str) -> None:
    """Allocate `size` bytes with `alignment` (CUDA's flags and attributes),
    report what the driver granted and what the tenant's memory view shows, and hold it
    until stdin closes."""
    from devbroker.tools.probe import CUDA_MEM_ATTR, CUDA_MEM_FLAGS, parse_size

    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    p = c.new("NV_MEMORY_ALLOCATION_PARAMS", owner=c.hclient, type=0, flags=CUDA_MEM_FLAGS,
              attr=CUDA_MEM_ATTR, size=parse_size(size), alignment=parse_size(alignment))
    try:
        c.alloc(g["hdevice"], 0x40, p)
        out(what="holding", status=0, granted=c.last_alloc_params.size,
            memory=c.memory(g["hsubdevice"]))
    except NvError as e:
        out(what="holding", status=e.status, memory=c.memory(g["hsubdevice"]))
    sys.stdin.read()


def dup(size: str, foreign: str = "0") -> None:
    """RM_DUP_OBJECT inside the tenant: memory of client 1 duplicated under
    client 2's device; each step waits for a line on stdin so that the test can read
    `devbroker status` between them. foreign: another tenant's client handle to dup from."""
    from devbroker.tools.probe import parse_size

    def dup_call(c, parent, src_client, src_obj):
        v = c.new("NVOS55_PARAMETERS", hClient=c.hclient, hParent=parent, hObject=c.handle(),
                  hClientSrc=src_client, hObjectSrc=src_obj, flags=0)
        got = c.escape(c.ctl, "NV_ESC_RM_DUP_OBJECT", v)
        return got.status, got.hObject

    c1, c2 = Client(), Client()
    for c in (c1, c2):
        c.check_version()
        c.open_root()
    g1 = c1.open_gpu(c1.attached_ids()[0])
    g2 = c2.open_gpu(c2.attached_ids()[0])
    mem = c1.alloc_device_memory(g1["hdevice"], parse_size(size))
    status, copy = dup_call(c2, g2["hdevice"], c1.hclient, mem)
    out(what="duplicated", status=status, client1=c1.hclient, client2=c2.hclient)
    sys.stdin.readline()
    out(what="original-freed", status=c1.free(g1["hdevice"], mem))
    sys.stdin.readline()
    out(what="copy-freed", status=c2.free(g2["hdevice"], copy))
    sys.stdin.readline()
    if foreign != "0":
        status, _ = dup_call(c2, g2["hdevice"], int(foreign, 0), int(foreign, 0) + 1)
        out(what="foreign", status=status)
    # the driver's root-object case: a client handle is not an object to duplicate
    status, _ = dup_call(c2, g2["hdevice"], c1.hclient, c1.hclient)
    out(what="client-as-object", status=status)
def export_import(size: str) -> None:
    """Object export through an fd between two processes of the tenant (NCCL and
    CUDA IPC with POSIX fds): process 1 allocates device memory, exports it into a fresh
    nvidiactl file with OS_UNIX_EXPORT_OBJECTS_TO_FD, frees its own handle and passes the
    file to process 2 over a Unix socket (SCM_RIGHTS); process 2 imports it under its own
    device. Steps wait for a line on stdin so that the test can read `devbroker status`."""
    import socket

    from devbroker.tools.probe import parse_size

    def control(c, cmd, **fields):
        p = c.params(cmd, **fields)
        pbuf = ctypes.create_string_buffer(p.encode(), p.spec.size)
        v = c.new("NVOS54_PARAMETERS", hClient=c.hclient, hObject=c.hclient, cmd=cmd,
                  params=ctypes.addressof(pbuf), paramsSize=p.spec.size)
        got = c.escape(c.ctl, "NV_ESC_RM_CONTROL", v)
        return got.status, p.spec.decode(pbuf.raw[:p.spec.size])

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    pid = os.fork()
    if pid == 0:  # process 2: the importer
        a.close()
        _msg, fds, _flags, _addr = socket.recv_fds(b, 16, 1)
        c2 = Client()
        c2.check_version()
        c2.open_root()
        g2 = c2.open_gpu(c2.attached_ids()[0])
        mine = c2.handle()
        st, got = control(c2, 0x3D0C, fd=fds[0], hParent=g2["hdevice"], objects=[mine],
                          numObjects=1, index=0)
        out(what="imported", status=st, handle=got.objects[0], type=got.objectTypes[0],
            fd_seen=got.fd, fd_sent=fds[0])
        os.close(fds[0])
        sys.stdin.readline()
        out(what="import-freed", status=c2.free(g2["hdevice"], mine))
        # a file that is not one of the tenant's nvidiactl files: refused
        with open("/dev/null", "rb") as null:
            st, _ = control(c2, 0x3D0C, fd=null.fileno(), hParent=g2["hdevice"],
                            objects=[c2.handle()], numObjects=1, index=0)
        out(what="import-not-ours", status=st)
        sys.stdin.readline()
        os._exit(0)
    b.close()
    c1 = Client()
    c1.check_version()
    c1.open_root()
    g1 = c1.open_gpu(c1.attached_ids()[0])
    mem = c1.alloc_device_memory(g1["hdevice"], parse_size(size))
    # NV_ESC_ATTACH_GPUS_TO_FD (CUDA sends it in multi-GPU jobs): own GPU id, then another
    attach = {}
    for name, gid in (("own", c1.attached_ids()[0]), ("other", 0xBAD00)):
        # as CUDA sends it: the ids padded with zeros; each on a fresh ctl file (once per file)
        buf = bytearray(gid.to_bytes(4, "little") + bytes(4 * 31))
        fd = os.open("/dev/nvidiactl", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, iowr(0xD4, len(buf)), buf, True)
            attach[name] = 0
        except OSError as e:
            attach[name] = e.errno
        os.close(fd)
    out(what="attach", **attach)
    xfd = os.open("/dev/nvidiactl", os.O_RDWR | os.O_CLOEXEC)
    st, _ = control(c1, 0x3D0B, fd=xfd, hDevice=g1["hdevice"], maxObjects=1,
                    objects=[mem], numObjects=1, index=0)
    st_info, info = control(c1, 0x3D08, fd=xfd)
    out(what="exported", status=st, info_status=st_info, max_objects=info.maxObjects)
    sys.stdin.readline()
    out(what="original-freed", status=c1.free(g1["hdevice"], mem))
    socket.send_fds(a, [b"x"], [xfd])
    os.close(xfd)  # the importer's copy (and the export slot) is all that holds it now
    os.waitpid(pid, 0)
    out(what="done")


def nvml_loop(held: str = "64MiB", step: str = "2MiB") -> None:
    """NVML-style queries and allocations in a loop until a line (or EOF) on stdin.

    A line "window" on stdin prints the calls so far and the longest call since the last
    window (and starts a new one); any other line (or EOF) ends the loop, and the end report
    lists the calls of 5 ms or more since the last window (start time, duration).

    Holds `held` for the whole run, then per iteration: the memory query NVML makes
    (FB_GET_INFO_V2), an allocation of `step`, the query again, the free, the query again.
    Every answer is checked against what it must be while the tenant's other processes hold
    still: the tenant's memory used as first seen after allocating `held` (+ `step` while
    that is held). Any ioctl error, driver status
    other than NV_OK or wrong memory figure is a failure, reported with its time. Prints
    "ready" after the first iteration and, at the end, the counts and the longest single
    call (the longest pause this tenant saw)."""
    import select
    import time

    from devbroker.tools.probe import parse_size

    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    step_n = parse_size(step)
    c.alloc_device_memory(g["hdevice"], parse_size(held))
    base = c.memory(g["hsubdevice"])["used"]
    calls = iterations = 0
    failures: list[dict] = []
    longest, longest_at = 0.0, 0.0
    slow: list[list[float]] = []  # [wall-clock start, seconds] of calls of 5 ms or more

    def timed(what, fn, *a):
        nonlocal calls, longest, longest_at
        t0 = time.monotonic()
        w0 = time.time()
        try:
            return fn(*a)
        except (OSError, NvError) as e:
            failures.append({"what": what, "at": time.time(), "error": str(e),
                             "errno": getattr(e, "errno", None),
                             "status": getattr(e, "status", None)})
            return None
        finally:
            dt = time.monotonic() - t0
            calls += 1
            if dt > longest:
                longest, longest_at = dt, w0
            if dt >= 0.005 and len(slow) < 2000:
                slow.append([round(w0, 6), round(dt, 6)])

    def query(expect: int) -> None:
        m = timed("query", c.memory, g["hsubdevice"])
        if m is not None and m["used"] != expect:
            failures.append({"what": "query", "at": time.time(),
                             "error": f"used {m['used']}, expected {expect}"})

    while True:
        query(base)
        h = timed("alloc", c.alloc_device_memory, g["hdevice"], step_n)
        if h is not None:
            query(base + step_n)
            status = timed("free", c.free, g["hdevice"], h)
            if status not in (None, nvs.NV_OK):
                failures.append({"what": "free", "at": time.time(), "status": status})
            query(base)
        iterations += 1
        if iterations == 1:
            out(what="ready", pid=os.getpid())
        if select.select([sys.stdin], [], [], 0)[0]:
            line = sys.stdin.readline().strip()
            if line != "window":
                break
            # The longest call since the last window: a baseline to compare a pause with.
            out(what="window", calls=calls, longest_call_s=round(longest, 6),
                longest_at=longest_at, failed=len(failures))
            longest = 0.0
            slow.clear()
    out(what="done", iterations=iterations, calls=calls, failures=failures[:20],
        failed=len(failures), longest_call_s=round(longest, 6), longest_at=longest_at,
        slow_calls=slow, memory=c.memory(g["hsubdevice"]))


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    {"refusals": refusals, "hold": hold, "ioctl-after-line": ioctl_after_line,
     "foreign-client": foreign_client, "cuda-rules": cuda_rules,
     "own-mount-ptr": own_mount_ptr, "hold-aligned": hold_aligned, "dup": dup,
     "export-import": export_import,
     "nvml-loop": nvml_loop}[cmd](*rest)
