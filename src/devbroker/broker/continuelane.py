"""The continue lane: the broker's decision to let the kernel continue a call the driver binds
to the calling process (UVM commands; the RM escapes RM_MAP_MEMORY, ALLOC/FREE_OS_EVENT,
UNMAP_MEMORY, UPDATE_DEVICE_MAPPING_INFO), made in a few lookups on the argument's bytes
instead of the general steps. The sibling of the control lane
(fastlane.py), whose module docstring says what a lane may and may not do; `ContinueLane`
says what this one checks. A decision that reads only client-handle fields
(`settle_fields`) the seccomp native loop may repeat by itself while the books say nothing
it read changed (settled continuations: frontends/nativelane.py, native/lane.c).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from devbroker.abi import ioc
from devbroker.abi.driver import NV_IOCTL_MAGIC
from devbroker.abi.nodes import NodeKind

from . import handlers, limits, rules
from .effects import STATE_LOCK
from .fastlane import _usable_session, headers_of, own_parent
from .refusal import Refusal

if TYPE_CHECKING:
    from devbroker.abi.driver import DriverABI

    from .core import Broker
    from .interface import Caller


def _client_offsets(spec, base: int = 0) -> tuple[tuple[int, bool], ...] | None:
    """(offset, 0 allowed) of a layout's top-level client-handle fields (the ones
    Broker.check_clients reads; 0 allowed for the names in rules.CLIENT_FIELDS_ZERO_OK), or
    None when one of them is not a 4-byte handle (then the lane decodes)."""
    out = []
    for name in rules.CLIENT_HANDLE_FIELDS:
        f = spec.by_name.get(name)
        if f is None:
            continue
        if f.size != 4:
            return None
        out.append((base + f.offset, name in rules.CLIENT_FIELDS_ZERO_OK))
    return tuple(out)


# The RM escapes the continue lane may take, by their rows' handlers: those whose general
# steps are "the client handles, the fds, then the driver" (which a file that lives in the
# tenant turns into CONTINUE for an in-caller row), and RM_MAP_MEMORY's, which also needs
# hDevice and hMemory to be objects of the client on GPUs the tenant still has.
_CONTINUE_HANDLERS = (handlers.fd, handlers.rm_objects, handlers.rm_map)
# NV_ESC_RM_ALLOC_MEMORY (NVOS02, handlers.rm_alloc_memory): continued when its class is one
# the driver binds to the caller through it (rules.ClassRule.in_caller_via: system memory,
# OS descriptors — CUDA sends 7 per init, ~0.3-0.5 ms each over the driver the general way
# on the H200); any other class is the broker's to run, the general way.
_ALLOC_MEMORY = "NV_ESC_RM_ALLOC_MEMORY"


@dataclass(frozen=True)
class _ContinuePlan:
    spec: Any  # the argument's layout (OpSpec)
    row: rules.EscapeRule
    clients: tuple | None  # _client_offsets of the argument (and of its `params`)
    fds: tuple  # offsets of its fd fields (4-byte ints)
    zero_ok: bool  # every client handle may be 0 (UVM: no RM client of the caller's)
    objects: tuple = ()  # rm_map: offsets of (hClient, hDevice, hMemory)
    alloc: tuple = ()  # NVOS02: offsets of (hRoot, hObjectParent, hObjectNew, hClass)


class ContinueLane:
    """The same idea for the calls the driver binds to the caller: ~120 of a CUDA
    init's ioctls are UVM commands, and ~40 RM escapes (RM_MAP_MEMORY, the OS events,
    UNMAP, UPDATE_DEVICE_MAPPING_INFO), whose row lets the kernel continue them in the
    tenant once the broker has checked what they name. `admit` answers whether the general
    steps would continue this one: the session is a real driver file of the tenant's, the
    call's row has an in-caller reason and one of the handlers whose checks the lane repeats
    (handlers.uvm for UVM; handlers.fd, rm_objects and rm_map for RM escapes), granted to
    the tenant on this node, every client handle in the argument (and in its `params`) the
    tenant's (or 0 where the general steps allow 0), every fd one of the tenant's NVIDIA
    files (`Broker._translate_fds`'s test, through the front end's resolver) and, for
    RM_MAP_MEMORY, hDevice and hMemory objects of the client on GPUs the tenant still has;
    the rate token is taken last. A refusal is never made here: the general steps make it,
    with the audit record. The front end refuses to continue for a caller that could hold
    CAP_SYS_ADMIN (the general rule) and answers CONTINUE; what a racing thread can do with
    the re-read argument is the row's `race` (docs/security.md), as for the general path."""

    def __init__(self, broker: Broker):
        self.broker = broker
        self._plans: dict[tuple, _ContinuePlan | None] = {}  # (abi, node kind, cmd) -> plan
        # The RM escape numbers the lane may take on a ctl or GPU file, over every ABI the
        # broker knows (any UVM command is a candidate): a front end asks `candidate`
        # before reading anything, so the general path's other calls pay no lock here.
        from devbroker.abi import registry

        self._rm_cmds = frozenset(
            abi.escape_cmd(spec.name) for abi in map(registry.get, registry.versions())
            for spec in abi.escapes.values()
            if spec.params is not None and spec.size
            and self._plan(abi, NodeKind.CTL, abi.escape_cmd(spec.name)) is not None)
        self.admitted = 0
        self.passed = 0
        self.settled = 0  # of admitted: continued by the native loop's settled decisions
        self.roots = 0  # of admitted: root clients the tenant allocated itself (root_alloc)

    def _plan(self, abi: DriverABI, node: NodeKind, cmd: int) -> _ContinuePlan | None:
        key = (abi, node, cmd)
        try:
            return self._plans[key]
        except KeyError:
            pass
        plan = None
        if node is NodeKind.UVM:
            spec = abi.uvm(cmd)
            if spec is not None and spec.params is None and not spec.size:
                # a command without an argument (UVM_DEINITIALIZE: NVML's shutdown, once
                # per init, ~190 µs over the driver the general way on the H200): its
                # general steps are handlers.uvm's with nothing to check
                row = rules.UVM_COMMANDS.get(spec.name)
                if (row is not None and row.handler is handlers.uvm and row.in_caller
                        and row.rewrite is None and not row.carries_fds):
                    plan = _ContinuePlan(spec, row, (), (), True)
            elif spec is not None and spec.params is not None and spec.size:
                row = rules.UVM_COMMANDS.get(spec.name)
                if (row is not None and row.handler is handlers.uvm and row.in_caller
                        and row.rewrite is None):
                    # (UVM_MM_INITIALIZE's uvmFd: checked as handlers.uvm checks it, one of
                    # the tenant's NVIDIA files; NVML's init sends it once, ~225 µs over
                    # the driver the general way on the H200)
                    where = {path: off for path, _f, off in spec.params.walk()}
                    fd_offs = tuple(where.get(f) for f in row.fd_fields(spec.params))
                    if all(o is not None for o in fd_offs):
                        plan = _ContinuePlan(spec, row, _client_offsets(spec.params), fd_offs,
                                             True)
        elif (cmd >> 8) & 0xFF == NV_IOCTL_MAGIC:
            spec = abi.escapes.get(cmd & 0xFF)
            row = rules.ESCAPES.get(spec.name) if spec is not None else None
            alloc_memory = (row is not None and spec.name == _ALLOC_MEMORY
                            and row.handler is handlers.rm_alloc_memory)
            if (row is not None and spec.params is not None and spec.size
                    and ioc.ioc_size(cmd) == spec.size and (row.in_caller or alloc_memory)
                    and (row.handler in _CONTINUE_HANDLERS or alloc_memory)
                    and row.rewrite is None):
                layout = spec.params
                fds = row.fd_fields(layout)
                clients = _client_offsets(layout)
                inner = layout.by_name.get("params")
                if inner is not None and inner.kind == "struct" and clients is not None \
                        and row.handler is not handlers.fd:
                    more = _client_offsets(inner.spec, inner.offset)
                    clients = clients + more if more is not None else None
                where = {path: off for path, _f, off in layout.walk()}
                fd_offs = tuple(where.get(f) for f in fds)
                objects = alloc = ()
                if row.handler is handlers.rm_map:
                    objects = tuple(inner.offset + inner.spec.by_name[n].offset
                                    for n in ("hClient", "hDevice", "hMemory"))
                if alloc_memory:
                    alloc = tuple(inner.offset + inner.spec.by_name[n].offset
                                  for n in ("hRoot", "hObjectParent", "hObjectNew", "hClass"))
                if clients is not None and all(o is not None for o in fd_offs):
                    plan = _ContinuePlan(spec, row, clients, fd_offs, False, objects, alloc)
        if len(self._plans) < 4096:  # command numbers come from the tenant
            self._plans[key] = plan
        return plan

    def candidate(self, node: NodeKind, cmd: int) -> bool:
        """Whether the lane could take ioctl `cmd` on a file of this kind at all (no lock:
        the tables do not change while the broker runs)."""
        return node is NodeKind.UVM or cmd in self._rm_cmds

    def arg_size(self, session_id: int, cmd: int) -> int | None:
        """The argument size to read for this command on this session, None when the lane
        cannot take it at all (the front end then reads nothing)."""
        with STATE_LOCK:
            s = self.broker.sessions.get(session_id)
            if s is None or s.closed or not getattr(s.file, "runs_in_caller", False):
                return None
            plan = self._plan(self.broker.abi_of(s), s.node, cmd)
            return plan.spec.size if plan is not None else None

    def settle_fields(self, session_id: int, cmd: int) -> tuple | None:
        """(argument size, offsets of its client-handle fields, the session, offsets of
        (client, object handles...), offsets of fd fields) when this command's decision on
        this session reads nothing of the argument but those fields — at most four client
        handles at fixed offsets, and for RM_MAP_MEMORY its client's device and memory
        (each must be an object the books hold on the tenant's GPUs: the loop asks for each
        an object fact on this file) and its one fd (-1, or one of the tenant's files: the
        loop asks for that file's file fact — a ctl or GPU file's mapping fact, an
        nvidia-uvm file's own; the OS events' fd and
        UVM_MM_INITIALIZE's the same way) — so that the native loop may
        repeat it while the books name neither the file nor one of those clients and the
        policy stands (frontends/nativelane.py settle_continue, native/lane.c struct
        dvb_cont_fact); None when it must ask the broker every time."""
        with STATE_LOCK:
            s = self.broker.sessions.get(session_id)
            if s is None or s.closed:
                return None
            plan = self._plan(self.broker.abi_of(s), s.node, cmd)
        if plan is None or plan.clients is None or len(plan.clients) > 4 or plan.alloc:
            return None  # (NVOS02's decision reads its class and handles: asked each time)
        if plan.objects and (len(plan.objects) > 3 or len(plan.fds) > 1):
            return None
        return (plan.spec.size, tuple(off for off, _zero_ok in plan.clients), s,
                tuple(plan.objects), tuple(plan.fds))

    def row_key(self, session_id: int, cmd: int, arg: bytes):
        """The call counters' row of this call (None: no call counters; callstats'
        wrapper answers)."""
        return None

    def map_key(self, session_id: int):
        """The call counters' row of a mapping of this session's file (None: no call
        counters; callstats' wrapper answers)."""
        return None

    def settled_maps(self, tenant, key, count: int, sum_ns: int, buckets) -> None:
        """Mappings the native loop let through by a mapping fact (Broker.map_check_now's
        decision for a ctl or GPU file, which counts nothing of the tenant's)."""

    def settled_answers(self, tenant, key, count: int, sum_ns: int, buckets) -> None:
        """Calls the native loop answered by an answer fact (rules.EscapeRule.answer_kept):
        the tenant's requests, as the general path counts each such call."""
        with STATE_LOCK:
            tenant.requests += count

    def settled_calls(self, tenant, key, count: int, sum_ns: int, buckets) -> None:
        """Calls the native loop continued by a settled decision (settle_fields): counted
        as the broker's own admissions (the tenant's requests, its continued calls)."""
        with STATE_LOCK:
            tenant.requests += count
            tenant.continued += count
            self.admitted += count
            self.settled += count

    def admit(self, session_id: int, caller: Caller, cmd: int, arg: bytes,
              resolve_fd: Callable[[int], int | None] | None = None) -> bool:
        """resolve_fd: the fd number (in the caller's table) -> the session of the file
        behind it, or None (the front end's `session_for_fd`); needed for calls with fds."""
        with STATE_LOCK:
            s = self.broker.sessions.get(session_id)
            plan = (self._plan(self.broker.abi_of(s), s.node, cmd)
                    if s is not None and not s.closed else None)
        sids: list = []
        if plan is not None and plan.fds:
            # (outside the lock: a statx of the caller's fd, which never waits on a server)
            for off in plan.fds:
                fd = int.from_bytes(arg[off:off + 4], "little", signed=True)
                if fd == -1:
                    continue  # no file (the driver sees -1), as the general steps allow
                sids.append(resolve_fd(fd) if fd >= 0 and resolve_fd is not None else None)
        with STATE_LOCK:
            ok = plan is not None and self._admit(session_id, caller, plan, arg, sids)
            if ok:
                self.admitted += 1
            else:
                self.passed += 1
            return ok

    def _admit(self, session_id: int, caller: Caller, plan: _ContinuePlan, arg: bytes,
               sids: list) -> bool:
        b = self.broker
        s = _usable_session(b, session_id, caller)
        if s is None or not getattr(s.file, "runs_in_caller", False):
            return False
        tenant = s.tenant
        row, spec = plan.row, plan.spec
        if not row.granted(tenant.policy.capabilities) or s.node not in row.nodes \
                or len(arg) != spec.size:
            return False
        if s.node is NodeKind.GPU and s.minor not in tenant.gpus:
            return False
        owner = b.clients.owner
        if plan.clients is not None:
            # Broker.check_clients on the handles' bytes (no decode of the whole argument)
            for off, zero_ok in plan.clients:
                h = int.from_bytes(arg[off:off + 4], "little")
                if h == 0 and (plan.zero_ok or zero_ok):
                    continue
                if owner(h) != tenant.name:
                    return False
        else:
            try:
                b.check_clients(s, spec.params.decode(arg), where=spec.name,
                                 zero_ok=plan.zero_ok)
            except Refusal:
                return False
        if plan.objects:  # rm_map: the device and the memory are the client's, GPUs kept
            h_client, h_device, h_memory = (int.from_bytes(arg[o:o + 4], "little")
                                            for o in plan.objects)
            client = tenant.clients.get(h_client)
            if client is None:
                return False  # (not adopted yet: the general steps may adopt it)
            for h in (h_device, h_memory):
                obj = client.objects.get(h)
                if obj is None or (obj.gpu is not None and obj.gpu not in tenant.gpus):
                    return False
        if plan.alloc and not self._alloc_continues(s, plan.alloc, arg):
            return False
        for sid in sids:  # Broker._translate_fds: each one of this tenant's NVIDIA files
            if b.tenant_file(tenant, sid) is None:
                return False
        if not tenant.limiter.try_acquire():
            return False
        tenant.requests += 1
        tenant.continued += 1
        if plan.alloc:  # (its class could be rewritten meanwhile: rules._RACE_ALLOC_MEMORY)
            b.watch_quota(s)
        return True

    def root_alloc(self, session_id: int, caller: Caller, ioctl_cmd: int, hdr: bytes) -> bool:
        """A root client the tenant allocates itself on an nvidiactl (NVML: one per init, on
        a file opened just before; ~230–300 µs over the driver the general way on the
        H200): the general steps (`Broker._ioctl_steps`: the session usable, RM_ALLOC's row
        granted on this node, a pace token, the request counted) and handlers.rm_alloc's
        root branch up to its RunInCaller, on the private header (an RM_ALLOC's, as the
        control lane reads it: fastlane.headers_of): a root class, its handle
        not another tenant's client, the tenant's client limit, and a file that runs calls
        in the caller and holds no client and continued none — which is what keeps a racing
        thread's rewrite of the argument to a root client (docs/seccomp.md). True: continue
        it (counted as the general steps count it). Anything else goes the general way,
        which decides again (its refusals and records)."""
        b = self.broker
        with STATE_LOCK:
            s = _usable_session(b, session_id, caller)
            if s is None or s.node is not NodeKind.CTL \
                    or not getattr(s.file, "runs_in_caller", False):
                return False
            header = headers_of(b.abi_of(s)).get(ioctl_cmd)
            if header is None or header.kind != "alloc" or len(hdr) != header.size:
                return False
            tenant = s.tenant
            row = rules.ESCAPES.get("NV_ESC_RM_ALLOC")
            if row is None or not row.granted(tenant.policy.capabilities) \
                    or s.node not in row.nodes:
                return False
            _root, _parent, h_new, cls, _params, _size = header.unpack(hdr)
            if cls not in handlers.ROOT_CLIENT_CLASSES:
                return False
            owner = b.clients.owner(h_new) if h_new else None
            if owner is not None and owner != tenant.name:
                return False  # (refused there, answered as a duplicate handle)
            f = s.file
            if (f.continued_root_allocs or b.clients.of_session(s.id)
                    or limits.alloc_refusal(tenant, root_client=True) is not None):
                return False
            if not tenant.limiter.try_acquire():
                return False
            tenant.requests += 1
            tenant.continued += 1
            f.continued_root_allocs += 1
            self.admitted += 1
            self.roots += 1
            return True

    def _alloc_continues(self, s, offsets: tuple, arg: bytes) -> bool:
        """NVOS02's general steps up to the driver (handlers.rm_alloc_memory) for a class
        the driver binds to the caller through it: the client the tenant's (known: not one
        to adopt), the parent one of its objects on a GPU it keeps, the class on the
        allowlist, granted and in_caller_via this escape (nothing charged: such classes are
        system memory), the new handle not one the client holds, the object limit. Then
        the general steps continue it (RunInCaller "watch")."""
        tenant = s.tenant
        h_root, h_parent, h_new, cls = (int.from_bytes(arg[o:o + 4], "little")
                                        for o in offsets)
        client, parent = own_parent(tenant, h_root, h_parent)
        if parent is None:
            return False
        rule = rules.class_rule(cls)
        if (rule is None or not rule.granted(tenant.capabilities())
                or _ALLOC_MEMORY not in rule.in_caller_via or rule.charge or rule.pinned):
            return False
        if h_new in client.objects:
            return False
        return limits.alloc_refusal(tenant, root_client=False) is None
