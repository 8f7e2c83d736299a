"""The tenant side of the escape tests; runs inside a tenant sandbox.

    python -m devbroker.escape.tenant ATTACK_ID...     one JSON line per attack
    python -m devbroker.escape.tenant --victim         hold a client + memory, hand out fds
    python -m devbroker.escape.tenant --flood N [--threads T]
    python -m devbroker.escape.tenant --calls N [--wait]   (--wait: "calls-ready", then a
                                                         line on stdin before calling)

The attacker's context (the victim's handles, the broker's pid, ...) comes as JSON in the
environment variable DEVBROKER_ESCAPE_CTX (see attacks.Ctx).
"""
from __future__ import annotations

import argparse
import array
import ctypes
import json
import os
import socket
import sys
import threading
import time
import traceback


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def run_attacks(ids: list[str]) -> int:
    from devbroker.escape.attacks import BY_ID, Ctx, Outcome

    ctx = Ctx.from_json(os.environ.get("DEVBROKER_ESCAPE_CTX", ""))
    for aid in ids:
        attack = BY_ID.get(aid)
        if attack is not None:  # a front end's own variant (the guest's, say) where it has one
            attack = attack.for_frontend(ctx.frontend)
        t0 = time.time()
        if attack is None:
            o = Outcome("error", "", f"no attack {aid!r}")
        else:
            try:
                o = attack.fn(ctx)
            except Exception as e:  # an attack that crashes is a harness error, not a refusal
                o = Outcome("error", type(e).__name__,
                            f"{e}: {traceback.format_exc(limit=3)[-400:]}")
        out(id=aid, t0=t0, t1=time.time(), pid=os.getpid(), **o.to_dict())
    return 0


MAP_SECRET = b"victim's mapped page"


def victim(sock_name: str, alloc: int) -> int:
    """Hold a client, a device-memory allocation on every GPU, and hand the fds out."""
    from devbroker.tools.probe import Client, NvError

    c = Client()
    # Handles of its own numbering: the attacker's Client counts from 0xA55A0000, and the
    # same number in the attacker's own client would be the attacker's own object.
    c._next = 0xB1C70000
    c.check_version()
    c.open_root()
    gpus = {}
    first = None
    shared = None  # the status of the victim's RM_SHARE (below)
    for gid in c.attached_ids():
        g = c.open_gpu(gid)
        hmem = c.alloc_device_memory(g["hdevice"], alloc)
        gpus[str(g["minor"])] = gid
        if first is None:
            first = dict(g, hmemory=hmem)
            # Shared with everyone (RS_SHARE_TYPE_ALL, the DUP_OBJECT right), as CUDA IPC
            # shares memory: the driver would now let any client duplicate it, so the
            # dup-object attack tests the broker's own refusal.
            share = c.new("NVOS57_PARAMETERS", hClient=c.hclient, hObject=hmem,
                          sharePolicy={"target": 0, "accessMask": {"limbs": [1]},
                                       "type": 1, "action": 0})
            shared = c.escape(c.ctl, "NV_ESC_RM_SHARE", share).status
    # The page NVML maps (RM shared data), faulted in and written: the page cache now holds
    # it. Handed out too (another tenant mapping this file must not see
    # it). Best effort: a front end without node mappings (CUSE) has no such file.
    extra: dict = {}
    try:
        map_fd = c.map_shared_data_fd(first)
        # mmap(2) itself (Python's mmap checks the size of a regular file first, and the
        # seccomp front end's placeholder is an empty memfd until the broker fills it).
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        addr = libc.mmap(None, 2608, 3, 1, map_fd, 0)  # PROT_RW, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap of the shared-data page")
        ctypes.memmove(addr, MAP_SECRET, len(MAP_SECRET))
        extra = {"map_fd_index": 1 + len(c.gpu_fds), "map_secret": MAP_SECRET.decode()}
    except (OSError, ValueError, NvError) as e:
        map_fd, extra = -1, {"map_error": str(e)}
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + sock_name)
    srv.listen(8)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            fds = array.array("i", [c.ctl, *c.gpu_fds.values()]
                              + ([map_fd] if map_fd >= 0 else []))
            try:
                conn.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
            finally:
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    out(what="victim", pid=os.getpid(), client=c.hclient, hdevice=first["hdevice"],
        hsubdevice=first["hsubdevice"], hmemory=first["hmemory"], gpu_ids=gpus,
        sock=sock_name, shared=shared, **extra)
    sys.stdin.read()
    return 0


def _client():
    from devbroker.tools.probe import Client

    c = Client()
    c.check_version()
    c.open_root()
    return c


def flood(n: int, threads: int) -> int:
    """n cheap controls from `threads` threads as fast as the broker answers."""
    c = _client()
    left = [n]
    lock = threading.Lock()
    out(what="flood-start", t=time.time())

    def go():
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            c.attached_ids()

    ts = [threading.Thread(target=go) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out(what="flood-done", t=time.time(), n=n)
    return 0


def calls(n: int, wait: bool = False) -> int:
    c = _client()
    if wait:  # start-up (slow in the QEMU guest) is not part of the race with the flood
        out(what="calls-ready", t=time.time())
        sys.stdin.readline()
    t0 = time.time()
    for _ in range(n):
        c.attached_ids()
    out(what="calls-done", t0=t0, t=time.time(), n=n)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devbroker.escape.tenant")
    ap.add_argument("--victim", metavar="SOCK", help="run as the victim (abstract socket name)")
    ap.add_argument("--alloc", type=int, default=64 << 20)
    ap.add_argument("--flood", type=int, metavar="N")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--calls", type=int, metavar="N")
    ap.add_argument("--wait", action="store_true", help="--calls: wait for a line on stdin")
    ap.add_argument("ids", nargs="*")
    a = ap.parse_args(argv)
    if a.victim:
        return victim(a.victim, a.alloc)
    if a.flood:
        return flood(a.flood, a.threads)
    if a.calls:
        return calls(a.calls, a.wait)
    return run_attacks(a.ids)


if __name__ == "__main__":
    sys.exit(main())
