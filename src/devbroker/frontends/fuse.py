"""FUSE front end: the broker's device nodes as files of a raw-protocol FUSE mount.

A thin adapter around the sans-IO codec in :mod:`devbroker.frontends.fusewire`: it
mounts with mount(2) on a /dev/fuse descriptor (no libfuse, no fusermount), reads requests
on reader threads that answer node ioctls themselves (the broker's steps, fairly between
tenants) and hand everything else to the trio thread, answers file-system metadata itself
from a tree the broker keeps up to date, and turns OPEN / IOCTL / READ / RELEASE on node
files into broker requests. See docs/fuse.md for the reasoning behind each choice.

Layout served::

    <mount>/<tenant>/nvidiactl, nvidia0..N-1, nvidia-uvm, nvidia-uvm-tools   (nodes)
    <mount>/<tenant>/proc/driver/nvidia/...                                 (static files)
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import select
import signal
import stat
import struct
import threading
import time
from contextlib import AsyncExitStack
import functools
from dataclasses import dataclass, field
from typing import Mapping

import trio

from devbroker.abi.nodes import NodeKind
from devbroker.broker import laneexec, limits, memgate
from devbroker.backends.base import NotHere
from devbroker.backends.tenantfile import drop_driver_capabilities_for_thread
from devbroker.broker.effects import (
    Await, HandOver, RateLimit, ReadMemory, Steps, WriteMemory, perform_async, perform_blocking,
    run_async, run_blocking,
)
from devbroker.broker.procinfo import pid_namespace
from devbroker.broker.interface import (
    BrokerInterface,
    Caller,
    IoctlRequest,
    MapReadRequest,
    OpenRequest,
    ProcessMemory,
    ReleaseRequest,
)
from devbroker.frontends import fusenative
from devbroker.frontends import fusewire as w
from devbroker.frontends.common import (
    GENERAL, WHOAMI_IOCTL, control_lane_of, name_os_thread, sanitize_errno, start_task,
    to_trio,
)
from devbroker.frontends.fusetree import Content, NodeSpec, TenantTree, desired, render
from devbroker.frontends.fusetree import split as split_path
from devbroker.frontends.procmem import pidfd_getfd

log = logging.getLogger(__name__)

# Node files claim to be this large so that a MAP_SHARED mapping of any sensible size
# never lies beyond EOF (which would SIGBUS on access) — the driver's nodes have no size.
NODE_SIZE = 1 << 40


# fh values of our own handles (static files, directories) live above every plausible
# broker session id, so node fhs can simply *be* the session id.
_PRIVATE_FH_BASE = 1 << 62

PIDFD_THREAD = os.O_EXCL  # Linux 6.9: a pidfd for a (non-leader) thread

_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MNT_DETACH = 0x2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

# --- the FUSE file system's inodes and open handles ------------------------------------------
@dataclass(eq=False)
class _Inode:
    nodeid: int
    kind: str  # "dir" | "node" | "file"
    parent: int
    name: bytes
    tenant: str | None
    node: NodeSpec | None = None
    content: Content | None = None
    children: dict[bytes, "_Inode"] = field(default_factory=dict)
    nlookup: int = 0
    removed: bool = False


@dataclass(eq=False)
class _Handle:
    kind: str  # "node" | "file" | "dir"
    inode: _Inode
    session: int = 0
    data: bytes = b""  # static file snapshot
    listing: list = field(default_factory=list)  # directory snapshot
    served_pages: bool = False
    poll_kh: int | None = None
    # Who opened a node file: a request on it from another sandbox means the file was
    # passed out, and from then on it serves no page to anyone.
    opener: Caller | None = None
    opener_ns: str | None = None
    passed: bool = False


# --- helpers ------------------------------------------------------------------------------
def _tgid_of(tid: int) -> int:
    """The thread group (process) of a thread id, 0 when it is gone."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    m = re.search(rb"^Tgid:\s*(\d+)", data, re.M)
    return int(m.group(1)) if m else 0


_OCTAL = re.compile(r"\\([0-7]{3})")


def _mounts_at(path: str) -> list[str]:
    """File system types mounted exactly at path in this mount namespace (bottom first)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) < 5:
                continue
            mp = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
            if mp == path:
                out.append(right.split()[0] if right else "")
    return out


def _umount_detach(path: str) -> None:
    if _libc.umount2(path.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount2({path}): {os.strerror(err)}")


def detach_stale_mount(path: str) -> int:
    """Lazily unmount dead FUSE mounts stacked at path (left by a broker that died).

    A mount counts as dead when statfs() on it fails with ENOTCONN (its server is gone).
    statfs, not stat: FUSE always forwards statfs, while stat may be answered from the
    attribute cache of a connection that is already dead.
    A live FUSE mount there is not ours to take over: EBUSY. Returns how many were removed.
    """
    removed = 0
    for _ in range(16):
        types = _mounts_at(path)
        if not types or not types[-1].startswith("fuse"):
            return removed
        try:
            os.statvfs(path)
        except OSError as e:
            if e.errno != errno.ENOTCONN:
                raise
            _umount_detach(path)
            removed += 1
            continue
        raise OSError(errno.EBUSY, f"a live FUSE file system is mounted at {path}")
    return removed


# --- the front end ------------------------------------------------------------------------

class _Undecided(BaseException):
    """An ioctl's wait for its pace token was ended by a live upgrade: nothing of it was
    decided; the successor (or this front end, when the upgrade is called off) decides it
    from the start. A BaseException, so that no step's `except Exception` keeps it."""

