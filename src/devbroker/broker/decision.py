"""The control lane's decision, as data: what the general path (handlers.rm_control,
rm_alloc, rm_free, relay, fd) would do with a call, decided from the 32-byte header the
front end read into its own memory, before anything else of the call is read.

`decide(broker, tables, session_id, caller, ioctl_cmd, hdr)` answers with an `Admitted`
(the call as the general path would run it on the driver: the checks still to make on
its private parameter block, its post-hook, its books) or None (the general way, which
decides the call again, refusals and audit records included). It reads the books and
changes nothing; the per-(ABI, control) and per-(ABI, class) part of the answer is frozen
data (`ControlPlan`, `AllocPlan`), computed once from the rule rows and the ABI's layout
(`LaneTables`). fastlane.ControlLane takes the rate token after it, checks the private
copy and keeps the books of the answer; laneexec.py executes it in Python, native/lane.c
in C. Where the lane's headers are in each driver version's layouts (`Header`,
`headers_of`) is here too: the decision reads them.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from devbroker.abi import ioc, registry
from devbroker.abi.driver import NV_IOCTL_MAGIC
from devbroker.abi.nodes import NodeKind

from . import compute, handlers, limits, preemption, rewrite, rules

if TYPE_CHECKING:
    from devbroker.abi.driver import DriverABI

    from .core import Broker, Session
    from .interface import Caller
    from .objects import RmClient

RM_CONTROL = "NV_ESC_RM_CONTROL"
RM_ALLOC = "NV_ESC_RM_ALLOC"
RM_FREE = "NV_ESC_RM_FREE"


@dataclass(frozen=True)
class Header:
    """Where one lane escape's header fields are in one driver version's layout (read from
    its table): NVOS54 for RM_CONTROL, NVOS64 or NVOS21 for RM_ALLOC."""
    ioctl_cmd: int  # the ioctl number: _IOWR('F', nr, sizeof(the layout))
    size: int
    # control: (hClient, hObject, cmd, params, paramsSize);
    # alloc: (hRoot, hObjectParent, hObjectNew, hClass, pAllocParms, paramsSize)
    unpack: Callable[[bytes], tuple]
    params_offset: int  # the params pointer (replaced by the broker's copy's address); -1: none
    status_offset: int  # -1: the layout has no status field
    # "control", "alloc", "free" (NVOS00: the header alone) or "escape" (a plain escape whose
    # argument is the whole call: `escape` names its row)
    kind: str = "control"
    new_offset: int = -1  # alloc: hObjectNew (where the driver names the new handle)
    rights_offset: int = -1  # alloc, NVOS64: pRightsRequested (the lane needs it NULL)
    escape: str = ""  # escape: its name (rules.ESCAPES)
    # escape: the offsets of its fd fields (int32, `fd_escape`: REGISTER_FD's ctl_fd), which
    # a front end that carries fds replaces with the broker's duplicates of those files
    fd_offsets: tuple = ()
    # control: the offsets of (hClient, hObject, cmd, params, paramsSize); alloc: of (hRoot,
    # hObjectParent, hClass, pAllocParms, paramsSize); free: of (hRoot, hObjectOld) and -1
    # three times — for a front end that reads them itself (the native loop's settled
    # controls, allocations and frees)
    offsets: tuple = ()


_HEADERS: dict[Any, dict[int, Header]] = {}
_HEADERS_LOCK = threading.Lock()

_CONTROL_FIELDS = (("hClient", "I"), ("hObject", "I"), ("cmd", "I"), ("params", "Q"),
                   ("paramsSize", "I"))
_ALLOC_FIELDS = (("hRoot", "I"), ("hObjectParent", "I"), ("hObjectNew", "I"), ("hClass", "I"),
                 ("pAllocParms", "Q"), ("paramsSize", "I"))
_FREE_FIELDS = (("hRoot", "I"), ("hObjectParent", "I"), ("hObjectOld", "I"))


def plain_escape(name: str, spec) -> bool:
    """An escape the lane may run as its whole argument (kind "escape"): its row passes it
    to the driver as sent (handlers.relay without a rewrite), it is not bound to the caller
    and names no fd, and its layout holds nothing the broker looks at (no client handle,
    GPU id, pointer or fd: rules.plain_layout), so the general path's only checks are the
    row's: allowed, granted, on this node (NV_ESC_NUMA_INFO, NV_ESC_WAIT_OPEN_COMPLETE).
    Also NV_ESC_CHECK_VERSION_STR (handlers.version: relayed as sent, and afterwards the
    process's ABI switched when it asked for another version the registry has — that
    case `decision._decide_escape` sends the general way, from the argument's bytes),
    and NV_ESC_SYS_PARAMS (handlers.sys_params: never relayed — a host-global, set-once
    value — but *answered* with the argument as sent when it asks for the host's own value;
    `Admitted.answered`: only a front end that answers without the driver takes it, the
    native loop; another value goes the general way, which refuses it)."""
    row = rules.ESCAPES.get(name)
    return (row is not None
            and row.handler in (handlers.relay, handlers.version, handlers.sys_params)
            and row.rewrite is None and not row.in_caller and not row.carries_fds
            and spec is not None and spec.size > 0 and rules.plain_layout(spec))


def fd_escape(name: str, spec) -> bool:
    """An escape the lane may run with its fd fields carried (kind "escape" with
    fd_offsets; only a front end that carries fds takes it, `ControlLane.fd_target`): its
    row is handlers.fd's, which checks client handles (none here) and that every fd is one
    of the tenant's NVIDIA files, then runs it on the broker's duplicates of those files;
    not bound to the caller; its layout is top-level int32 fds and nothing else the broker
    looks at (NV_ESC_REGISTER_FD: NVML twice per init, CUDA 13 times, ~400 µs each over the
    driver the general way on the H200)."""
    row = rules.ESCAPES.get(name)
    if (row is None or row.handler is not handlers.fd or row.rewrite is not None
            or row.in_caller or not row.carries_fds or spec is None or not spec.size):
        return False
    fields = list(spec.walk())
    return (all("." not in path and "[" not in path for path, _f, _o in fields)
            and any(f.kind == "fd" and f.size == 4 for _p, f, _o in fields)
            and all(f.kind != "fd" or f.size == 4 for _p, f, _o in fields)
            # (else plain: rules.plain_layout's tests but the fds)
            and not any(f.kind == "ptr" or f.name in rules.CLIENT_HANDLE_FIELDS
                        or f.name in rewrite.GPU_ID_FIELD_NAMES for _p, f, _o in fields))


def _header(nr: int, spec, kind: str, name: str = "") -> Header | None:
    cmd = ioc.ioc(ioc.IOC_READ | ioc.IOC_WRITE, NV_IOCTL_MAGIC, nr, spec.size)
    f = spec.by_name
    if kind == "escape":
        status = f["status"].offset if "status" in f else -1
        fds = tuple(o for _p, fl, o in spec.walk() if fl.kind == "fd")
        return Header(cmd, spec.size, lambda b: (), -1, status, kind="escape", escape=name,
                      fd_offsets=fds)
    if kind == "free":
        if not all(n in f for n, _k in _FREE_FIELDS) or "status" not in f:
            return None
        unpack = _fixed_unpacker([f[n].offset for n, _k in _FREE_FIELDS], ["I", "I", "I"])
        # (offsets: hRoot and hObjectOld where a control's client and object are, for the
        # native loop's settled frees; no control, parameters or size)
        return (Header(cmd, spec.size, unpack, -1, f["status"].offset, kind="free",
                       offsets=(f["hRoot"].offset, f["hObjectOld"].offset, -1, -1, -1))
                if unpack is not None else None)
    fields = _CONTROL_FIELDS if kind == "control" else _ALLOC_FIELDS
    if not all(n in f for n, _k in fields) or "status" not in f:
        return None
    unpack = _fixed_unpacker([f[n].offset for n, _k in fields], [k for _n, k in fields])
    if unpack is None:
        return None
    if kind == "control":
        return Header(cmd, spec.size, unpack, f["params"].offset, f["status"].offset,
                      offsets=tuple(f[n].offset for n, _k in fields))
    rights = f["pRightsRequested"].offset if "pRightsRequested" in f else -1
    return Header(cmd, spec.size, unpack, f["pAllocParms"].offset, f["status"].offset,
                  kind="alloc", new_offset=f["hObjectNew"].offset, rights_offset=rights,
                  offsets=tuple(f[n].offset for n in ("hRoot", "hObjectParent", "hClass",
                                                      "pAllocParms", "paramsSize")))


def headers_of(abi: DriverABI) -> dict[int, Header]:
    """The lane's headers in `abi`, by ioctl number: RM_CONTROL's NVOS54, RM_ALLOC's NVOS64
    and NVOS21, RM_FREE's NVOS00 and the plain escapes' arguments (`plain_escape`) (the
    layouts the table knows; one whose fields are not found is left out, and the lane is
    then off for it)."""
    known = _HEADERS.get(abi)
    if known is not None:
        return known
    with _HEADERS_LOCK:
        out: dict[int, Header] = {}
        for nr, spec in abi.escapes.items():
            if spec.params is None:
                continue
            if spec.name in (RM_CONTROL, RM_ALLOC, RM_FREE):
                kind = {RM_CONTROL: "control", RM_ALLOC: "alloc", RM_FREE: "free"}[spec.name]
            elif plain_escape(spec.name, spec.params) or fd_escape(spec.name, spec.params):
                kind = "escape"
            else:
                continue
            layouts = [spec.params]
            if kind == "alloc":
                layouts += list((getattr(spec, "variants", None) or {}).values())
            for layout in layouts:
                h = _header(nr, layout, kind, spec.name)
                if h is not None:
                    out[h.ioctl_cmd] = h
        _HEADERS[abi] = out
        return out


def header_of(abi: DriverABI) -> Header | None:
    """NVOS54's layout in `abi` (RM_CONTROL's header), or None when its table has none."""
    for h in headers_of(abi).values():
        if h.kind == "control":
            return h
    return None


def _fixed_unpacker(offsets: list[int], kinds: list[str]) -> Callable[[bytes], tuple] | None:
    """One struct.unpack_from for fields at these offsets (pad bytes between them)."""
    order = sorted(zip(offsets, kinds, range(len(kinds))))
    fmt, pos = "<", 0
    for off, kind, _i in order:
        if off < pos:
            return None
        fmt += f"{off - pos}x" if off > pos else ""
        fmt += kind
        pos = off + struct.calcsize("<" + kind)
    s = struct.Struct(fmt)
    perm = [i for _o, _k, i in order]
    if perm == list(range(len(kinds))):
        return lambda b, _u=s.unpack_from: _u(b)

    def unpack(b: bytes, _u=s.unpack_from, _p=perm) -> tuple:
        got = _u(b)
        out = [0] * len(got)
        for j, i in enumerate(_p):
            out[i] = got[j]
        return tuple(out)
    return unpack


# pointers a settled control's check may test NULL (native/lane.c DVB_SETTLED_PTRS)
SETTLED_NULL_PTRS = 2


def _gpu_id_only(spec) -> int:
    """The offset of a control layout's one GPU id when that and its pointers (which the
    lane admits only NULL: `Admitted.null_ptrs`) are the only things in it the broker looks
    at — a top-level 4-byte `gpuId`, and no fd, client handle or other GPU id at any depth
    — so that ControlLane.check on it is `_copy_usable` (the pointers NULL) and
    rewrite.require_own_gpu_ids on that one field (the id one of the tenant's GPUs';
    INVALID_GPU_ID is not); -1 for any other layout. (NVML's GET_ID_INFO ×4,
    GET_ID_INFO_V2, GET_PCI_INFO, QUERY_DRAIN_STATE, ASYNC_ATTACH_ID: eight per init, on
    a new client each time.)"""
    found = -1
    for path, f, off in spec.walk():
        if f.kind == "ptr":
            continue
        if f.kind == "fd" or f.name in rules.CLIENT_HANDLE_FIELDS:
            return -1
        if f.name in rewrite.GPU_ID_FIELD_NAMES:
            if found >= 0 or path != "gpuId" or f.kind not in ("u32", "i32") or f.size != 4:
                return -1
            found = off
    return found


# embedded buffers a settled control may carry (native/lane.c DVB_SETTLED_EMBED)
SETTLED_EMBEDDED = 2


def _embedded_only(abi, spec) -> tuple:
    """For a control layout whose check (ControlLane.check, no pre-hook) comes down to its
    embedded buffers' sizes and its other pointers being NULL: ((pointer offset, count
    offset, element bytes), ...) of each embedded buffer — a top-level `ptr->T@count` whose
    count is a top-level 4-byte field and whose element T holds no pointer, fd, client
    handle or GPU id — so that a front end may repeat the whole check itself on its private
    copy (native/lane.c settled_embed: count × element bytes read from the tenant into its
    own buffer, whose address the driver gets, as `check` lists and `_native_embedded`
    copies them); () for any other layout. The layout itself must hold no fd, client
    handle or GPU id anywhere (what `check` would test), and at most SETTLED_NULL_PTRS
    other pointers. (CUDA's FIFO_GET_CHANNELLIST: 20 per init, each ~120 µs of the
    broker's over the driver's 4 µs on the H200 with the check in Python.)"""
    embedded = rules.lane_embedded(spec)
    if not embedded or len(embedded) > SETTLED_EMBEDDED:
        return ()
    names = {name for _off, name in embedded}
    others = 0
    for path, f, _off in spec.walk():
        if f.kind == "fd" or f.name in rules.CLIENT_HANDLE_FIELDS \
                or f.name in rewrite.GPU_ID_FIELD_NAMES:
            return ()
        if f.kind == "ptr" and path not in names:
            others += 1
    if others > SETTLED_NULL_PTRS:
        return ()
    out = []
    for off, name in embedded:
        f = spec.by_name[name]
        count = spec.by_name.get(f.size_field)
        if count is None or count.kind not in ("size", "u32") or count.size != 4:
            return ()
        if f.points_to == "bytes":
            elem = 1
        else:
            try:
                elem_spec = abi.struct(f.points_to)
            except KeyError:
                return ()
            if any(g.kind in ("ptr", "fd") or g.name in rules.CLIENT_HANDLE_FIELDS
                   or g.name in rewrite.GPU_ID_FIELD_NAMES for _p, g, _o in elem_spec.walk()):
                return ()
            elem = elem_spec.size
        if elem <= 0:
            return ()
        out.append((off, count.offset, elem))
    return tuple(out)


def _usable_session(b: Broker, session_id: int, caller: Caller) -> Session | None:
    """The session, when the general path would go on with it: open, its tenant in the
    running policy, and the caller in the opener's sandbox (core.Broker._same_sandbox
    without its refusal: same uid, same pid namespace; an unknown namespace on either side
    goes the general way, which reads it). Both lanes start here."""
    s = b.sessions.get(session_id)
    if s is None or s.closed or s.tenant.revoked:
        return None
    if s.tenant.name in b.preemption.held:
        return None  # preempted: its calls wait on the general path (preemption.py)
    if caller.uid != s.caller.uid or (s.pidns is not None and (
            caller.pidns is None or caller.pidns != s.pidns)):
        return None
    return s


@dataclass(slots=True)
class Admitted:
    """A control the general path would run as sent: what the front end needs to run it."""
    session: Session
    abi: DriverABI
    header: Header
    client: RmClient
    h_object: int
    cmd: int
    params_ptr: int
    params_size: int
    gpu: int | None
    post: Callable | None  # the row's post-hook (rewrite.py), run on an NV_OK answer
    mark: Any = None  # the call counters' (callstats._CountedLane): start and row
    booked: bool = False  # the tenant's request already counted (ControlLane.book)
    # A checked control (ControlLane.check must pass on the private parameters before the
    # driver runs it): its row's pre-hook, and the parameters as checked (for the post-hook)
    checked: bool = False
    pre: Callable | None = None
    params_value: Any = None
    null_ptrs: tuple = ()  # offsets of pointer fields that must be NULL (checked controls)
    # (offset, name) of the pointer fields that name embedded buffers (rules.lane_embedded),
    # which a front end that carries them may leave set; `check` then lists the buffers
    # (offset, the tenant's pointer, bytes) in `embedded` for it to copy in and back
    embedded_fields: tuple = ()
    # the offset of its one GPU id when the check reads nothing else (ControlLane._plan)
    gpu_id_off: int = -1
    # its embedded buffers as a front end repeats the check itself when that is all the
    # check reads (`_embedded_only`: (pointer offset, count offset, element bytes), ...)
    embedded_only: tuple = ()
    embedded: tuple = ()
    # an escape the broker answers itself (SYS_PARAMS): no driver call, the argument back
    # as sent and 0 (`plain_escape`); only the native loop takes it (its check)
    answered: bool = False
    # An allocation (RM_ALLOC): its class row (rules.CLASSES); h_object is then the parent,
    # cmd the class, gpu the parent's GPU (the new object's; a device's own, from its check)
    alloc: Any = None
    # device memory: the bytes checked against the quota, and the placeholder object that
    # holds them in the books while the driver runs (released by finish or release)
    charge: int = 0
    reserved: int = 0


# Class checks (rules.ClassRule.check) the allocation lane may run on its private copy: they
# read only the call (its parameters, the allocating client), never the context.
LANE_CLASS_CHECKS = frozenset({handlers.debugger_on_own_context, handlers.os_event_notifier})
# After-hooks the lane can tell from the header to have nothing to do: a channel's
# (compute.after_channel_alloc) stops it only for a tenant stopped on that GPU (for a
# high-priority tenant, or out of its turn: compute.stops_new_channels), and looks for the
# driver's own channel group only for a channel under a device; the lane sends both the
# general way (compute.lane_leaves_channel; a tenant stopped between the admission and the driver's
# answer has the channel stopped by the watching task's next look, PREEMPT_TICK_S, or
# by the next turn's switch).
LANE_AFTER_HOOKS = frozenset({compute.after_channel_alloc})
# After-hooks a front end runs itself, between the lane's books and the tenant's answer
# (`run_after`), when it offers to at admission (`admit(..., run_hooks=True)`: the native
# seccomp loop with real driver files, whose hook's own driver calls run on this thread on
# duplicates of the tenant's file, as the general path's do). A channel group's compute
# share (compute.after_alloc): SET_TIMESLICE on the new group before the tenant has its
# handle — the general path's order, without the general path's ~0.8 ms per group on the
# H200 (docs/benchmarks.md, "Channel groups in the lane").
LANE_RUN_AFTER_HOOKS = frozenset({compute.after_alloc})


def own_parent(tenant: Any, h_root: int, h_parent: int) -> tuple[Any, Any]:
    """(client, parent object) of an allocation when the client is the tenant's (in its
    books: not one still to adopt) and the parent one of its objects on a GPU it keeps —
    handlers.rm_alloc's first tests; (client or None, None) otherwise."""
    client = tenant.clients.get(h_root)
    if client is None:
        return None, None
    parent = client.objects.get(h_parent)
    if parent is None or (parent.gpu is not None and parent.gpu not in tenant.gpus):
        return client, None
    return client, parent

