"""Tenant memory is touched only from worker threads, and only for a bounded time.

Why: a tenant's pointer can lead into a page whose fault the kernel cannot
complete on its own — a page the tenant mapped from the broker's own FUSE mount (the fault
becomes a FUSE READ that only the broker can answer), a userfaultfd range nobody serves, a
file on a FUSE server the tenant runs. ``process_vm_readv``/``writev`` then sleeps, often
uninterruptibly, until someone answers. Done on the trio thread (as it was), that froze every
tenant, the control socket and SIGTERM, with no audit line. So every access to a tenant's
memory goes through a :class:`MemoryGate`:

1. it runs on a worker thread: the trio thread, which serves FUSE, the control socket and
   every other tenant, never waits on a tenant's page;
2. it has a deadline (:attr:`MemoryGate.deadline`): past it the request is refused with
   EFAULT (the broker's audit record names the tenant), and the thread is *abandoned* — it is
   still in the kernel, so it is counted as **stalled** for its tenant until it returns
   (``devbroker status`` shows the count; its return is audited);
3. a tenant with :attr:`MemoryGate.stall_limit` stalled threads has its further accesses
   refused at once, and at most :attr:`MemoryGate.threads` of its accesses run at a time, so
   no tenant can make the broker pile up threads;
4. while an access runs, its thread id is published (:func:`accessing`): the FUSE front end
   answers a fault that such a thread takes on the broker's own mount with an error at once
   (``note_own_mount_fault``) instead of serving the tenant a read through the broker's own
   nodes, and the access fails promptly with EFAULT, its reason saying why.

Point 4 makes the common case (the broker's own mount) fail fast; points 1–3 make *any* case
harmless to everyone else, including ones no check can foresee (a racing thread that remaps
the page between a check and the read, userfaultfd, a foreign FUSE server).
"""
from __future__ import annotations

import errno
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import trio

log = logging.getLogger("devbroker.memgate")

# Thread ids (as the kernel numbers them: what a FUSE request header carries) of the threads
# now reading or writing a tenant's memory, and which tenant. Written by the worker threads,
# read by the FUSE front end on the trio thread; dict get/set/pop are atomic under the GIL.
_accessing: dict[int, str] = {}
_own_mount_faults: set[int] = set()
_lock = threading.Lock()


def accessing(tid: int) -> str | None:
    """The tenant whose memory thread `tid` is reading or writing now, or None."""
    return _accessing.get(tid)


def note_own_mount_fault(tid: int) -> None:
    """The front end refused a fault that tenant-memory thread `tid` took on its own mount."""
    with _lock:
        _own_mount_faults.add(tid)


class MemoryAccessRefused(OSError):
    """A tenant-memory access refused by the gate (deadline, stall limit, own-mount page)."""


@dataclass
class _Job:
    event: threading.Event
    outcome: Any = None  # outcome.Value / outcome.Error once the thread is done
    done: bool = False
    wake: trio.Event | None = None  # set from the thread when the trio side waits for it
    abandoned: bool = False  # refused at its deadline while fn ran: counted as stalled
    started: float = 0.0


