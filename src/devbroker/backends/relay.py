"""The relay process: runs the real backend's ioctls and mmaps, holding no capabilities.

Started by RealBackend as `python -m devbroker.backends.relay --fds A,B,... [--uid U]`.
Before it serves anything it drops every capability (bounding set included), switches to an
unprivileged uid/gid (65534 unless told otherwise), sets no_new_privs, makes itself
non-dumpable (no ptrace by that uid) and asks for SIGKILL when the broker dies. The driver
evaluates capable(CAP_SYS_ADMIN) of the caller at every ioctl (BRIEF §3), so a tenant's call
relayed from here is never privileged, whatever the broker itself holds.

Each inherited socket is one channel served by one thread; a channel carries one request at
a time (relaywire). The driver fds are this process's own: fd arguments the broker puts in
an argument are numbers in *this* fd table, and nested buffers live in this process's
memory. When every channel is closed (the broker exited or crashed) the process exits and
the kernel closes the fds, which frees every RM client they held.

Everything it needs is imported before the privilege drop: after it, the uid may not be
able to read the source tree.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import mmap
import os
import signal
import socket
import struct
import sys
import threading
import time

from devbroker.backends import relaywire as w
from devbroker.sandbox import linux

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int

def status_caps() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb"):
                out[k] = int(v.strip(), 16)
    return out


def drop_privileges(uid: int | None, gid: int | None) -> None:
    """Drop every capability for good; switch uid/gid when given. Raises on any failure."""
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the broker died before we got here
        os._exit(0)
    caps = status_caps()
    if caps.get("CapEff"):
        for cap in range(linux.last_cap() + 1):
            try:
                linux.prctl(linux.PR_CAPBSET_DROP, cap)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        try:
            linux.prctl(linux.PR_CAP_AMBIENT, linux.PR_CAP_AMBIENT_CLEAR_ALL)
        except OSError:
            pass
        if gid is not None:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
        if uid is not None:
            os.setresuid(uid, uid, uid)
        linux.capset(0, 0, 0)
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
    linux.prctl(linux.PR_SET_DUMPABLE, 0)
    caps = status_caps()
    if caps.get("CapEff") or caps.get("CapPrm"):
        raise OSError(errno.EPERM, f"capabilities remain after the drop: {caps}")


def run_ioctl(req: w.IoctlRequest) -> w.IoctlReply:
    """Run one prepared ioctl in this process: the buffers are copied into fresh memory of
    ours and chained by their pointer offsets (the caller has refused every other pointer).
    Also used by the broker's capability-less driver threads (backends/tenantfile.py)."""
    bufs = [ctypes.create_string_buffer(b.data, max(len(b.data), 1)) for b in req.buffers]
    for i, b in enumerate(req.buffers[1:], 1):
        struct.pack_into("<Q", bufs[b.parent], b.ptr_offset, ctypes.addressof(bufs[i]))
    t0 = time.monotonic_ns()
    ret = _libc.ioctl(req.fd, req.cmd, ctypes.addressof(bufs[0]))
    err = ctypes.get_errno() if ret < 0 else 0
    ns = time.monotonic_ns() - t0
    out = [bufs[i].raw[:len(b.data)] for i, b in enumerate(req.buffers)]
    return w.IoctlReply(ret, err, ns, out)


