"""Priority preemption by checkpoint (docs/preemption.md).

An allocation of device memory that fits the tenant's quota but not the GPU (the driver
answered NV_ERR_NO_MEMORY) from a tenant whose priority is higher than some preemptible
tenant's on that GPU waits while the broker moves enough of those tenants' processes to host
memory with the backend's checkpoint executor (backends/checkpoint.py), then is retried.
When memory frees again, preempted tenants are restored: the room is reserved in the books
first (no other allocation may take it), then the executor restores.

Three parts:
- `choose_victims`: the decision, sans-IO (candidates in, victims or a reason out);
- `Preemption`: the broker's preemption state and the sequences (checkpoint a tenant,
  restore it) as trio code, each executor call on a worker thread with its deadline;
- `after_no_memory`: the post-step of a charged allocation's row (handlers.rm_alloc), which
  waits through an `Await` effect, so a seccomp listener thread hands the call to the trio
  thread and never waits itself.

The call's order (make room, then retry) lives here once: front ends reach it only through
the general path (the control lane declines charged allocations while preemption is on:
`lane_declines`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import trio

from devbroker.abi import status as nvstatus
from devbroker.backends.checkpoint import CheckpointError, GpuPair
from devbroker.broker import compute, turns
from devbroker.broker.effects import STATE_LOCK, Await, run_async
from devbroker.broker.effects import locked as effects_locked
from devbroker.broker.objects import BOOKS
from devbroker.broker.refusal import Refusal

log = logging.getLogger("devbroker.preemption")

# Policy priorities, lowest first: a tenant may preempt only tenants ranked below it.
RANK = {"low": 0, "normal": 1, "high": 2}
# How often the restoring task looks for room while some tenant is preempted (a free is
# not announced to it: the books and the backend's heap are read instead).
RESTORE_TICK_S = 0.2
# Seconds an executor call for a restore or an undo may take (no waiting allocation bounds
# them; the executor itself keeps this deadline).
RESTORE_TIMEOUT_S = 60.0
# The driver moves device memory to and from host memory at ~1.8 GiB/s out and ~6 GiB/s
# back on the H200 (docs/preemption-driver.md); a checkpoint's or restore's deadline grows
# with the bytes it moves at a quarter of the slower rate, so a 100 GiB tenant is not cut
# off half way while a hung one is still found out.
MOVE_BYTES_PER_S = (1 << 30) // 2
# CUDA maps one 2 MiB range of nvidia-uvm for itself at init (the PyTorch trace, and the
# driver checkpoints such processes: H200, docs/preemption-driver.md); beyond that a
# process's nvidia-uvm mappings are managed allocations, which the checkpoint cannot carry.
CUDA_OWN_UVM_MAPPING = 2 << 20


def move_deadline(nbytes: int) -> float:
    """Seconds a checkpoint or restore that moves `nbytes` may take."""
    return RESTORE_TIMEOUT_S + nbytes / MOVE_BYTES_PER_S

# States of a preempted tenant (Preempted.state)
PREEMPTING, PREEMPTED, RESTORING = "preempting", "preempted", "restoring"


@dataclass(frozen=True)
class Candidate:
    """A tenant holding memory on the GPU that could make room there."""
    tenant: str
    rank: int  # RANK of its priority
    on_gpu: int  # bytes it holds on the GPU (the books)
    total: int  # bytes it holds on all GPUs: what a checkpoint moves to host memory
    started: float  # when its first file still open was opened (most recent preempted first)
    refusal: str | None = None  # why it may not be preempted (audited when it mattered)


@dataclass(frozen=True)
class Plan:
    victims: tuple[Candidate, ...]
    refusal: str | None  # None: the victims make room


def choose_victims(candidates: Iterable[Candidate], need: int, host_left: int) -> Plan:
    """Which tenants to checkpoint so that `need` bytes free on the GPU, within `host_left`
    bytes of host memory. Lowest priority first; within one priority, the tenant whose bytes
    alone suffice with the fewest bytes (ties: the most recently started, whose work is the
    least to lose), else the largest (the fewest victims), and so on until enough. A plan
    that cannot make enough room preempts nobody: its reason says why."""
    pool = [c for c in candidates if c.refusal is None]
    refused = [c for c in candidates if c.refusal is not None]
    victims: list[Candidate] = []
    over_budget: list[Candidate] = []
    left = need
    for rank in sorted({c.rank for c in pool}):
        level = [c for c in pool if c.rank == rank]
        while level and left > 0:
            fits = [c for c in level if c.total <= host_left]
            over_budget += [c for c in level if c.total > host_left]
            level = fits
            if not level:
                break
            enough = [c for c in level if c.on_gpu >= left]
            pick = (min(enough, key=lambda c: (c.on_gpu, -c.started)) if enough
                    else max(level, key=lambda c: (c.on_gpu, c.started)))
            level.remove(pick)
            victims.append(pick)
            left -= pick.on_gpu
            host_left -= pick.total
        if left <= 0:
            return Plan(tuple(victims), None)
    why = [f"{need} bytes needed, {need - left} could be made"]
    why += [f"tenant {c.tenant}: {c.refusal}" for c in refused]
    why += [f"tenant {c.tenant}: its {c.total} bytes exceed the host memory left for "
            "checkpoints" for c in {c.tenant: c for c in over_budget}.values()]
    if not pool and not refused:
        why.append("no lower-priority preemptible tenant holds memory on the GPU")
    return Plan((), "; ".join(why))


@dataclass
class Preempted:
    """A tenant whose processes are (being) checkpointed."""
    tenant: str
    gpu: int  # the GPU room was made on
    by: str  # the tenant whose allocation asked, or "operator"
    pids: tuple[int, ...]
    bytes: int  # device memory moved to host memory (all its GPUs)
    since: float = field(default_factory=time.time)
    state: str = PREEMPTING
    auto: bool = True  # restored when room frees (an operator's preemption waits for resume)
    seconds: float = 0.0  # what the checkpoint took
    # Device memory it held on each GPU when it was checkpointed: what its restore needs.
    # Its books cannot say afterwards: the driver's checkpoint, running inside the process,
    # frees and remakes objects through the tenant's own calls (H200: the books fell from
    # 66.7 to 59.1 GiB over a checkpoint and restore, and a restore sized from them ran
    # while the room was taken).
    held: dict[int, int] = field(default_factory=dict)


class Preemption:
    """The broker's preemption: who is preempted, the room reserved for restores, and the
    counters the metrics read. One trio lock orders every preemption and restore."""

    def __init__(self, broker: Any):
        self.broker = broker
        self.entries: dict[str, Preempted] = {}
        # Tenants whose driver calls the broker holds (an executor with holds_calls: the
        # emulated driver; libcuda blocks a locked process itself). Read by the lanes.
        self.held: set[str] = set()
        self.reserved: dict[int, int] = {}  # GPU -> bytes a restore in progress will take
        self.waiting: dict[int, int] = {}  # GPU -> allocations waiting for room there
        self.counts: dict[tuple[str, str], int] = {}  # (event, tenant) -> times
        self.seconds: dict[tuple[str, str], float] = {}  # (event, tenant) -> total seconds
        self.moved: dict[str, int] = {}  # tenant -> bytes checkpointed, all together
        self.calls_held: dict[str, int] = {}  # tenant -> its calls waiting in until_running
        self._lock: trio.Lock | None = None
        self._resumed: dict[str, trio.Event] = {}
        self._wake: trio.Event | None = None
        self._restoring = False  # the restoring task runs

    # ------------------------------------------------------------------ reading
    @property
    def config(self):
        return self.broker.policy.broker.preemption

    def host_used(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    def state_of(self, tenant: str) -> str | None:
        e = self.entries.get(tenant)
        return e.state if e else None

    def snapshot(self) -> dict[str, Any]:
        return {
            "enabled": self.config.enabled,
            "host_memory": self.config.host_memory, "host_used": self.host_used(),
            "tenants": {n: {"state": e.state, "gpu": e.gpu, "by": e.by, "bytes": e.bytes,
                            "pids": list(e.pids), "since": e.since, "auto": e.auto}
                        for n, e in self.entries.items()},
            "reserved": {str(g): n for g, n in self.reserved.items()},
            # calls of preempted tenants waiting in this broker (held: the emulated driver)
            "calls_held": dict(self.calls_held),
            "counts": [[ev, t, n] for (ev, t), n in self.counts.items()],
            "seconds": [[ev, t, s] for (ev, t), s in self.seconds.items()],
            "moved": dict(self.moved),
        }

    def _count(self, event: str, tenant: str, seconds: float = 0.0) -> None:
        self.counts[(event, tenant)] = self.counts.get((event, tenant), 0) + 1
        self.seconds[(event, tenant)] = self.seconds.get((event, tenant), 0.0) + seconds

    # ------------------------------------------------------------------ the books
    def gpu_free(self, gpu: int, waiting: int = 0) -> int:
        """Bytes free on the GPU: the backend's own count where it keeps one (the
        emulator), else its size less what the books hold there outside checkpoints.
        `waiting`: the bytes of an allocation waiting for room, which its tenant's books
        hold while it waits (core._reserved) although the driver refused them."""
        b = self.broker
        total = b.backend.gpus()[gpu].memory_bytes
        in_use = b.backend.memory_in_use()
        if in_use is not None:
            return total - in_use.get(gpu, 0)
        held = sum(t.used().get(gpu, 0) for t in b.tenants.values()
                   if t.name not in self.entries)
        return total - held + waiting

    def room_refusal(self, gpu: int | None, charge: int) -> str | None:
        """(Under STATE_LOCK, before an allocation reaches the driver.) Room reserved for a
        restore is not offered to another allocation: the reason it is refused, else None."""
        if gpu is None or not charge or not self.reserved.get(gpu):
            return None
        free = self.gpu_free(gpu) - self.reserved[gpu]
        if charge > free:
            return (f"{self.reserved[gpu]} bytes of GPU {gpu} are reserved for restoring a "
                    f"preempted tenant; {max(free, 0)} bytes are left")
        return None

    def _candidates(self, requester: str, gpu: int) -> list[Candidate]:
        b = self.broker
        rank = RANK.get(b.tenants[requester].policy.priority, 1)
        out = []
        for t in b.tenants.values():
            if t.name == requester or t.revoked or t.name in self.entries:
                continue
            p = t.policy
            if not p.preemptible or RANK.get(p.priority, 1) >= rank:
                continue
            used = t.used()
            if not used.get(gpu):
                continue
            out.append(Candidate(t.name, RANK.get(p.priority, 1), used[gpu],
                                 sum(used.values()), _started(t), _refusal(b, t)))
        return out

    # ------------------------------------------------------------------ the sequences
    def _trio_lock(self) -> trio.Lock:
        if self._lock is None:
            self._lock = trio.Lock()
        return self._lock

    def wait_begins(self, gpu: int) -> None:
        """An allocation waits for room on `gpu`, from its first NO_MEMORY until its retry
        has its answer: no automatic restore takes that room meanwhile (on the H200 the
        restoring task gave a just-checkpointed tenant its room back before the waiting
        allocation's retry reached the driver)."""
        self.waiting[gpu] = self.waiting.get(gpu, 0) + 1

    def wait_ends(self, gpu: int) -> None:
        self.waiting[gpu] -= 1
        if not self.waiting[gpu]:
            del self.waiting[gpu]

    async def make_room(self, requester: str, gpu: int, charge: int) -> str | None:
        """(Trio, between wait_begins and wait_ends.) Checkpoint lower-priority preemptible
        tenants until `charge` bytes fit on the GPU, within the policy's wait. None: retry
        the allocation; else why not."""
        cfg = self.config
        deadline = trio.current_time() + cfg.wait
        with trio.move_on_at(deadline):
            async with self._trio_lock():
                return await self._make_room(requester, gpu, charge, deadline)
        return f"no room within the policy's wait of {cfg.wait:g} s"

    async def _make_room(self, requester: str, gpu: int, charge: int,
                         deadline: float) -> str | None:
        ck = self.broker.backend.checkpointer
        if not ck.supported:
            return f"the driver cannot checkpoint: {ck.why}"
        with STATE_LOCK:
            need = charge - self.gpu_free(gpu, waiting=charge) + self.reserved.get(gpu, 0)
            if need <= 0:
                return None  # room freed meanwhile: retry
            plan = choose_victims(self._candidates(requester, gpu), need,
                                  self.config.host_memory - self.host_used())
        if plan.refusal is not None:
            return plan.refusal
        for v in plan.victims:
            left = deadline - trio.current_time()
            if left <= 0:
                return f"no room within the policy's wait of {self.config.wait:g} s"
            # Shielded: a checkpoint half done must be finished or undone, never abandoned
            # with its processes locked (the executor bounds each call itself).
            with trio.CancelScope(shield=True):
                why = await self.checkpoint_tenant(
                    v.tenant, gpu, by=requester,
                    lock_timeout=min(self.config.lock_timeout, left))
            if why is not None:
                # The allocation fails; those already taken stay preempted and come back
                # by the restoring task as room allows (their room may serve others now).
                return f"tenant {v.tenant} was not preempted: {why}"
        return None

    async def checkpoint_tenant(self, name: str, gpu: int, *, by: str,
                                lock_timeout: float | None = None,
                                auto: bool = True) -> str | None:
        """(Trio, inside the preemption lock or an operator's order.) Lock and checkpoint
        every process of the tenant holding RM clients. None: done; else why not (nothing
        stays locked: what was done is undone)."""
        b = self.broker
        ck = b.backend.checkpointer
        timeout = max(0.1, lock_timeout if lock_timeout is not None else self.config.lock_timeout)
        with STATE_LOCK:
            t = b.tenants.get(name)
            if t is None or name in self.entries:
                return f"tenant {name} is {'unknown' if t is None else 'already preempted'}"
            refusal = _refusal(b, t)
            if refusal is not None:
                b.audit.write("checkpoint_refused", tenant=name, by=by, gpu=gpu, reason=refusal)
                self._count("refused", name)
                return refusal
            used = t.used()
            pids = tuple(sorted({c.tgid for c in t.clients.values()}))
            entry = Preempted(name, gpu, by, pids, sum(used.values()), auto=auto,
                              held={g: n for g, n in used.items() if n})
            self.entries[name] = entry
            if getattr(ck, "holds_calls", False):
                self.held.add(name)
                self._resumed[name] = trio.Event()
                BOOKS.policy_changed()  # (the native loop's settled facts: asked again)
        started = time.monotonic()
        locked: list[int] = []
        taken: list[int] = []
        try:
            # Channels compute priority or turns stopped would keep the lock from ever
            # completing: they run again first (the entry above exempts the tenant from
            # both).
            try:
                await run_async(effects_locked(_let_channels_run(b, t)), b.perform)
            except Exception:  # a failed pass costs the lock its chance, never the broker
                log.exception("preemption of %s: letting its channels run", name)
            for pid in pids:
                await _run(ck.lock, pid, timeout)
                locked.append(pid)
            for pid in pids:
                await _run(ck.checkpoint, pid, move_deadline(entry.bytes))
                taken.append(pid)
        except CheckpointError as e:
            await self._undo(name, taken, locked)
            b.audit.write("checkpoint_failed", tenant=name, by=by, gpu=gpu, reason=str(e))
            self._count("failed", name, time.monotonic() - started)
            return str(e)
        entry.seconds = time.monotonic() - started
        entry.state = PREEMPTED
        self._count("preempted", name, entry.seconds)
        self.moved[name] = self.moved.get(name, 0) + entry.bytes
        b.audit.write("checkpoint", tenant=name, by=by, gpu=gpu, pids=list(pids),
                      bytes=entry.bytes, seconds=round(entry.seconds, 6),
                      message=f"tenant {name} checkpointed to host memory ({entry.bytes} "
                              f"bytes, {len(pids)} processes) for {by} on GPU {gpu}")
        self._kick()
        return None

    async def _undo(self, name: str, taken: list[int], locked: list[int]) -> None:
        ck = self.broker.backend.checkpointer
        moved = self.entries[name].bytes if name in self.entries else 0
        for pid in taken:
            try:
                await _run(ck.restore, pid, (), move_deadline(moved))
            except CheckpointError as e:
                log.warning("preemption of %s: undoing the checkpoint of %d: %s", name, pid, e)
        for pid in locked:
            try:
                await _run(ck.unlock, pid, RESTORE_TIMEOUT_S)
            except CheckpointError as e:
                log.warning("preemption of %s: unlocking %d: %s", name, pid, e)
        self._release(name)

    def _release(self, name: str) -> None:
        with STATE_LOCK:
            self.entries.pop(name, None)
            if name in self.held:
                self.held.discard(name)
                BOOKS.policy_changed()
        ev = self._resumed.pop(name, None)
        if ev is not None:
            ev.set()

    async def restore_tenant(self, name: str, *, by: str = "room") -> str | None:
        """(Trio, inside the preemption lock.) Reserve the tenant's room in the books, then
        restore and unlock its processes. None: running again; else why not (it stays
        preempted, its room given back)."""
        b = self.broker
        ck = b.backend.checkpointer
        with STATE_LOCK:
            e = self.entries.get(name)
            if e is None or e.state != PREEMPTED:
                return f"tenant {name} is not preempted"
            t = b.tenants.get(name)
            live = {c.tgid for c in t.clients.values()} if t is not None else set()
            now = t.used() if t is not None else {}
            need = {g: max(n, e.held.get(g, 0)) for g, n in {**e.held, **now}.items()}
            need = {g: n for g, n in need.items() if n}
            short = [g for g, n in need.items()
                     if n > self.gpu_free(g) - self.reserved.get(g, 0)]
            if short:
                return (f"GPU {short[0]} lacks the room ({need[short[0]]} bytes) to restore "
                        f"tenant {name}")
            for g, n in need.items():
                self.reserved[g] = self.reserved.get(g, 0) + n
            e.state = RESTORING
        started = time.monotonic()
        failed = None
        try:
            for pid in e.pids:
                try:
                    await _run(ck.restore, pid, (), move_deadline(e.bytes))
                    await _run(ck.unlock, pid, RESTORE_TIMEOUT_S)
                except CheckpointError as err:
                    if pid in live:
                        failed = str(err)
                        break
                    # (a process that exited meanwhile left nothing to restore)
        finally:
            with STATE_LOCK:
                for g, n in need.items():
                    self.reserved[g] -= n
                    if not self.reserved[g]:
                        del self.reserved[g]
        seconds = time.monotonic() - started
        if failed is not None:
            e.state = PREEMPTED
            b.audit.write("restore_failed", tenant=name, reason=failed)
            self._count("restore_failed", name, seconds)
            return failed
        self._release(name)
        self._count("restored", name, seconds)
        b.audit.write("restore", tenant=name, by=by, bytes=e.bytes, seconds=round(seconds, 6),
                      preempted_seconds=round(time.time() - e.since, 3),
                      message=f"tenant {name} restored from host memory ({e.bytes} bytes)")
        return None

    async def until_running(self, name: str) -> None:
        """(Trio.) Wait while the tenant's calls are held (a call of a preempted tenant)."""
        self.calls_held[name] = self.calls_held.get(name, 0) + 1
        try:
            while name in self.held:
                await self._resumed.setdefault(name, trio.Event()).wait()
        finally:
            self.calls_held[name] -= 1
            if not self.calls_held[name]:
                del self.calls_held[name]

    # ------------------------------------------------------------------ operator orders
    async def preempt(self, name: str) -> str | None:
        """`devbroker preempt TENANT`: checkpoint now, restored only by `resume`."""
        t = self.broker.tenants.get(name)
        if t is None or t.revoked:
            return f"no tenant {name}"
        if not self.broker.backend.checkpointer.supported:
            return f"the driver cannot checkpoint: {self.broker.backend.checkpointer.why}"
        used = t.used()
        gpu = max(used, key=lambda g: used[g]) if used else (t.gpus[0] if t.gpus else 0)
        async with self._trio_lock():
            return await self.checkpoint_tenant(name, gpu, by="operator", auto=False)

    async def resume(self, name: str) -> str | None:
        """`devbroker resume TENANT`: restore now (room permitting)."""
        async with self._trio_lock():
            return await self.restore_tenant(name, by="operator")

    async def migrate(self, name: str, gpu: int) -> str | None:
        """`devbroker migrate TENANT --gpu N`: checkpoint the tenant's processes, restore them
        onto GPU N (one the tenant's policy allows), their objects and the broker's books
        with them — its device objects are GPU N's from then on, so what it asks of them
        (UUID, PCI id, memory) is GPU N's. None: done; else why not (nothing moved)."""
        b = self.broker
        ck = b.backend.checkpointer
        t = b.tenants.get(name)
        if t is None or t.revoked:
            return f"no tenant {name}"
        if not ck.supported:
            return f"the driver cannot checkpoint: {ck.why}"
        gpus = b.backend.gpus()
        async with self._trio_lock():
            with STATE_LOCK:
                if name in self.entries:
                    return f"tenant {name} is preempted: resume it first"
                if gpu not in t.gpus:
                    return f"GPU {gpu} is not one of tenant {name}'s GPUs {list(t.gpus)}"
                on = {o.gpu for c in t.clients.values() for o in c.objects.values()
                      if o.gpu is not None}
                if on == {gpu}:
                    return f"tenant {name} is on GPU {gpu} already"
                if len(on) != 1:
                    return (f"tenant {name} uses GPUs {sorted(on)}: a migration moves the "
                            "state of one GPU")
                old = on.pop()
                need = t.used().get(old, 0)
                if need > self.gpu_free(gpu) - self.reserved.get(gpu, 0):
                    return f"GPU {gpu} lacks the room ({need} bytes) for tenant {name}"
                self.reserved[gpu] = self.reserved.get(gpu, 0) + need
            started = time.monotonic()
            try:
                with trio.CancelScope(shield=True):
                    return await self._migrate(name, t, old, gpu, started,
                                               (GpuPair(gpus[old].uuid, gpus[gpu].uuid),))
            finally:
                with STATE_LOCK:
                    self.reserved[gpu] -= need
                    if not self.reserved[gpu]:
                        del self.reserved[gpu]

    async def _migrate(self, name: str, t: Any, old: int, gpu: int, started: float,
                       pairs: tuple[GpuPair, ...]) -> str | None:
        b = self.broker
        ck = b.backend.checkpointer
        why = await self.checkpoint_tenant(name, old, by="operator", auto=False)
        if why is not None:
            return why
        e = self.entries[name]
        e.state = RESTORING
        moved: list[int] = []
        try:
            for pid in e.pids:
                await _run(ck.restore, pid, pairs, move_deadline(e.bytes))
                moved.append(pid)
        except CheckpointError as err:
            # Back where it was (those moved already stay on the new GPU: the driver cannot
            # move a restored process back without another checkpoint); then running again.
            e.state = PREEMPTED
            b.audit.write("migrate_failed", tenant=name, gpu=gpu, reason=str(err))
            await self.restore_tenant(name, by="migrate_failed")
            return f"restore onto GPU {gpu} failed: {err}"
        with STATE_LOCK:
            # The books follow the objects before any held call of the tenant goes on.
            for c in t.clients.values():
                for obj in c.objects.values():
                    if obj.gpu == old:
                        c._count(obj, -1)
                        obj.gpu = gpu
                        c._count(obj, 1)
            BOOKS.policy_changed()  # (settled facts name the objects' GPUs)
        for pid in e.pids:
            try:
                await _run(ck.unlock, pid, RESTORE_TIMEOUT_S)
            except CheckpointError as err:
                log.warning("migration of %s: unlocking %d: %s", name, pid, err)
        self._release(name)
        seconds = time.monotonic() - started
        self._count("migrated", name, seconds)
        b.audit.write("migrate", tenant=name, from_gpu=old, gpu=gpu, bytes=e.bytes,
                      pids=list(e.pids), seconds=round(seconds, 6),
                      message=f"tenant {name} moved from GPU {old} to GPU {gpu} "
                              f"({e.bytes} bytes)")
        return None

    # ------------------------------------------------------------------ the restoring task
    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def ensure_restoring(self) -> None:
        """Start the restoring task in the broker's trio run where preemption is on or a
        tenant is preempted (a predecessor's, after a live upgrade). Never otherwise: a task
        that runs for the broker's life would keep whatever nursery holds it from closing."""
        if self._restoring or not (self.config.enabled or self.entries):
            return
        self._restoring = self.broker._start_soon(self.restoring)

    async def restoring(self) -> None:
        """(Trio, for the broker's life.) Restores automatically preempted tenants when
        their room is free again, highest priority first, then the longest preempted; never
        while an allocation waits for room on that GPU (it comes first)."""
        self._restoring = True
        try:
            await self._restore_loop()
        finally:
            self._restoring = False

    async def _restore_loop(self) -> None:
        while True:
            self._wake = trio.Event()
            if not any(e.auto and e.state == PREEMPTED for e in self.entries.values()):
                await self._wake.wait()
                continue
            await trio.sleep(RESTORE_TICK_S)
            order = sorted((e for e in self.entries.values()
                            if e.auto and e.state == PREEMPTED and not self.waiting.get(e.gpu)),
                           key=lambda e: (-RANK.get(self._priority(e.tenant), 1), e.since))
            for e in order:
                try:
                    async with self._trio_lock():
                        if self.waiting.get(e.gpu) or e.state != PREEMPTED:
                            continue
                        await self.restore_tenant(e.tenant)
                except Exception as err:  # a bug must cost one look, never the broker
                    log.exception("preemption: restoring %s failed", e.tenant)
                    self.broker.audit.write("error", tenant=e.tenant, what="restore",
                                            reason=f"internal error: {type(err).__name__}: "
                                                   f"{err}; trying again at the next look")

    def _priority(self, name: str) -> str:
        t = self.broker.tenants.get(name)
        return t.policy.priority if t is not None and not t.revoked else "low"

    # ------------------------------------------------------------------ hand-over
    def export(self) -> dict[str, Any]:
        return {"entries": [{"tenant": e.tenant, "gpu": e.gpu, "by": e.by,
                             "pids": list(e.pids), "bytes": e.bytes, "since": e.since,
                             "state": e.state, "auto": e.auto, "seconds": e.seconds,
                             "held": [[g, n] for g, n in e.held.items()]}
                            for e in self.entries.values()],
                "held": sorted(self.held),
                "counts": [[ev, t, n] for (ev, t), n in self.counts.items()],
                "seconds": [[ev, t, s] for (ev, t), s in self.seconds.items()],
                "moved": [[t, n] for t, n in self.moved.items()]}

    def restore_state(self, state: dict[str, Any]) -> None:
        """The predecessor's state (broker/handover.py). Only settled preemptions are handed
        over (`handover_refusal` refuses an upgrade during a checkpoint or restore)."""
        for d in state.get("entries", []):
            self.entries[d["tenant"]] = Preempted(
                d["tenant"], int(d["gpu"]), d["by"], tuple(d["pids"]), int(d["bytes"]),
                since=float(d["since"]),
                state=PREEMPTED, auto=bool(d["auto"]), seconds=float(d["seconds"]),
                held={int(g): int(n) for g, n in d.get("held", [])})
        self.held = set(state.get("held", []))
        self.counts = {(ev, t): int(n) for ev, t, n in state.get("counts", [])}
        self.seconds = {(ev, t): float(s) for ev, t, s in state.get("seconds", [])}
        self.moved = {t: int(n) for t, n in state.get("moved", [])}

    def handover_refusal(self) -> str | None:
        """Why a live upgrade must wait, None when it need not: a checkpoint or restore in
        progress (the executor's calls belong to this process), or calls of a preempted
        tenant this broker holds (only it can answer them, and only once the tenant runs
        again). A preempted tenant without waiting calls is handed over as it is."""
        busy = [n for n, e in self.entries.items() if e.state != PREEMPTED]
        if busy:
            return (f"tenant {busy[0]} is being {self.entries[busy[0]].state[:-3]}ed: try "
                    "again when it is done")
        if self.calls_held:
            name = next(iter(self.calls_held))
            return (f"tenant {name} is preempted and {self.calls_held[name]} of its calls "
                    f"wait in this broker: `devbroker resume {name}` (or wait for its "
                    "automatic restore), then upgrade")
        if self.waiting:
            return "an allocation is waiting for a preemption: try again when it is done"
        return None


async def _run(fn, *args) -> Any:
    """An executor call on a worker thread (it keeps its own deadline: checkpoint.py). Any
    failure is a CheckpointError to the sequences, which undo what was done: an executor's
    bug must not leave a tenant locked."""
    try:
        return await trio.to_thread.run_sync(fn, *args)
    except CheckpointError:
        raise
    except Exception as e:
        log.exception("checkpoint executor: %s failed", getattr(fn, "__name__", fn))
        raise CheckpointError(f"{getattr(fn, '__name__', 'the executor')} failed: "
                              f"{type(e).__name__}: {e}") from e


def _let_channels_run(b: Any, t: Any):
    yield from compute.preempt_all(b)
    yield from turns.release_tenant(b, t)


def _started(t: Any) -> float:
    ids = [s.id for s in t.sessions.values()]
    return float(max(ids)) if ids else 0.0


def _refusal(b: Any, t: Any) -> str | None:
    """Why the tenant's processes may not be checkpointed, None when they may: the
    driver's checkpoint does not carry managed (UVM) memory or memory another process
    imported (CUDA IPC). The managed charges follow the processes' maps (managed.py): the
    driver's restore, running inside the process, maps CUDA's own range anew (H200), and
    only what is mapped counts."""
    if any(n > CUDA_OWN_UVM_MAPPING for n in t.managed.by_process().values()):
        return ("it uses managed (UVM) memory, which the driver's checkpoint does not "
                "carry")
    for c in t.clients.values():
        for obj in c.objects.values():
            group = obj.share
            if group and any(m.owner is not None and m.owner.tgid != c.tgid for m in group):
                return ("it shares device memory between processes (CUDA IPC), which the "
                        "driver's checkpoint does not carry")
    return None


# ---------------------------------------------------------------------- the allocation row
def lane_declines(broker: Any) -> bool:
    """Whether the control lane must send charged allocations the general way: while
    preemption is on, a NO_MEMORY answer must reach `after_no_memory`."""
    return broker.policy.broker.preemption.enabled


def may_preempt(broker: Any, tenant: Any, gpu: int | None) -> bool:
    """Whether a NO_MEMORY answer to this tenant on this GPU is worth a preemption."""
    if gpu is None or not broker.policy.broker.preemption.enabled:
        return False
    rank = RANK.get(tenant.policy.priority, 1)
    return rank > 0 and any(
        t.policy.preemptible and RANK.get(t.policy.priority, 1) < rank
        for t in broker.tenants.values() if not t.revoked and t is not tenant)


def after_no_memory(ctx: Any, gpu: int | None, charge: int, where: str, result: Any,
                    again: Any):
    """Steps, the `no_memory` of a charged class row (handlers.rm_alloc): when the driver
    answered NV_ERR_NO_MEMORY and the tenant outranks a preemptible tenant, wait (on the
    trio thread: an Await) while lower-priority tenants are checkpointed, then run the
    driver call again. Gives the result the tenant gets; a refusal keeps the driver's
    answer (the normal out-of-memory) and is audited with its reason."""
    b, s = ctx.broker, ctx.session
    if result.errno:
        return result
    out = ctx.abi.decode_ioctl(s.node, ctx.req.cmd, result.arg).value
    if out.status != nvstatus.NV_ERR_NO_MEMORY or not may_preempt(b, s.tenant, gpu):
        return result
    b.preemption.wait_begins(gpu)
    try:
        why = yield Await(b.preemption.make_room, (s.tenant.name, gpu, charge))
        if why is None:
            return (yield from again())
    finally:
        b.preemption.wait_ends(gpu)
    b.audit.write("checkpoint_refused", tenant=s.tenant.name, pid=s.caller.pid, what=where,
                  gpu=gpu, bytes=charge, reason=f"no preemption for this allocation: {why}")
    b.preemption._count("refused", s.tenant.name)
    return result


def own_channel_schedule(ctx: Any, params: Any) -> Any:
    """The pre hook of NVA06F_CTRL_CMD_GPFIFO_SCHEDULE (rules.CONTROLS): the driver's
    checkpoint has the process disable and enable its own channels with it (measured on the
    H200: the one call of a checkpoint the broker refused). Only on one of the tenant's own
    channels (the row's object check makes it the tenant's; this makes it a channel), and
    never enabling a channel while the broker holds the tenant's channels on that GPU
    stopped (compute.py: a high-priority tenant there, or another tenant's turn)."""
    obj = ctx.client.objects.get(ctx.handle) if ctx.client is not None else None
    what = "RM_CONTROL NVA06F_CTRL_CMD_GPFIFO_SCHEDULE"
    if obj is None or obj.rm_class not in compute.CHANNEL_CLASSES:
        raise Refusal(f"{what}: object {ctx.handle:#x} is not one of the tenant's channels",
                      status=nvstatus.NV_ERR_INVALID_OBJECT_HANDLE, what=what)
    if (params is not None and params.bEnable and obj.gpu is not None
            and compute.stops_new_channels(ctx.broker, ctx.session.tenant.name, obj.gpu)):
        raise Refusal(f"{what}: the tenant's channels on GPU {obj.gpu} are stopped by the "
                      "broker (compute shares): enabling one is refused",
                      status=nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS, what=what)
    return params


def hold_steps(b: Any, tenant: Any):
    """Steps: a call of a tenant whose calls are held waits until it runs again."""
    if tenant.name in b.preemption.held:
        yield Await(b.preemption.until_running, (tenant.name,))


def metric_families(snap: dict[str, Any], gauge, counter) -> list:
    """Prometheus families for broker/metrics.py from `snapshot()`."""
    pre = gauge("devbroker_tenant_preempted", "1 while the tenant is preempted (its GPU "
                "state in host memory)", ["tenant", "state"])
    for name, e in snap["tenants"].items():
        pre.add_metric([name, e["state"]], 1)
    host = gauge("devbroker_preemption_host_bytes", "Host memory held by checkpoints of "
                 "preempted tenants, and the policy's limit", ["kind"])
    host.add_metric(["used"], snap["host_used"])
    host.add_metric(["limit"], snap["host_memory"])
    events = counter("devbroker_preemptions", "Preemptions and restores by tenant and outcome "
                     "(preempted, restored, refused, failed, restore_failed, migrated)",
                     labels=["tenant", "event"])
    secs = counter("devbroker_preemption_seconds", "Time the checkpoints and restores took",
                   labels=["tenant", "event"])
    for ev, t, n in snap["counts"]:
        events.add_metric([t, ev], n)
    for ev, t, s in snap["seconds"]:
        secs.add_metric([t, ev], s)
    moved = counter("devbroker_preempted_bytes", "Device memory moved to host memory by "
                    "preemptions", labels=["tenant"])
    for t, n in snap["moved"].items():
        moved.add_metric([t], n)
    return [pre, host, events, secs, moved]



# ---------------------------------------------------------------------- the control socket
def control_ops(broker: Any) -> dict[str, Any]:
    """`tenant.preempt` / `tenant.resume` / `tenant.migrate` for the control socket (broker/control.py: admin
    role, as every op it does not list). A refusal is the reply's error, with its reason."""
    from devbroker.broker.control import ControlError

    def tenant_of(req: dict) -> str:
        name = req.get("tenant")
        if not isinstance(name, str) or name not in broker.tenants:
            raise ControlError(f"no tenant {name!r}")
        return name

    async def preempt(req: dict) -> dict:
        name = tenant_of(req)
        why = await broker.preemption.preempt(name)
        if why is not None:
            raise ControlError(f"tenant {name} not preempted: {why}")
        e = broker.preemption.entries[name]
        return {"tenant": name, "bytes": e.bytes, "pids": list(e.pids), "seconds": e.seconds}

    async def resume(req: dict) -> dict:
        name = tenant_of(req)
        why = await broker.preemption.resume(name)
        if why is not None:
            raise ControlError(f"tenant {name} not resumed: {why}")
        return {"tenant": name}

    async def migrate(req: dict) -> dict:
        name = tenant_of(req)
        gpu = req.get("gpu")
        if isinstance(gpu, bool) or not isinstance(gpu, int):
            raise ControlError("migrate needs \"gpu\": a GPU index")
        why = await broker.preemption.migrate(name, gpu)
        if why is not None:
            raise ControlError(f"tenant {name} not migrated: {why}")
        return {"tenant": name, "gpu": gpu}

    return {"tenant.preempt": preempt, "tenant.resume": resume, "tenant.migrate": migrate}
