"""The real backend: relays the broker's decided calls to the host's NVIDIA driver.

The broker process itself never holds a driver file. A relay process (backends/relay.py),
started here, drops every capability and its root uid, opens /dev/nvidiactl, /dev/nvidiaN
and /dev/nvidia-uvm, and runs each ioctl and mmap; this module speaks to it over socketpairs
(backends/relaywire.py) and does the sans-IO part:

- re-encodes the argument: fd fields become the relay's fd numbers of the target files
  (the driver resolves fds in the caller's table, and the caller is the relay); fd fields
  the broker did not translate become -1 (never a number the tenant chose);
- places the nested buffer (and the second-level buffers the core copied, dc.embedded) in the
  relay's memory: the relay patches the pointer fields with its own addresses;
- refuses, without calling the driver, any other non-NULL pointer (it would make the driver
  read or write the relay's memory at an address the tenant chose) and UVM commands that
  act on the caller's address space (the relay's, not the tenant's: docs/real-backend.md);
- restores the tenant's own fd numbers and pointers in what goes back.

See docs/real-backend.md for the privilege design and what this path cannot serve.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from devbroker.abi import UnknownVersion, registry
from devbroker.abi import status as nvs
from devbroker.abi.nodes import NodeKind
from devbroker.abi.spec import StructSpec, StructValue
from devbroker.backends import relaywire as w
from devbroker.backends.cudackpt import CudaCheckpointer
from devbroker.backends.base import DriverCall, DriverResult, NotHere, PciLocation
from devbroker.backends.relay import run_ioctl
from devbroker.backends.tenantfile import (
    FdRef, NoCapsExecutor, PrivateNodes, TenantFile, effective_caps_lowered,
    thread_is_driver_safe,
)

log = logging.getLogger("devbroker.real")

PROC = Path("/proc/driver/nvidia")
MEMBLOCK = Path("/sys/devices/system/memory/block_size_bytes")
PAGE = 4096

MAX_DEEP = 64 << 10

# UVM commands that only bind or unbind a va space of the relay's own (harmless, and what
# NVML sends). Everything else UVM does acts on the caller's mm, which here is the relay's:
# refused (CUDA cannot run through a relay, docs/real-backend.md).
UVM_RELAYED = frozenset({"UVM_INITIALIZE", "UVM_DEINITIALIZE", "UVM_MM_INITIALIZE",
                         "UVM_PAGEABLE_MEM_ACCESS"})


# Pointer-typed fields the driver never dereferences: mapping cookies it handed out itself.
COOKIE_POINTERS = frozenset({("NV_ESC_RM_MAP_MEMORY", "params.pLinearAddress"),
                             ("NV_ESC_RM_UNMAP_MEMORY", "pLinearAddress")})


# Calls the broker executes inline on its trio thread for tenant files (microseconds in the
# driver: RM_CONTROL p50 16 µs natively on the H200); the rest (allocations, frees, which
# take up to tens of ms) run in capability-less worker threads.
INLINE_CALLS = frozenset({"NV_ESC_RM_CONTROL", "NV_ESC_CARD_INFO", "NV_ESC_CHECK_VERSION_STR",
                          "NV_ESC_NUMA_INFO", "NV_ESC_REGISTER_FD"})


# Pointer-typed fields of nested parameters that the driver never dereferences as a pointer
# in the executing process: NV01_EVENT_OS_EVENT's `data` is the fd number its
# NV_ESC_ALLOC_OS_EVENT was registered with, used as a key together with the client
# (osUserHandleToKernelPtr, unix os.c). The broker checks that the event class is 0x79.
KEY_POINTERS = frozenset({("NV0005_ALLOC_PARAMETERS", "data")})


class Unrelayable(Exception):
    """The call cannot be relayed safely; answered NOT_SUPPORTED without the driver."""


# --------------------------------------------------------------------------- files, GPUs
@dataclass(eq=False)
class RealFile:
    node: NodeKind
    minor: int
    rfd: int  # the relay's fd number
    path: str
    map_length: int = 0  # set by a successful RM_MAP_MEMORY naming this file
    closed: bool = False
    # The broker's own duplicate of the relay's file, for lane calls from FUSE reader
    # threads (RealBackend._lend; -1 until the first), and how many calls use it now: it is closed
    # with the file, by the last of them (never while a call is on it, so its number is
    # never reused under one). Not handed over: a successor makes its own.
    local_fd: int = -1
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass(frozen=True)
class RealGpu(PciLocation):
    index: int  # device minor number
    name: str
    uuid: str
    pci_bus_id: str
    gpu_id: int
    memory_bytes: int = 0
    # The driver's device instance (NV0080_ALLOC_PARAMETERS.deviceId): given at attach time,
    # not the minor number. Seen on the two-H200 host: GPU minor 0 was instance 1.
    device_instance: int | None = None


def parse_information(text: str) -> dict[str, str]:
    """/proc/driver/nvidia/gpus/<bus>/information: 'Key: \\t value' lines."""
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


def parse_version(text: str) -> str | None:
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)\s", text)
    if m is None:
        m = re.search(r"\s(\d{3}\.\d+(?:\.\d+)?)\s", text)
    return m.group(1) if m else None


def gpu_id_of(pci_bus_id: str) -> int:
    """The driver's GPU id for a PCI address (domain<<16 | bus<<8 | device): 0x6 for the
    H200 at 0000:00:06.0 (BRIEF §2); checked against GET_ATTACHED_IDS at start."""
    dom, bus, rest = pci_bus_id.split(":")
    return (int(dom, 16) << 16) | (int(bus, 16) << 8) | int(rest.split(".")[0], 16)


def discover_proc(proc: Path = PROC) -> list[RealGpu]:
    gpus = []
    for info in sorted((proc / "gpus").glob("*/information")):
        d = parse_information(info.read_text())
        bus = d.get("Bus Location", info.parent.name)
        gpus.append(RealGpu(index=int(d.get("Device Minor", len(gpus))),
                            name=d.get("Model", "NVIDIA GPU"), uuid=d.get("GPU UUID", ""),
                            pci_bus_id=bus.lower(), gpu_id=gpu_id_of(bus)))
    return sorted(gpus, key=lambda g: g.index)


# --------------------------------------------------------------------------- sans-IO part
_PTR_LAYOUT: dict[int, tuple[StructSpec, tuple[tuple[str, int], ...]]] = {}


def _ptr_layout(spec: StructSpec, base: int = 0, path: str = "") -> list[tuple[str, int]]:
    """(path, absolute offset) of every pointer field, through structs and arrays: a fact
    of the layout, computed once per spec (most specs have none)."""
    out: list[tuple[str, int]] = []
    for f in spec.fields:
        if f.kind == "ptr":
            out.append((path + f.name, base + f.offset))
        elif f.kind == "struct" and f.spec is not None:
            out += _ptr_layout(f.spec, base + f.offset, path + f.name + ".")
        elif f.kind == "array" and isinstance(f.elem, StructSpec):
            inner = _ptr_layout(f.elem)
            for i in range(f.count if inner else 0):
                out += [(f"{path}{f.name}[{i}].{p}", base + f.offset + i * f.elem.size + o)
                        for p, o in inner]
    return out


def _walk_ptrs(spec: StructSpec, value: StructValue | bytes):
    """(path, absolute offset, value) of every pointer field of value (or raw bytes)."""
    cached = _PTR_LAYOUT.get(id(spec))
    if cached is None or cached[0] is not spec:
        cached = _PTR_LAYOUT[id(spec)] = (spec, tuple(_ptr_layout(spec)))
    if not cached[1]:
        return
    raw = value if isinstance(value, (bytes, bytearray)) else value.encode()
    for path, off in cached[1]:
        yield path, off, struct.unpack_from("<Q", raw, off)[0]


def _walk_fds(spec: StructSpec, base: int = 0, path: str = ""):
    for f in spec.fields:
        if f.kind == "fd":
            yield path + f.name, base + f.offset
        elif f.kind == "struct" and f.spec is not None:
            yield from _walk_fds(f.spec, base + f.offset, path + f.name + ".")


@dataclass
class Prepared:
    """An ioctl ready for the relay, and how to give its answer back to the tenant."""

    request: w.IoctlRequest
    arg_in: bytes  # the tenant's argument as the broker decided it
    restore: list[tuple[int, bytes]] = field(default_factory=list)  # (offset, tenant bytes)
    nested_index: int = -1
    nested_restore: list[tuple[int, bytes]] = field(default_factory=list)
    deep: list[tuple[str, int]] = field(default_factory=list)  # (pointer field, buf index)


def prepare_ioctl(file: Any, dc: DriverCall) -> Prepared:
    """Build the relay request for `dc` on `file` (sans-IO). Second-level buffers come from
    `dc.embedded` (the core copied the ones the ABI marks). Raises Unrelayable."""
    call = dc.call
    abi = dc.abi or registry.get("580.159.04")
    arg = bytearray(call.encode())
    if call.kind == "uvm" and call.name not in UVM_RELAYED:
        raise Unrelayable(f"{call.name} acts on the caller's address space; through the relay "
                          "that would be the relay's")
    value = call.value
    spec = value.spec if value is not None else None
    ref = abi.nested(call) if value is not None else None
    prep = Prepared(w.IoctlRequest(file.rfd, call.cmd, [w.Buffer(b"")]), bytes(arg))
    if spec is not None:
        for path, off in _walk_fds(spec):
            tenant_fd = struct.unpack_from("<i", arg, off)[0]
            target = dc.fd_files.get(path)
            real = target.rfd if target is not None else -1
            prep.restore.append((off, struct.pack("<i", tenant_fd)))
            struct.pack_into("<i", arg, off, real)
        for path, off, ptr in _walk_ptrs(spec, bytes(arg)):
            if ref is not None and path == ref.field:
                continue
            if ptr and (call.name, path) not in COOKIE_POINTERS:
                raise Unrelayable(f"{call.name}: pointer {path} is not relayed")
    nested = dc.nested
    if ref is not None:
        off = spec.by_name[ref.field].offset
        prep.restore.append((off, struct.pack("<Q", ref.ptr)))
        struct.pack_into("<Q", arg, off, 0)
        if nested is not None:
            nested = bytearray(nested)
            prep.nested_index = 1
            prep.request.buffers.append(w.Buffer(b"", 0, off))
            _prepare_deep(prep, call, ref, nested, dc.embedded)
            prep.request.buffers[1].data = bytes(nested)
    prep.request.buffers[0].data = bytes(arg)
    return prep


def _prepare_deep(prep: Prepared, call, ref, nested: bytearray, embedded: dict) -> None:
    if ref.spec is None:
        return
    for path, off, ptr in _walk_ptrs(ref.spec, bytes(nested[:ref.spec.size])):
        if not ptr or (ref.spec.name, path) in KEY_POINTERS:
            continue
        if path not in embedded:
            raise Unrelayable(f"{ref.op.name if ref.op else call.name}: nested pointer "
                              f"{path} is not relayed")
        data = bytes(embedded[path])
        if len(data) > MAX_DEEP:
            raise Unrelayable(f"{path}: {len(data)} bytes is more than the relay copies")
        prep.nested_restore.append((off, struct.pack("<Q", ptr)))
        struct.pack_into("<Q", nested, off, 0)
        prep.deep.append((path, len(prep.request.buffers)))
        prep.request.buffers.append(w.Buffer(data, 1, off))


def finish_ioctl(prep: Prepared, rep: w.IoctlReply) -> tuple[bytes, bytes | None]:
    """The argument and nested buffer as the tenant must see them (its own fds/pointers)."""
    arg = bytearray(rep.buffers[0])
    for off, b in prep.restore:
        arg[off:off + len(b)] = b
    nested = None
    if prep.nested_index >= 0:
        nested = bytearray(rep.buffers[prep.nested_index])
        for off, b in prep.nested_restore:
            nested[off:off + len(b)] = b
        nested = bytes(nested)
    return bytes(arg), nested


def not_supported(dc: DriverCall) -> DriverResult:
    """The driver's own answer to what it does not support: status in the argument."""
    arg = dc.call.with_status(nvs.NV_ERR_NOT_SUPPORTED)
    if arg is None:
        return DriverResult(arg=dc.call.encode(), errno=errno.EINVAL)
    return DriverResult(arg=arg, nested=dc.nested)


