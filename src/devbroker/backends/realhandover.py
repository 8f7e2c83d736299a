"""Live upgrade of the real backend: the relay process, its driver files and the
broker's own driver files pass to the successor; nothing is reopened.

What the running broker's RealBackend holds, and how each piece passes:

- the relay process (backends/relay.py) with every driver file it opened for tenants (FUSE
  sessions: RealFile.rfd are numbers in *its* fd table) and for the broker's own RM clients:
  it is not restarted. Its channels (the broker's ends of the socketpairs) pass by
  SCM_RIGHTS; the relay is told first (relaywire KEEP) to stop asking for SIGKILL at its
  parent's death, since its parent, the old broker, is about to exit. It still exits when its
  last channel closes (the successor's exit or crash). A pidfd of it passes too: the
  successor is not its parent, and waits for its exit through the pidfd;
- the tenant files of the seccomp front end (TenantFile) live in the tenants' own fd tables:
  the broker holds no reference to them after installing them (each executed call brings a
  fresh duplicate), so what passes is their description (node, key, the root clients the
  broker learnt of); the sessions' inotify watches pass with the seccomp supervisors;
- the GPU files the broker keeps open (the driver lets a process allocate a device object
  only while it holds a file of that GPU) pass by SCM_RIGHTS;
- the private-node tmpfs (tenantfile.PrivateNodes) stays mounted and is adopted as it is;
- the quota watch's RM client in the relay (VidmemMonitor) passes as its handles.

The channels must be idle when this runs: the broker has paused every front end (no call is
in flight); :func:`export_real` checks and refuses otherwise.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import select
import socket
import subprocess
from pathlib import Path
from typing import Any, Callable

from devbroker.abi import registry
from devbroker.abi.nodes import NodeKind
from devbroker.backends import relaywire as w

# What the hand-over carries of a RealBackend (or deliberately leaves, with the reason). A
# name on the live object missing here stops an upgrade (handover.check_supported).
REAL_ATTRS = frozenset({
    "version", "abi", "dev", "proc", "memblock_size", "private_dir", "_gpus", "relay",
    "relay_info", "_noticed", "_keep", "_broker_gpu_fds", "_private", "_monitor",
    "last_ns",  # the last call's driver time (a gauge)
    "notice",  # the successor's audit log
    "_executor",  # capability-less threads: the successor starts its own
    "_limiter",  # never set (None)
    "relayed_here",  # a counter: the successor's starts at 0
})
RELAY_ATTRS = frozenset({"proc", "sync", "pool", "thread_chan",  # passed (channels, pidfd)
                         "idle", "_free", "_achans",  # rebuilt (trio's wrappers: lazily)
                         "_pidfd"})  # the successor's proc carries the pidfd
REAL_FILE_FIELDS = frozenset({"node", "minor", "rfd", "path", "map_length", "closed",
                              "local_fd", "users", "lock"})  # (the last three: rebuilt)
TENANT_FILE_FIELDS = frozenset({"node", "minor", "path", "key", "install_fd", "runs_in_caller",
                                "closed", "continued_root_allocs", "adopted"})
GPU_FIELDS = frozenset({"index", "name", "uuid", "pci_bus_id", "gpu_id", "memory_bytes",
                        "device_instance"})


class RealHandoverError(Exception):
    """The real backend cannot be handed over now (the reason says why)."""


def _fields(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def unknown_state(backend) -> list[tuple[str, list[str]]]:
    """(what, names) of state a RealBackend has that this module does not carry."""
    from devbroker.backends.real import RealFile, RealGpu
    from devbroker.backends.tenantfile import TenantFile

    out = []
    relay = getattr(backend, "relay", None)
    for what, have, known in [("the real backend", set(vars(backend)), REAL_ATTRS),
                              ("the relay process", set(vars(relay)) if relay else set(),
                               RELAY_ATTRS),
                              ("a relayed file", _fields(RealFile), REAL_FILE_FIELDS),
                              ("a tenant file", _fields(TenantFile), TENANT_FILE_FIELDS),
                              ("a real GPU", _fields(RealGpu), GPU_FIELDS)]:
        extra = sorted(have - known)
        if extra:
            out.append((what, extra))
    return out


# ------------------------------------------------------------------------------ the running broker
def _files_of(broker) -> list:
    """The backend files the broker's sessions hold, each once, in a stable order."""
    seen: dict[int, Any] = {}
    for s in broker.sessions.values():
        seen.setdefault(id(s.file), s.file)
    return list(seen.values())