class MemoryGate:
    """Runs accesses to tenants' memory on worker threads with a deadline (see module doc).

    One per broker; the seccomp front end uses the broker's. ``audit`` (an AuditLog, which
    is thread-safe) gets a notice when an abandoned thread finally returns."""

    deadline = 2.0  # seconds; a normal access takes microseconds, a page-in from swap ms
    stall_limit = 4  # abandoned threads per tenant before its accesses are refused at once
    threads = 16  # accesses of one tenant in flight at the same time (stalled ones count)
    # How long the trio thread waits for the worker *blocking*, before it waits the trio way.
    # A normal access is back in ~30 µs, and a blocking wait costs no trio wake-up (a trio
    # wait doubles the cost of each access, measured: ~90 vs ~30 µs). Bounded, so a page that
    # does not come holds the trio thread at most this long; then it serves everyone else
    # (including the FUSE READ that such a page may be waiting for) until the deadline.
    inline_wait = 0.001

    def __init__(self, audit: Any = None, *, deadline: float | None = None,
                 stall_limit: int | None = None, threads: int | None = None):
        self.audit = audit
        if deadline is not None:
            self.deadline = deadline
        if stall_limit is not None:
            self.stall_limit = stall_limit
        if threads is not None:
            self.threads = threads
        self.stalled: dict[str, int] = {}  # tenant -> abandoned threads still in the kernel
        self.timeouts: dict[str, int] = {}  # tenant -> accesses refused at their deadline
        self.inflight: dict[str, int] = {}  # tenant -> accesses whose thread has not returned
        self._direct: dict[int, list] = {}  # thread id -> [tenant, started, what, late]

    async def read(self, tenant: str, memory: Any, addr: int, length: int) -> bytes:
        return await self.run(tenant, memory.read, addr, length,
                              what=f"read of {length} bytes at {addr:#x}")

    async def write(self, tenant: str, memory: Any, addr: int, data: bytes) -> None:
        await self.run(tenant, memory.write, addr, bytes(data),
                       what=f"write of {len(data)} bytes at {addr:#x}")

    async def run(self, tenant: str, fn: Callable, *args: Any, what: str = "access",
                  memory: bool = True) -> Any:
        """fn(*args) on a worker thread, for at most `deadline` seconds. `memory`: fn touches
        the tenant's memory (its faults on the broker's own mount are refused); False for
        other blocking work on a tenant's behalf (fstat/close of one of its files).
        Raises MemoryAccessRefused (errno EFAULT) when refused or late."""
        with _lock:
            stalled = self.stalled.get(tenant, 0)
            inflight = self.inflight.get(tenant, 0)
            if stalled < self.stall_limit and inflight < self.threads:
                self.inflight[tenant] = inflight + 1
        if stalled >= self.stall_limit:
            raise MemoryAccessRefused(
                errno.EFAULT, f"{what}: refused at once, {stalled} earlier accesses to this "
                              "tenant's memory are still blocked in the kernel (stall limit)")
        if inflight >= self.threads:
            raise MemoryAccessRefused(
                errno.EFAULT, f"{what}: refused at once, {inflight} accesses to this "
                              "tenant's memory are already in flight")
        job = _Job(threading.Event(), started=time.monotonic())
        token = trio.lowlevel.current_trio_token()

        def work():
            tid = threading.get_native_id()
            if memory:
                _accessing[tid] = tenant
            try:
                return fn(*args)
            except OSError as e:
                if memory and tid in _own_mount_faults:
                    raise MemoryAccessRefused(
                        errno.EFAULT, f"{what}: the address is in a page mapped from the "
                                      "broker's own nodes, which the broker does not read "
                                      "for a tenant") from e
                raise
            finally:
                if memory:
                    with _lock:
                        _accessing.pop(tid, None)
                        _own_mount_faults.discard(tid)

        def deliver(result) -> None:  # on the worker thread, after work(); must not raise
            with _lock:
                job.outcome, job.done = result, True
                self.inflight[tenant] = max(0, self.inflight.get(tenant, 1) - 1)
                late, wake = job.abandoned, job.wake
                if late:
                    self.stalled[tenant] = max(0, self.stalled.get(tenant, 1) - 1)
            job.event.set()
            if wake is not None and not late:
                try:
                    token.run_sync_soon(wake.set)
                except trio.RunFinishedError:
                    pass
            if late:
                self._returned(tenant, what, time.monotonic() - job.started)

        trio.lowlevel.start_thread_soon(work, deliver)
        if not job.event.wait(self.inline_wait):
            with _lock:
                if not job.done:
                    job.wake = trio.Event()
            if job.wake is not None:
                with trio.move_on_after(max(0.0, self.deadline - self.inline_wait)):
                    await job.wake.wait()
            with _lock:
                if not job.done:
                    job.abandoned = True
                    n = self.stalled[tenant] = self.stalled.get(tenant, 0) + 1
                    self.timeouts[tenant] = self.timeouts.get(tenant, 0) + 1
            if job.abandoned:
                raise MemoryAccessRefused(
                    errno.EFAULT, f"{what} did not complete within {self.deadline:g} s (the "
                                  "page waits on something outside the broker: userfaultfd, a "
                                  "file system's server); its thread is left to the kernel "
                                  f"({n} stalled for this tenant)")
        return job.outcome.unwrap()

    # -- accesses made on a thread of their own (seccomp listener threads) -------------
    # A listener thread serves one tenant's process tree only, so it may touch that
    # tenant's memory itself (no hand-off). What the worker above gives by its
    # deadline, such a thread gets from its listener's watchdog: sweep() finds accesses
    # past the deadline, counts them as stalled (the same stall limit), and the watchdog
    # answers the tenant's call with EFAULT and starts another thread for the tenant.

    def direct(self, tenant: str, fn: Callable, *args: Any, what: str = "access") -> Any:
        """fn(*args) touching tenant memory on this thread (see above)."""
        tid = threading.get_native_id()
        with _lock:
            stalled = self.stalled.get(tenant, 0)
            if stalled < self.stall_limit:
                self._direct[tid] = [tenant, time.monotonic(), what, False]
                marked = _accessing.get(tid)  # a native listener thread's mark (below)
                _accessing[tid] = tenant
        if stalled >= self.stall_limit:
            raise MemoryAccessRefused(
                errno.EFAULT, f"{what}: refused at once, {stalled} earlier accesses to this "
                              "tenant's memory are still blocked in the kernel (stall limit)")
        try:
            return fn(*args)
        except OSError as e:
            if tid in _own_mount_faults:
                raise MemoryAccessRefused(
                    errno.EFAULT, f"{what}: the address is in a page mapped from the broker's "
                                  "own nodes, which the broker does not read for a tenant") from e
            raise
        finally:
            with _lock:
                entry = self._direct.pop(tid, None)
                if marked is None:
                    _accessing.pop(tid, None)
                else:
                    _accessing[tid] = marked
                _own_mount_faults.discard(tid)
                late = entry is not None and entry[3]
                if late:
                    self.stalled[tenant] = max(0, self.stalled.get(tenant, 1) - 1)
            if late:
                self._returned(tenant, what, time.monotonic() - entry[1])

    def sweep(self, threads: Any, now: float | None = None) -> list[tuple[int, str, str]]:
        """Direct accesses of these threads (ids) now past the deadline, each reported once
        as (thread id, tenant, what) and counted as stalled for its tenant until it
        returns. Each listener sweeps its own threads: the gate is the broker's, shared."""
        now = time.monotonic() if now is None else now
        out = []
        with _lock:
            for tid, entry in self._direct.items():
                tenant, started, what, late = entry
                if tid in threads and not late and now - started > self.deadline:
                    entry[3] = True
                    self.stalled[tenant] = self.stalled.get(tenant, 0) + 1
                    self.timeouts[tenant] = self.timeouts.get(tenant, 0) + 1
                    out.append((tid, tenant, what))
        return out

    # -- accesses made in C (the seccomp listener's native loop, frontends/nativelane.py) --
    # Its thread reads and writes the tenant's memory whenever it answers a call, so it is
    # marked as accessing for its whole life (the FUSE front end refuses its faults on the
    # broker's own mount at once); its listener's watchdog reads when an access started
    # and reports one past the deadline here, and the loop reports its return.

    @staticmethod
    def mark_native(tid: int, tenant: str) -> None:
        with _lock:
            _accessing[tid] = tenant

    @staticmethod
    def unmark_native(tid: int) -> None:
        with _lock:
            _accessing.pop(tid, None)
            _own_mount_faults.discard(tid)

    def native_stalled(self, tenant: str) -> int:
        """A native access past the deadline: counted as stalled until native_returned."""
        with _lock:
            n = self.stalled[tenant] = self.stalled.get(tenant, 0) + 1
            self.timeouts[tenant] = self.timeouts.get(tenant, 0) + 1
        return n

    def native_returned(self, tenant: str, what: str, seconds: float) -> None:
        with _lock:
            self.stalled[tenant] = max(0, self.stalled.get(tenant, 1) - 1)
        self._returned(tenant, what, seconds)

    def _returned(self, tenant: str, what: str, seconds: float) -> None:
        # On the worker thread: AuditLog.write takes its own lock.
        log.info("tenant %s: a %s returned after %.1f s", tenant, what, seconds)
        if self.audit is not None:
            try:
                self.audit.write("notice", tenant=tenant,
                                 message=f"a stalled {what} in this tenant's memory returned "
                                         f"after {seconds:.1f} s")
            except Exception:  # pragma: no cover - never let accounting kill the thread
                log.exception("audit write failed")


_default: MemoryGate | None = None


def default_gate() -> MemoryGate:
    """The gate for front ends whose broker has none of its own (test doubles)."""
    global _default
    if _default is None:
        _default = MemoryGate()
    return _default


def gate_of(broker: Any) -> MemoryGate:
    gate = getattr(broker, "memgate", None)
    return gate if isinstance(gate, MemoryGate) else default_gate()
