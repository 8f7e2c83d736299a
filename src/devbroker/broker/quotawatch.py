"""The quota watch: device memory a tenant got past the broker's books.

A few calls run in the tenant's own kernel context after the broker decided them (an
OS-descriptor or system-memory allocation, NVOS02: the driver binds it to the calling
process), and the kernel reads their argument again then. A racing thread of the tenant can
turn such a call into a device-memory allocation the broker never saw (rules.py
``_RACE_ALLOC_MEMORY``). Nothing outside the process can prevent that; the driver's own
per-process accounting (NV2080_CTRL_CMD_GPU_GET_PID_INFO, video memory: memory of the
clients that process created) shows it. So the broker watches every process that made such
a call, for as long as it lives:

* a first look FIRST_S after the call (a won race is found within about that);
* then a look every PERIOD_S (a random time in that range: a tenant cannot place an excess
  between two looks it can predict) while any watched process lives — the kernel's re-read
  can come later than any fixed delay after the decision (the argument's page faulting to a
  handler the tenant serves when it likes: userfaultfd where the host allows it to tenants),
  so looks that stop after a few delays would miss it;
* each look sums, per tenant and GPU, the accounting of its watched processes, of its
  other processes holding its files (each checked to be in the sandbox the file was opened
  in: a pid reused by another process is neither read nor killed) and of openers that have
  exited while their files live on in other processes (a client's memory is accounted to
  the pid that created it), and compares the sum with the tenant's quota (or its books,
  where a policy change lowered the quota under what it already held): the quota is the
  tenant's, so memory split over processes counts as one. More than that + SLACK: the
  tenant is ended — every live process of it the watch knows is killed (SIGKILL through a
  pidfd taken before the read), with a `violation` audit record.

On the H200 the driver's accounting matched the broker's books to the byte
(docs/hardware.md), so the sum stays within the quota unless something went past the books.

One background task does the looks; the driver reads (one control per GPU for up to 200
processes) run on a worker thread, never on the trio thread: the relay's synchronous channel
is a blocking socket exchange. Calls come from any thread (the decision runs where the
listener runs it): `watch` only records the process and asks for an early look.
"""
from __future__ import annotations

import logging
import os
import random
import select
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable

from devbroker.broker.effects import STATE_LOCK
from devbroker.broker.procinfo import pid_namespace

log = logging.getLogger("devbroker.quotawatch")

FIRST_S = 0.05
PERIOD_S = (0.5, 1.0)
SLACK = 64 << 20  # driver-side bytes beyond the quota tolerated per tenant and GPU


@dataclass
class _Watched:
    pidfd: int
    tenant: str


def exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