def export_real(backend, files: list) -> tuple[dict[str, Any], list[int]]:
    """(state, fds) of a paused RealBackend; `files` are the sessions' files (their index in
    the list is the id export_broker writes). The fds stay this process's; the caller sends
    them (SCM_RIGHTS). Tells the relay to outlive this process (KEEP)."""
    from devbroker.backends.real import RealFile

    relay = backend.relay
    threads = [relay.thread_chan] if relay.thread_chan is not None else []
    chans = [relay.sync, *relay.pool, *threads]
    if relay._free is not None and len(relay._achans) != len(relay.pool):
        raise RealHandoverError("a relayed call is in flight (or a channel broke)")
    if any(c.lock.locked() for c in chans):
        raise RealHandoverError("a synchronous relay call is in flight")
    if any(isinstance(f, RealFile) and f.users for f in files):
        raise RealHandoverError("a lane call is in flight on a relayed file")
    if relay.proc.poll() is not None:
        raise RealHandoverError(f"the relay process exited ({relay.proc.returncode})")
    err = w.parse_keep_reply(relay.sync.call(w.encode_keep, w.KEEP))
    if err:
        raise RealHandoverError(f"the relay refused to outlive this broker: "
                                f"{os.strerror(err)}")
    fds = [c.sock.fileno() for c in chans]
    pidfd = os.pidfd_open(relay.pid)
    fds.append(pidfd)  # closed by the caller's process exit (or below, when called off)
    out_files = []
    for f in files:
        if isinstance(f, RealFile):
            out_files.append({"kind": "relay", "node": int(f.node), "minor": f.minor,
                              "rfd": f.rfd, "path": f.path, "map_length": f.map_length,
                              "closed": f.closed})
        else:
            if f.install_fd >= 0:
                raise RealHandoverError("a tenant file is being installed")
            out_files.append({"kind": "tenant", "node": int(f.node), "minor": f.minor,
                              "path": f.path, "key": list(f.key), "closed": f.closed,
                              "runs_in_caller": f.runs_in_caller,
                              "continued_root_allocs": f.continued_root_allocs,
                              "adopted": sorted(f.adopted)})
    gpu_fds = list(backend._broker_gpu_fds)
    if backend._private is not None:
        backend._private.drop_nodes()  # (the successor makes spares of its own)
    monitor = None
    rm = getattr(backend._monitor, "rm", None)
    if rm is not None:
        monitor = {"ctl": rm.ctl, "client": rm.client, "next_handle": next(rm.handles),
                   "subdevices": [[i, h] for i, h in backend._monitor.subdevices.items()]}
    state = {
        "version": backend.version, "dev": backend.dev, "proc": str(backend.proc),
        "memblock_size": backend.memblock_size, "private_dir": str(backend.private_dir),
        "private": ({"dir": str(backend._private.dir), "dev": backend._private.dev,
                     "mounted": backend._private.mounted}
                    if backend._private is not None else None),
        "gpus": [dataclasses.asdict(g) for g in backend._gpus],
        "relay": {"pid": relay.pid, "channels": len(chans), "thread_chan": bool(threads),
                  "info": dataclasses.asdict(backend.relay_info)},
        "keep": list(backend._keep),
        "noticed": [list(k) if isinstance(k, tuple) else k for k in backend._noticed],
        "files": out_files,
        "monitor": monitor,
        "last_ns": getattr(backend, "last_ns", None),
        # fd positions in what follows the caller's own fds: channels, the relay's pidfd,
        # the broker's GPU files
        "fds": {"channels": len(chans), "pidfd": 1, "gpu": len(gpu_fds)},
    }
    return state, fds + gpu_fds


def release_export(fds: list[int], state: dict) -> None:
    """The upgrade was called off: close what export_real opened (the relay's pidfd)."""
    i = state["fds"]["channels"]
    try:
        os.close(fds[i])
    except OSError:
        pass


# ------------------------------------------------------------------------------ the successor
class PidfdProcess:
    """The relay as seen by a broker that is not its parent: wait() through a pidfd (the
    exit status is its reaper's, reported as 0), kill() through pidfd_send_signal."""

    def __init__(self, pid: int, pidfd: int):
        self.pid, self.pidfd = pid, pidfd
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.pidfd], [], [], 0)[0]:
            self._exited()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(["devbroker-relay"], timeout)
            self._exited()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            import signal

            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _exited(self) -> None:
        self.returncode = 0
        os.close(self.pidfd)
        self.pidfd = -1