class Relay:
    def __init__(self) -> None:
        self.maps: dict[int, tuple[int, mmap.mmap]] = {}
        self.lock = threading.Lock()

    # -- requests
    def do_open(self, path: str, flags: int) -> tuple[int, int]:
        try:
            return os.open(path, (flags & (os.O_RDWR | os.O_WRONLY | os.O_NONBLOCK))
                           | os.O_CLOEXEC), 0
        except OSError as e:
            return -1, e.errno or errno.EIO

    def do_close(self, fd: int) -> int:
        with self.lock:
            m = self.maps.pop(fd, None)
        if m is not None:
            m[1].close()
        try:
            os.close(fd)
        except OSError as e:
            return e.errno or errno.EIO
        return 0

    def do_ioctl(self, req: w.IoctlRequest) -> w.IoctlReply:
        return run_ioctl(req)

    def do_mapread(self, fd: int, maplen: int, offset: int, length: int) -> tuple[int, bytes]:
        with self.lock:
            m = self.maps.get(fd)
            if m is None or m[0] != maplen:
                if m is not None:
                    m[1].close()
                try:
                    mm = mmap.mmap(fd, maplen, mmap.MAP_SHARED, mmap.PROT_READ, offset=0)
                except OSError as e:
                    self.maps.pop(fd, None)
                    return e.errno or errno.EIO, b""
                m = self.maps[fd] = (maplen, mm)
        end = min(offset + length, maplen)
        data = m[1][offset:end] if offset < end else b""
        return 0, data + bytes(length - len(data))

    def do_keep(self) -> int:
        """A live upgrade hands this relay to the broker's successor: the broker that
        started it exits, the relay goes on. Its channels (now the successor's) still end it:
        when the last one closes, the process exits (main). Runs on the main thread (the
        synchronous channel's), whose setting the parent-death signal is."""
        if threading.current_thread() is not threading.main_thread():
            return errno.EINVAL
        try:
            linux.prctl(linux.PR_SET_PDEATHSIG, 0)
        except OSError as e:
            return e.errno or errno.EIO
        return 0

    def do_info(self) -> w.Info:
        caps = status_caps()
        try:
            nfds = len(os.listdir("/proc/self/fd"))
        except OSError:
            nfds = 0
        return w.Info(os.getpid(), os.getuid(), os.getgid(), nfds, caps.get("CapEff", 0),
                      caps.get("CapPrm", 0), caps.get("CapBnd", 0),
                      linux.prctl(linux.PR_GET_NO_NEW_PRIVS))

    def handle(self, f: w.Frame) -> bytes:
        try:
            if f.type == w.OPEN:
                fd, err = self.do_open(*w.parse_open(f.payload))
                return w.reply_open(f.id, fd, err)
            if f.type == w.CLOSE:
                return w.reply_close(f.id, self.do_close(w.parse_close(f.payload)))
            if f.type == w.IOCTL:
                return w.reply_ioctl(f.id, self.do_ioctl(w.parse_ioctl(f.payload)))
            if f.type == w.MAPREAD:
                err, data = self.do_mapread(*w.parse_mapread(f.payload))
                return w.reply_mapread(f.id, err, data)
            if f.type == w.INFO:
                return w.reply_info(f.id, self.do_info())
            if f.type == w.KEEP:
                return w.reply_keep(f.id, self.do_keep())
            return w.reply_error(f.id, f"unknown request type {f.type}")
        except w.WireError as e:
            return w.reply_error(f.id, str(e))

    def serve(self, sock: socket.socket) -> None:
        dec = w.FrameDecoder()
        # One receive buffer for the channel's life: a fresh 1 MiB recv per request was
        # mapped and unmapped each time.
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                n = sock.recv_into(buf)
                if not n:
                    return
                for f in dec.feed(view[:n]):
                    sock.sendall(self.handle(f))
        except (OSError, w.WireError):
            return
        finally:
            sock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="devbroker-relay")
    ap.add_argument("--fds", required=True, help="comma-separated channel socket fds")
    ap.add_argument("--uid", type=int, default=65534)
    ap.add_argument("--gid", type=int, default=65534)
    ap.add_argument("--keep-uid", action="store_true",
                    help="stay at the current uid (capabilities are dropped regardless)")
    args = ap.parse_args(argv)
    socks = [socket.socket(fileno=int(x)) for x in args.fds.split(",")]
    try:
        drop_privileges(None if args.keep_uid else args.uid,
                        None if args.keep_uid else args.gid)
    except OSError as e:
        print(f"devbroker-relay: cannot drop privileges: {e}", file=sys.stderr)
        return 3
    relay = Relay()
    threads = [threading.Thread(target=relay.serve, args=(s,), daemon=True) for s in socks[1:]]
    for t in threads:
        t.start()
    # The first (synchronous) channel is served on the main thread: the parent-death signal
    # is the main thread's setting, and KEEP (Relay.do_keep) must clear it there.
    relay.serve(socks[0])
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