@dataclass(frozen=True, slots=True)
class ControlPlan:
    """What the lane needs of one control in one ABI (`control_plan`)."""
    capability: str
    post: Callable | None  # the row's post-hook (rewrite.py), run on an NV_OK answer
    size: int  # the parameter block's
    pre: Callable | None  # the row's pre-hook (may rewrite the private copy)
    checked: bool  # ControlLane.check must pass on the private parameters first
    null_ptrs: tuple  # offsets of pointer fields that must be NULL
    embedded_fields: tuple  # (offset, name) of the embedded buffers' pointers
    gpu_id_off: int  # the offset of its one GPU id when the check reads nothing else; -1
    embedded_only: tuple  # `_embedded_only`'s: its check is its embedded buffers' sizes


@dataclass(frozen=True, slots=True)
class AllocPlan:
    """What the allocation lane needs of one class in one ABI (`alloc_plan`)."""
    capability: str
    size: int  # the class's parameter block
    checked: bool  # ControlLane.check must pass on the private parameters first
    null_ptrs: tuple  # offsets of pointer fields that must be NULL
    rule: Any  # the class row (rules.ClassRule)


def control_plan(abi: DriverABI, cmd: int) -> ControlPlan | None:
    """The ControlPlan of a
    control the lane may take in this ABI, None for one it may not. It may take a
    control whose row is on the allowlist, not reserved by the driver's flags, neither
    answered, run nor charged by the broker, and whose layout has no fd and no pointer
    inside an array (rules.lane_pointers). It is *checked* (ControlLane.check on the
    private copy before the driver call) when its row has a pre-hook or its layout
    holds something the broker looks at: client handles, GPU ids, pointers (which must
    then be NULL); else the header alone decides. A post-hook on the answer is allowed.
    The tables do not change while the broker runs: LaneTables keeps the answer per (ABI,
    control)."""
    plan = None
    rule = rules.control_rule(cmd, abi)
    op = abi.control(cmd)
    ptrs = (rules.lane_pointers(op.params)
            if op is not None and op.params is not None else None)
    if (rule is not None and not rule.driver_flag
            and rule.relay_if is None and rule.run is None and not rule.charge
            and ptrs is not None and op.size):
        checked = rule.pre is not None or not rules.plain_layout(op.params)
        embedded = rules.lane_embedded(op.params)
        gpu_id_off = (_gpu_id_only(op.params) if checked and rule.pre is None
                      and len(ptrs) <= SETTLED_NULL_PTRS and not embedded
                      and cmd not in rewrite.GPU_IDS_ANSWERED else -1)
        embedded_only = (_embedded_only(abi, op.params)
                         if checked and rule.pre is None and embedded else ())
        plan = ControlPlan(rule.capability, rule.post, op.size, rule.pre, checked, ptrs,
                           embedded, gpu_id_off, embedded_only)
    return plan


