"""Tenant-side programs for the noisy-neighbour test and benchmark.

    python -m devbroker.tools.noisy flood --seconds S [--threads-per-kind T] [--kinds K,...]
    python -m devbroker.tools.noisy hoard --groups G --seconds S
    python -m devbroker.tools.noisy quiet --n N [--wait]

`flood` makes every kind of request a tenant can send through the FUSE front end, each kind
in its own threads, as fast as they are answered, for S seconds: node opens, ioctls, page
reads of a node mapping (each mmap() drops the page, so every touch is a READ), reads of the
/proc view, lookups of names that do not exist (never cached), readdirs, polls, and RM
clients and objects until its limits refuse them. One JSON line at the end: counts per kind,
errors per kind.

`--kinds` picks kinds (default: all of the above); two more are only asked for by name:
`other-open` (opens of a file that is none of the broker's: through seccomp each is a
notification) and `other-mmap` (file-backed mmaps of such a file).

`hoard` holds G channel groups (the most objects its limits allow, say) and then loops on
its most expensive call: allocating one more channel group (the broker sets its compute
share, dividing the tenant's slice among all of them) and freeing it, for S seconds. One
JSON line "hoard-start" once the G are held, one at the end with the loop's count.

`quiet` runs NVML's sequence N times (version check, card info, root client, attached ids,
id info, REGISTER_FD, device, subdevice, name, UUID, framebuffer info, the /proc view's
version file, close), checks every answer against the first one's, and prints one JSON line:
the latencies of the sequences (µs) and whether every answer was right. With --wait it
prints "ready" and waits for a line on stdin before starting (the benchmark starts the flood
in between).
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import select
import sys
import threading
import time

from devbroker.tools.probe import Client, NvError

VERSION_FILE = "/proc/driver/nvidia/version"


def _out(**kw) -> None:
    print(json.dumps(kw), flush=True)


# ------------------------------------------------------------------ the quiet tenant
def nvml_sequence() -> dict:
    """One NVML-style start-up; what it saw."""
    c = Client()
    try:
        c.check_version()
        cards = [e.minor_number for e in c.card_info() if e.valid]
        c.open_root()
        gpus = []
        for gid in c.attached_ids():
            g = c.open_gpu(gid)
            gpus.append({"name": g["name"], "uuid": g["uuid"], "minor": g["minor"],
                         "memory": c.memory(g["hsubdevice"])["total"]})
        with open(VERSION_FILE) as f:
            version = f.readline().strip()
        return {"cards": cards, "gpus": gpus, "version": version}
    finally:
        c.close()


def quiet(n: int, wait: bool) -> int:
    first = nvml_sequence()  # also warms the interpreter's imports
    if wait:
        _out(what="ready")
        sys.stdin.readline()
    lat, wrong = [], []
    for i in range(n):
        t0 = time.perf_counter_ns()
        try:
            got = nvml_sequence()
        except (OSError, NvError) as e:
            got = {"error": str(e)}
        lat.append((time.perf_counter_ns() - t0) // 1000)
        if got != first:
            wrong.append({"i": i, "got": got})
    _out(what="quiet", n=n, first=first, latencies_us=lat, wrong=wrong[:5],
         all_right=not wrong and bool(first["gpus"]))
    return 0


# ------------------------------------------------------------------ the flood
class _Flood:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.counts: dict[str, int] = {}
        self.errors: dict[str, dict[str, int]] = {}
        self.lock = threading.Lock()

    def note(self, kind: str, err: str | None = None) -> None:
        with self.lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if err:
                e = self.errors.setdefault(kind, {})
                e[err] = e.get(err, 0) + 1

    def loop(self, kind: str, fn) -> None:
        while time.monotonic() < self.deadline:
            try:
                fn()
                self.note(kind)
            except OSError as e:
                self.note(kind, errno.errorcode.get(e.errno, str(e.errno)))
            except NvError as e:
                self.note(kind, f"status {e.status:#x}")


def flood(seconds: float, threads_per_kind: int, only: set[str] | None = None) -> int:
    import mmap

    f = _Flood(seconds)
    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    # (a node mapping only for page reads: through seccomp's emulated placeholder the
    # shared-data page is not a mappable file of that size)
    map_fd = c.map_shared_data(g)[0] if not only or "page-read" in only else -1
    names = iter(range(1 << 62))
    held_clients: list[int] = []

    def node_open():
        os.close(os.open("/dev/nvidiactl", os.O_RDWR))

    def ioctl():
        c.attached_ids()

    def page_read():
        m = mmap.mmap(map_fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            m[0]  # the mmap dropped the page: this is a READ to the broker
        finally:
            m.close()

    def proc_read():
        with open(VERSION_FILE, "rb") as fh:
            fh.read()

    def lookup():
        os.path.exists(f"/proc/driver/nvidia/no-such-{next(names)}")

    def readdir():
        os.listdir("/proc/driver/nvidia")

    def poll():
        p = select.poll()
        p.register(c.ctl, select.POLLIN)
        p.poll(0)

    def rm_client():
        h = c.alloc(0, 0x41, handle=0, root=0)  # a new root client, kept: the limit ends it
        held_clients.append(h)

    def rm_object():
        c.alloc(g["hsubdevice"], 0xDE, c.new("NV00DE_ALLOC_PARAMETERS"))

    other = os.open(sys.executable, os.O_RDONLY)

    def other_open():
        os.close(os.open(sys.executable, os.O_RDONLY))

    def other_mmap():
        mmap.mmap(other, 4096, mmap.MAP_SHARED, mmap.PROT_READ).close()

    kinds = {"open": node_open, "ioctl": ioctl, "page-read": page_read,
             "proc-read": proc_read, "lookup": lookup, "readdir": readdir, "poll": poll,
             "rm-client": rm_client, "rm-object": rm_object}
    extra = {"other-open": other_open, "other-mmap": other_mmap}
    if only:
        kinds = {k: fn for k, fn in {**kinds, **extra}.items() if k in only}
    _out(what="flood-start", t=time.time())
    threads = [threading.Thread(target=f.loop, args=(k, fn), daemon=True)
               for k, fn in kinds.items() for _ in range(threads_per_kind)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _out(what="flood", counts=f.counts, errors=f.errors, t=time.time())
    return 0


def hoard(groups: int, seconds: float) -> int:
    """Hold `groups` channel groups, then allocate and free one more in a loop."""
    from devbroker.tools.sched_probe import Groups

    gs = Groups()
    for _ in range(groups):
        gs.alloc()
    _out(what="hoard-start", groups=len(gs.handles), t=time.time())
    deadline, loops, errors = time.monotonic() + seconds, 0, {}
    while time.monotonic() < deadline:
        try:
            h = gs.alloc()
            gs.handles.pop()
            st = gs.c.free(gs.g["hdevice"], h)
            if st:
                errors[f"free {st:#x}"] = errors.get(f"free {st:#x}", 0) + 1
            loops += 1
        except (OSError, NvError) as e:
            key = str(getattr(e, "status", e))
            errors[key] = errors.get(key, 0) + 1
    _out(what="hoard", groups=len(gs.handles), loops=loops, errors=errors, t=time.time())
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devbroker.tools.noisy")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("flood")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--threads-per-kind", type=int, default=1)
    p.add_argument("--kinds", default="", help="comma-separated kinds (default: all)")
    p = sub.add_parser("hoard")
    p.add_argument("--groups", type=int, default=100)
    p.add_argument("--seconds", type=float, default=5.0)
    p = sub.add_parser("quiet")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--wait", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "flood":
        return flood(a.seconds, a.threads_per_kind,
                     {k for k in a.kinds.split(",") if k} or None)
    if a.cmd == "hoard":
        return hoard(a.groups, a.seconds)
    return quiet(a.n, a.wait)


if __name__ == "__main__":
    sys.exit(main())