# --------------------------------------------------------------------------- the relay
class RelayError(OSError):
    pass


class Channel:
    """One socket to the relay; one request at a time (blocking; call from a thread)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.dec = w.FrameDecoder()
        self.lock = threading.Lock()
        self.ids = itertools.count(1)
        self._buf = bytearray(1 << 16)  # one receive buffer, not one per reply

    def call(self, build: Callable[[int], bytes], want: int) -> bytes:
        with self.lock:
            rid = next(self.ids)
            self.sock.sendall(build(rid))
            while True:
                got = self.sock.recv_into(self._buf)
                if not got:
                    raise RelayError(errno.EPIPE, "the relay process is gone")
                frames = self.dec.feed(memoryview(self._buf)[:got])
                if frames:
                    f = frames[0]
                    if f.id != rid:
                        raise RelayError(errno.EPROTO, f"reply {f.id} to request {rid}")
                    if f.type == w.ERROR:
                        raise RelayError(errno.EPROTO, "relay: " + f.payload.decode())
                    if f.type != want | w.REPLY:
                        raise RelayError(errno.EPROTO, f"reply type {f.type:#x}")
                    return f.payload


class AsyncChannel:
    """A pool channel driven from the trio loop: the broker awaits the reply on the socket
    and blocks no thread (the ioctl blocks only the relay's thread for this channel)."""

    def __init__(self, sock: socket.socket):
        import trio

        self.sock = trio.socket.from_stdlib_socket(sock)
        self.dec = w.FrameDecoder()
        self.ids = itertools.count(1)

    async def call(self, data_for: Callable[[int], bytes], want: int) -> bytes:
        rid = next(self.ids)
        data = memoryview(data_for(rid))
        while data:
            n = await self.sock.send(data)
            data = data[n:]
        while True:
            chunk = await self.sock.recv(1 << 16)
            if not chunk:
                raise RelayError(errno.EPIPE, "the relay process is gone")
            frames = self.dec.feed(chunk)
            if frames:
                f = frames[0]
                if f.id != rid or f.type != want | w.REPLY:
                    msg = f.payload.decode("utf-8", "replace") if f.type == w.ERROR else ""
                    raise RelayError(errno.EPROTO, f"relay reply {f.id}/{f.type:#x} to "
                                                   f"request {rid}: {msg}")
                return f.payload


class RelayProcess:
    """Starts the relay with `n` channels (+1 for the synchronous calls)."""

    def __init__(self, n: int = 8, *, uid: int | None = 65534, gid: int | None = 65534,
                 python: str | None = None):
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(n + 1)]
        theirs = [b for _, b in pairs]
        cmd = [python or sys.executable, "-m", "devbroker.backends.relay",
               "--fds", ",".join(str(s.fileno()) for s in theirs)]
        if uid is None or os.geteuid() != 0:
            cmd.append("--keep-uid")
        else:
            cmd += ["--uid", str(uid), "--gid", str(gid if gid is not None else uid)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.proc = subprocess.Popen(cmd, pass_fds=[s.fileno() for s in theirs], env=env,
                                     stdin=subprocess.DEVNULL, close_fds=True)
        for s in theirs:
            s.close()
        # A pidfd of the relay for pidfd_getfd (take_fd): a pid number could name another
        # process once the relay has exited and been reaped. (None on a kernel without
        # pidfds: the lane's calls then go through the relay.)
        try:
            self._pidfd: int | None = os.pidfd_open(self.proc.pid)
        except OSError:
            self._pidfd = None
        chans = [Channel(a) for a, _ in pairs]
        self.sync = chans[0]
        self.pool = chans[1:]
        # One pool channel is kept for blocking calls from front-end threads (ioctl_here).
        self.thread_chan = self.pool.pop() if len(self.pool) > 1 else None
        self.idle = list(self.pool)
        self._free = None
        self._achans: list = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def info(self) -> w.Info:
        return w.parse_info_reply(self.sync.call(w.encode_info, w.INFO))

    def open(self, path: str, flags: int = os.O_RDWR) -> int:
        fd, err = w.parse_open_reply(self.sync.call(
            lambda rid: w.encode_open(rid, path, flags), w.OPEN))
        if fd < 0:
            raise OSError(err, f"{path}: {os.strerror(err)}")
        return fd

    def close(self, fd: int) -> None:
        err = w.parse_close_reply(self.sync.call(lambda rid: w.encode_close(rid, fd), w.CLOSE))
        if err:
            raise OSError(err, os.strerror(err))

    def ioctl(self, chan: Channel, req: w.IoctlRequest) -> w.IoctlReply:
        return w.parse_ioctl_reply(chan.call(lambda rid: w.encode_ioctl(rid, req), w.IOCTL))

    def take_fd(self, rfd: int) -> int:
        """The broker's own duplicate of the relay's fd `rfd` (pidfd_getfd). After a hand-over
        the relay is not this broker's child and its proc carries the pidfd."""
        from devbroker.sandbox.linux import pidfd_getfd

        pidfd = getattr(self.proc, "pidfd", None)
        if pidfd is None:
            pidfd = self._pidfd
        if pidfd is None:
            raise OSError(errno.ENOSYS, "no pidfd of the relay")
        return pidfd_getfd(pidfd, rfd)

    def ioctl_here(self, req: w.IoctlRequest) -> w.IoctlReply:
        """A blocking ioctl from a front end's own thread (a FUSE reader) on the
        channel kept for them; NotHere when there is none or another thread is using it
        (the call then goes the trio way, aioctl)."""
        chan = self.thread_chan
        if chan is None or chan.lock.locked():
            raise NotHere
        return self.ioctl(chan, req)

    async def aioctl(self, req: w.IoctlRequest) -> w.IoctlReply:
        """From the trio loop: take an idle pool channel (waiting if all are busy)."""
        import trio

        if self._free is None:
            self._free = trio.Semaphore(len(self.pool))
            self._achans = [AsyncChannel(c.sock) for c in self.pool]
        async with self._free:
            if not self._achans:
                raise RelayError(errno.EPIPE, "no working channel to the relay is left")
            chan = self._achans.pop()
            # A broken exchange leaves the channel out of step: it is not put back.
            payload = await chan.call(lambda rid: w.encode_ioctl(rid, req), w.IOCTL)
            self._achans.append(chan)
        return w.parse_ioctl_reply(payload)

    def mapread(self, fd: int, maplen: int, offset: int, length: int) -> bytes:
        err, data = w.parse_mapread_reply(self.sync.call(
            lambda rid: w.encode_mapread(rid, fd, maplen, offset, length), w.MAPREAD))
        if err:
            raise OSError(err, f"mmap in the relay: {os.strerror(err)}")
        return data

    def stop(self) -> None:
        # Every channel, the front-end threads' one too: the relay exits when its last
        # channel closes (relay.main); one left open kept it waiting for the kill below.
        for c in [self.sync, *self.pool, *([self.thread_chan] if self.thread_chan else [])]:
            try:
                c.sock.close()
            except OSError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if getattr(self, "_pidfd", None) is not None:
            os.close(self._pidfd)
            self._pidfd = None


# --------------------------------------------------------------------------- the backend
def _ioctl_in_place(fd: int, cmd: int, arg: bytearray) -> tuple[int, int]:
    """ioctl(fd, cmd, arg) with arg answered in place: (return value, errno)."""
    try:
        return fcntl.ioctl(fd, cmd, arg, True), 0
    except OSError as e:
        return -1, e.errno or errno.EIO


def _run_control_on(fd: int, hdr: bytes, params: bytearray, header) -> tuple[int, int, bytes]:
    """A lane call on the broker's own duplicate `fd` of a driver file: the driver reads the
    private header, whose params pointer names the private parameter block (answered in
    place), never the tenant's memory; without the capabilities the driver checks.
    (return value, errno, the header as the driver left it, with the tenant's pointer)."""
    off = header.params_offset
    if off < 0:  # the header alone (RM_FREE, a plain escape)
        priv = bytearray(hdr)
        ret, err = _uncapable_ioctl_in_place(fd, header.ioctl_cmd, priv)
        return ret, err, bytes(priv)
    block = (ctypes.c_char * len(params)).from_buffer(params)
    priv = bytearray(hdr)
    struct.pack_into("<Q", priv, off, ctypes.addressof(block))
    try:
        ret, err = _uncapable_ioctl_in_place(fd, header.ioctl_cmd, priv)
    finally:
        del block  # (releases params for resizing)
    priv[off:off + 8] = hdr[off:off + 8]  # the tenant's pointer, as the driver leaves it
    return ret, err, bytes(priv)


def _uncapable_ioctl_in_place(fd: int, cmd: int, arg: bytearray) -> tuple[int, int]:
    """_ioctl_in_place on this thread without the capabilities the driver checks: the
    thread dropped them for its life (a seccomp listener), or they are lowered for the
    call."""
    if thread_is_driver_safe():
        return _ioctl_in_place(fd, cmd, arg)
    with effective_caps_lowered():
        return _ioctl_in_place(fd, cmd, arg)


class RealBackend:
    name = "real"
    # Capabilities (backends/base.py Backend says what each means): the host's driver files
    # are shown (filtered) and handed out to seccomp tenants; the driver credits relayed
    # objects to the relay, not to tenants, but accounts memory per process (VidmemMonitor);
    # the hand-over carries the relay's channels (backends/realhandover.py).
    host_proc = True
    reports_tenant_pids = False
    counts_process_memory = True
    handover_format = "real"
    # Lane calls run on the broker's own duplicates of relayed files (a counter; a class
    # default, so a backend rebuilt by a live upgrade starts at 0 too).
    relayed_here = 0
    # libcuda's checkpoint API, one helper process per call (backends/cudackpt.py); whether
    # the host's driver has it is probed once (`checkpointer.supported`), from start.
    checkpointer = CudaCheckpointer()

    def __init__(self, notice: Callable[[str], None] | None = None, *, dev: str = "/dev",
                 proc: Path = PROC, relay_uid: int | None = 65534, channels: int = 8,
                 discover: bool = True, private_dir: str | Path | None = None):
        self.notice = notice or (lambda m: log.info("%s", m))
        self.dev = dev
        self.proc = Path(proc)
        try:
            self.version = parse_version((self.proc / "version").read_text()) or "(unreadable)"
        except OSError as e:
            raise OSError(e.errno, f"no NVIDIA driver on this host ({self.proc}/version: "
                          f"{e.strerror})") from None
        try:  # an unknown driver may lay its structs out differently: refuse to start
            self.abi = registry.get(registry.require_supported(self.version, "NVIDIA driver"))
        except UnknownVersion as e:
            raise OSError(errno.ENOTSUP, f"real backend: {e}") from None
        self.memblock_size = _memblock_size()
        # Where the seccomp front end's per-open device nodes are made (tenantfile.py).
        self.private_dir = Path(private_dir or "/run/devbroker/private-nodes")
        self._private = None
        self._executor = None
        self._broker_gpu_fds: list[int] = []
        self._monitor = None
        self._gpus = discover_proc(self.proc)
        self.relay = RelayProcess(channels, uid=relay_uid)
        self._limiter = None
        self._noticed: set = set()
        self._keep: list[int] = []  # GPU fds held open so that tenant opens find it ready
        info = self.relay.info()
        self.relay_info = info
        self.notice(f"real backend: driver {self.version}, relay pid {info.pid} uid {info.uid} "
                    f"CapEff {info.cap_eff:#x} CapPrm {info.cap_prm:#x} CapBnd {info.cap_bnd:#x} "
                    f"no_new_privs {info.no_new_privs}")
        if info.cap_eff or info.cap_prm:
            self.relay.stop()
            raise OSError(errno.EPERM, "the relay process kept capabilities; refusing to run")
        if discover:
            self._discover()
            # (the answer is ready before preemption first asks, on the broker's trio thread)
            self.checkpointer.probe_soon()

    def prepare_tenant_files(self) -> None:
        """Make what tenant files need (the private-node tmpfs, the GPU files the broker
        holds) now, on the broker's main thread: opens come on seccomp listener threads,
        which have dropped CAP_SYS_ADMIN and so cannot mount."""
        self._tenant_nodes()

    # -- discovery through the driver (also a self-test of the relay)
    def _discover(self) -> None:
        try:
            found = query_gpus(self)
        except Exception as e:  # discovery is informative; /proc already gave the GPUs
            self.notice(f"real backend: driver query at start failed: {e}")
            return
        by_id = {g.gpu_id: g for g in self._gpus}
        out = []
        for q in found:
            g = by_id.get(q["gpu_id"])
            if g is None:
                self.notice(f"real backend: GPU id {q['gpu_id']:#x} from the driver is not in "
                            f"{self.proc}/gpus (ids there: {[hex(i) for i in by_id]})")
                continue
            out.append(RealGpu(g.index, q.get("name") or g.name, q.get("uuid") or g.uuid,
                               g.pci_bus_id, g.gpu_id, q.get("memory_bytes", 0),
                               q.get("device_instance")))
        if out:
            self._gpus = sorted(out, key=lambda g: g.index)
        self.notice("real backend: GPUs " + "; ".join(
            f"{g.index}: {g.name} {g.uuid} {g.pci_bus_id} id {g.gpu_id:#x} "
            f"{g.memory_bytes} bytes" for g in self._gpus))

    # -- Backend API
    def gpus(self) -> list[RealGpu]:
        return self._gpus

    def memory_in_use(self) -> None:
        """Not counted here: the driver accounts per process (process_vidmem)."""
        return None

    def gpu_index_of_instance(self, instance: int) -> int | None:
        """The GPU (minor) a device instance names, as the driver numbered them at start
        (the broker keeps every GPU's file open, so the numbering holds); minor = instance
        where discovery could not ask the driver."""
        known = {g.device_instance: g.index for g in self._gpus if g.device_instance is not None}
        if known:
            return known.get(instance)
        return instance if any(g.index == instance for g in self._gpus) else None

    def node_path(self, node: NodeKind, minor: int) -> str:
        if node is NodeKind.CTL:
            return f"{self.dev}/nvidiactl"
        if node is NodeKind.GPU:
            if not any(g.index == minor for g in self._gpus):
                raise OSError(errno.ENODEV, f"no GPU with minor {minor}")
            return f"{self.dev}/nvidia{minor}"
        if node is NodeKind.UVM:
            return f"{self.dev}/nvidia-uvm"
        raise OSError(errno.ENODEV, f"the real backend does not relay {node.name} nodes")

    # -- files that live in the tenant (seccomp front end; backends/tenantfile.py)
    tenant_files = True  # this backend can hand out real driver files to install

    def _tenant_nodes(self):
        if self._private is None:
            self._private = PrivateNodes(self.private_dir, self.dev)
            self._executor = NoCapsExecutor()
            # The driver lets a process allocate a device object (class 0x80) only while
            # its own fd table holds a file of that GPU (nv_is_gpu_accessible in nv.c
            # iterates current->files; measured on the H200: NV_ERR_INSUFFICIENT_PERMISSIONS
            # otherwise). The broker executes tenants' device allocations, so it keeps one
            # file of each GPU open, as the persistence daemon does; which GPU a tenant may
            # use is the policy's decision (deviceId checked before the call).
            for g in self._gpus:
                try:
                    self._broker_gpu_fds.append(
                        os.open(self.node_path(NodeKind.GPU, g.index), os.O_RDWR | os.O_CLOEXEC))
                except OSError as e:
                    self.notice(f"real backend: cannot hold GPU {g.index} open: {e}")
        return self._private

    def open(self, node: NodeKind, minor: int, *, tenant_file: bool = False,
             flags: int = os.O_RDWR):
        path = self.node_path(node, minor)
        if tenant_file:
            fd = self._tenant_nodes().open(path, flags)
            st = os.fstat(fd)
            return TenantFile(node, minor, path, (st.st_dev, st.st_ino), install_fd=fd)
        return RealFile(node, minor, self.relay.open(path), path)

    def after_open_answered(self, later: bool = False) -> bool:
        if self._private is None:
            return False
        if later and not self._private.running_low():
            return True  # (the spares last: the tidy waits for a quiet listener)
        self._private.tidy()
        return False

    def quiet_work(self) -> None:
        if self._private is not None:
            self._private.tidy()

    def close(self, file: RealFile) -> None:
        if getattr(file, "runs_in_caller", False):
            # A tenant file: the tenant holds it; the driver closes it with its last fd.
            if file.install_fd >= 0:
                os.close(file.install_fd)
                file.install_fd = -1
            file.closed = True
            return
        with file.lock:
            if file.closed:
                return
            file.closed = True
            if not file.users and file.local_fd >= 0:  # (else the last user closes it)
                os.close(file.local_fd)
                file.local_fd = -1
        self.relay.close(file.rfd)

    def map_read(self, file: RealFile, offset: int, length: int) -> bytes:
        if not file.map_length:
            raise OSError(errno.EINVAL, "no mapping context on this file")
        return self.relay.mapread(file.rfd, file.map_length, offset, length)

    def _prepare_tenant_call(self, file, dc: DriverCall):
        """The request for a call on the broker's duplicate of the tenant's own file, with
        the broker's private copies of every buffer; a DriverResult when it cannot run."""
        if dc.file_fd is None:
            return DriverResult(arg=dc.call.encode(), errno=errno.EBADF)
        view = DriverCall(dc.call, dc.nested, {p: FdRef(fd) for p, fd in dc.fds.items()},
                          abi=dc.abi, tgid=dc.tgid, embedded=dc.embedded)
        try:
            prep = prepare_ioctl(FdRef(dc.file_fd, file.node, file.minor), view)
        except Unrelayable as e:
            self._note(("unrelayable", str(e)), f"real backend: {e}: NV_ERR_NOT_SUPPORTED "
                                                "(the driver was not called)")
            return not_supported(dc)
        self._tenant_nodes()
        return prep

    def _finish_tenant_call(self, dc: DriverCall, prep, rep) -> DriverResult:
        arg, nested = finish_ioctl(prep, rep)
        if rep.ret >= 0:
            for path, i in prep.deep:
                dc.embedded[path][:] = rep.buffers[i]
        self.last_ns = rep.ns
        return DriverResult(arg=arg, nested=nested, result=rep.ret, errno=rep.errno)

    async def _tenant_file_ioctl(self, file, dc: DriverCall) -> DriverResult:
        """On the trio thread: short calls inline with the thread's effective capabilities
        lowered (a worker hop costs more than the control itself), others on a worker
        thread without capabilities."""
        prep = self._prepare_tenant_call(file, dc)
        if isinstance(prep, DriverResult):
            return prep
        if dc.call.name in INLINE_CALLS:
            with effective_caps_lowered():
                rep = run_ioctl(prep.request)
        else:
            rep = await self._executor.run(run_ioctl, prep.request)
        return self._finish_tenant_call(dc, prep, rep)

    def ioctl_blocking(self, file, dc: DriverCall) -> DriverResult:
        """On a seccomp listener thread (broker/effects.py): a call on a tenant file runs
        right here, without the capabilities the driver checks (dropped for the
        thread's life, tenantfile.drop_driver_capabilities_for_thread, or lowered for the
        call): the driver must never see CAP_SYS_ADMIN on a tenant's behalf; a slow call holds only this
        tenant's listener thread. Relayed files are served the trio way."""
        if not getattr(file, "runs_in_caller", False):
            return self._relay_here(file, dc)
        prep = self._prepare_tenant_call(file, dc)
        if isinstance(prep, DriverResult):
            return prep
        if thread_is_driver_safe():  # a listener thread without the driver-checked caps
            rep = run_ioctl(prep.request)
        else:
            with effective_caps_lowered():
                rep = run_ioctl(prep.request)
        return self._finish_tenant_call(dc, prep, rep)

    def can_run_control(self, file) -> bool:
        # a tenant file (on the broker's duplicate), or a relayed one when the relay has a
        # channel for front-end threads (run_control below; NotHere when it is busy)
        return getattr(file, "runs_in_caller", False) or (
            self.relay is not None and getattr(self.relay, "thread_chan", None) is not None)

    def control_is_plain_ioctl(self, file) -> bool:
        return getattr(file, "runs_in_caller", False)  # run_control below, on such a file

    def run_control(self, file, fd: int, hdr: bytes, params: bytearray, header,
                    abi) -> tuple[int, int, bytes]:
        """A control the broker admitted unchanged (broker/fastlane.py), on the broker's
        duplicate of a tenant file: the driver reads the private header, whose params
        pointer names the private parameter block (answered in place), never the tenant's
        memory. On this thread, without the capabilities the driver checks (as
        ioctl_blocking). A relayed file: through the relay (`_run_control_relayed`)."""
        if not getattr(file, "runs_in_caller", False):
            return self._run_control_relayed(file, hdr, params, header)
        if fd < 0:
            raise NotHere
        return _run_control_on(fd, hdr, params, header)

    # -- the broker's own duplicates of relayed files --------------------------------------
    def _lend(self, file: RealFile) -> int | None:
        """The broker's duplicate of a relayed file for one lane call, made at the first
        (pidfd_getfd of the relay's fd, checked to be the node the relay opened); None when
        it cannot be had (the relay's channel then). NotHere when the file is closed. Every
        _lend is followed by one _unlend."""
        with file.lock:
            if file.closed:
                raise NotHere
            if file.local_fd < 0:
                try:
                    fd = self.relay.take_fd(file.rfd)
                except OSError as e:
                    self._note(("take_fd", e.errno),
                               f"relayed files: no duplicate of the relay's file "
                               f"({e.strerror}); lane calls go through the relay")
                    return None
                try:
                    same = os.fstat(fd).st_rdev == os.stat(file.path).st_rdev
                except OSError:
                    same = False
                if not same:  # (a bug: never call the driver on another file)
                    os.close(fd)
                    log.error("relayed file %s: the relay's fd %d is not that node",
                              file.path, file.rfd)
                    return None
                file.local_fd = fd
            file.users += 1
            return file.local_fd

    def _unlend(self, file: RealFile) -> None:
        with file.lock:
            file.users -= 1
            if file.closed and not file.users and file.local_fd >= 0:
                os.close(file.local_fd)
                file.local_fd = -1

    def _run_control_relayed(self, file, hdr: bytes, params: bytearray,
                             header) -> tuple[int, int, bytes]:
        """A lane call (control or allocation) on a relayed file. From a thread that has
        dropped the capabilities the driver checks for its life (a FUSE reader thread,
        tenantfile.drop_driver_capabilities_for_thread: effective and permitted sets, so no
        bug can raise them again), on the broker's own duplicate of the relay's file
        (`_lend`), as the seccomp listeners run the same calls on duplicates of tenant
        files: the driver validates the client by the open file, not the process
        (BRIEF §8; an RM client's accounting stays its creator's, the relay's), and the
        lane's calls are none of those the driver binds to the calling process. This saves
        the relay's round trip (docs/benchmarks.md, "The hot path"); `relayed_here` counts
        such calls (a lane call on them took 134 µs against 182 through the relay on the H200:
        docs/hardware.md). Any other thread, or no duplicate: through
        the relay's channel for front-end threads — the header with its parameter pointer
        cleared and the private parameter block as the buffer that pointer names (the relay
        points it at its own copy), so the driver reads the broker's copies only, from the
        relay's capability-less process. What the general path's prepare_ioctl builds for
        the same call: the lane's calls hold no fd and no other pointer (a checked call's
        pointers are NULL). NotHere when the channel is taken (the general way then)."""
        if getattr(file, "closed", False):
            raise NotHere
        if thread_is_driver_safe():
            fd = self._lend(file)
            if fd is not None:
                try:
                    t0 = time.monotonic_ns()
                    out = _run_control_on(fd, hdr, params, header)
                    self.last_ns = time.monotonic_ns() - t0
                    self.relayed_here += 1
                    return out
                finally:
                    self._unlend(file)
        off = header.params_offset
        if off < 0:  # the header alone (RM_FREE, a plain escape)
            rep = self.relay.ioctl_here(w.IoctlRequest(file.rfd, header.ioctl_cmd,
                                                       [w.Buffer(bytes(hdr))]))
            self.last_ns = rep.ns
            return rep.ret, rep.errno, bytes(rep.buffers[0])
        arg = bytearray(hdr)
        arg[off:off + 8] = bytes(8)
        rep = self.relay.ioctl_here(w.IoctlRequest(
            file.rfd, header.ioctl_cmd, [w.Buffer(bytes(arg)), w.Buffer(bytes(params), 0, off)]))
        out = bytearray(rep.buffers[0])
        out[off:off + 8] = hdr[off:off + 8]  # the tenant's pointer, as the driver leaves it
        if rep.ret >= 0 and len(rep.buffers) > 1 and len(rep.buffers[1]) == len(params):
            params[:] = rep.buffers[1]
        self.last_ns = rep.ns
        return rep.ret, rep.errno, bytes(out)

    async def ioctl(self, file: RealFile, dc: DriverCall) -> DriverResult:
        import trio

        if getattr(file, "runs_in_caller", False):
            return await self._tenant_file_ioctl(file, dc)
        try:
            prep = prepare_ioctl(file, dc)
        except Unrelayable as e:
            self._note(("unrelayable", str(e)), f"real backend: {e}: NV_ERR_NOT_SUPPORTED "
                                                "(the driver was not called)")
            return not_supported(dc)
        except OSError as e:
            return DriverResult(arg=dc.call.encode(), errno=e.errno or errno.EFAULT)
        with trio.CancelScope(shield=True):  # a half-done exchange would desync a channel
            rep = await self.relay.aioctl(prep.request)
        return self._relayed(dc, prep, rep)

    def _relay_here(self, file: RealFile, dc: DriverCall) -> DriverResult:
        """A relayed call from a front end's thread: the relay's channel for
        threads, blocking; NotHere (the trio way) when it is taken."""
        try:
            prep = prepare_ioctl(file, dc)
        except Unrelayable:
            raise NotHere from None  # the trio way notes and answers it
        except OSError as e:
            return DriverResult(arg=dc.call.encode(), errno=e.errno or errno.EFAULT)
        return self._relayed(dc, prep, self.relay.ioctl_here(prep.request))

    def _relayed(self, dc: DriverCall, prep, rep) -> DriverResult:
        arg, nested = finish_ioctl(prep, rep)
        if rep.ret >= 0:
            for path, i in prep.deep:  # the core writes them back to the tenant
                dc.embedded[path][:] = rep.buffers[i]
        if dc.call.name == "NV_ESC_RM_MAP_MEMORY" and rep.ret >= 0:
            self._after_map(dc, arg)
        self.last_ns = rep.ns
        return DriverResult(arg=arg, nested=nested, result=rep.ret, errno=rep.errno)

    def _after_map(self, dc: DriverCall, arg: bytes) -> None:
        out = dc.call.spec.params.decode(arg) if dc.call.spec.params else None
        target = dc.fd_files.get("fd")
        if out is None or target is None or out.params.status != nvs.NV_OK:
            return
        target.map_length = (int(out.params.length) + PAGE - 1) // PAGE * PAGE or PAGE

    def _note(self, key, msg: str) -> None:
        if key not in self._noticed:
            self._noticed.add(key)
            self.notice(msg)

    def process_vidmem(self, tgid: int) -> dict[int, int]:
        """The driver's per-process video-memory accounting for tgid (GPU index -> bytes)."""
        return self.process_vidmem_many([tgid])[tgid]

    def process_vidmem_many(self, tgids: list[int]) -> dict[int, dict[int, int]]:
        """The same for several processes at once (tgid -> GPU index -> bytes)."""
        if self._monitor is None:
            self._monitor = VidmemMonitor(self)
        return self._monitor.usage(list(tgids))

    def stop(self) -> None:
        self.relay.stop()
        if self._executor is not None:
            self._executor.stop()
        if self._private is not None:
            self._private.close()
        for fd in self._broker_gpu_fds:
            os.close(fd)
        self._broker_gpu_fds = []


# --------------------------------------------------------------------------- the broker's own RM calls
class RelayRmClient:
    """An RM client of the broker's own, spoken through the relay's synchronous channel
    (capability-less, like every driver call of this backend): GPU discovery at start and
    the quota watch's accounting reads use it. Never on a tenant's behalf."""

    def __init__(self, backend: "RealBackend", first_handle: int):
        self.backend = backend
        self.abi, self.relay = backend.abi, backend.relay
        self.handles = itertools.count(first_handle, 0x10)
        self.ctl = self.relay.open(f"{backend.dev}/nvidiactl")
        self.client = 0
        try:
            self.client = self.alloc(0, 0x41)
        except OSError:
            self.relay.close(self.ctl)
            raise

    def esc(self, fd: int, name: str, value, nested: bytes | None = None, ptr_field: str = ""):
        bufs = [w.Buffer(value.encode())]
        if nested is not None:
            bufs.append(w.Buffer(nested, 0, value.spec.by_name[ptr_field].offset))
        rep = self.relay.ioctl(self.relay.sync,
                               w.IoctlRequest(fd, self.abi.escape_cmd(name, len(bufs[0].data)),
                                              bufs))
        if rep.ret < 0:
            raise OSError(rep.errno, f"{name}: {os.strerror(rep.errno)}")
        return value.spec.decode(rep.buffers[0]), (rep.buffers[1] if nested is not None else None)

    def new(self, struct_name: str, **kw):
        spec = self.abi.struct(struct_name)
        return spec.decode(bytes(spec.size)).replace(**kw)

    def alloc(self, parent: int, cls: int, params=None) -> int:
        v = self.new("NVOS64_PARAMETERS", hRoot=self.client, hObjectParent=parent,
                     hObjectNew=0 if cls == 0x41 else next(self.handles), hClass=cls)
        out, _ = self.esc(self.ctl, "NV_ESC_RM_ALLOC", v,
                          params.encode() if params is not None else None, "pAllocParms")
        if out.status != nvs.NV_OK:
            raise OSError(errno.EIO, f"RM_ALLOC {cls:#x}: {nvs.name(out.status)}")
        return out.hObjectNew

    def control(self, obj: int, cmd: int, params=None, **kw):
        pspec = self.abi.control(cmd).params
        p = params if params is not None else pspec.decode(bytes(pspec.size)).replace(**kw)
        return pspec.decode(self.control_raw(obj, cmd, p.encode()))

    def control_raw(self, obj: int, cmd: int, params: bytes) -> bytes:
        """control() with the parameters as bytes in and out (the quota watch reads
        200-entry blocks from a worker thread without the codec, whose Python would hold
        the interpreter lock that listener threads want)."""
        v = self.new("NVOS54_PARAMETERS", hClient=self.client, hObject=obj, cmd=cmd,
                     paramsSize=len(params))
        out, nested = self.esc(self.ctl, "NV_ESC_RM_CONTROL", v, params, "params")
        if out.status != nvs.NV_OK:
            raise OSError(errno.EIO, f"control {self.abi.control_name(cmd)}: "
                                     f"{nvs.name(out.status)}")
        return nested

    def open_gpu(self, index: int, device_instance: int) -> tuple[int, int]:
        """A device and subdevice of this client on GPU `index` (its node file stays open in
        the relay, like the persistence daemon's). Returns (hDevice, hSubdevice)."""
        gfd = self.relay.open(f"{self.backend.dev}/nvidia{index}")
        self.backend._keep.append(gfd)
        self.esc(gfd, "NV_ESC_REGISTER_FD", self.new("nv_ioctl_register_fd_t", ctl_fd=self.ctl))
        hdev = self.alloc(self.client, 0x80,
                          self.new("NV0080_ALLOC_PARAMETERS", deviceId=device_instance))
        return hdev, self.alloc(hdev, 0x2080, self.new("NV2080_ALLOC_PARAMETERS"))

    def close(self) -> None:
        """Free the client (and all it holds) and close the file."""
        try:
            self.esc(self.ctl, "NV_ESC_RM_FREE", self.new(
                "NVOS00_PARAMETERS", hRoot=self.client, hObjectParent=0, hObjectOld=self.client))
        finally:
            self.relay.close(self.ctl)


class VidmemMonitor:
    """The driver's own per-process video-memory accounting (NV2080_CTRL_CMD_GPU_GET_PID_INFO,
    VIDEO_MEMORY_USAGE: memory of the clients whose owner is that pid), read on a client of
    the broker's own. The broker uses it to catch device memory a tenant got past the
    broker's books (a racing thread rewriting a continued allocation,
    rules._RACE_ALLOC_MEMORY; broker/quotawatch.py). Thread-safe: the quota watch reads it
    from a worker thread."""

    PER_CALL = 200  # entries of one GET_PID_INFO (NV2080_CTRL_GPU_GET_PID_INFO_MAX_COUNT)

    def __init__(self, backend: "RealBackend"):
        self.backend = backend
        self.rm: RelayRmClient | None = None
        self.subdevices: dict[int, int] = {}  # GPU index -> subdevice handle
        self.lock = threading.Lock()
        self._layout: tuple | None = None  # GET_PID_INFO's offsets, from the ABI tables

    def _open(self) -> None:
        rm = RelayRmClient(self.backend, 0xDB100000)
        for g in self.backend.gpus():
            info = rm.control(rm.client, 0x205, gpuId=g.gpu_id)
            self.subdevices[g.index] = rm.open_gpu(g.index, info.deviceInstance)[1]
        self.rm = rm

    def usage(self, tgids: list[int]) -> dict[int, dict[int, int]]:
        """Bytes of video memory the driver accounts to each process, per GPU index: one
        control per GPU for up to PER_CALL processes."""
        with self.lock:
            if self.rm is None:
                self._open()
            out: dict[int, dict[int, int]] = {t: {} for t in tgids}
            for i, hsub in self.subdevices.items():
                for k in range(0, len(tgids), self.PER_CALL):
                    part = tgids[k:k + self.PER_CALL]
                    for tgid, n in zip(part, self._read(hsub, part)):
                        out[tgid][i] = n
            return out

    def _read(self, hsub: int, tgids: list[int]) -> list[int]:
        if self._layout is None:
            p = self.rm.abi.control(0x2080018E).params
            e = self.rm.abi.struct("NV2080_CTRL_GPU_PID_INFO")
            f = {x.name: x.offset for x in e.fields}
            self._layout = (p.size, p.by_name["pidInfoList"].offset, e.size,
                            f["pid"], f["index"], f["result"], f["data"])
        size, base, stride, o_pid, o_index, o_result, o_data = self._layout
        req = bytearray(size)
        struct.pack_into("<I", req, 0, len(tgids))  # pidInfoListCount
        for j, tgid in enumerate(tgids):
            at = base + j * stride
            struct.pack_into("<I", req, at + o_pid, tgid)
            struct.pack_into("<I", req, at + o_index, 0)  # VIDEO_MEMORY_USAGE
        got = self.rm.control_raw(hsub, 0x2080018E, bytes(req))
        res = []
        for j in range(len(tgids)):
            at = base + j * stride
            result, = struct.unpack_from("<I", got, at + o_result)
            priv, shared = struct.unpack_from("<QQ", got, at + o_data)
            res.append((priv + shared) if result == nvs.NV_OK else 0)
        return res


# --------------------------------------------------------------------------- discovery
def query_gpus(backend: "RealBackend") -> list[dict]:
    """Ask the driver, through the relay, which GPUs it has: GET_ATTACHED_IDS, then per GPU
    its name, UUID and memory (FB_GET_INFO_V2 TOTAL_RAM_SIZE). The GPU files opened for
    this stay open (like the persistence daemon), so tenants' opens find the GPU ready."""
    rm = RelayRmClient(backend, 0xDB000010)
    found = []
    try:
        ids = [i for i in rm.control(rm.client, 0x201).gpuIds if i != 0xFFFFFFFF]
        by_id = {g.gpu_id: g for g in backend._gpus}
        for gid in ids:
            info = rm.control(rm.client, 0x205, gpuId=gid)
            g = by_id.get(gid)
            q = {"gpu_id": gid, "device_instance": info.deviceInstance}
            found.append(q)
            if g is None:
                continue
            _hdev, hsub = rm.open_gpu(g.index, info.deviceInstance)
            name = rm.control(hsub, 0x20800110)
            q["name"] = bytes(name.gpuNameString.raw).split(b"\0", 1)[0].decode("ascii", "replace")
            fb = rm.abi.control(0x20801303).params
            entries = list(fb.decode(bytes(fb.size)).fbInfoList)
            entries[0] = entries[0].replace(index=0x08)  # TOTAL_RAM_SIZE (KiB)
            out = rm.control(hsub, 0x20801303, fbInfoListSize=1, fbInfoList=entries)
            q["memory_bytes"] = int(list(out.fbInfoList)[0].data) * 1024
    finally:
        rm.close()
    return found


def _memblock_size() -> int | None:
    try:
        return int(MEMBLOCK.read_text().strip(), 16)
    except (OSError, ValueError):
        return None