def alloc_plan(abi: DriverABI, cls: int) -> AllocPlan | None:
    """The AllocPlan of a class the
    allocation lane may take in this ABI, None for one it may not. It may take a class
    on the allowlist that is not a root client (its books are the client books, and the
    first one of a tenant file is the tenant's own call), not bound to the caller
    through RM_ALLOC, whose class check (if any) reads nothing but the call
    (LANE_CLASS_CHECKS) and whose after-hook (if any) can be told from the header to
    have nothing to do (LANE_AFTER_HOOKS) or is one a front end may run itself
    (LANE_RUN_AFTER_HOOKS, admitted only where it does), and whose layout has no fd and no pointer
    inside an array. It is *checked* (its parameters decoded on the private copy and
    tested as handlers.rm_alloc tests them) when it has a class check or its layout
    names client handles, GPU ids or pointers, always when it is charged against the
    quota (the size is in the parameters), and for a device (its deviceId names the
    GPU: the backend's numbering of device instances, a lookup in its table)."""
    rule = rules.CLASSES.get(cls)
    if rule is None:
        return None
    plan = None
    op = abi.rm_class(cls)
    if (cls not in handlers.ROOT_CLIENT_CLASSES
            and not rule.pinned  # (its size is booked by the general path only)
            and RM_ALLOC not in rule.in_caller_via
            and (rule.check is None or rule.check in LANE_CLASS_CHECKS)
            and (rule.after is None or rule.after in LANE_AFTER_HOOKS
                 or rule.after in LANE_RUN_AFTER_HOOKS)
            and op is not None and op.params is not None and op.size):
        ptrs = rules.lane_pointers(op.params)
        if ptrs is not None and rule.keys:  # (keys, not pointers: the row says why)
            keys = {op.params.by_name[k].offset for k in rule.keys}
            ptrs = tuple(o for o in ptrs if o not in keys)
        if ptrs is not None:
            checked = (rule.check is not None or rule.charge
                       or cls == handlers.DEVICE_CLASS
                       or not rules.plain_layout(op.params))
            plan = AllocPlan(rule.capability, op.size, checked, ptrs, rule)
    return plan