class QuotaWatch:
    """Per broker. `read(tgids) -> {tgid: {gpu: bytes}}` is the driver's accounting
    (Backend.process_vidmem_many); `tenants()` the broker's tenants by name, whose
    `quota(gpu)`, `used()` and `openers()` a look uses; `start_soon(fn) -> bool` starts
    the look task from any thread (Broker._start_soon; False: no trio run to start it in)."""

    def __init__(self, read: Callable[[list[int]], dict[int, dict[int, int]]],
                 tenants: Callable[[], dict[str, Any]], audit: Any,
                 start_soon: Callable[[Callable], bool]):
        self.read = read
        self.tenants = tenants
        self.audit = audit
        self.start_soon = start_soon
        self._lock = threading.Lock()
        self._watched: dict[int, _Watched] = {}  # tgid -> its pidfd and tenant
        self._running = False  # a look task exists (started or about to)
        self._early = False  # a watched call since the last look began
        self._sleep = None  # the look task's sleep (trio.CancelScope), trio thread only
        self._token = None
        self.looks = 0  # for status and tests
        self.killed = 0
        self._seen: set[str] = set()

    # -- any thread
    def watch(self, tgid: int, tenant: str) -> None:
        """After a continued call of tgid that a racing thread could have turned into
        device memory: watch tgid for its life, and look soon."""
        with self._lock:
            if tgid not in self._watched:
                try:
                    # Taken now, while the process waits in this very call: the kill
                    # reaches this process even if its pid is reused after it exits.
                    pidfd = os.pidfd_open(tgid)
                except OSError:
                    return
                self._watched[tgid] = _Watched(pidfd, tenant)
            self._early = True
            start, self._running = not self._running, True
            token = self._token
        if start:
            self._start()
        elif token is not None:
            try:
                token.run_sync_soon(self._look_soon)
            except Exception:  # the trio run has ended: nothing is watched any more
                pass

    def resume(self) -> None:
        """Start looking if processes are watched and no look task runs (called when the
        broker's trio run begins: a live upgrade's successor watched its tenants' processes
        before it had one)."""
        with self._lock:
            start = bool(self._watched) and not self._running
            self._running = self._running or start
        if start:
            self._start()

    def _start(self) -> None:
        if not self.start_soon(self._run):
            with self._lock:  # no trio run yet: resume() starts it
                self._running = False

    def watching(self) -> list[int]:
        with self._lock:
            return sorted(self._watched)

    def close(self) -> None:
        with self._lock:
            for w in self._watched.values():
                os.close(w.pidfd)
            self._watched.clear()

    # -- the trio thread
    def _look_soon(self) -> None:
        import trio

        if self._sleep is not None:
            self._sleep.deadline = min(self._sleep.deadline, trio.current_time() + FIRST_S)

    async def _run(self) -> None:
        import trio

        self._token = trio.lowlevel.current_trio_token()
        done = False
        try:
            while True:
                with self._lock:
                    if not self._watched:
                        self._running = False
                        done = True  # a watch from now on starts a new task
                        return
                    delay = FIRST_S if self._early else random.uniform(*PERIOD_S)
                with trio.CancelScope(deadline=trio.current_time() + delay) as self._sleep:
                    await trio.sleep_forever()
                self._sleep = None
                try:
                    await self._look()
                except Exception as e:  # a bug must cost a look, never the broker
                    log.exception("quota watch: look failed")
                    self._once(("error", type(e).__name__),
                               f"quota watch: a look failed ({type(e).__name__}: {e}); "
                               "looking again at the next period")
        finally:
            self._sleep = None
            if not done:  # cancelled (the broker stopping) or failed
                with self._lock:
                    self._running = False

    async def _look(self) -> None:
        import trio

        with self._lock:
            self._early = False
            watched = dict(self._watched)
        for tgid, w in watched.items():
            if exited(w.pidfd):
                with self._lock:
                    self._watched.pop(tgid, None)
                os.close(w.pidfd)
        # Per tenant: its watched processes, its other processes with files open (each
        # checked to be the opener, not a process that reused its pid), and openers that
        # have exited while their files live on (their clients' memory is still
        # accounted to their pid).
        pidfds: dict[int, int] = {}
        mine: dict[str, set[int]] = {}
        gone: dict[str, set[int]] = {}
        extra: list[int] = []
        try:
            with self._lock:
                for tgid, w in self._watched.items():
                    pidfds[tgid] = w.pidfd
                    mine.setdefault(w.tenant, set()).add(tgid)
            with STATE_LOCK:
                tenants = self.tenants()
                others = {name: tenants[name].openers() for name in mine if name in tenants}
            for name, openers in others.items():
                for tgid, ns in openers.items():
                    if tgid in pidfds:
                        continue
                    fd = self._opener(tgid, ns)
                    if fd is None:
                        continue
                    if fd < 0:
                        gone.setdefault(name, set()).add(tgid)
                        continue
                    pidfds[tgid] = fd
                    extra.append(tgid)
                    mine[name].add(tgid)
            if not pidfds:
                return
            self.looks += 1
            dead = sorted({t for ts in gone.values() for t in ts})
            used = await trio.to_thread.run_sync(self.read, sorted(pidfds) + dead)
            for tgid in dead:  # still no process of that pid, so the figure was its clients'
                if self._opener(tgid, None) != -1:
                    used.pop(tgid, None)
            for name, tgids in mine.items():
                with STATE_LOCK:
                    t = self.tenants().get(name)
                    if t is not None:
                        read = tgids | gone.get(name, set())
                        self._judge(t, {p: used.get(p, {}) for p in read},
                                    {p: pidfds[p] for p in tgids})
        except OSError as e:
            self._once(("unavailable", str(e)), f"quota watch unavailable: {e}")
        finally:
            for tgid in extra:
                os.close(pidfds[tgid])

    @staticmethod
    def _opener(tgid: int, ns: str | None) -> int | None:
        """A pidfd of the process with pid tgid if it is in the pid namespace `ns` (the
        sandbox the tenant's file was opened in: a pid reused by a process of another
        sandbox or the host is not the tenant's, and is neither read nor killed); -1 when
        no process has that pid; None otherwise."""
        try:
            fd = os.pidfd_open(tgid)
        except ProcessLookupError:
            return -1
        except OSError:
            return None
        # The namespace read through /proc is this pidfd's process's only while the pidfd
        # shows it alive after the read (a pid is not reused while the process lives).
        if ns is not None and pid_namespace(tgid) == ns and not exited(fd):
            return fd
        os.close(fd)
        return None

    def _judge(self, t: Any, used: dict[int, dict[int, int]], live: dict[int, int]) -> None:
        """used: the driver's figures of the tenant's processes (live and exited openers);
        live: pidfds of its live processes, every one ended on a violation."""
        total: dict[int, int] = {}
        for per_gpu in used.values():
            for g, n in per_gpu.items():
                total[g] = total.get(g, 0) + n
        self._once(("seen", t.name),
                   f"quota watch: the driver accounts {total} bytes per GPU to the processes "
                   f"{sorted(used)} of tenant {t.name} (books: {t.used()})")
        # The bound is the quota, or the books where they hold more (a policy change lowered
        # the quota under what the tenant already held: kept, not a violation).
        books = t.used()
        over = {g: n for g, n in total.items()
                if n > max(t.quota(g), books.get(g, 0)) + SLACK}
        if not over:
            return
        holders = sorted(p for p, per_gpu in used.items()
                         if any(per_gpu.get(g, 0) for g in over))
        # The tenant is ended: every live process of it the watch knows, not only those the
        # memory is accounted to (that may be an exited opener's pid).
        ended = sorted(live)
        self.audit.write("violation", tenant=t.name, pid=holders[0] if holders else None,
                         what="device memory beyond the quota",
                         reason=f"the driver accounts {over} bytes per GPU to processes "
                                f"{holders} of the tenant (quota {t.quota(next(iter(over)))}):"
                                f" a continued call was rewritten; processes {ended} killed")
        for tgid in ended:
            try:
                signal.pidfd_send_signal(live[tgid], signal.SIGKILL)
                self.killed += 1
            except ProcessLookupError:
                pass

    def _once(self, key: tuple, msg: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.audit.write("notice", message=msg)
