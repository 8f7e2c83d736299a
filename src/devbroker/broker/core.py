"""The broker core: every front end's requests end here.

For each ioctl the core (1) finds the session and tenant, (2) waits for the tenant's rate
limit, (3) decodes the argument with the driver ABI, (4) refuses what the tenant's
capabilities do not allow (deny by default: the rule tables in rules.py), and runs the
call's row: its handler (handlers.py) (5) checks that every client handle named belongs to
the tenant, (6) enforces the device-memory quota, (7) hands the call to the backend, (8)
rewrites what the tenant may see (the row's hooks, rewrite.py) and (9) writes the results
back. Refusals are answered the way the driver itself refuses: an errno for an escape, an
NV_STATUS in the argument for a class or control.
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from devbroker.abi import DecodeError, UnknownVersion, registry
from devbroker.abi import status as nvstatus
from devbroker.abi.nodes import NodeKind
from devbroker.abi.driver import DriverABI
from devbroker.backends.base import Backend, DriverCall, DriverFile, DriverResult
from devbroker.broker import compute, limits, preemption, rules, turns
from devbroker.broker.audit import AuditLog
from devbroker.broker.continuelane import ContinueLane
from devbroker.broker.fastlane import ControlLane
from devbroker.broker.effects import (
    STATE_LOCK, DriverIoctl, Effect, RateLimit, ReadMemory, ResolveFd, Steps, WriteMemory,
    locked, perform_async, run_async,
)
from devbroker.broker.memgate import MemoryGate
from devbroker.broker.interface import (
    Caller,
    IoctlReply,
    IoctlRequest,
    MapCheckReply,
    MapReadReply,
    MapReadRequest,
    OpenReply,
    OpenRequest,
    ReleaseRequest,
    RunInCaller,
)
from devbroker.broker.handlers import CallContext, embedded_buffers
from devbroker.broker.objects import BOOKS, ClientRegistry, RmClient
from devbroker.broker.policy import Policy, TenantPolicy
from devbroker.broker.procinfo import pid_namespace, stat_nosync
from devbroker.broker.quotawatch import QuotaWatch
from devbroker.broker.record import Recorder
from devbroker.broker.ratelimit import TokenBucket
from devbroker.broker.refusal import Refusal
from devbroker.broker.rules import CLIENT_FIELDS_ZERO_OK, CLIENT_HANDLE_FIELDS

log = logging.getLogger("devbroker.broker")

# The biggest nested buffer the broker will copy from a tenant. The largest real control
# parameter block in the traces is under 8 KiB; anything near this is an attack.
MAX_NESTED_BYTES = 1 << 20
# Embedded buffers (pointers inside control parameters) are strings and small tables.
MAX_EMBEDDED_BYTES = 64 << 10
# nvidia-uvm mappings (managed memory) a tenant process may make, in bytes, when the policy
# does not say (tenant key managed_memory): CUDA maps 2 MiB for itself; cudaMallocManaged
# beyond the allowance fails with out-of-memory (docs/seccomp.md).
MANAGED_MEMORY_DEFAULT = 64 << 20

# A control every root client answers, with no state and a 4-byte parameter block
# (NV0000_CTRL_CMD_SYSTEM_GET_FEATURES): the broker's probe that a handle is a client of a file.
PROBE_CONTROL = 0x1F0


def _locked(method: Callable) -> Callable:
    """Run a method that reads or changes the broker's books under the state lock (listener
    threads run decision steps concurrently with the trio thread: effects.py)."""
    def locked(self, *args: Any, **kw: Any) -> Any:
        with STATE_LOCK:
            return method(self, *args, **kw)
    locked.__name__, locked.__doc__ = method.__name__, method.__doc__
    return locked


SQUAT_RECORDS = 16  # client-squat records written for each tenant before they thin out


@dataclass
class Session:
    id: int
    tenant: "TenantState"
    node: NodeKind
    minor: int
    caller: Caller
    file: DriverFile
    closed: bool = False
    pidns: str | None = None  # the opener's pid namespace (an fd passed out of it is refused)
    prepared: bool = False  # opened ahead, not given to a process yet (OpenRequest.prepared)

    @property
    def node_name(self) -> str:
        if self.node is NodeKind.GPU:
            return f"nvidia{self.minor}"
        return {NodeKind.CTL: "nvidiactl", NodeKind.UVM: "nvidia-uvm",
                NodeKind.UVM_TOOLS: "nvidia-uvm-tools"}.get(self.node, self.node.name.lower())


@dataclass
class TenantState:
    name: str
    policy: TenantPolicy
    limiter: TokenBucket
    sessions: dict[int, Session] = field(default_factory=dict)
    # Its root clients by handle: written by the broker's ClientRegistry only.
    clients: dict[int, RmClient] = field(default_factory=dict)
    abi_by_tgid: dict[int, DriverABI] = field(default_factory=dict)
    refusals: int = 0
    requests: int = 0
    continued: int = 0  # decided calls the tenant's own kernel context ran (run_in_caller)
    uvm_mapped: dict[int, int] = field(default_factory=dict)  # tgid -> nvidia-uvm bytes mapped

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(self.policy.gpus)

    def quota(self, gpu: int) -> int:
        return int(self.policy.memory_quota)

    def used(self) -> dict[int, int]:
        out: dict[int, int] = {g: 0 for g in self.gpus}
        for client in self.clients.values():
            for gpu, n in client.charged_by_gpu().items():
                out[gpu] = out.get(gpu, 0) + n
        return out

    @property
    def revoked(self) -> bool:
        """Removed from the running policy: its open files stay until closed, every call is
        refused (kept in Broker.tenants under "<name> (revoked)" for status and hand-over)."""
        return isinstance(self.policy, _RevokedTenant)

    def capabilities(self) -> frozenset[str]:
        return frozenset(self.policy.capabilities)

    def tgids(self) -> set[int]:
        return set(self.openers())

    def openers(self) -> dict[int, str | None]:
        """The processes that opened its files (pid -> the pid namespace they were opened
        in; the pid may have exited, or been reused since, while the file lives on)."""
        return {s.caller.pid: s.pidns for s in self.sessions.values() if not s.prepared}


class Broker:
    """Implements devbroker.broker.interface.BrokerInterface."""

    def __init__(self, policy: Policy, backend: Backend, audit: AuditLog | None = None,
                 *, recorder: Recorder | None = None):
        self.backend = backend
        self.audit = audit or AuditLog()
        self.recorder = recorder
        # Every read and write of a tenant's memory goes through the gate: on a worker
        # thread, with a deadline, so that no tenant's page can stall the broker.
        self.memgate = MemoryGate(self.audit)
        # The common RM controls decided in a few lookups (fastlane.py; seccomp listeners).
        self.control_lane = ControlLane(self)
        # UVM commands the driver binds to the caller, continued after the client check
        self.continue_lane = ContinueLane(self)
        self.sessions: dict[int, Session] = {}
        self.tenants: dict[str, TenantState] = {}
        # Every root client, its tenant and its session (the only place they are added
        # and removed; TenantState.clients is its per-tenant view).
        self.clients = ClientRegistry()
        self._ids = itertools.count(1)
        self._squats: dict[str, int] = {}  # tenant -> root clients named in the driver's range
        self.policy: Policy | None = None
        self.on_policy_change: list[Callable[[Policy], None]] = []
        compute.install(self)  # a policy change re-sets running channel groups
        # Starts a background task (the daemon's nursery.start_soon); None: no background
        # work (quota watch off). Set with set_spawner (it may be called from any thread).
        self.spawn: Callable | None = None
        self._trio_token: Any = None
        # Device memory past the books (a rewritten continued call), from the driver's own
        # per-process accounting: only where the backend has one.
        self.quota_watch: QuotaWatch | None = (
            QuotaWatch(backend.process_vidmem_many, lambda: self.tenants, self.audit,
                       self._start_soon) if backend.counts_process_memory else None)
        # Priority preemption by checkpoint (preemption.py): who is preempted, the room
        # reserved for restores.
        self.preemption = preemption.Preemption(self)
        self.apply_policy(policy)
        self._logged_once: set[tuple] = set()

    # ------------------------------------------------------------------ policy
    @_locked
    def apply_policy(self, policy: Policy, *, ending: frozenset[str] = frozenset()) -> None:
        """Install a (validated) policy. Running tenants keep their sessions and objects.
        `ending`: tenants the caller removes and whose processes it then ends (`devbroker
        tenant rm`): what their filters let the kernel run ends with them."""
        for gpu in {g for t in policy.tenants.values() for g in t.gpus}:
            if gpu >= len(self.backend.gpus()):
                raise ValueError(f"policy names GPU {gpu}; the {self.backend.name} backend has "
                                 f"{len(self.backend.gpus())}")
        self._check_kernel_run_kept(policy, ending)
        new: dict[str, TenantState] = {}
        for name, tp in policy.tenants.items():
            rate = tp.rate_limit.requests_per_second if tp.rate_limit else 0
            burst = tp.rate_limit.burst if tp.rate_limit else 0
            old = self.tenants.get(name)
            if old is not None:
                lost = set(old.gpus) - set(tp.gpus)
                held = {g: n for g, n in old.used().items() if g in lost and n}
                if lost:
                    # From now on every call on the tenant's objects of
                    # these GPUs is refused (except freeing them); say what is still held.
                    self.audit.write("notice", tenant=name, message=(
                        f"GPU(s) {sorted(lost)} revoked from tenant {name}: calls on its "
                        f"objects there are refused from now on; memory still held there: "
                        f"{held or 'none'} bytes (freeing it stays allowed)"))
                old.policy = tp
                if (old.limiter.rate, old.limiter.burst) != (float(rate), float(burst)):
                    old.limiter = TokenBucket(rate, burst)
                new[name] = old
            else:
                new[name] = TenantState(name, tp, TokenBucket(rate, burst))
        # A tenant removed from the policy loses its nodes (the front end drops them); its
        # open files stay valid until closed, but every further call is refused.
        for name, old in self.tenants.items():
            if name not in new:
                old.policy = _RevokedTenant()
                new[f"{name} (revoked)"] = old
        self.tenants = new
        self.policy = policy
        BOOKS.policy_changed()  # (every settled decision read the policy: decided again)
        self.preemption.ensure_restoring()  # (preemption turned on, or tenants handed over)
        for cb in self.on_policy_change:
            cb(policy)

    def _check_kernel_run_kept(self, policy: Policy, ending: frozenset[str]) -> None:
        """ValueError when the policy would take from a running tenant calls the kernel runs
        for it unasked. A seccomp tenant with real driver files has the UVM rows with
        `in_kernel` in its filter (rules.kernel_commands), and a running process's filter
        cannot be changed: taking the capability away (or the tenant) while it holds
        nvidia-uvm files would leave those calls reaching the driver. So the change is
        refused until those files are closed (its processes ended); the running policy
        stays in force. A tenant in `ending` is removed by a caller that ends its processes
        next, which ends those calls too."""
        if not self.backend.tenant_files:
            return
        try:
            abi = registry.get(self.backend.version)
        except UnknownVersion:  # no tables: no command is run by the kernel alone
            return
        for name, t in self.tenants.items():
            if t.revoked or (name in ending and name not in policy.tenants):
                continue
            tp = policy.tenants.get(name)
            keep = set(rules.kernel_commands(abi, frozenset(tp.capabilities) if tp else
                                             frozenset()))
            lost = set(rules.kernel_commands(abi, t.capabilities())) - keep
            if not lost:
                continue
            live = [s for s in t.sessions.values() if s.node is NodeKind.UVM
                    and not s.closed and getattr(s.file, "runs_in_caller", False)]
            if live:
                pids = sorted({s.caller.pid for s in live})
                raise ValueError(
                    f"tenant {name} holds {len(live)} open nvidia-uvm file(s) (pids "
                    f"{', '.join(map(str, pids[:8]))}) whose seccomp filter lets the kernel "
                    f"run {len(lost)} UVM commands this policy takes away; a running "
                    "filter cannot be changed: end those processes, then apply again")

    def note_client_squat(self, s: Session, handle: int, what: str) -> None:
        """Audit a root client named with a handle of the driver's own range
        (handlers.names_driver_client_handle): the first SQUAT_RECORDS of a tenant, then
        every power of two (a tenant that loops cannot fill the log with them)."""
        n = self._squats[s.tenant.name] = self._squats.get(s.tenant.name, 0) + 1
        if n <= SQUAT_RECORDS or not n & (n - 1):
            self.audit.write("client-squat", tenant=s.tenant.name, pid=s.caller.pid,
                             what=what, handle=f"{handle:#x}", count=n,
                             reason="a root client named with a handle of the range the "
                                    "driver hands out itself (another tenant's next client "
                                    "would get it; the driver skips it)")

    def tenant_gpus(self, tenant: str) -> tuple[int, ...]:
        t = self.tenants.get(tenant)
        return t.gpus if t else ()

    def set_spawner(self, start_soon: Callable) -> None:
        """Background tasks start in this trio run (call from inside it)."""
        self.spawn = start_soon
        self._trio_token = trio.lowlevel.current_trio_token()
        compute.schedule_preempt(self)  # low-priority tenants yield to high ones (compute.py)
        if self.quota_watch is not None:
            self.quota_watch.resume()  # processes watched before the run (a live upgrade)
        turns.schedule(self, startup=True)  # weighted turns, when the policy asks (turns.py)
        self.preemption.ensure_restoring()  # preempted tenants back as room frees

    def _start_soon(self, fn: Callable) -> bool:
        """Start a background task from the trio thread or from a listener thread. False:
        there is no trio run to start it in (none yet, or it has finished)."""
        if self.spawn is None:
            return False
        if self._trio_token is None:
            self.spawn(fn)
            return True
        try:
            self._trio_token.run_sync_soon(self._spawn_guarded, fn)
        except Exception as e:  # the run has finished: no more background work
            log.warning("background task not started: %s", e)
            return False
        return True

    def _spawn_guarded(self, fn: Callable) -> None:
        """(Trio thread, a run_sync_soon callback from a listener thread.) An exception here
        would end the whole trio run; a nursery already closed (the broker stopping) means
        no more background work."""
        try:
            self.spawn(fn)
        except Exception as e:
            log.warning("background task not started: %s", e)

    def kernel_ioctls(self, tenant: str) -> tuple[int, ...]:
        """The ioctl numbers a seccomp tenant's filter lets the kernel run without asking
        (rules.kernel_commands): only where the backend hands out real driver files (an
        emulated backend's files are placeholders, every call of theirs is answered here),
        for the tenant's capabilities now."""
        t = self.tenants.get(tenant)
        if t is None or not self.backend.tenant_files:
            return ()
        try:
            abi = registry.get(self.backend.version)
        except UnknownVersion:  # no tables for this driver: every call notified (always safe)
            return ()
        return rules.kernel_commands(abi, t.capabilities())

    # ------------------------------------------------------------------ helpers
    def _abi(self, session: Session):
        t = session.tenant
        return t.abi_by_tgid.get(session.caller.pid) or registry.get(self.backend.version)

    def _deny(self, session: Session | None, what: str, reason: str, **extra: Any) -> None:
        tenant = session.tenant if session else None
        if tenant:
            tenant.refusals += 1
        self.audit.deny(tenant=tenant.name if tenant else None,
                        pid=session.caller.pid if session else None,
                        node=session.node_name if session else None,
                        what=what, reason=reason, **extra)

    def _same_sandbox(self, s: Session, caller: Caller) -> bool:
        """A file is usable only by the kind of caller that opened it: the same uid (tenants
        of the kernel-module and CUSE front ends are uids sharing one pid namespace) and the
        same pid namespace (FUSE/exec sandboxes usually all run as uid 0). A tenant that
        passes its fd to another (over a Unix socket, say) hands over nothing. A process that
        changes its uid after opening loses its files too; said in docs/security.md."""
        if caller.uid != s.caller.uid:
            reason = (f"file opened by uid {s.caller.uid} used by uid {caller.uid} "
                      "(fd passed between tenants)")
        else:
            if s.pidns is None:  # the opener's namespace could not be read
                return True
            mine = caller.pidns or pid_namespace(caller.pid)
            if mine == s.pidns:
                return True
            reason = (f"file opened in pid namespace {s.pidns} used from "
                      f"{mine or 'a vanished process'} (fd passed between sandboxes)")
        self._deny(s, f"{s.node_name} used by pid {caller.pid}", reason)
        return False

    def _once(self, key: tuple, msg: str) -> None:
        if key not in self._logged_once:
            self._logged_once.add(key)
            self.audit.write("notice", message=msg)

    # ------------------------------------------------------------------ open
    async def open(self, req: OpenRequest) -> OpenReply:
        await limits.take(self.tenants.get(req.tenant))  # opens are paced like ioctls
        return self.open_now(req)

    @_locked
    def open_now(self, req: OpenRequest) -> OpenReply:
        tenant = self.tenants.get(req.tenant)
        what = f"open {req.node.name.lower()}{req.minor if req.node is NodeKind.GPU else ''}"
        if tenant is None or tenant.revoked:
            self.audit.deny(tenant=req.tenant, pid=req.caller.pid, what=what,
                            reason="no such tenant in the running policy")
            return OpenReply(errno=errno.EACCES)
        pinned = getattr(tenant.policy, "uids", None)
        if pinned and req.caller.uid not in pinned:
            self.audit.deny(tenant=tenant.name, pid=req.caller.pid, what=what,
                            reason=f"uid {req.caller.uid} is not pinned to this tenant")
            return OpenReply(errno=errno.EACCES)
        refusal = rules.check_open(req.node, req.minor, tenant.gpus, tenant.capabilities())
        if refusal:
            tenant.refusals += 1
            self.audit.deny(tenant=tenant.name, pid=req.caller.pid, what=what, reason=refusal)
            return OpenReply(errno=errno.EACCES)
        if over := limits.open_refusal(tenant):
            tenant.refusals += 1
            self.audit.deny(tenant=tenant.name, pid=req.caller.pid, what=what, reason=over)
            return OpenReply(errno=errno.EMFILE)
        try:
            if req.want_file and self.backend.tenant_files:
                file = self.backend.open(req.node, req.minor, tenant_file=True, flags=req.flags)
            else:
                file = self.backend.open(req.node, req.minor)
        except OSError as e:
            self.audit.write("error", tenant=tenant.name, pid=req.caller.pid, what=what,
                             reason=f"driver open failed: {e}")
            return OpenReply(errno=e.errno or errno.EIO)
        sid = next(self._ids)
        s = Session(sid, tenant, req.node, req.minor, req.caller, file,
                    pidns=req.caller.pidns or pid_namespace(req.caller.pid),
                    prepared=req.prepared)
        self.sessions[sid] = s
        tenant.sessions[sid] = s
        if self.recorder is not None:
            self.recorder.open(s)
        install = getattr(file, "install_fd", -1)
        if install >= 0:
            file.install_fd = -1  # the front end owns (installs, then closes) it now
        return OpenReply(session=sid, install_fd=install)

    @_locked
    def opened_by(self, session_id: int, caller: Caller) -> None:
        """A session opened ahead for a front end's prepared open (seccomp: an open decided
        before it was asked, for the opener's sandbox) was given to `caller`, of that same
        sandbox: the session is its file now (its process's ABI, its tgid in the tenant's
        process list)."""
        s = self.sessions.get(session_id)
        if s is not None and not s.closed and s.caller.uid == caller.uid:
            s.caller = caller
            s.prepared = False

    def after_open_answered(self, later: bool = False) -> bool:
        """A front end has installed a tenant file (open_now's install_fd) and answered the
        open: the backend's deferred work for it, off the tenant's path (no state lock:
        the backend's own). later=True: the front end calls `quiet_work` when it next has
        nothing to answer, and the backend may keep the work for then (True: it did)."""
        return bool(self.backend.after_open_answered(later))

    def quiet_work(self) -> None:
        """What `after_open_answered(later=True)` kept: the front end is quiet now."""
        self.backend.quiet_work()

    # ------------------------------------------------------------------ release
    async def release(self, req: ReleaseRequest) -> None:
        self.release_now(req)

    @_locked
    def release_now(self, req: ReleaseRequest) -> None:
        s = self.sessions.pop(req.session, None)
        if s is None or s.closed:
            return
        s.closed = True
        s.tenant.sessions.pop(s.id, None)
        if self.recorder is not None:
            self.recorder.close(s)
        # Closing the ctl file frees every client allocated through it (driver semantics),
        # and with them the quota they held.
        self.clients.close_session(s.id)
        try:
            self.backend.close(s.file)
        except OSError as e:  # pragma: no cover - real driver close errors are only logged
            log.warning("backend close failed: %s", e)
        if not any(x.caller.pid == s.caller.pid for x in s.tenant.sessions.values()):
            s.tenant.abi_by_tgid.pop(s.caller.pid, None)
        if s.node is NodeKind.UVM and not any(
                x.caller.pid == s.caller.pid and x.node is NodeKind.UVM
                for x in s.tenant.sessions.values()):
            # The kernel releases a file only when no mapping holds it any more: the
            # process's nvidia-uvm mappings are gone with its last nvidia-uvm file.
            s.tenant.uvm_mapped.pop(s.caller.pid, None)

    # ------------------------------------------------------------------ mmap page reads
    async def map_read(self, req: MapReadRequest) -> MapReadReply:
        s = self.sessions.get(req.session)
        if s is None:
            return MapReadReply(errno=errno.EBADF)
        if not self._same_sandbox(s, req.caller):
            return MapReadReply(errno=errno.EACCES)
        await limits.take(s.tenant)  # page reads are paced like ioctls
        if s.node is NodeKind.GPU and s.minor not in s.tenant.gpus:
            # No more pages of a revoked GPU (its memory can still be freed).
            self._deny(s, f"mmap read nvidia{s.minor}", f"GPU {s.minor} was revoked from "
                       f"tenant {s.tenant.name} by a policy change")
            return MapReadReply(errno=errno.EACCES)
        try:
            data = self.backend.map_read(s.file, req.offset, req.length)
        except OSError as e:
            if self.recorder is not None:
                self.recorder.map_read(s, req.offset, req.length, ok=False)
            return MapReadReply(errno=e.errno or errno.EIO)
        if self.recorder is not None:
            self.recorder.map_read(s, req.offset, req.length)
        return MapReadReply(data=data)

    # ------------------------------------------------------------------ mmap of real files
    async def map_check(self, req: MapReadRequest) -> MapCheckReply:
        return self.map_check_now(req)

    @_locked
    def map_check_now(self, req: MapReadRequest) -> MapCheckReply:
        """May the caller map this file (a driver file that lives in the tenant)? The driver
        itself checks the mapping context; what the broker adds is that nvidia-uvm mappings
        (managed memory: device memory UVM allocates inside the kernel, which no tenant
        ioctl shows and no quota could count) stay within a small allowance per process,
        enough for what CUDA maps for itself (one 2 MiB range in the PyTorch trace)."""
        s = self.sessions.get(req.session)
        if s is None or s.closed:
            return MapCheckReply(errno=errno.EBADF)
        if not self._same_sandbox(s, req.caller):
            return MapCheckReply(errno=errno.EACCES)
        if s.node is NodeKind.UVM:
            limit = int(getattr(s.tenant.policy, "managed_memory", MANAGED_MEMORY_DEFAULT))
            used = s.tenant.uvm_mapped.get(s.caller.pid, 0)
            if used + req.length > limit:
                self._deny(s, f"mmap nvidia-uvm {req.length} bytes",
                           f"managed (UVM) memory beyond {limit} bytes per process is not "
                           f"offered ({used} mapped): its device memory cannot be counted "
                           "against the quota")
                return MapCheckReply(errno=errno.ENOMEM)
            s.tenant.uvm_mapped[s.caller.pid] = used + req.length
        return MapCheckReply()

    # ------------------------------------------------------------------ ioctl
    async def ioctl(self, req: IoctlRequest) -> IoctlReply:
        return await run_async(self.ioctl_steps(req), self.perform)

    async def perform(self, eff: Effect) -> Any:
        return await perform_async(eff, self.memgate)


    def ioctl_steps(self, req: IoctlRequest, around: Callable[[], Any] | None = None) -> Steps:
        """The whole decision for one ioctl, as steps (effects.py): run by `ioctl` on the
        trio thread, or by a seccomp listener thread (frontends/seccomp.py). The broker's
        books are touched under the state lock only, released at every effect."""
        return locked(self._ioctl_steps(req), around)

    def _ioctl_steps(self, req: IoctlRequest) -> Steps:
        s = self.sessions.get(req.session)
        if s is None or s.closed:
            return IoctlReply(errno=errno.EBADF)
        tenant = s.tenant
        if tenant.revoked:
            self._deny(s, f"ioctl {req.cmd:#x}", "tenant removed from the running policy")
            return IoctlReply(errno=errno.EACCES)
        if not self._same_sandbox(s, req.caller):
            return IoctlReply(errno=errno.EACCES)
        if tenant.name in self.preemption.held:
            # Preempted: its calls wait until it runs again (the driver's lock, modelled)
            yield from preemption.hold_steps(self, tenant)
        if s.node is NodeKind.GPU and s.minor not in tenant.gpus:
            # A GPU node opened before a policy change took the GPU away.
            # New opens are refused by rules.check_open; an open file must not outlive it.
            self._deny(s, f"ioctl {req.cmd:#x}", f"GPU {s.minor} was revoked from tenant "
                       f"{tenant.name} by a policy change")
            return IoctlReply(errno=errno.EACCES)
        if not tenant.limiter.try_acquire():
            self._once(("rate", tenant.name), f"tenant {tenant.name} reached its rate limit: "
                       "its requests are being delayed")
            yield RateLimit(tenant.limiter)
        tenant.requests += 1
        abi = self._abi(s)
        try:
            arg = yield from self._top_level_arg(s, abi, req)
            call = abi.decode_ioctl(s.node, req.cmd, arg)
        except DecodeError as e:
            self._deny(s, f"ioctl {req.cmd:#x}", f"malformed argument: {e}")
            return IoctlReply(errno=errno.EINVAL)
        except Refusal as r:
            self._deny(s, r.what or f"ioctl {req.cmd:#x}", r.reason)
            return IoctlReply(errno=r.errno)
        except OSError as e:
            self._deny(s, f"ioctl {req.cmd:#x}", f"argument unreadable: {e.strerror}")
            return IoctlReply(errno=errno.EFAULT)

        if call.spec is None:
            self._deny(s, call.name, "unknown command for driver " + abi.version)
            return IoctlReply(errno=errno.EINVAL if call.kind == "uvm" else errno.EPERM)
        rule = rules.escape_rule(call)
        if rule is None or not rule.granted(tenant.capabilities()):
            reason = (f"{call.name} is not allowed for tenants" if rule is None else
                      f"{call.name} needs capability '{rule.capability}'")
            self._deny(s, call.name, reason)
            return IoctlReply(errno=errno.EPERM)
        if s.node not in rule.nodes:
            self._deny(s, call.name, f"{call.name} is not valid on {s.node_name}")
            return IoctlReply(errno=errno.EINVAL)

        try:
            out = rule.handler(CallContext(self, s, abi, req, call, rule, rules))
            # Handlers that need nothing from outside decide in one go (no steps).
            reply = (yield from out) if isinstance(out, types.GeneratorType) else out
        except RunInCaller as rc:
            # Decided; the driver binds it to the caller: the kernel runs it in the tenant.
            tenant.continued += 1
            if rc.args and rc.args[0] == "watch":
                self._watch_quota(s)
            return IoctlReply(run_in_caller=True)
        except Refusal as r:
            self._deny(s, r.what or call.name, r.reason)
            if r.status is not None:
                reply = self._status_reply(abi, call, r.status, r.errno)
            else:
                reply = IoctlReply(errno=r.errno)
        except DecodeError as e:
            self._deny(s, call.name, f"malformed nested argument: {e}")
            reply = self._status_reply(abi, call, nvstatus.NV_ERR_INVALID_ARGUMENT)
        except OSError as e:
            if e.errno == errno.ESRCH:  # the caller is gone: nobody to answer, nothing done
                return IoctlReply(errno=errno.ESRCH)
            # Nested buffers unreadable or unwritable: the driver answers EFAULT too.
            self._deny(s, call.name, f"tenant memory access failed: {e.strerror or e}")
            reply = IoctlReply(errno=errno.EFAULT)
        except Exception as e:  # a bug must cost one call, never the broker
            log.exception("internal error handling %s", call.name)
            self.audit.write("error", tenant=tenant.name, pid=s.caller.pid,
                             node=s.node_name, what=call.name,
                             reason=f"internal error: {type(e).__name__}: {e}")
            reply = IoctlReply(errno=errno.EIO)
        if reply.arg_out is not None and call.kind == "uvm" and req.arg is None:
            # UVM arguments carry no size in the ioctl number: the front end gave us only
            # the pointer, so the result goes back through the tenant's memory.
            try:
                yield from self._mem_write(s, req, req.arg_ptr, reply.arg_out)
            except OSError as e:
                self._deny(s, call.name, f"tenant memory access failed: {e.strerror or e}")
                return IoctlReply(errno=errno.EFAULT)
            reply = IoctlReply(result=reply.result, errno=reply.errno)
        return reply

    # ------------------------------------------------------------------ tenant memory
    # Never req.memory directly: a tenant's page may only fault in with help from someone
    # (the broker's own FUSE mount, userfaultfd, ...). The gate (broker/memgate.py) runs the
    # access on a worker thread with a deadline; refusals are OSError(EFAULT), audited by
    # the callers like any unreadable pointer.
    def _mem_read(self, s: Session, req: IoctlRequest, addr: int, n: int) -> bytes:
        if req.memory is None:
            raise Refusal("front end cannot read tenant memory", errno_=errno.EINVAL)
        return (yield ReadMemory(req.memory, addr, n, s.tenant.name,
                                 f"read of {n} bytes at {addr:#x}"))

    def _mem_write(self, s: Session, req: IoctlRequest, addr: int, data: bytes) -> None:
        if req.memory is None:
            raise Refusal("front end cannot write tenant memory", errno_=errno.EINVAL)
        yield WriteMemory(req.memory, addr, bytes(data), s.tenant.name,
                          f"write of {len(data)} bytes at {addr:#x}")

    def _top_level_arg(self, s: Session, abi, req: IoctlRequest) -> bytes:
        if req.arg is not None and len(req.arg) > 0:
            return req.arg
        if s.node in (NodeKind.UVM, NodeKind.UVM_TOOLS):
            spec = abi.uvm(req.cmd)
            if spec is None:
                raise Refusal(f"unknown UVM command {req.cmd:#x}", errno_=errno.EINVAL,
                              what=f"UVM {req.cmd:#x}")
            return (yield from self._mem_read(s, req, req.arg_ptr, spec.size)) if spec.size else b""
        return req.arg or b""

    def _status_reply(self, abi, call, status: int, errno_: int = errno.EINVAL) -> IoctlReply:
        """Answer with the driver's status in the argument and ioctl() == 0; arguments
        without a status field (REGISTER_FD, …) are refused with errno_ instead."""
        arg = call.with_status(status)
        return IoctlReply(errno=errno_) if arg is None else IoctlReply(arg_out=arg)

    def _call_backend(self, s: Session, call, nested: bytes | None = None,
                            fd_files: dict | None = None,
                            embedded: dict | None = None, *, req: IoctlRequest | None = None,
                            rm_class: int | None = None,
                            nested_fds: dict | None = None) -> DriverResult:
        dc = DriverCall(call, nested, fd_files or {}, abi=self._abi(s), tgid=s.caller.pid,
                        embedded=embedded if embedded is not None else {},
                        nested_fds=nested_fds or {})
        if getattr(s.file, "runs_in_caller", False):
            # A driver file that lives in the tenant (seccomp + real backend).
            if rules.in_caller_reason(call, rm_class):
                # An allocation the kernel re-reads could be rewritten by a racing thread
                # into device memory the books never see: check the driver's accounting.
                raise RunInCaller("watch" if rm_class is not None else call.name)
            return (yield from self._execute_on_tenant_file(s, dc, req))
        self._confirm(req)
        started = time.monotonic_ns()
        result = yield DriverIoctl(self.backend, s.file, dc)
        if self.recorder is not None:
            self.recorder.ioctl(s, call, nested, result,
                                duration_ns=time.monotonic_ns() - started)
        return result

    def _execute_on_tenant_file(self, s: Session, dc: DriverCall,
                                      req: IoctlRequest | None) -> DriverResult:
        """Run a decided call on the broker's own duplicate of the tenant's file (and of the
        files its fd fields name), closed again right after the call."""
        if req is None or req.dup_fd is None or req.fd < 0:
            raise Refusal(f"{dc.call.name}: the front end cannot lend the tenant's file",
                          errno_=errno.EBADF)
        dups: list[int] = []

        def dup(number: int, file) -> int:
            # The fd number is the tenant's: a racing thread may have put another file
            # there (dup2) since the broker identified it. Run only on the file decided on.
            fd = req.dup_fd(number)
            dups.append(fd)
            st = stat_nosync(fd=fd)  # never waits on a server, should fd be a FUSE file now
            if (st.st_dev, st.st_ino) != getattr(file, "key", None):
                raise Refusal(f"{dc.call.name}: the file behind fd {number} changed while the "
                              "call was being decided", errno_=errno.EBADF)
            return fd

        try:
            dc.file_fd = dup(req.fd, s.file)
            for path, target in dc.fd_files.items():
                if path.startswith("params."):
                    continue  # in the nested parameters: nested_fds below
                dc.fds[path] = dup(int(_get_path(dc.call.value, path)), target)
            if dc.nested_fds:
                # An fd inside the parameters: the driver looks it up in the broker's own
                # fd table, so the private copy names the broker's duplicate.
                nested = bytearray(dc.nested or b"")
                for offset, (number, target) in dc.nested_fds.items():
                    nested[offset:offset + 4] = dup(number, target).to_bytes(4, "little",
                                                                             signed=True)
                dc.nested = bytes(nested)
            self._confirm(req)  # after the last read and dup, before the driver sees them
            started = time.monotonic_ns()
            result = yield DriverIoctl(self.backend, s.file, dc)
            if self.recorder is not None:
                self.recorder.ioctl(s, dc.call, dc.nested, result,
                                    duration_ns=time.monotonic_ns() - started)
            return result
        finally:
            for fd in dups:
                os.close(fd)

    @staticmethod
    def _confirm(req: IoctlRequest | None) -> None:
        """The caller must still be the one that made the call before the broker acts on
        what it read (IoctlRequest.confirm)."""
        if req is not None and req.confirm is not None and not req.confirm():
            raise OSError(errno.ESRCH, "the calling thread went away during the call")

    def _adopt_client(self, s: Session, h: int, req: IoctlRequest | None) -> bool:
        """A root client the tenant allocated itself (a continued call) on this ctl file: the
        broker learns its handle when the tenant first names it here, and only after the
        driver confirms it is a client of this very file (a harmless control on it; client
        handles are validated per file and unique host-wide, so it cannot be another
        tenant's)."""
        if not self._may_adopt(s, h):
            return False
        abi, probe, dc = self._adoption_probe(s, h)
        result = yield from self._execute_on_tenant_file(s, dc, req)
        return self._adopted(s, h, abi, probe, result)

    def _adoption_probe(self, s: Session, h: int) -> tuple:
        """(abi, the probe control, its DriverCall): a harmless control on client h of this
        file, which the driver answers NV_OK only for a client of this very file."""
        abi = self._abi(s)
        probe = abi.own_control(NodeKind.CTL, h, h, PROBE_CONTROL, 4)
        return abi, probe, DriverCall(probe, bytes(4), {}, abi=abi, tgid=s.caller.pid)

    def _may_adopt(self, s: Session, h: int) -> bool:
        f = s.file
        return (getattr(f, "runs_in_caller", False) and s.node is NodeKind.CTL and not s.closed
                and f.continued_root_allocs > len(f.adopted) and h not in self.clients)

    def _adopted(self, s: Session, h: int, abi, probe, result: DriverResult) -> bool:
        """After the probe control: the client into the books if the driver accepted it."""
        out = abi.decode_ioctl(NodeKind.CTL, probe.cmd, result.arg).value
        if result.errno or out.status != nvstatus.NV_OK:
            return False
        if not self._may_adopt(s, h):  # (adopted meanwhile by another thread: fine)
            return h in s.tenant.clients
        self.clients.new(s, h)
        s.file.adopted.add(h)
        self.audit.write("notice", tenant=s.tenant.name, pid=s.caller.pid, node=s.node_name,
                         message=f"root client {h:#x} allocated by the tenant itself adopted")
        return True

    def adopt_client_here(self, session_id: int, h: int, file_fd: int) -> bool:
        """`_adopt_client` for a front end's thread that holds a duplicate of the session's
        file it checked itself (the native loop, before the lane's admission: NVML's first
        control on each client it allocated itself went the general way for this, ~350 µs
        on the H200). The same probe control, on that duplicate, without the capabilities
        the driver checks; True when the client is the tenant's now. Not while recording
        (the general path records the probe)."""
        with STATE_LOCK:
            s = self.sessions.get(session_id)
            if s is None or self.recorder is not None or not self._may_adopt(s, h):
                return False
            abi, probe, dc = self._adoption_probe(s, h)
        dc.file_fd = file_fd
        result = self.backend.ioctl_blocking(s.file, dc)
        with STATE_LOCK:
            return self._adopted(s, h, abi, probe, result)

    def _client_of(self, s: Session, h: int, where: str,
                         req: IoctlRequest | None) -> RmClient:
        c = s.tenant.clients.get(h)
        if c is None and (yield from self._adopt_client(s, h, req)):
            c = s.tenant.clients.get(h)
        return self._client(s, h, where)

    # ------------------------------------------------------------------ race detection
    def _watch_quota(self, s: Session) -> None:
        """After a continued call a racing thread could have turned into device memory the
        books never saw: the quota watch (quotawatch.py) reads the driver's own accounting
        of the process from now on, for its life, and ends the tenant's processes when the
        tenant holds more than its quota."""
        if self.quota_watch is not None and self.spawn is not None:
            self.quota_watch.watch(s.caller.pid, s.tenant.name)

    def _check_clients(self, s: Session, value: Any, *, where: str,
                       zero_ok: bool = False) -> int | None:
        """Every client handle named in value must be the tenant's. Returns hClient.
        zero_ok: 0 means "no client" for this call (UVM_REGISTER_GPU without an RM client)."""
        first = None
        fields = value.spec.by_name if hasattr(value, "spec") else None
        for name in CLIENT_HANDLE_FIELDS:
            if fields is not None and name not in fields:
                continue  # (a missing attribute costs an exception: this runs per call)
            h = getattr(value, name, None)
            if h is None:
                continue
            if first is None:
                first = h
            if h == 0 and (zero_ok or name in CLIENT_FIELDS_ZERO_OK):
                continue
            owner = self.clients.owner(h)
            if owner != s.tenant.name:
                raise Refusal(f"{where}: {name}={h:#x} is not a client of this tenant",
                              status=nvstatus.NV_ERR_INVALID_CLIENT, what=where)
        return first

    def _refuse_revoked(self, s: Session, gpu: int | None, where: str) -> None:
        """A policy change that takes a GPU from a tenant must take it for
        the objects the tenant already holds there too, or a device allocated before the
        change keeps allocating memory and answering controls. Every call that acts on an
        object of a GPU no longer in the tenant's policy is refused (RM_FREE is not: the
        tenant must be able to give the memory back, and status keeps showing it until
        then). The audit record says that the GPU was revoked."""
        if gpu is not None and gpu not in s.tenant.gpus:
            raise Refusal(f"{where}: GPU {gpu} was revoked from tenant {s.tenant.name} by a "
                          f"policy change (its GPUs are now {list(s.tenant.gpus)}); only "
                          "freeing its objects there is allowed",
                          status=nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS, what=where)

    def _client(self, s: Session, h: int, where: str) -> RmClient:
        c = s.tenant.clients.get(h)
        if c is None:
            raise Refusal(f"{where}: client {h:#x} is not this tenant's",
                          status=nvstatus.NV_ERR_INVALID_CLIENT, what=where)
        return c

    def _read_nested(self, s: Session, req: IoctlRequest, ref) -> bytes | None:
        if ref is None or ref.size == 0:
            return None
        if ref.size > MAX_NESTED_BYTES:
            raise Refusal(f"nested buffer of {ref.size} bytes is absurd",
                          status=nvstatus.NV_ERR_INVALID_ARGUMENT)
        if ref.ptr == 0:
            raise Refusal("nested buffer pointer is NULL", status=nvstatus.NV_ERR_INVALID_ARGUMENT)
        return (yield from self._mem_read(s, req, ref.ptr, ref.size))

    # ------------------------------------------------------------------ escape handlers




    def _translate_fds(self, s, req, value, fd_fields, where) -> dict:
        out = {}
        for path in fd_fields:
            fd = _get_path(value, path)
            if fd is None or fd == -1:
                continue  # -1: no file (NVOS02's mapping fd is optional); the driver sees -1
            if fd < 0:
                raise Refusal(f"{where}: {path}={fd} is not a file descriptor",
                              errno_=errno.EBADF, status=nvstatus.NV_ERR_INVALID_ARGUMENT)
            sid = (yield ResolveFd(req.resolve_fd, fd)) if req.resolve_fd else None
            target = self.tenant_file(s.tenant, sid)
            if target is None:
                raise Refusal(f"{where}: fd {fd} in {path} is not one of this tenant's "
                              "NVIDIA files", errno_=errno.EBADF,
                              status=nvstatus.NV_ERR_INVALID_ARGUMENT)
            out[path] = target.file
        return out


    def tenant_file(self, tenant, session_id: int | None) -> "Session | None":
        """The session behind a tenant's fd (as its front end resolved it) when it is one of
        that tenant's NVIDIA files, else None: `_translate_fds`'s test, and the lanes'
        (ContinueLane, ControlLane.fd_target) for the same fds."""
        target = self.sessions.get(session_id) if session_id else None
        return target if target is not None and target.tenant is tenant else None

    def _read_embedded(self, s: Session, req: IoctlRequest, abi, params,
                             where: str) -> dict[str, bytearray]:
        """Copy in the buffers that pointer fields of the parameters point to, as the driver
        does for the controls whose ABI marks them: `ptr->bytes@sizeField` (sizeField bytes)
        or `ptr->STRUCT@countField` (countField entries of STRUCT)."""
        out: dict[str, bytearray] = {}
        if params is None:
            return out
        for name, size in embedded_buffers(abi, params):
            if size > MAX_EMBEDDED_BYTES:
                raise Refusal(f"{where}: {size} bytes behind {name} is absurd",
                              status=nvstatus.NV_ERR_INVALID_ARGUMENT, what=where)
            out[name] = bytearray((yield from self._mem_read(s, req, getattr(params, name), size)))
        return out


    @contextlib.contextmanager
    def _reserved(self, s: Session, client: RmClient, cls: int, parent: int,
                  gpu: int | None, charge: int, where: str):
        """Check `charge` bytes of device memory against the tenant's quota on `gpu` and hold
        them while the driver runs: the await may interleave with a racing allocation of the
        same tenant, which must see this one. Released afterwards either way; the caller
        records the object with its charge when the driver succeeded."""
        if not charge:
            yield
            return
        if gpu is None:
            raise Refusal(f"{where}: device memory needs a device parent",
                          status=nvstatus.NV_ERR_INVALID_OBJECT_PARENT, what=where)
        used = s.tenant.used().get(gpu, 0)
        if used + charge > s.tenant.quota(gpu):
            raise Refusal(f"{where}: {charge} bytes on GPU {gpu} would exceed the quota "
                          f"({used} of {s.tenant.quota(gpu)} used)",
                          status=nvstatus.NV_ERR_NO_MEMORY, what=where)
        placeholder = client.add(-next(self._ids), cls, parent, gpu=gpu, charged=charge)
        try:
            yield
        finally:
            client.remove(placeholder.handle)







    # ------------------------------------------------------------------ status
    @_locked
    def snapshot(self) -> dict:
        tenants = []
        for t in self.tenants.values():
            used = t.used()
            tenants.append({
                "name": t.name,
                "gpus": list(t.gpus),
                # what the cluster calls it (pod, namespace, container: broker/tenancy.py)
                "labels": dict(getattr(t.policy, "labels", ())),
                # the files its processes hold (opens the broker prepared ahead and has
                # not given out yet: "prepared_files")
                "open_files": sum(not s.prepared for s in t.sessions.values()),
                "prepared_files": sum(s.prepared for s in t.sessions.values()),
                "processes": sorted(t.tgids()),
                "clients": len(t.clients),
                "objects": sum(len(c.objects) for c in t.clients.values()),
                "memory": {str(g): {"used": used.get(g, 0), "quota": t.quota(g)} for g in t.gpus},
                # Memory still held on GPUs a policy change took away (the
                # tenant can only free it): shown until it is freed, so the operator sees it.
                "revoked_memory": {str(g): n for g, n in sorted(used.items())
                                   if g not in t.gpus and n},
                "requests": t.requests,
                "refusals": t.refusals,
                # accesses to the tenant's memory stuck in the kernel past their deadline
                "memory_stalled": self.memgate.stalled.get(t.name, 0),
                "rate_limited": t.limiter.waited,
                **compute.tenant_status(self, t),  # share, priority, groups
                "preemptible": t.policy.preemptible,
                "preempted": self.preemption.state_of(t.name),  # None: running
            })
        return {"backend": self.backend.name, "driver": self.backend.version,
                "tenants": tenants,
                # the control lane (fastlane.py): controls it ran, and those it sent the
                # general way (refusals, rows with hooks, unknown clients, ...)
                "control_lane": {"admitted": self.control_lane.admitted,
                                 "declined": self.control_lane.passed,
                                 "allocations": self.control_lane.allocations,
                                 "frees": self.control_lane.frees,
                                 # of the admitted: by a decision the native loop had
                                 # settled (no question to the broker)
                                 "settled": self.control_lane.settled,
                                 # of them, those run on the broker's own duplicates of
                                 # the real backend's relayed files (FUSE readers)
                                 "relayed_here": self.backend.relayed_here},
                "continue_lane": {"admitted": self.continue_lane.admitted,
                                  "declined": self.continue_lane.passed,
                                  # of admitted: continued by the native loop's settled
                                  # decisions (no question to the broker)
                                  "settled": self.continue_lane.settled,
                                  # of admitted: root clients the tenant allocated itself
                                  "roots": self.continue_lane.roots},
                "preemption": self.preemption.snapshot(),
                # quotawatch.py (real backend only): processes watched for device memory
                # past the books, the looks at the driver's accounting, processes killed
                **({"quota_watch": {"watching": len(self.quota_watch.watching()),
                                    "looks": self.quota_watch.looks,
                                    "killed": self.quota_watch.killed}}
                   if self.quota_watch is not None else {})}


class _RevokedTenant:
    gpus: tuple = ()
    capabilities: tuple = ()
    memory_quota = 0
    uids = None
    rate_limit = None
    preemptible = False


def _get_path(value: Any, path: str):
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value