def _mirrored(name: str, handler: Callable) -> rules.EscapeRule | None:
    """The escape row `name` when the lane can stand for it: its handler is `handler` (whose
    checks the lane repeats), with no rewrite and no in-caller reason; None else."""
    row = rules.ESCAPES.get(name)
    return (row if row is not None and row.handler is handler and row.rewrite is None
            and not row.in_caller else None)

@dataclass
class LaneTables:
    """The escape rows the lane stands for and the plans it computed, per broker. The lane
    mirrors handlers.rm_control (rm_alloc, rm_free): if an escape row ever gets another
    handler, a rewrite of its own or an in-caller reason, that part of the lane is off
    rather than wrong."""
    control: Any = field(default_factory=lambda: _mirrored(RM_CONTROL, handlers.rm_control))
    alloc: Any = field(default_factory=lambda: _mirrored(RM_ALLOC, handlers.rm_alloc))
    free: Any = field(default_factory=lambda: _mirrored(RM_FREE, handlers.rm_free))
    _controls: dict = field(default_factory=dict)  # (abi, cmd) -> ControlPlan | None
    _classes: dict = field(default_factory=dict)  # (abi, class) -> AllocPlan | None

    def control_plan(self, abi: DriverABI, cmd: int) -> ControlPlan | None:
        """`control_plan`, once per (ABI, control) on the allowlist (a number not on it
        costs a lookup, and is not remembered)."""
        if cmd not in rules.CONTROLS:
            return None
        key = (abi, cmd)
        try:
            return self._controls[key]
        except KeyError:
            got = self._controls[key] = control_plan(abi, cmd)
            return got

    def alloc_plan(self, abi: DriverABI, cls: int) -> AllocPlan | None:
        """`alloc_plan`, once per (ABI, class) on the allowlist."""
        if cls not in rules.CLASSES:
            return None
        key = (abi, cls)
        try:
            return self._classes[key]
        except KeyError:
            got = self._classes[key] = alloc_plan(abi, cls)
            return got