class FuseFrontend:
    """Serve tenants' node directories on a FUSE mount, forwarding to ``broker``.

    ``async with FuseFrontend(mountpoint, broker, tenants) as fe:`` mounts (detaching a
    stale mount of a dead broker first) and serves until the block exits, then unmounts
    (MNT_DETACH) and closes /dev/fuse, which fails tenants' further calls with ENOTCONN.

    The tree changes at run time through :meth:`set_tenants`, :meth:`put_tenant` and
    :meth:`remove_tenant`; the kernel's caches are invalidated for what changed.
    """

    def __init__(self, mountpoint: str | os.PathLike, broker: BrokerInterface,
                 tenants: Mapping[str, TenantTree] | None = None, *,
                 entry_ttl: float = 1.0, attr_ttl: float = 1.0,
                 max_write: int = 128 * 1024, init_timeout: float = 10.0,
                 adopt: tuple[int, dict] | None = None):
        """adopt=(fd, state): serve a mount another broker process made (live upgrade,
        broker/handover.py): the /dev/fuse fd it passed and its export_state()."""
        self.mountpoint = os.path.abspath(os.fspath(mountpoint))
        self.broker = broker
        self._lane, self._lane_cmds = control_lane_of(broker)  # broker/fastlane.py
        self.entry_ttl = entry_ttl
        self.attr_ttl = attr_ttl
        self.max_write = max_write
        self.init_timeout = init_timeout
        self.st_dev: int | None = None
        self.proto_minor = 0
        self._fd = -1
        self._mounted = False
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._init_done = trio.Event()
        self._serve_done = trio.Event()
        self._closed = False
        self._mtime = int(time.time())
        self._next_nodeid = w.ROOT_ID + 1
        self._next_private_fh = _PRIVATE_FH_BASE
        self._root = _Inode(w.ROOT_ID, "dir", w.ROOT_ID, b"", None, nlookup=1)
        self._inodes: dict[int, _Inode] = {w.ROOT_ID: self._root}
        self._handles: dict[int, _Handle] = {}
        # Handles of /proc view files and directories each tenant holds (not broker
        # sessions: the broker never sees them), bounded by its open-files limit.
        self._private_held: dict[str, int] = {}
        # Node files are opened FOPEN_DIRECT_IO when the kernel lets such files be mapped
        # shared (FUSE_DIRECT_IO_ALLOW_MMAP, Linux 6.6): every mmap() of one then drops the
        # inode's cached pages first (see _on_open).
        self.node_direct_io = False
        self._sessions_by_pollkh: dict[int, int] = {}
        self._pending_notify: list[bytes] = []
        # The read buffer must hold the largest request: a WRITE of max_write or an
        # ioctl argument of max_pages pages, plus headers.
        self._max_pages = 32
        self._bufsize = max(max_write, self._max_pages * 4096) + 4096
        # Live upgrade: pause() parks the readers and waits for the requests in flight.
        self._inflight = 0
        self._idle = trio.Event()
        self._idle.set()
        self._pause_requested = False
        self._parked = trio.Event()
        self._handed_over = False
        self._adopted = adopt
        # Requests waiting for a token of their tenant's pace, which a live upgrade does
        # not wait for (a tenant flooding at its limit froze every tenant for the drain
        # timeout, then the upgrade was called off). Nothing of them has been decided: the
        # wait is the first thing of a decision. Ioctls (whose decisions may call the
        # driver): their waits by unique; the pause ends them and they go to the successor
        # undecided (`_undecided`, their messages re-encoded), which answers them on the
        # same connection, where the kernel still waits for a reply with that unique (or
        # this front end decides them again if the upgrade is called off). Every other
        # paced request (lookups, stats, opens, page reads, polls): cheap to decide, so the
        # pause ends their waits (limits.PaceSkips) and they are answered at once, unpaced.
        self._pace_waiters: dict[int, trio.CancelScope] = {}
        self._pace_skips = limits.PaceSkips()
        self._undecided: list[w.Ioctl] = []
        # Reader threads (see "serving" below): requests read and waiting, by tenant; the
        # threads' own duplicate of /dev/fuse and the eventfd that wakes them.
        self._queue = limits.FairQueue()
        self._tlock = threading.Lock()
        self._live = 0  # reader threads running
        self._leaving = 0  # threads `_surplus` let go that have not counted themselves out
        self._parked_threads = 0
        self._thread_busy = 0  # ioctls read by a thread and not yet answered or handed over
        self._handed = 0  # requests a thread passed to the trio thread, not yet taken up
        self._serving: dict[int, list] = {}  # thread id -> [unique, since, answered]
        self._resume_cond = threading.Condition(self._tlock)
        self._tfd = -1
        self._tfd_refs = 0
        self._wake = -1
        self._token = None
        self._conn_ended: trio.Event | None = None
        self._spare_until = 0.0  # see spare_keep
        # thread id -> (thread pidfd, tgid, pid namespace): see _caller
        self._callers: dict[int, tuple[int, int, str | None]] = {}
        self._callers_lock = threading.Lock()
        # The reader threads' native loop (frontends/fusenative.py), None: the Python one.
        # It must know the node inodes before the tree is built below.
        self._native = fusenative.FuseNative.create()
        self._native_threads: dict[int, fusenative.FuseNativeThread] = {}  # thread id ->
        self.native_lane_calls = 0  # lane calls the native loop answered (tests, status)
        if adopt is not None:
            self._import_state(*adopt)
        if tenants:
            self._apply({k: v if isinstance(v, TenantTree) else TenantTree.from_dict(v)
                         for k, v in tenants.items()})
            self._pending_notify.clear()

    # ---- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> "FuseFrontend":
        if self._adopted is None:
            # Mount before the nursery exists so that a refusal (EBUSY, EPERM) reaches the
            # caller as a plain OSError rather than inside an exception group.
            await trio.to_thread.run_sync(detach_stale_mount, self.mountpoint)
            self._mount()
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            stack.push_async_callback(self._shutdown)  # runs even if the nursery fails
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            stack.push_async_callback(self._shutdown)  # runs before the nursery waits
            self._nursery.start_soon(self._serve)
            if self._adopted is None:
                with trio.fail_after(self.init_timeout):
                    await self._init_done.wait()
                # stat runs in a thread: it is answered by this very server.
                st = await trio.to_thread.run_sync(os.stat, self.mountpoint)
                self.st_dev = st.st_dev
        except BaseException as exc:
            if not await stack.__aexit__(type(exc), exc, exc.__traceback__):
                raise
        self._stack = stack
        return self

    async def __aexit__(self, *exc) -> bool | None:
        stack, self._stack = self._stack, None
        if stack is not None:
            return await stack.__aexit__(*exc)
        return None

    def _mount(self) -> None:
        os.makedirs(self.mountpoint, exist_ok=True)
        # CLOEXEC: a tenant we spawn must never inherit the connection, or our death
        # would not abort it.
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        opts = (f"fd={self._fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},"
                "allow_other,default_permissions")
        if _libc.mount(b"devbroker", self.mountpoint.encode(), b"fuse.devbroker",
                       _MS_NOSUID | _MS_NODEV, opts.encode()) != 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            self._fd = -1
            raise OSError(err, f"mount fuse at {self.mountpoint}: {os.strerror(err)}")
        self._mounted = True

    async def _shutdown(self) -> None:
        self._closed = True
        self._wake_threads()  # a parked reader sees _closed and returns
        if self._mounted and not self._handed_over:
            self._mounted = False
            try:
                _umount_detach(self.mountpoint)
            except OSError as e:
                log.warning("unmount %s: %s", self.mountpoint, e)
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            trio.lowlevel.notify_closing(fd)
            # Aborts the connection (tenants' calls then fail with ENOTCONN) unless another
            # process holds the file too: after a live upgrade the successor does.
            os.close(fd)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # ---- the tree ----------------------------------------------------------------------
    async def set_tenants(self, tenants: Mapping[str, TenantTree]) -> None:
        """Replace the whole tree (policy reload); unchanged nodes keep their inodes.
        Returns once the kernel has been told to drop what changed."""
        self._apply({k: v if isinstance(v, TenantTree) else TenantTree.from_dict(v)
                     for k, v in tenants.items()})
        await self._flush_notify()

    def set_tree(self, tenants: Mapping[str, "TenantTree | Mapping"]) -> None:
        """Synchronous form of set_tenants for callbacks: the tree changes at once, the
        kernel cache invalidations are sent in the background. Values may be TenantTree or
        the plain dict form of TenantTree.from_dict."""
        self._apply({k: v if isinstance(v, TenantTree) else TenantTree.from_dict(v)
                     for k, v in tenants.items()})
        if self._nursery is not None and not self._closed:
            self._nursery.start_soon(self._flush_notify)

    async def wait_closed(self) -> None:
        """Return once the kernel connection has ended (unmounted, aborted or shut down)."""
        await self._serve_done.wait()

    # ---- live upgrade (broker/handover.py) -------------------------------------------------
    async def pause(self) -> None:
        """Stop reading requests and return once every request already read is answered
        (and the kernel told of every invalidation). Tenants' calls meanwhile wait in the
        kernel's queue: none fails and none is lost. The caller bounds the wait."""
        self._pause_requested = True
        self._parked = trio.Event()
        self._wake_threads()
        if not self._serve_done.is_set():
            await self._parked.wait()
        # Requests the threads read: answered, or taken up by a task of the trio thread
        # (which _idle then waits for). Waits for a pace token are ended as they come
        # (module doc of _pace_waiters): ioctls become undecided, the rest go on unpaced.
        self._pace_skips.skip_all()
        while (self._thread_busy or self._handed
               or (self._native is not None and self._native.queued())
               or not self._idle.is_set()):
            self._end_pace_waits()
            await trio.sleep(0.001)
        await self._flush_notify()

    def _end_pace_waits(self) -> None:
        self._pace_skips.skip_all()
        for scope in list(self._pace_waiters.values()):
            scope.cancel()

    def resume(self) -> None:
        """Read requests again (an upgrade that was called off); the ioctls the pause left
        undecided are decided here after all."""
        with self._tlock:
            self._pause_requested = False
            self._unwake()
            self._resume_cond.notify_all()
        self._pace_skips.stop()
        self._decide_undecided()

    def _decide_undecided(self) -> None:
        """(Trio thread.) Decide from the start the ioctls a pause left undecided (this
        front end's, or a predecessor's)."""
        undecided, self._undecided = self._undecided, []
        for req in undecided:
            self._start_for(req, self._finish_task, req, self._ioctl_steps(req, False), None)

    def detach(self) -> None:
        """The successor serves this mount now: closing here must not unmount or abort it
        (and the undecided ioctls are the successor's to answer)."""
        self._handed_over = True
        self._undecided = []

    @property
    def fd(self) -> int:
        return self._fd

    def export_state(self) -> dict:
        """What a successor needs to answer this mount's next request as this process would
        (paused; plain JSON-able data): the kernel knows inodes by node id and open files by
        fh, and counts lookups; all three must survive. File contents are not exported:
        the successor's tree (set_tree) gives them back."""
        inodes = []
        for ino in self._inodes.values():
            parent = self._inodes.get(ino.parent)
            inodes.append({
                "id": ino.nodeid, "kind": ino.kind, "parent": ino.parent,
                "name": ino.name.hex(), "tenant": ino.tenant,
                "node": [int(ino.node.kind), ino.node.minor] if ino.node else None,
                "nlookup": ino.nlookup, "removed": ino.removed,
                "linked": (ino.nodeid != w.ROOT_ID and parent is not None
                           and parent.children.get(ino.name) is ino),
            })
        handles = []
        for fh, h in self._handles.items():
            handles.append({
                "fh": fh, "kind": h.kind, "inode": h.inode.nodeid, "session": h.session,
                "data": h.data.hex(), "served_pages": h.served_pages, "poll_kh": h.poll_kh,
                "listing": [[i.nodeid, name.hex(), real] for i, name, real in h.listing],
                "opener": ([h.opener.pid, h.opener.tid, h.opener.uid, h.opener.gid]
                           if h.opener is not None else None),
                "opener_ns": h.opener_ns, "passed": h.passed,
            })
        return {"proto_minor": self.proto_minor, "st_dev": self.st_dev, "mtime": self._mtime,
                "node_direct_io": self.node_direct_io,
                "next_nodeid": self._next_nodeid, "next_private_fh": self._next_private_fh,
                "inodes": inodes, "handles": handles,
                # read, not decided (waiting for the pace when the pause began): the
                # successor decides them and answers them on the same connection
                "undecided": [w.encode_ioctl_request(r).hex() for r in self._undecided]}

    def _import_state(self, fd: int, state: dict) -> None:
        self._fd = fd
        self._mounted = True
        self.proto_minor = int(state["proto_minor"])
        self.node_direct_io = bool(state["node_direct_io"])
        self.st_dev = state["st_dev"]
        self._mtime = int(state["mtime"])
        self._next_nodeid = int(state["next_nodeid"])
        self._next_private_fh = int(state["next_private_fh"])
        self._inodes = {}
        for d in state["inodes"]:
            node = NodeSpec(NodeKind(d["node"][0]), d["node"][1]) if d["node"] else None
            self._inodes[d["id"]] = _Inode(d["id"], d["kind"], d["parent"],
                                           bytes.fromhex(d["name"]), d["tenant"], node=node,
                                           nlookup=d["nlookup"], removed=d["removed"])
        for d in state["inodes"]:
            if d["linked"]:
                ino = self._inodes[d["id"]]
                self._inodes[d["parent"]].children[ino.name] = ino
        self._root = self._inodes[w.ROOT_ID]
        for ino in self._inodes.values():
            if ino.kind == "node" and not ino.removed:
                self._native_node(ino)
        for d in state["handles"]:
            ino = self._inodes.get(d["inode"])
            if ino is None:
                continue
            listing = [(self._inodes[i], bytes.fromhex(n), real) for i, n, real in d["listing"]
                       if i in self._inodes]
            self._handles[d["fh"]] = _Handle(
                d["kind"], ino, session=d["session"], data=bytes.fromhex(d["data"]),
                listing=listing, served_pages=d["served_pages"], poll_kh=d["poll_kh"],
                opener=Caller(*d["opener"]) if d["opener"] else None,
                opener_ns=d["opener_ns"], passed=d["passed"])
        self._undecided = [w.parse_request(bytes.fromhex(x), minor=self.proto_minor)
                           for x in state.get("undecided", ())]
        self._init_done.set()

    async def put_tenant(self, name: str, tree: TenantTree) -> None:
        current = self.tenants()
        current[name] = tree
        await self.set_tenants(current)

    async def remove_tenant(self, name: str) -> None:
        current = self.tenants()
        current.pop(name, None)
        await self.set_tenants(current)

    def tenants(self) -> dict[str, TenantTree]:
        """The tree as currently served (reconstructed from the inodes)."""
        out = {}
        for name, d in self._root.children.items():
            nodes, files = {}, {}
            stackp = [(d, "")]
            while stackp:
                ino, prefix = stackp.pop()
                for cname, c in ino.children.items():
                    p = prefix + cname.decode()
                    if c.kind == "dir":
                        stackp.append((c, p + "/"))
                    elif c.kind == "node":
                        nodes[p] = c.node
                    else:
                        files[p] = c.content
            out[name.decode()] = TenantTree(nodes=nodes, files=files)
        return out

    async def invalidate_node(self, tenant: str, path: str) -> None:
        """Drop the kernel's cached pages of one node file (call when the mapping contents
        behind it change, e.g. a new mmap context on that file)."""
        ino = self._find(tenant, path)
        if ino is not None:
            self._pending_notify.append(w.encode_notify_inval_inode(ino.nodeid, 0, 0))
            await self._flush_notify()

    async def notify_poll(self, session: int) -> None:
        """Wake the tenant threads polling on this session (when the broker supports poll)."""
        h = self._handles.get(session)
        if h is not None and h.poll_kh is not None:
            self._pending_notify.append(w.encode_notify_poll(h.poll_kh))
            await self._flush_notify()

    def _find(self, tenant: str, path: str) -> _Inode | None:
        ino = self._root.children.get(tenant.encode())
        for comp in split_path(path):
            if ino is None:
                return None
            ino = ino.children.get(comp)
        return ino

    def _new_inode(self, kind, parent: _Inode, name: bytes, tenant, **kw) -> _Inode:
        ino = _Inode(self._next_nodeid, kind, parent.nodeid, name, tenant, **kw)
        self._next_nodeid += 1
        self._inodes[ino.nodeid] = ino
        parent.children[name] = ino
        if kind == "node":
            self._native_node(ino)
        return ino

    def _native_node(self, ino: _Inode) -> None:
        """Ioctls on a node inode wait in the native loop's queue for its tenant's turns."""
        if self._native is not None:
            self._native.node_put(ino.nodeid, ino.tenant)

    def _drop(self, parent: _Inode, name: bytes) -> None:
        ino = parent.children.pop(name)
        self._pending_notify.append(w.encode_notify_inval_entry(parent.nodeid, name))
        todo = [ino]
        while todo:
            i = todo.pop()
            i.removed = True
            if i.kind == "node" and self._native is not None:
                # (its queued requests still reach Python, which finds the node removed)
                self._native.node_drop(i.nodeid)
            todo.extend(i.children.values())
            i.children = {}
            if i.nlookup == 0:
                self._inodes.pop(i.nodeid, None)

    def _sync_dir(self, d: _Inode, want: dict, tenant: str) -> None:
        for name in list(d.children):
            cur = d.children[name]
            spec = want.get(name)
            keep = (
                (cur.kind == "dir" and isinstance(spec, dict))
                or (cur.kind == "node" and isinstance(spec, NodeSpec) and spec == cur.node)
                or (cur.kind == "file" and isinstance(spec, tuple))
            )
            if not keep:
                self._drop(d, name)
        for name, spec in want.items():
            cur = d.children.get(name)
            if isinstance(spec, dict):
                if cur is None:
                    cur = self._new_inode("dir", d, name, tenant)
                    self._pending_notify.append(w.encode_notify_inval_entry(d.nodeid, name))
                self._sync_dir(cur, spec, tenant)
            elif isinstance(spec, NodeSpec):
                if cur is None:
                    self._new_inode("node", d, name, tenant, node=spec)
                    self._pending_notify.append(w.encode_notify_inval_entry(d.nodeid, name))
            else:
                content = spec[1]
                if cur is None:
                    self._new_inode("file", d, name, tenant, content=content)
                    self._pending_notify.append(w.encode_notify_inval_entry(d.nodeid, name))
                elif cur.content is not content and cur.content != content:
                    cur.content = content
                    self._pending_notify.append(w.encode_notify_inval_inode(cur.nodeid, 0, 0))

    def _apply(self, tenants: dict[str, TenantTree]) -> None:
        want = {}
        for name, tree in tenants.items():
            comps = split_path(name)
            if len(comps) != 1 or "/" in name:
                raise ValueError(f"tenant name {name!r} must be one path component")
            want[comps[0]] = desired(tree)
        for name in list(self._root.children):
            if name not in want:
                self._drop(self._root, name)
        for name, sub in want.items():
            d = self._root.children.get(name)
            if d is None:
                d = self._new_inode("dir", self._root, name, name.decode())
                self._pending_notify.append(w.encode_notify_inval_entry(w.ROOT_ID, name))
            self._sync_dir(d, sub, name.decode())

    async def _flush_notify(self) -> None:
        msgs, self._pending_notify = self._pending_notify, []
        if not msgs or not self._init_done.is_set() or self._fd < 0:
            return
        # In a worker thread: an invalidation can wait on a page or directory lock held by
        # a request that only this (trio) thread can answer.
        await trio.to_thread.run_sync(self._write_notifications, msgs, self._fd)

    @staticmethod
    def _write_notifications(msgs: list[bytes], fd: int) -> None:
        for m in msgs:
            try:
                os.write(fd, m)
            except OSError as e:
                # ENOENT: the kernel has no such inode/entry cached — nothing to drop.
                if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ENODEV):
                    log.warning("FUSE notification failed: %s", e)

    # ---- attributes --------------------------------------------------------------------
    def _attr(self, ino: _Inode) -> w.Attr:
        t = self._mtime
        if ino.kind == "dir":
            subdirs = sum(1 for c in ino.children.values() if c.kind == "dir")
            # The root is root's alone: tenants reach their nodes through bind mounts and
            # never walk the mount, and no other local user may walk to them either.
            perms = 0o700 if ino.nodeid == w.ROOT_ID else 0o555
            return w.Attr(ino=ino.nodeid, mode=stat.S_IFDIR | perms, nlink=2 + subdirs,
                          atime=t, mtime=t, ctime=t)
        if ino.kind == "node":
            return w.Attr(ino=ino.nodeid, mode=stat.S_IFREG | 0o666, size=NODE_SIZE,
                          atime=t, mtime=t, ctime=t)
        try:
            size = len(render(ino.content)) if not ino.removed else 0
        except Exception:
            log.exception("static file content callback failed")
            size = 0
        return w.Attr(ino=ino.nodeid, mode=stat.S_IFREG | 0o444, size=size,
                      blocks=(size + 511) // 512, atime=t, mtime=t, ctime=t)

    def _attr_ttl(self, ino: _Inode) -> float:
        return 0.0 if ino.kind == "file" and callable(ino.content) else self.attr_ttl

    def _entry(self, unique: int, ino: _Inode) -> bytes:
        ino.nlookup += 1
        return w.encode_entry(unique, ino.nodeid, self._attr(ino), entry_valid=self.entry_ttl,
                              attr_valid=self._attr_ttl(ino), minor=self.proto_minor)

    # ---- serving -------------------------------------------------------------------------
    # Requests are read by reader threads, blocking on their own duplicate of
    # /dev/fuse: no trio wake-up, no task and no 132 KiB buffer per request. An IOCTL on a
    # node file is decided on the thread that read it (the broker's steps, run_blocking:
    # broker/effects.py), tenant memory through MemoryGate.direct with the watchdog below
    # keeping its deadline, as the seccomp front end's listener threads do; a step that
    # must wait (a rate limit, an fd lookup, a relay channel in use) hands the half-run
    # steps to the trio thread (HandOver), which finishes and answers them. Every other
    # request (open, release, page reads, lookups, ...) goes to the trio thread as before.
    # Fairness: a thread reads everything the kernel has pending into a FairQueue and
    # serves one tenant's ioctl per turn (broker/limits.py).
    threads = 1  # one thread answers: a second one waiting contends for the GIL
    max_extra_threads = 8  # started by the watchdog while every thread is held up
    busy_hold = 0.1  # seconds all threads must have been busy before another is started
    watchdog_tick = 0.1
    # Once the watchdog had to start a thread (a tenant's page held the readers up), one
    # extra thread stays this long: a tenant repeating the trick (a pointer into a page of
    # this mount, whose fault needs a second reader to be refused) costs the others one
    # watchdog tick per minute, not one per call.
    spare_keep = 60.0
    drain_batch = 64  # requests read per pass before one is served

    async def _serve(self) -> None:
        try:
            await self._serve_threads()
        finally:
            self._serve_done.set()

    async def _serve_threads(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._conn_ended = trio.Event()
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._tfd = os.dup(self._fd)  # the threads' own reference: see _drop_thread_ref
        self._tfd_refs = 1
        self._decide_undecided()  # (a predecessor's: see _pace_waiters)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watchdog)
                for _ in range(self.threads):
                    self._start_reader()
                await self._conn_ended.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._closed = True
            self._wake_threads()
            self._drop_thread_ref()
            self._forget_callers()

    def _connection_ended(self) -> None:
        if self._conn_ended is not None:
            self._conn_ended.set()

    def _start_reader(self) -> None:
        with self._tlock:
            self._tfd_refs += 1
            self._live += 1
        threading.Thread(target=self._reader_main, name="fuse-reader", daemon=True).start()

    def _drop_thread_ref(self) -> None:
        with self._tlock:
            self._tfd_refs -= 1
            last = self._tfd_refs == 0
            fds = (self._tfd, self._wake) if last else ()
            if last:
                self._tfd = self._wake = -1
        for fd in fds:
            # No thread can use the numbers any more (one held up in a tenant's page keeps
            # its reference, so it never answers on a number reused meanwhile).
            os.close(fd)

    def _wake_threads(self) -> None:
        if self._wake >= 0:
            try:
                os.eventfd_write(self._wake, 1)
            except OSError:
                pass
        with self._tlock:
            self._resume_cond.notify_all()

    def _unwake(self) -> None:
        if self._wake >= 0:
            try:
                os.eventfd_read(self._wake)
            except OSError:
                pass

    def _to_trio(self, fn, *args) -> bool:
        return to_trio(self._token, fn, *args)

    def _reader_main(self) -> None:
        me = threading.get_native_id()
        name_os_thread("dvb-fuse-reader")
        try:
            # Lane calls on the real backend's relayed files run on this thread, on the
            # broker's own duplicates (RealBackend._run_control_relayed): never with the
            # capabilities the driver checks (tenantfile.DRIVER_CAPS), dropped for the
            # thread's life as a seccomp listener's. Nothing a reader does needs them.
            drop_driver_capabilities_for_thread()
        except OSError as e:  # (then the relayed files' lane calls take the relay)
            log.warning("FUSE reader: driver capabilities not dropped: %s", e)
        retired = False  # left because `_surplus` said so
        try:
            if self._native is not None:
                retired = self._native_reader(me)
            else:
                retired = self._python_reader(me)
        except Exception:  # pragma: no cover - a bug must not end the service silently
            log.exception("FUSE reader thread failed")
        finally:
            with self._tlock:
                self._live -= 1
                if retired:
                    self._leaving -= 1
            self._drop_thread_ref()

    # After each answer a reader looks for the tenant's next request without sleeping for a
    # while (usually microseconds away): the wake-up across CPUs is most of a FUSE round trip
    # here. Measured on the 2-CPU development machine with the lanes (docs/benchmarks.md,
    # "The hot path"): one FUSE call 81-113 µs against 114-141 without, 16 tenant processes
    # 12.3-13.5k calls/s against 11.9-13.6k (no loss; it cost throughput before the lanes
    # made a call cheap). 0 turns it off.
    @staticmethod
    def _spin_s() -> float:
        return int(os.environ.get("DEVBROKER_FUSE_SPIN_US", "100") or 0) / 1e6

    def _python_reader(self, me: int) -> bool:
        """The reader's loop in Python (no native library). True: retired as surplus."""
        fd = self._tfd
        buf = bytearray(self._bufsize)  # one buffer for the thread's life
        view = memoryview(buf)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._wake, select.POLLIN)
        spin = self._spin_s()
        spin_until = 0.0
        while not self._closed:
            if self._pause_requested:
                if self._queue.pending:
                    self._serve_next(me)  # read before the pause: answered first
                else:
                    self._park()
                continue
            if not self._drain(fd, buf, view):
                break
            if self._serve_next(me):
                if self._surplus():
                    return True
                spin_until = time.monotonic() + spin
                continue
            if spin and time.monotonic() < spin_until:
                poller.poll(0)  # the tenant's next request is usually microseconds away
                continue
            if not poller.poll(200) and self._surplus():
                return True  # an extra thread retires when idle
        return False

    def _native_reader(self, me: int) -> bool:
        """The reader's loop on the native one (frontends/fusenative.py): C reads, queues
        the node ioctls fairly and hands them out one by one; this thread decides each
        (`_native_node_ioctl`) and routes every other request as the Python loop does.
        True: retired as surplus."""
        try:
            nt = self._native.thread(self._tfd, self._wake, self._bufsize,
                                     int(self._spin_s() * 1e9))
        except MemoryError as e:  # (no memory for its buffers: this thread reads in Python)
            log.warning("FUSE reader: %s; this thread serves in Python", e)
            return self._python_reader(me)
        # Marked as reading tenant memory for its life: a fault it takes on this very
        # mount (a tenant's pointer into a page of one of our nodes) is refused at once by
        # another reader (_route), never served for the broker through the tenant's mapping.
        memgate.MemoryGate.mark_native(me, "")
        self._native_threads[me] = nt
        try:
            while not self._closed:
                if self._pause_requested:
                    if self._queue.pending:
                        self._serve_next(me)  # read before the pause: answered first
                    elif nt.next(read_more=False) == fusenative.DVBF_NODE_IOCTL:
                        self._native_node_ioctl(me, nt)
                    else:
                        self._park()
                    continue
                r = nt.next()
                if r == fusenative.DVBF_NODE_IOCTL:
                    self._native_node_ioctl(me, nt)
                elif r == fusenative.DVBF_REQUEST:
                    self._route(nt.request())
                elif r in (fusenative.DVBF_HUP, fusenative.DVBF_ERROR):
                    err = nt.call.err
                    if r == fusenative.DVBF_ERROR:
                        log.error("FUSE reader: reading %s failed: %s", self.mountpoint,
                                  os.strerror(err))
                    elif not self._closed:
                        log.info("FUSE connection at %s ended (%s)", self.mountpoint,
                                 os.strerror(err))
                    self._to_trio(self._connection_ended)
                    return False
                elif r == fusenative.DVBF_IDLE:
                    if self._surplus():
                        return True  # an extra thread retires when idle
                    continue
                # Requests the native queue could not hold wait in Python's, in turn too.
                if self._queue.pending:
                    self._serve_next(me)
                if self._surplus():
                    return True
            return False
        finally:
            with self._tlock:  # (the watchdog looks at the thread's state under it)
                self._native_threads.pop(me, None)
                nt.free()
            memgate.MemoryGate.unmark_native(me)

    def _native_node_ioctl(self, me: int, nt: fusenative.FuseNativeThread) -> None:
        """(Reader thread.) The node ioctl the native queue handed out, in its tenant's
        turn: the control lane's call answered here (`_native_lane_call`), anything else
        parsed and served by the general steps now."""
        with self._tlock:
            self._thread_busy += 1
        req = None
        try:
            if self._native_lane_call(me, nt):
                return
            req = w.parse_request(nt.raw(), minor=self.proto_minor or w.MAX_MINOR)
        except w.WireError as e:  # (C checked the lengths; the parser has the last word)
            log.error("malformed FUSE request: %s", e)
            nt.error(errno.EIO)
        except Exception:
            log.exception("FUSE ioctl %#x failed", nt.call.cmd)
            nt.error(errno.EIO)
        finally:
            if req is None:  # (answered here; else _serve_req counts it out)
                with self._tlock:
                    self._thread_busy -= 1
        if req is not None:
            # The lane was asked above: the general steps decide it now, as the Python
            # loop's do after the lane's GENERAL.
            self._serve_req(me, req, lane=False)

    def _native_lane_call(self, me: int, nt: fusenative.FuseNativeThread) -> bool:
        """A control the control lane admits, run by the lane's executor
        (broker/laneexec.py) as `_control_lane_steps` runs it, on the native loop's private
        copies (the header is the kernel's copy in the request, the parameter block read
        once into the thread's buffer at the address and size the admission names), without
        the effects around each step. True: answered (or answered by the watchdog
        meanwhile); False: the general steps decide it, from the start (refusals and audit
        records included)."""
        c = nt.call
        cmd = c.cmd
        if (cmd not in self._lane_cmds or c.in_size != c.out_size or c.flags & w.IOCTL_DIR
                or not c.in_size):
            return False
        h = self._handles.get(c.fh)
        if h is None or h.kind != "node":
            return False
        caller = self._caller_ids(c.pid, c.uid, c.gid)
        if not self._same_sandbox_quick(h, caller):
            return False
        tenant = h.inode.tenant or ""
        if memgate.gate_of(self.broker).stalled.get(tenant):
            return False  # its accesses go through the gate, which keeps the stall limit
        entry = [c.unique, time.monotonic(), False]
        self._serving[me] = entry
        late = False

        def read(ptr: int, size: int) -> bytes:
            nonlocal late
            nt.tenant, nt.what = tenant, ("read", size, ptr)
            got = nt.read(ptr, size)
            if got == fusenative.DVBF_LATE:
                late = True  # (answered by the watchdog meanwhile: nothing more to do)
            if got is None or late:
                raise OSError(errno.EFAULT, "the parameter block could not be read")
            return got

        try:
            got = laneexec.run_here(
                laneexec.lane_steps(self._lane, h.session, caller, cmd, nt.arg()),
                read, self._lane_driver)
            if late:
                self._native_late(nt)
                return True
            if got is GENERAL or got is laneexec.GONE:
                return False  # the general way reads again, and answers with its record
            if got.err:  # the driver's failure: the tenant's buffers stay as they were
                nt.error(sanitize_errno(got.err))
                return True
            adm = got.adm
            nt.what = ("write", adm.params_size, adm.params_ptr)
            if nt.answer(got.ret, got.hdr_out[:c.out_size], adm.params_ptr,
                         got.out if adm.params_size else b"") == fusenative.DVBF_LATE:
                self._native_late(nt)
            self.native_lane_calls += 1  # (one reader at a time in the common case; a count)
            return True
        finally:
            self._serving.pop(me, None)

    def _native_late(self, nt: fusenative.FuseNativeThread) -> None:
        """An access the watchdog claimed came back: its stall is over."""
        memgate.gate_of(self.broker).native_returned(nt.tenant, nt.describe_access(),
                                                     nt.call.late_ns / 1e9)

    def _park(self) -> None:
        with self._tlock:
            self._parked_threads += 1
            if self._parked_threads >= self._live:
                self._to_trio(lambda: self._parked.set())
            while self._pause_requested and not self._closed:
                self._resume_cond.wait(0.2)
            self._parked_threads -= 1

    def _surplus(self) -> bool:
        """More threads free to read than `threads` (threads held up in a slow call or a
        stalled page do not count: they are why the others were started): then the calling
        thread retires, counted as leaving in the same step (under the lock), so that the
        next thread to ask sees one fewer — as SeccompSupervisor._surplus, where two extra
        threads back from a stall both left and nothing served the tenant any more."""
        if self._live <= self.threads:  # the common case, asked after every request
            return False
        now = time.monotonic()
        held = sum(1 for _u, since, _a in list(self._serving.values())
                   if now - since > self.busy_hold)
        keep = self.threads + (1 if now < self._spare_until else 0)
        with self._tlock:
            if self._live - self._leaving - held > keep:
                self._leaving += 1
                return True
            return False

    def _drain(self, fd: int, buf: bytearray, view: memoryview) -> bool:
        """Read what the kernel has pending (up to drain_batch requests) and route each.
        False: the connection has ended."""
        for _ in range(self.drain_batch):
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                return True
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.ENOENT:  # the request was withdrawn before we read it
                    continue
                if e.errno in (errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
                    if not self._closed:
                        log.info("FUSE connection at %s ended (%s)", self.mountpoint, e)
                    self._to_trio(self._connection_ended)
                    return False
                raise
            self._route(view[:n])
        return True

    def _route(self, data) -> None:
        """(Reader thread.) Queue an ioctl on a node file for this thread; hand anything
        else to the trio thread."""
        try:
            req = w.parse_request(data, minor=self.proto_minor or w.MAX_MINOR)
        except w.WireError as e:
            log.error("malformed FUSE request: %s", e)
            if e.unique is not None:
                self._error(e.unique, errno.EIO)
            return
        kind = type(req)
        if kind is w.Read and memgate.accessing(req.header.pid) is not None:
            # A broker thread reading or writing a tenant's memory faulted on a page the
            # tenant mapped from this very mount. Serving it would read a node
            # for the broker through the tenant's mapping; waiting would be worse (nobody
            # may be left to answer it). Fail the fault now: the access sees EFAULT and
            # the broker refuses the tenant's call.
            memgate.note_own_mount_fault(req.header.pid)
            self._error(req.unique, errno.EIO)
            return
        if kind is w.Ioctl:
            h = self._handles.get(req.fh)
            if h is not None and h.kind == "node":
                with self._tlock:
                    self._thread_busy += 1
                self._queue.put(h.inode.tenant, req)
                return
        with self._tlock:
            self._handed += 1
        if not self._to_trio(self._take_handed, self._dispatch_request, req):
            with self._tlock:
                self._handed -= 1

    def _take_handed(self, fn, *args) -> None:
        """(Trio thread.) Take up what a reader thread handed over. This runs as a trio
        run_sync_soon callback, where an exception would end the whole run
        (TrioInternalError: the broker exits 1): one that escapes costs that request EIO."""
        with self._tlock:
            self._handed -= 1
        try:
            fn(*args)
        except Exception:
            log.exception("FUSE: a handed-over request failed")
            req = args[0] if args else None
            if hasattr(req, "unique"):
                self._error(req.unique, errno.EIO)

    def _start_for(self, req, fn, *args) -> None:
        """(Trio thread.) A task answering `req`. A request handed over while the front end
        shuts down (its nursery closed to new tasks: seen in CI as a tenant holding pages
        of the broker's own mount met the broker's SIGTERM) is answered EIO instead."""
        self._begin()
        if not start_task(self._nursery, fn, *args):
            self._end()
            self._error(req.unique, errno.EIO)

    def _serve_next(self, me: int) -> bool:
        """(Reader thread.) Answer the next queued ioctl here (False: none waits)."""
        req = self._queue.get()
        if req is None:
            return False
        self._serve_req(me, req)
        return True

    def _serve_req(self, me: int, req: w.Ioctl, lane: bool = True) -> None:
        """(Reader thread.) Answer one node ioctl here, or hand it to the trio thread;
        counts it out of _thread_busy. lane: False when the control lane was asked already."""
        entry = [req.unique, time.monotonic(), False]
        self._serving[me] = entry
        try:
            steps = self._ioctl_steps(req, lane)
            try:
                out = run_blocking(steps, self._perform_here)
            except HandOver as ho:
                with self._tlock:
                    self._handed += 1
                if not self._to_trio(self._take_handed, self._finish_on_trio, req, ho.steps,
                                     ho.pending):
                    with self._tlock:
                        self._handed -= 1
                    ho.steps.close()
                    self._error(req.unique, errno.EIO)
                return
            except Exception:
                log.exception("FUSE ioctl %#x failed", req.cmd)
                out = w.encode_error(req.unique, errno.EIO)
            if not entry[2]:  # not answered by the watchdog meanwhile
                self._send(out)
        finally:
            self._serving.pop(me, None)
            with self._tlock:
                self._thread_busy -= 1

    def _finish_on_trio(self, req: w.Ioctl, steps: Steps, pending) -> None:
        self._start_for(req, self._finish_task, req, steps, pending)

    async def _finish_task(self, req: w.Ioctl, steps: Steps, pending) -> None:
        try:
            out = await run_async(steps, functools.partial(self._perform_paced, req), pending)
        except _Undecided:
            self._undecided.append(req)  # (its steps were closed: nothing was held)
            return
        except Exception:
            log.exception("FUSE ioctl %#x failed", req.cmd)
            out = w.encode_error(req.unique, errno.EIO)
        finally:
            self._end()
        self._send(out)

    async def _perform_paced(self, req: w.Ioctl, eff):
        """_perform_async for an ioctl's steps, whose wait for a pace token a live upgrade
        ends (_Undecided: see _pace_waiters)."""
        if not isinstance(eff, RateLimit):
            return await self._perform_async(eff)
        if self._pause_requested:
            raise _Undecided  # (a live upgrade is pausing: no wait starts now)
        with trio.CancelScope() as scope:
            self._pace_waiters[req.unique] = scope
            try:
                return await eff.limiter.acquire()
            finally:
                self._pace_waiters.pop(req.unique, None)
        raise _Undecided  # (ended by pause)

    def _perform_here(self, eff):
        return perform_blocking(eff, memgate.gate_of(self.broker))

    async def _perform_async(self, eff):
        return await perform_async(eff, memgate.gate_of(self.broker))

    async def _watchdog(self) -> None:
        """Keeps the mount answering while its threads are held up: an access to a
        tenant's memory past the memory gate's deadline is answered with EFAULT and audited
        (the thread stays in the kernel, counted as stalled); when every thread has been busy
        for busy_hold (a stalled page, a slow call, a fault on this very mount), another
        thread is started, so other tenants (and that fault) are still answered."""
        gate = memgate.gate_of(self.broker)
        while True:
            await trio.sleep(self.watchdog_tick)
            late = gate.sweep(self._serving.keys()) + self._sweep_native(gate)
            for tid, tenant, what in late:
                held = self._serving.get(tid)
                if held is None or held[2]:
                    continue
                held[2] = True
                self._error(held[0], errno.EFAULT)
                audit = getattr(self.broker, "audit", None)
                if audit is not None:
                    audit.deny(tenant=tenant, what=what,
                               reason=f"{what} did not complete within {gate.deadline:g} s "
                                      "(the page waits on something outside the broker); "
                                      "its thread is left to the kernel")
            now = time.monotonic()
            busy = [since for _u, since, _a in list(self._serving.values())]
            with self._tlock:
                live = self._live
            if (not self._closed and not self._pause_requested and busy
                    and len(busy) >= live and now - max(busy) > self.busy_hold
                    and live < self.threads + self.max_extra_threads):
                self._spare_until = now + self.spare_keep
                self._start_reader()
            elif not self._closed and not self._pause_requested and live == 0:
                # No thread reads the mount (one ended on a bug, say): every request would
                # wait for ever. Another is started, and said.
                log.warning("FUSE %s: no reader thread left; starting one", self.mountpoint)
                self._start_reader()

    def _sweep_native(self, gate: memgate.MemoryGate) -> list[tuple[int, str, str]]:
        """The native readers' accesses to tenant memory past the gate's deadline, each
        claimed (so the access, when it returns, reports DVBF_LATE and answers nothing) and
        counted as stalled: (thread id, tenant, what), as MemoryGate.sweep reports."""
        out = []
        limit = int(gate.deadline * 1e9)
        now = time.monotonic_ns()  # (CLOCK_MONOTONIC, as native/fuselane.c's)
        with self._tlock:  # (a thread frees its state under it)
            for tid, nt in self._native_threads.items():
                since = nt.mem_since()
                if since > 0 and now - since > limit and nt.claim(since):
                    out.append((tid, nt.tenant, nt.describe_access()))
        for _tid, tenant, _what in out:
            gate.native_stalled(tenant)
        return out

    def _send(self, data: bytes) -> None:
        fd = self._tfd if self._tfd >= 0 else self._fd
        if fd < 0:
            return
        try:
            os.write(fd, data)
        except OSError as e:
            # ENOENT: the request was interrupted and withdrawn; the reply has no reader.
            if e.errno != errno.ENOENT:
                log.warning("FUSE reply write failed: %s", e)

    def _error(self, unique: int, err: int) -> None:
        self._send(w.encode_error(unique, sanitize_errno(err)))

    def _dispatch_request(self, req) -> None:
        """(Trio thread.) Answer a request a reader thread handed over."""
        handler = self._SYNC.get(type(req))
        if handler is not None:
            if type(req) in self._PACED:
                # A tenant's lookups, stats, readdirs... are requests like its ioctls: they
                # take its tokens. With a token at hand (the usual case)
                # they are answered at once; without, they wait in a task of their own.
                tenant = self._tenant_of(req)
                if not limits.pace_nowait(self.broker, tenant):
                    self._start_for(req, self._paced_sync, handler, req, tenant)
                    return
            self._run_sync(handler, req)
            return
        handler = self._ASYNC.get(type(req))
        if handler is not None:
            self._start_for(req, self._run_async, handler, req)
            return
        self._error(req.unique, errno.ENOSYS)

    def _begin(self) -> None:
        """A request read and not yet answered (what pause() waits for)."""
        self._inflight += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle

    def _end(self) -> None:
        self._inflight -= 1
        if not self._inflight:
            self._idle.set()

    def _run_sync(self, handler, req) -> None:
        try:
            handler(self, req)
        except Exception:
            log.exception("FUSE %s failed", type(req).__name__)
            if req.expects_reply:
                self._error(req.unique, errno.EIO)

    async def _paced_sync(self, handler, req, tenant: str | None) -> None:
        try:
            limits.PACE_SKIPS.set(self._pace_skips)  # (a live upgrade ends the wait)
            await limits.pace(self.broker, tenant)
            self._run_sync(handler, req)
        finally:
            self._end()

    def _tenant_of(self, req) -> str | None:
        """The tenant whose tree a request is about (None: the mount's root, which only the
        host sees)."""
        fh = getattr(req, "fh", None)
        h = self._handles.get(fh) if fh is not None else None
        ino = h.inode if h is not None else self._inodes.get(req.header.nodeid)
        return ino.tenant if ino is not None else None

    async def _run_async(self, handler, req) -> None:
        try:
            limits.PACE_SKIPS.set(self._pace_skips)  # (a live upgrade ends its pace waits)
            await handler(self, req)
        except Exception:
            log.exception("FUSE %s failed", type(req).__name__)
            if req.expects_reply:
                self._error(req.unique, errno.EIO)
        finally:
            self._end()

    def _caller(self, h: w.InHeader) -> Caller:
        """Who sent the request: uid and gid from the request itself, the thread's process
        and pid namespace from /proc (~30 µs) the first time a thread is seen, then from a
        cache held by a thread pidfd (PIDFD_THREAD): a signal-0 check on it (~1 µs) tells
        that the thread is still the one cached, never a new thread that reused the number
        (a thread's process and pid namespace never change)."""
        return self._caller_ids(h.pid, h.uid, h.gid)

    def _caller_ids(self, tid: int, uid: int, gid: int) -> Caller:
        """`_caller` from the request header's fields."""
        if not tid:
            return Caller(pid=0, tid=0, uid=uid, gid=gid)
        with self._callers_lock:
            hit = self._callers.get(tid)
            if hit is not None:
                try:
                    signal.pidfd_send_signal(hit[0], 0)
                    return Caller(pid=hit[1], tid=tid, uid=uid, gid=gid, pidns=hit[2])
                except OSError:
                    del self._callers[tid]
                    os.close(hit[0])
        tgid = _tgid_of(tid)
        ns = pid_namespace(tgid or tid)
        caller = Caller(pid=tgid or tid, tid=tid, uid=uid, gid=gid, pidns=ns)
        if not tgid or ns is None:
            return caller
        try:
            pidfd = os.pidfd_open(tid, PIDFD_THREAD)
        except OSError:
            return caller
        if _tgid_of(tid) != tgid:  # the thread ended and its number was reused meanwhile
            os.close(pidfd)
            return caller
        with self._callers_lock:
            if len(self._callers) >= 4096:  # threads come and go: drop the oldest half
                for old in list(self._callers)[:2048]:
                    os.close(self._callers.pop(old)[0])
            prev = self._callers.pop(tid, None)
            if prev is not None:
                os.close(prev[0])
            self._callers[tid] = (pidfd, tgid, ns)
        return caller

    def _forget_callers(self) -> None:
        with self._callers_lock:
            for pidfd, _t, _n in self._callers.values():
                os.close(pidfd)
            self._callers.clear()

    def _inode(self, nodeid: int) -> _Inode | None:
        return self._inodes.get(nodeid)

    # ---- metadata requests (answered inline: no await, nothing slow) -----------------------
    def _on_init(self, req: w.Init) -> None:
        if req.major < w.KERNEL_VERSION:
            log.error("kernel speaks FUSE %d.%d; need 7.x", req.major, req.minor)
            self._error(req.unique, errno.EPROTO)
            return
        want = w.InitReply(
            max_readahead=0,  # a fault reads exactly the page touched, nothing around it
            flags=w.BIG_WRITES | w.MAX_PAGES | w.PARALLEL_DIROPS | w.DIRECT_IO_ALLOW_MMAP,
            max_write=self.max_write,
            max_pages=self._max_pages,
        )
        r = w.negotiate_init(req, want)
        self.node_direct_io = bool(r.flags & w.DIRECT_IO_ALLOW_MMAP)
        self._send(w.encode_init(req.unique, r))
        if r.major == w.KERNEL_VERSION and req.major == w.KERNEL_VERSION:
            self.proto_minor = r.minor
            self._init_done.set()

    def _on_lookup(self, req: w.Lookup) -> None:
        d = self._inode(req.nodeid)
        if d is None or d.kind != "dir":
            self._error(req.unique, errno.ENOTDIR if d else errno.ENOENT)
            return
        child = d.children.get(req.name)
        if child is None:
            # Not cached: a tenant added by the next policy reload must appear at once.
            self._error(req.unique, errno.ENOENT)
            return
        self._send(self._entry(req.unique, child))

    def _forget_one(self, nodeid: int, n: int) -> None:
        ino = self._inodes.get(nodeid)
        if ino is None or nodeid == w.ROOT_ID:
            return
        ino.nlookup = max(0, ino.nlookup - n)
        if ino.nlookup == 0 and ino.removed:
            del self._inodes[nodeid]

    def _on_forget(self, req: w.Forget) -> None:
        self._forget_one(req.nodeid, req.nlookup)

    def _on_batch_forget(self, req: w.BatchForget) -> None:
        for nodeid, n in req.items:
            self._forget_one(nodeid, n)

    def _on_getattr(self, req: w.GetAttr) -> None:
        ino = self._inode(req.nodeid)
        if ino is None:
            self._error(req.unique, errno.ENOENT)
            return
        self._send(w.encode_attr(req.unique, self._attr(ino), attr_valid=self._attr_ttl(ino),
                                 minor=self.proto_minor))

    def _on_setattr(self, req: w.SetAttr) -> None:
        ino = self._inode(req.nodeid)
        if ino is None:
            self._error(req.unique, errno.ENOENT)
            return
        if req.valid & (w.FATTR_MODE | w.FATTR_UID | w.FATTR_GID):
            self._error(req.unique, errno.EPERM)
            return
        if req.valid & w.FATTR_SIZE and ino.kind != "node":
            self._error(req.unique, errno.EACCES if ino.kind == "file" else errno.EISDIR)
            return
        # Size on a node (open with O_TRUNC) and times are accepted and ignored: a node
        # has no contents to truncate, and its size must stay large for mmap.
        self._send(w.encode_attr(req.unique, self._attr(ino), attr_valid=self._attr_ttl(ino),
                                 minor=self.proto_minor))

    def _passed_out(self, h: _Handle, caller: Caller) -> bool:
        """Is this request on a node file made from outside the sandbox that opened it (the
        file was passed over a Unix socket)? The first time: every cached page of the
        inode is dropped (from every mapping: the kernel unmaps them), the file serves no
        more pages — to its owner either — and the audit log says so. The broker refuses
        the request itself (same check, broker.core._same_sandbox); this is what the page
        cache needs on top: pages already cached are never asked for again."""
        o = h.opener
        # pid 0: a request the kernel makes on no process's behalf (not a tenant's use)
        if o is None or h.passed or caller.pid == o.pid or caller.pid <= 0:
            return False
        ns = pid_namespace(caller.pid)
        if caller.uid == o.uid and (h.opener_ns is None or ns == h.opener_ns):
            return False  # another process of the same sandbox (a child, say)
        h.passed = True
        self._pending_notify.append(w.encode_notify_inval_inode(h.inode.nodeid, 0, 0))
        self._nursery.start_soon(self._flush_notify)
        audit = getattr(self.broker, "audit", None)
        if audit is not None:
            owner = h.inode.tenant
            # The record is the user's: the tenant whose sandbox the caller is in, when one
            # of its own node files says so (found once per passed file, not per request).
            user = next((x.inode.tenant for x in self._handles.values()
                         if x.kind == "node" and x.opener_ns == ns and ns is not None
                         and x.opener is not None and x.opener.uid == caller.uid), None)
            name = h.inode.name.decode(errors="replace")
            audit.deny(tenant=user or owner, pid=caller.pid, node=name,
                       what=f"{owner}'s {name} used by pid {caller.pid}",
                       reason=f"node file of tenant {owner} (opened by pid {o.pid}, uid "
                              f"{o.uid}) passed to another sandbox ({user or 'unknown tenant'}, "
                              f"uid {caller.uid}): its cached pages are dropped and it serves "
                              "no more pages")
        return True

    def _hold_private(self, req, ino: _Inode, what: str) -> bool:
        """Count one more /proc-view handle of ino's tenant, or refuse it (EMFILE, audited)
        at the tenant's open-files limit. False: refused and answered."""
        if ino.tenant is None:
            return True
        held = self._private_held.get(ino.tenant, 0)
        path = b"/".join(self._path_parts(ino)).decode(errors="replace")
        if limits.front_end_open_refusal(self.broker, ino.tenant, held, pid=req.header.pid,
                                         what=f"{what} {path}"):
            self._error(req.unique, errno.EMFILE)
            return False
        self._private_held[ino.tenant] = held + 1
        return True

    def _drop_private(self, h: _Handle) -> None:
        t = h.inode.tenant
        if t is not None and self._private_held.get(t):
            self._private_held[t] -= 1

    def _path_parts(self, ino: _Inode) -> list[bytes]:
        parts = []
        while ino.nodeid != w.ROOT_ID and len(parts) < 64:
            parts.append(ino.name)
            ino = self._inodes.get(ino.parent, self._root)
        return parts[::-1]

    def _private_fh(self) -> int:
        fh = self._next_private_fh
        self._next_private_fh += 1
        return fh

    def _on_opendir(self, req: w.OpenDir) -> None:
        ino = self._inode(req.nodeid)
        if ino is None or ino.kind != "dir":
            self._error(req.unique, errno.ENOTDIR if ino else errno.ENOENT)
            return
        parent = self._inodes.get(ino.parent, self._root)
        listing = [(ino, b".", False), (parent, b"..", False)]
        listing += [(c, name, True) for name, c in ino.children.items()]
        if not self._hold_private(req, ino, "opendir"):
            return
        fh = self._private_fh()
        self._handles[fh] = _Handle("dir", ino, listing=listing)
        self._send(w.encode_open(req.unique, fh, 0))

    def _dirents(self, h: _Handle, offset: int):
        for i in range(offset, len(h.listing)):
            ino, name, real = h.listing[i]
            dtype = (stat.S_IFDIR if ino.kind == "dir" else stat.S_IFREG) >> 12
            yield w.DirEntry(ino.nodeid, name, dtype, i + 1), ino, real

    def _on_readdir(self, req: w.ReadDir) -> None:
        h = self._handles.get(req.fh)
        if h is None or h.kind != "dir":
            self._error(req.unique, errno.EBADF)
            return
        reply, _ = w.encode_readdir(req.unique, (e for e, _, _ in self._dirents(h, req.offset)), req.size)
        self._send(reply)

    def _on_readdirplus(self, req: w.ReadDirPlus) -> None:
        h = self._handles.get(req.fh)
        if h is None or h.kind != "dir":
            self._error(req.unique, errno.EBADF)
            return
        items = []
        for e, ino, real in self._dirents(h, req.offset):
            if real:
                entry = w.pack_entry(ino.nodeid, self._attr(ino), entry_valid=self.entry_ttl,
                                     attr_valid=self._attr_ttl(ino))
            else:  # "." and ".." are never linked by the kernel: nodeid 0, no lookup count
                entry = w.pack_entry(0, w.Attr(ino=0, mode=0), entry_valid=0, attr_valid=0)
            items.append((e, entry, ino, real))
        reply, n = w.encode_readdirplus(req.unique, ((e, entry) for e, entry, _, _ in items), req.size)
        for _, _, ino, real in items[:n]:
            if real:
                ino.nlookup += 1
        self._send(reply)

    def _on_releasedir(self, req: w.ReleaseDir) -> None:
        h = self._handles.pop(req.fh, None)
        if h is not None:
            self._drop_private(h)
        self._send(w.encode_reply(req.unique))

    def _on_statfs(self, req: w.StatFs) -> None:
        self._send(w.encode_statfs(req.unique, w.StatFsOut(files=len(self._inodes)),
                                   minor=self.proto_minor))

    def _on_access(self, req: w.Access) -> None:
        ino = self._inode(req.nodeid)
        if ino is None:
            self._error(req.unique, errno.ENOENT)
        elif req.mask & os.W_OK and ino.kind != "node":
            self._error(req.unique, errno.EACCES)
        elif req.mask & os.X_OK and ino.kind != "dir":
            self._error(req.unique, errno.EACCES)
        else:
            self._send(w.encode_reply(req.unique))

    def _on_getxattr(self, req: w.GetXattr) -> None:
        self._error(req.unique, errno.ENODATA)

    def _on_listxattr(self, req: w.ListXattr) -> None:
        self._send(w.encode_xattr_size(req.unique, 0) if req.size == 0 else w.encode_data(req.unique, b""))

    def _on_write(self, req: w.Write) -> None:
        h = self._handles.get(req.fh)
        # The NVIDIA nodes have no write(); static files are read-only.
        self._error(req.unique, errno.EINVAL if h is not None and h.kind == "node" else errno.EBADF)

    def _on_flush(self, req: w.Flush) -> None:
        self._send(w.encode_reply(req.unique))

    def _on_fsync(self, req: w.Fsync) -> None:
        self._send(w.encode_reply(req.unique))

    def _on_interrupt(self, req: w.Interrupt) -> None:
        # Broker calls run to completion so the broker's state matches what the tenant
        # can observe; the kernel drops the reply if the caller has gone.
        log.debug("FUSE interrupt for request %d ignored", req.target)

    def _on_destroy(self, req: w.Destroy) -> None:
        self._send(w.encode_reply(req.unique))
        self._closed = True
        self._connection_ended()

    def _on_unknown(self, req: w.Unknown) -> None:
        self._error(req.unique, errno.ENOSYS)

    # ---- requests that may reach the broker (each in its own task) -------------------------
    async def _on_open(self, req: w.Open) -> None:
        ino = self._inode(req.nodeid)
        if ino is None:
            self._error(req.unique, errno.ENOENT)
            return
        if ino.kind == "dir":
            self._error(req.unique, errno.EISDIR)
            return
        if ino.removed:
            # The tenant (or this node) was withdrawn by a policy reload: like a device
            # whose driver has gone away.
            self._error(req.unique, errno.ENXIO)
            return
        if ino.kind == "file":
            if req.flags & os.O_ACCMODE != os.O_RDONLY:
                self._error(req.unique, errno.EACCES)
                return
            await limits.pace(self.broker, ino.tenant)
            if not self._hold_private(req, ino, "open"):
                return
            data = render(ino.content)
            fh = self._private_fh()
            self._handles[fh] = _Handle("file", ino, data=data)
            # direct_io: reads come to us even past the size the kernel last saw, so a
            # file that changed since stat() is read whole and consistent (the snapshot).
            self._send(w.encode_open(req.unique, fh, w.FOPEN_DIRECT_IO | w.FOPEN_NOFLUSH))
            return
        caller = self._caller(req.header)
        spec = ino.node
        flags = req.flags & ~(os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_TRUNC)
        rep = await self.broker.open(OpenRequest(caller, ino.tenant, spec.kind, spec.minor, flags))
        if rep.errno:
            self._error(req.unique, rep.errno)
            return
        fh = rep.session
        if not 0 <= fh < _PRIVATE_FH_BASE or fh in self._handles:
            log.error("broker returned unusable session id %r", fh)
            await self.broker.release(ReleaseRequest(fh))
            self._error(req.unique, errno.EIO)
            return
        self._handles[fh] = _Handle("node", ino, session=fh, opener=caller,
                                    opener_ns=pid_namespace(caller.pid))
        # No FOPEN_KEEP_CACHE: the kernel drops the inode's cached pages on this open, so
        # a fresh context never sees pages another context mapped. FOPEN_DIRECT_IO (where
        # the kernel still allows shared mappings of such files): every mmap() of the file
        # drops the inode's cached pages before it maps anything, so a tenant that got this
        # file passed over a socket never finds the pages its owner faulted in
        # before; its own faults reach us (READ) and are refused. Mappings still
        # fill through the page cache (READ -> broker.map_read).
        flags = w.FOPEN_NOFLUSH | (w.FOPEN_DIRECT_IO if self.node_direct_io else 0)
        self._send(w.encode_open(req.unique, fh, flags))

    async def _on_read(self, req: w.Read) -> None:
        h = self._handles.get(req.fh)
        if h is None:
            self._error(req.unique, errno.EBADF)
            return
        if h.kind == "file":
            await limits.pace(self.broker, h.inode.tenant)
            self._send(w.encode_data(req.unique, h.data[req.offset:req.offset + req.size]))
            return
        if h.kind != "node":
            self._error(req.unique, errno.EISDIR)
            return
        caller = self._caller(req.header)
        if self._passed_out(h, caller) or h.passed:
            self._error(req.unique, errno.EACCES)  # the faulting access gets SIGBUS
            return
        rep = await self.broker.map_read(MapReadRequest(caller, h.session, req.offset, req.size))
        if rep.errno:
            self._error(req.unique, rep.errno)
            return
        data = bytes(rep.data[:req.size])
        # Always the full length: a short read makes the kernel believe the file ends
        # there and shrink i_size, and the next page of the mapping would SIGBUS.
        data += b"\0" * (req.size - len(data))
        h.served_pages = True
        self._send(w.encode_data(req.unique, data))

    async def _on_release(self, req: w.Release) -> None:
        h = self._handles.pop(req.fh, None)
        if h is not None and h.kind != "node":
            self._drop_private(h)
        if h is not None and h.kind == "node":
            try:
                await self.broker.release(ReleaseRequest(h.session))
            finally:
                self._send(w.encode_reply(req.unique))
            if h.served_pages and not h.inode.removed:
                # Pages this context filled must not outlive it in the shared inode cache.
                self._pending_notify.append(w.encode_notify_inval_inode(h.inode.nodeid, 0, 0))
                await self._flush_notify()
            return
        self._send(w.encode_reply(req.unique))

    async def _on_ioctl(self, req: w.Ioctl) -> None:
        self._send(await run_async(self._ioctl_steps(req), self._perform_async))

    def _ioctl_steps(self, req: w.Ioctl, lane: bool = True) -> Steps:
        """One IOCTL as steps (broker/effects.py), returning the reply to send: run on a
        reader thread (run_blocking) or, from a hand-over or _on_ioctl, on the trio thread."""
        h = self._handles.get(req.fh)
        if h is None or h.kind != "node" or req.flags & w.IOCTL_DIR:
            return w.encode_error(req.unique, errno.ENOTTY)
        caller = self._caller(req.header)
        if req.cmd == WHOAMI_IOCTL and caller.pid == os.getpid():
            return w.encode_ioctl(req.unique, 0, struct.pack("<Q", h.session)[:req.out_size])
        if not self._same_sandbox_quick(h, caller):
            # Perhaps a file passed out of its sandbox: the trio thread's books say (and
            # drop its cached pages if so); the broker refuses the call itself.
            yield Await(self._passed_out_async, (h, caller))
        memory = ProcessMemory(caller.pid)
        # Restricted FUSE ioctls carry the argument only for commands that encode a size
        # and direction. UVM commands are bare numbers: arg is None and the broker reads
        # and writes the argument through `memory` at arg_ptr, sized from its ABI registry.
        arg = req.data if req.in_size else None
        tenant = h.inode.tenant or ""
        if lane and req.cmd in self._lane_cmds and req.in_size == req.out_size == len(req.data):
            got = yield from self._control_lane_steps(req, h, caller, memory, tenant)
            if got is not GENERAL:
                return got
        ireq = IoctlRequest(caller, h.session, req.cmd, req.arg, arg, memory,
                            resolve_fd=functools.partial(self.resolve_fd, caller.pid,
                                                         tenant=tenant))
        steps = getattr(self.broker, "ioctl_steps", None)
        if steps is not None:
            rep = yield from steps(ireq)
        else:
            rep = yield Await(self.broker.ioctl, (ireq,))
        if rep.errno:
            # ENOSYS would make the kernel disable ioctls on the whole mount for good.
            return w.encode_error(req.unique, sanitize_errno(
                errno.ENOTTY if rep.errno == errno.ENOSYS else rep.errno))
        out = b""
        if rep.arg_out is not None:
            if req.out_size:
                out = bytes(rep.arg_out[:req.out_size])
            elif rep.arg_out and req.arg:
                # No out buffer in the FUSE reply (a bare-number or write-only command):
                # the driver copies the argument back regardless, so do the same — through
                # the memory gate, like every access to a tenant's memory.
                try:
                    yield WriteMemory(memory, req.arg, bytes(rep.arg_out), tenant,
                                      f"write of ioctl {req.cmd:#x}'s result")
                except OSError as e:
                    log.info("ioctl %#x of pid %d: result not written back: %s", req.cmd,
                             caller.pid, e)
                    return w.encode_error(req.unique, errno.EFAULT)
        return w.encode_ioctl(req.unique, rep.result, out)

    def _control_lane_steps(self, req: w.Ioctl, h: "_Handle", caller: Caller,
                            memory: ProcessMemory, tenant: str) -> Steps:
        """An RM control the broker's control lane admits, run by the lane's executor
        (broker/laneexec.py) on private copies: the header is the kernel's copy in the
        request, the parameter block is read once through the memory gate; GENERAL for
        everything else (the general steps then decide it, refusals and audit records
        included). The backend may decline (NotHere: a relayed file), and the general
        steps take it then."""
        got = yield from laneexec.run_in_steps(
            laneexec.lane_steps(self._lane, h.session, caller, req.cmd, bytes(req.data)),
            lambda eff: ReadMemory(memory, eff.ptr, eff.size, tenant,
                                   f"read of {eff.size} bytes at {eff.ptr:#x}"),
            self._lane_driver)
        if got is GENERAL or got is laneexec.GONE:
            return GENERAL
        if got.err:  # the driver's failure: the tenant's buffers stay as they were
            return w.encode_error(req.unique, sanitize_errno(got.err))
        if got.adm.params_size:  # (none for a call whose header is the whole argument)
            try:
                yield WriteMemory(memory, got.adm.params_ptr, got.out, tenant,
                                  f"write of ioctl {req.cmd:#x}'s results")
            except OSError:
                return w.encode_error(req.unique, errno.EFAULT)
        return w.encode_ioctl(req.unique, got.ret, got.hdr_out[:req.out_size])

    def _lane_driver(self, eff: laneexec.RunDriver):
        """The lane executor's driver call on the reader's thread (the backend's, on the
        session's file); GENERAL when the backend cannot run it here."""
        try:
            return self.broker.backend.run_control(eff.adm.session.file, -1, eff.hdr,
                                                   eff.params, eff.adm.header, eff.adm.abi)
        except NotHere:
            return GENERAL

    @staticmethod
    def _same_sandbox_quick(h: _Handle, caller: Caller) -> bool:
        """The cases where _passed_out answers False without touching anything: the
        opener itself, a process of the same uid and pid namespace, a file already marked."""
        o = h.opener
        if o is None or h.passed or caller.pid == o.pid or caller.pid <= 0:
            return True
        return (caller.uid == o.uid and caller.pidns is not None
                and (h.opener_ns is None or caller.pidns == h.opener_ns))

    async def _passed_out_async(self, h: _Handle, caller: Caller) -> bool:
        return self._passed_out(h, caller)

    async def _on_poll(self, req: w.Poll) -> None:
        h = self._handles.get(req.fh)
        if h is None:
            self._error(req.unique, errno.EBADF)
            return
        ready = select.POLLIN | select.POLLRDNORM
        if h.kind != "node":
            self._send(w.encode_poll(req.unique, ready))
            return
        if self._passed_out(h, self._caller(req.header)):
            self._error(req.unique, errno.EACCES)
            return
        await limits.pace(self.broker, h.inode.tenant)  # a poll loop is a request flood too
        if req.flags & w.POLL_SCHEDULE_NOTIFY:
            h.poll_kh = req.kh
        poll = getattr(self.broker, "poll", None)
        if poll is None:
            # Without a broker poll, report what the driver reports when an OS event is
            # pending (POLLIN|POLLPRI): the tenant then drains events by ioctl and finds
            # none. Never blocking forever beats a missed wakeup (docs/fuse.md).
            revents = ready | select.POLLPRI
        else:
            revents = await poll(h.session, req.events)
        self._send(w.encode_poll(req.unique, revents))

    _SYNC = {
        w.Init: _on_init,
        w.Lookup: _on_lookup,
        w.Forget: _on_forget,
        w.BatchForget: _on_batch_forget,
        w.GetAttr: _on_getattr,
        w.SetAttr: _on_setattr,
        w.OpenDir: _on_opendir,
        w.ReadDir: _on_readdir,
        w.ReadDirPlus: _on_readdirplus,
        w.ReleaseDir: _on_releasedir,
        w.StatFs: _on_statfs,
        w.Access: _on_access,
        w.GetXattr: _on_getxattr,
        w.ListXattr: _on_listxattr,
        w.Write: _on_write,
        w.Flush: _on_flush,
        w.Fsync: _on_fsync,
        w.Interrupt: _on_interrupt,
        w.Destroy: _on_destroy,
        w.Unknown: _on_unknown,
        w.CuseInit: _on_unknown,
    }
    # Answered inline, but on a tenant's behalf: paced by its rate (see _dispatch). Never
    # paced: INIT, FORGET (no reply), INTERRUPT, DESTROY, and the releases (they give back).
    _PACED = frozenset({w.Lookup, w.GetAttr, w.SetAttr, w.OpenDir, w.ReadDir, w.ReadDirPlus,
                        w.StatFs, w.Access, w.GetXattr, w.ListXattr, w.Write, w.Flush,
                        w.Fsync})

    _ASYNC = {
        w.Open: _on_open,
        w.Read: _on_read,
        w.Release: _on_release,
        w.Ioctl: _on_ioctl,
        w.Poll: _on_poll,
    }

    # ---- fd arguments ------------------------------------------------------------------------
    async def resolve_fd(self, pid: int, fd: int, *, tenant: str = "") -> int | None:
        """The broker session behind file descriptor ``fd`` of process ``pid``, or None when
        that fd is not an open node file of this mount.

        Takes a duplicate of the tenant's file (pidfd_getfd), checks that it lives on this
        mount and is a node file, then asks this very server through a private ioctl on the
        duplicate — the kernel hands that ioctl to us with the file's own fh.

        On a worker thread with the memory gate's deadline: the fstat and the close of a file
        of the tenant's choosing may wait on a file system the tenant serves.
        """
        try:
            return await memgate.gate_of(self.broker).run(
                tenant or f"pid {pid}", self._resolve_fd_blocking, pid, fd,
                what=f"lookup of fd {fd}", memory=False)
        except OSError as e:
            log.info("resolve_fd(%d, %d): %s", pid, fd, e)
            return None

    def _resolve_fd_blocking(self, pid: int, fd: int) -> int | None:
        try:
            dup = pidfd_getfd(pid, fd)
        except OSError as e:
            log.debug("resolve_fd(%d, %d): %s", pid, fd, e)
            return None
        try:
            st = os.fstat(dup)  # may be answered by GETATTR: hence a worker thread
            if st.st_dev != self.st_dev:
                return None
            ino = self._inodes.get(st.st_ino)
            if ino is None or ino.kind != "node":
                return None
            buf = bytearray(8)
            fcntl.ioctl(dup, WHOAMI_IOCTL, buf, True)
            return struct.unpack("<Q", buf)[0]
        except OSError as e:
            log.debug("resolve_fd(%d, %d): %s", pid, fd, e)
            return None
        finally:
            os.close(dup)
