"""Real driver files that live in the tenant's own fd table (seccomp front end, real backend).

CUDA needs what a relay cannot give it: UVM and RM_MAP_MEMORY act on the calling process
(its tgid, its mm), and its mappings must be the driver's own (doorbells, GPU memory). So
with the seccomp front end the tenant holds a **real** driver file, installed by the broker
at `open` (SECCOMP_IOCTL_NOTIF_ADDFD), and every NVIDIA ioctl on it stops at the broker,
which either refuses it, executes it itself on a duplicate of the tenant's file
(`pidfd_getfd`) with private copies of every argument, or lets the kernel continue it in the
tenant (only calls the driver binds to the calling process; broker/allow.py says which and
why a racing thread cannot turn them into something refused). docs/seccomp.md has the
design; this module has the two mechanisms it needs from the host:

- :class:`PrivateNodes`: each open goes through a device node of its own (same major/minor
  as the host's, in a private directory, each opened once and unlinked after the tenant has
  its answer), so every open file
  has an inode of its own. The front end then knows which session an fd is by
  ``(st_dev, st_ino)``, exactly as for memfd placeholders, and an inotify watch on that inode
  reports when the last reference (fd or mapping, in any process) is gone.
- :class:`NoCapsExecutor`: threads that hold **no capability at all** (dropped per thread
  with capset; the broker's other threads keep theirs). The driver checks
  ``capable(CAP_SYS_ADMIN)``, ``CAP_PERFMON`` and ``CAP_SYS_NICE`` of the caller at every
  ioctl (kernel-open/nvidia/os-interface.c: os_is_administrator, os_check_access): a call
  the broker executes on a tenant's behalf is never privileged.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import secrets
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from devbroker.abi.nodes import NodeKind
from devbroker.sandbox import linux

log = logging.getLogger("devbroker.tenantfile")


def thread_caps() -> tuple[int, int]:
    """(effective, permitted) capability sets of the calling thread."""
    eff, prm, _inh = linux.capget()
    return eff, prm


def drop_thread_capabilities() -> None:
    """Drop every capability of the calling thread only (capset acts per thread; glibc's
    setuid broadcast is not involved). Raises if anything is left."""
    linux.capset(0, 0, 0)
    eff, prm = thread_caps()
    if eff or prm:
        raise OSError(errno.EPERM, f"capabilities left after the drop: eff={eff:#x} prm={prm:#x}")


class effective_caps_lowered:
    """Context manager: the calling thread runs with an empty *effective* capability set
    (its permitted set is kept, and the effective set restored on exit). For short driver
    calls the broker runs inline on its trio thread: the driver evaluates capable() of the
    caller at the ioctl, which then holds none (checked before the call)."""

    def __enter__(self):
        self._saved = linux.capget()
        _eff, prm, inh = self._saved
        linux.capset(0, prm, inh)
        if thread_caps()[0]:
            raise OSError(errno.EPERM, "effective capabilities left after lowering them")
        return self

    def __exit__(self, *exc):
        try:
            linux.capset(*self._saved)
        except OSError as e:
            log.error("could not restore the broker thread's effective capabilities: %s",
                      e.strerror)
        return False


class NoCapsExecutor:
    """A few threads without capabilities that run driver calls for the trio loop.

    ``await run(fn, *args)`` queues fn for a worker and waits; cancellation waits for the
    call to finish (a half-done driver call cannot be taken back). Each worker drops its
    capabilities before taking its first job and re-checks them before every job: a worker
    that somehow holds one refuses to run anything.
    """

    def __init__(self, threads: int = 4, name: str = "devbroker-driver"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._ready = threading.Barrier(threads + 1)
        self.errors: list[BaseException] = []
        for i in range(threads):
            t = threading.Thread(target=self._worker, name=f"{name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        self._ready.wait(10)
        if self.errors:
            raise OSError(errno.EPERM, f"driver executor: {self.errors[0]}")

    def _worker(self) -> None:
        try:
            drop_thread_capabilities()
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            self.errors.append(e)
            self._ready.wait(10)
            return
        self._ready.wait(10)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, deliver = job
            try:
                eff, prm = thread_caps()
                if eff or prm:
                    raise OSError(errno.EPERM, "driver worker holds capabilities; refusing")
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting task
                deliver(e, None)
            else:
                deliver(None, result)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        import outcome

        def deliver(exc, result):
            out = outcome.Error(exc) if exc is not None else outcome.Value(result)
            token.run_sync_soon(trio.lowlevel.reschedule, task, out)

        self._jobs.put((fn, args, deliver))
        # wait_task_rescheduled unwraps the outcome (raising the worker's exception).
        return await trio.lowlevel.wait_task_rescheduled(
            lambda _raise_cancel: trio.lowlevel.Abort.FAILED)

    def stop(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


# --------------------------------------------------------------------------- private nodes
def nvidia_majors(proc_devices: str = "/proc/devices") -> dict[str, int]:
    """Character majors of the NVIDIA drivers ("nvidia-frontend"/"nvidia", "nvidia-uvm",
    "nvidia-caps", …) from /proc/devices."""
    out: dict[str, int] = {}
    try:
        text = Path(proc_devices).read_text()
    except OSError:
        return out
    chars = text.split("Block devices:")[0]
    for line in chars.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].startswith("nvidia"):
            out[parts[1]] = int(parts[0])
    return out


# What the driver asks capable() about (kernel-open/nvidia/os-interface.c, nv-linux.h):
# CAP_SYS_ADMIN (os_is_administrator), CAP_PERFMON and CAP_SYS_NICE (os_check_access).
CAP_SYS_NICE = 23
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
DRIVER_CAPS = (1 << CAP_SYS_ADMIN) | (1 << CAP_SYS_NICE) | (1 << CAP_PERFMON)

_thread_state = threading.local()


def drop_driver_capabilities_for_thread() -> None:
    """For a thread that executes driver calls for tenants and does nothing else that needs
    them (a seccomp listener thread): drop the capabilities the driver checks from this
    thread's effective **and** permitted sets, once, for the thread's life. The thread keeps
    the rest (CAP_SYS_PTRACE for pidfd_getfd and process_vm_readv, CAP_MKNOD for private
    nodes). Saves two capset calls per executed ioctl; checked with capget."""
    eff, prm, inh = linux.capget()
    linux.capset(eff & ~DRIVER_CAPS, prm & ~DRIVER_CAPS, inh & ~DRIVER_CAPS)
    eff, prm = thread_caps()
    if (eff | prm) & DRIVER_CAPS:
        raise OSError(errno.EPERM, f"driver-checked capabilities left: {eff:#x}/{prm:#x}")
    _thread_state.driver_safe = True


def thread_is_driver_safe() -> bool:
    """Whether this thread dropped the driver-checked capabilities for good."""
    return getattr(_thread_state, "driver_safe", False)


class PrivateNodes:
    """Opens driver files through device nodes of their own (one inode per open file).

    The directory is a tmpfs of the broker's (device nodes need a mount without nodev),
    mode 0700. Each node is opened once: `open` takes a node made ahead of time for that
    host path (or makes one), opens it and hands it to `tidy`, which the front end calls
    after it has answered the tenant (mknod, unlink and the host node's stat cost
    ~40 µs of a tenant's ~200 µs open on the development machine). `tidy` unlinks the
    opened nodes and makes `SPARE` new ones for each host path opened since, from a fresh
    stat of the host node (a node whose device number no longer matches is dropped unused).
    Only the broker reaches the directory; a node is taken out of the spare list under the
    lock before it is opened, so no node is ever opened twice. (The device numbers cannot
    change under a running real backend anyway: it holds every GPU's file open, so the
    driver cannot be unloaded; were they to, the opens before the next tidy would reach the
    old numbers.)"""

    # Nodes kept ready per host path (a CUDA init opens nvidiactl 30 times, nvidia0 18,
    # nvidia-uvm 4; NVML 6 files per init). The tidy runs on a listener thread: on the H200
    # that measured best (NVIDIA opens ~180 µs over native in NVML's sequence) against a
    # thread of its own, woken per open or after a quiet 2 ms (~225 and ~245 µs: its Python
    # competes with the listeners for the interpreter). A listener that can wait for a quiet
    # moment (the native loop: 1 ms without a notification) tidies then, unless a path
    # runs low (`running_low`: fewer than LOW spares), when it tidies right after the
    # answer; the tenant's next call never waits for the tidy of a burst of opens
    # (tenantfile's mknod/unlink of every open: ~100 µs on the development machine).
    SPARE = 32
    LOW = 4

    def __init__(self, directory: str | Path, dev: str = "/dev"):
        self.dir = Path(directory)
        self.dev = dev
        self.mounted = False
        self._init_pool()
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        try:
            linux.mount("devbroker-nodes", str(self.dir), "tmpfs",
                        linux.MS_NOSUID | linux.MS_NOEXEC, "mode=0700,size=64k")
            self.mounted = True
        except OSError as e:  # the directory's own file system may allow device nodes
            log.info("private nodes: tmpfs mount on %s failed (%s); using the directory as is",
                     self.dir, e)

    def _init_pool(self) -> None:
        """(Also for an adopted instance, realhandover: a successor starts with no spares.)"""
        self._lock = threading.Lock()
        self._spare: dict[str, list[tuple[str, int]]] = {}  # host path -> [(node, rdev)]
        self._opened: list[str] = []  # opened nodes, to unlink
        self._wanted: set[str] = set()  # host paths opened since the last tidy
        self._prefix = f"{self.dir}/{secrets.token_hex(3)}."
        self._names = itertools.count()


    def rdev(self, path: str) -> int:
        st = os.stat(path)
        if not stat.S_ISCHR(st.st_mode):
            raise OSError(errno.ENODEV, f"{path} is not a character device")
        return st.st_rdev

    def _make(self, host_path: str, rdev: int) -> str:
        # (only the broker reaches the directory: a counter names nodes apart; the random
        # part keeps a successor's names apart from nodes a predecessor may have left)
        node = f"{self._prefix}{os.path.basename(host_path)}.{next(self._names)}"
        os.mknod(node, stat.S_IFCHR | 0o600, rdev)
        return node

    def open(self, host_path: str, flags: int) -> int:
        with self._lock:
            spare = self._spare.get(host_path)
            node = spare.pop()[0] if spare else None
            self._wanted.add(host_path)
        if node is None:
            node = self._make(host_path, self.rdev(host_path))
        try:
            mode = os.O_RDWR | os.O_CLOEXEC | (flags & os.O_NONBLOCK)
            return os.open(node, mode)
        finally:
            with self._lock:
                self._opened.append(node)

    def running_low(self) -> bool:
        """Whether a host path opened since the last tidy has fewer than LOW spares left
        (then the tidy should not wait)."""
        with self._lock:
            return any(len(self._spare.get(p, ())) < self.LOW for p in self._wanted)

    def tidy(self) -> None:
        """Unlink the nodes opened since the last call and make spares for the host paths
        they came from. Not on the tenant's path: the front end calls it after answering.
        Errors are logged (the next open makes its node itself)."""
        with self._lock:
            opened, self._opened = self._opened, []
            wanted, self._wanted = self._wanted, set()
        for node in opened:
            try:
                os.unlink(node)
            except OSError as e:
                log.warning("private nodes: unlink %s: %s", node, e)
        for host_path in wanted:
            try:
                rdev = self.rdev(host_path)
                with self._lock:
                    have = self._spare.setdefault(host_path, [])
                    stale = [n for n, r in have if r != rdev]
                    have[:] = [(n, r) for n, r in have if r == rdev]
                    need = self.SPARE - len(have)
                for n in stale:
                    os.unlink(n)
                made = [(self._make(host_path, rdev), rdev) for _ in range(need)]
                with self._lock:
                    self._spare[host_path].extend(made)
            except OSError as e:
                log.warning("private nodes: spare nodes for %s: %s", host_path, e)

    def drop_nodes(self) -> None:
        """Unlink every node not yet unlinked (spares and opened ones): at close, and before
        a live upgrade hands the directory to a successor (which starts with none)."""
        with self._lock:
            nodes = self._opened + [n for have in self._spare.values() for n, _ in have]
            self._opened, self._spare, self._wanted = [], {}, set()
        for n in nodes:
            try:
                os.unlink(n)
            except OSError:
                pass

    def close(self) -> None:
        self.drop_nodes()
        if self.mounted:
            try:
                linux.umount2(str(self.dir), linux.MNT_DETACH)
            except OSError as e:
                log.warning("private nodes: umount %s: %s", self.dir, e)
            self.mounted = False


@dataclass(eq=False)
class TenantFile:
    """A driver file that lives in the tenant's fd table. The broker holds no reference
    once the front end has installed ``install_fd``; each executed call brings a duplicate
    of the tenant's file (DriverCall.file_fd)."""

    node: NodeKind
    minor: int
    path: str  # the host node it opens (for messages)
    key: tuple[int, int]  # (st_dev, st_ino) of its private node
    install_fd: int = -1  # the broker's copy until the front end installs it
    runs_in_caller: bool = True  # calls the driver binds to the caller may be continued
    closed: bool = False
    # Root-client allocations the tenant made itself (continued) on this file; the broker
    # learns their handles when the tenant first names them here (Broker._adopt_client).
    continued_root_allocs: int = 0
    adopted: set[int] = field(default_factory=set)


@dataclass
class FdRef:
    """Stands for a file in prepare_ioctl: a number in the executing process's fd table."""

    rfd: int
    node: NodeKind = NodeKind.OTHER
    minor: int = 0