def decide(b: Broker, tables: LaneTables, session_id: int, caller: Caller, ioctl_cmd: int,
           hdr: bytes, max_params: int | None = None,
           run_hooks: bool = False) -> Admitted | None:
    """The lane's decision on a call's header (the front end's private copy): the call, as
    the general path would run it on the driver, with what its execution needs (Admitted:
    the checks still to make on its parameters, its post-hook, its books); None sends it
    the general way (which decides it again, refusals and audit included). It reads the
    books and changes nothing — the rate token is the caller's (ControlLane.admit), taken
    last. Under the state lock. max_params, run_hooks: ControlLane.admit's."""
    s = _usable_session(b, session_id, caller)
    if s is None:
        return None
    tenant = s.tenant
    if s.node is NodeKind.GPU and s.minor not in tenant.gpus:
        return None
    if not b.backend.can_run_control(s.file):  # (a relayed file without a thread channel)
        return None
    abi = b.abi_of(s)
    h = headers_of(abi).get(ioctl_cmd)
    if h is None or len(hdr) != h.size:
        return None
    if h.kind == "alloc":
        return _decide_alloc(b, tables, s, abi, h, hdr, max_params, run_hooks)
    if h.kind == "free":
        return _decide_free(tables, s, abi, h, hdr)
    if h.kind == "escape":
        return _decide_escape(b, s, abi, h, hdr)
    escape = tables.control
    if escape is None:
        return None
    caps = tenant.policy.capabilities
    if not escape.granted(caps) or s.node not in escape.nodes:
        return None
    h_client, h_object, cmd, params_ptr, params_size = h.unpack(hdr)
    client = tenant.clients.get(h_client)
    if client is None:  # not the tenant's, or not adopted yet: the general path decides
        return None
    obj = client.objects.get(h_object)
    if obj is None or (obj.gpu is not None and obj.gpu not in tenant.gpus):
        return None
    plan = tables.control_plan(abi, cmd)
    if plan is None or plan.capability not in caps:
        return None
    size = plan.size
    if params_size != size or params_ptr == 0 or (
            max_params is not None and size > max_params):
        return None
    return Admitted(s, abi, h, client, h_object, cmd, params_ptr, params_size, obj.gpu,
                    plan.post, checked=plan.checked, pre=plan.pre, null_ptrs=plan.null_ptrs,
                    embedded_fields=plan.embedded_fields, gpu_id_off=plan.gpu_id_off,
                    embedded_only=plan.embedded_only)