def import_real(state: dict[str, Any], fds: list[int],
                notice: Callable[[str], None] | None = None):
    """(RealBackend, files by id) serving through the predecessor's relay. Owns the fds."""
    from devbroker.backends.real import (
        Channel, RealBackend, RealFile, RealGpu, RelayProcess, RelayRmClient, VidmemMonitor,
    )
    from devbroker.backends.tenantfile import NoCapsExecutor, PrivateNodes, TenantFile

    nfds = state["fds"]
    want = nfds["channels"] + nfds["pidfd"] + nfds["gpu"]
    if len(fds) != want:
        raise RealHandoverError(f"{len(fds)} file descriptors for the real backend, "
                                f"{want} expected")
    version = state["version"]
    registry.require_supported(version, "NVIDIA driver")
    # The channels' blocking modes are the predecessor's (O_NONBLOCK belongs to the open
    # file, shared): the synchronous one blocking, the pool ones non-blocking once trio
    # drove them. Both uses stay the same here; changing the mode would change it under a
    # predecessor that goes on serving if the upgrade is called off.
    chans = [Channel(socket.socket(fileno=fd)) for fd in fds[:nfds["channels"]]]
    pidfd = fds[nfds["channels"]]
    gpu_fds = fds[nfds["channels"] + 1:]

    relay = RelayProcess.__new__(RelayProcess)
    relay.proc = PidfdProcess(int(state["relay"]["pid"]), pidfd)
    relay.sync, relay.pool = chans[0], chans[1:]
    # the channel kept for front-end threads' blocking calls, the last one
    relay.thread_chan = relay.pool.pop() if state["relay"].get("thread_chan") else None
    relay.idle = list(relay.pool)
    relay._free = None
    relay._achans = []

    b = RealBackend.__new__(RealBackend)
    b.notice = notice or (lambda m: None)
    b.dev, b.proc, b.version = state["dev"], Path(state["proc"]), version
    b.abi = registry.get(version)
    b.memblock_size = state["memblock_size"]
    b.private_dir = Path(state["private_dir"])
    b._gpus = [RealGpu(**g) for g in state["gpus"]]
    b.relay = relay
    b.relay_info = w.Info(**state["relay"]["info"])
    b._limiter = None
    b._noticed = {tuple(k) if isinstance(k, list) else k for k in state["noticed"]}
    b._keep = list(state["keep"])
    b._broker_gpu_fds = gpu_fds
    b._private = b._executor = None
    if state["private"] is not None:
        p = PrivateNodes.__new__(PrivateNodes)  # the mount is there already: adopted
        p.dir, p.dev, p.mounted = (Path(state["private"]["dir"]), state["private"]["dev"],
                                   state["private"]["mounted"])
        p._init_pool()  # (spare nodes of the predecessor's are not carried over)
        b._private = p
        b._executor = NoCapsExecutor()
    b._monitor = None
    if state["monitor"] is not None:
        m = state["monitor"]
        rm = RelayRmClient.__new__(RelayRmClient)
        rm.backend, rm.abi, rm.relay = b, b.abi, relay
        rm.handles = itertools.count(int(m["next_handle"]), 0x10)
        rm.ctl, rm.client = int(m["ctl"]), int(m["client"])
        mon = VidmemMonitor(b)
        mon.rm, mon.subdevices = rm, {int(i): int(h) for i, h in m["subdevices"]}
        b._monitor = mon
    if state.get("last_ns") is not None:
        b.last_ns = state["last_ns"]
    files: dict[int, Any] = {}
    for i, f in enumerate(state["files"]):
        node = NodeKind(f["node"])
        if f["kind"] == "relay":
            files[i] = RealFile(node, f["minor"], f["rfd"], f["path"], f["map_length"],
                                f["closed"])
        elif f["kind"] == "tenant":
            files[i] = TenantFile(node, f["minor"], f["path"], (f["key"][0], f["key"][1]),
                                  runs_in_caller=f["runs_in_caller"], closed=f["closed"],
                                  continued_root_allocs=f["continued_root_allocs"],
                                  adopted=set(f["adopted"]))
        else:
            raise RealHandoverError(f"a file of kind {f['kind']!r}")
    unknown = unknown_state(b)
    if unknown:  # this code built something its own lists do not know: a bug here
        raise RealHandoverError(f"the adopted real backend has unknown state: {unknown}")
    info = relay.info()  # the relay answers, and it is the one we were told of
    if info.pid != relay.pid:
        raise RealHandoverError(f"the relay's channels lead to pid {info.pid}, not "
                                f"{relay.pid}")
    return b, files