def _decide_alloc(b: Broker, tables: LaneTables, s: Session, abi: DriverABI, h: Header,
                  hdr: bytes, max_params: int | None, run_hooks: bool = False
                  ) -> Admitted | None:
    """The allocation lane: an RM_ALLOC the general path (handlers.rm_alloc) would run
    on the driver as sent, decided on its header as the control lane decides a control
    (module docstring, "Allocations"). None: the general way."""
    tenant = s.tenant
    escape = tables.alloc
    caps = tenant.policy.capabilities
    if escape is None or not escape.granted(caps) or s.node not in escape.nodes:
        return None
    h_root, h_parent, h_new, cls, params_ptr, params_size = h.unpack(hdr)
    if h.rights_offset >= 0 and any(hdr[h.rights_offset:h.rights_offset + 8]):
        return None  # access rights asked for: the general way reads them
    client, parent = own_parent(tenant, h_root, h_parent)
    if parent is None:
        return None
    if h_new and h_new in client.objects:
        return None  # (a duplicate handle: refused there)
    plan = tables.alloc_plan(abi, cls)
    if plan is None or plan.capability not in caps:
        return None
    size, rule = plan.size, plan.rule
    if rule.no_memory is not None and preemption.lane_declines(b):
        return None  # its NO_MEMORY answer may start a preemption: the general way's
    if rule.parents and parent.rm_class not in rule.parents:
        return None  # (refused the general way, with its audit record)
    # paramsSize 0 (what CUDA sends) makes the driver read its class's own parameter
    # size, which is the table's for this driver version (abi.nested does the same)
    if params_size not in (0, size) or params_ptr == 0 or (
            max_params is not None and size > max_params):
        return None
    if rule.after in LANE_RUN_AFTER_HOOKS and not run_hooks:
        return None  # (its hook's driver calls: the general way's, for this front end)
    if rule.after in LANE_AFTER_HOOKS and compute.lane_leaves_channel(b, tenant.name, parent):
        return None  # a channel of a stopped tenant, or one under a device: its
        # after-hook stops it, or finds the group the driver made for it, there
    if limits.alloc_refusal(tenant, root_client=False) is not None:
        return None
    return Admitted(s, abi, h, client, h_parent, cls, params_ptr, size, parent.gpu, None,
                    checked=plan.checked, null_ptrs=plan.null_ptrs, alloc=rule)

def _decide_free(tables: LaneTables, s: Session, abi: DriverABI, h: Header,
                 hdr: bytes) -> Admitted | None:
    """An RM_FREE the general path (handlers.rm_free) would run as sent: the client is
    the tenant's and the object one of its objects or the client itself (NVML frees
    its root clients three times per init: ~420 µs each over the driver the general
    way on the H200). A GPU taken from the tenant does not stop it: freeing stays
    allowed there, as on the general path."""
    tenant, escape = s.tenant, tables.free
    if escape is None or not escape.granted(tenant.policy.capabilities) \
            or s.node not in escape.nodes:
        return None
    h_root, _h_parent, h_old = h.unpack(hdr)
    client = tenant.clients.get(h_root)
    if client is None or h_old not in client.objects:  # (the root is one of them)
        return None
    return Admitted(s, abi, h, client, h_old, 0, 0, 0, client.objects[h_old].gpu, None)

def _decide_escape(b: Broker, s: Session, abi: DriverABI, h: Header,
                   hdr: bytes) -> Admitted | None:
    """A plain escape (`plain_escape`): the general path checks only its row — allowed,
    granted, on this node — and passes the argument to the driver as sent. For the
    version check, the asked version too: another version the registry has switches
    the process's ABI afterwards (handlers.version), which is the general way's."""
    row = rules.ESCAPES.get(h.escape)
    tenant = s.tenant
    if row is None or not row.granted(tenant.policy.capabilities) or s.node not in row.nodes:
        return None
    if row.handler is handlers.version:
        asked = handlers._cstr(abi.escape(h.escape).params.decode(hdr).versionString)
        if asked != abi.version and asked in registry.versions():
            return None
    answered = row.handler is handlers.sys_params
    if answered:
        host = b.backend.memblock_size
        asked = abi.escape(h.escape).params.decode(hdr).memblock_size
        if host is not None and asked != host:
            return None  # the general way refuses it, with its record
    # an fd escape: the front end's check carries its fds (`fd_target`), or declines;
    # an answered one: the front end's check takes it only if it answers without the
    # driver (the native loop), or declines
    return Admitted(s, abi, h, None, 0, 0, 0, 0, None, None,
                    checked=bool(h.fd_offsets) or answered, answered=answered)
