"""The control lane: the broker's decision for the most common CUDA/NVML calls — RM
controls, and RM allocations of the classes that need no more — made in a few dictionary
lookups instead of the general steps.

Most of what CUDA and NVML send is NV_ESC_RM_CONTROL with a control whose row changes
nothing and whose parameter block holds nothing the broker looks at (`rules.simple_control`:
173 of the 231 controls of a PyTorch run). For those the general path (core.Broker.
_ioctl_steps -> handlers.rm_control) decodes the NVOS54 header into objects, walks the rule
tables through generator layers and effects, and ends by copying the parameter block to the
driver and back; on the H200 that cost ~200 µs per call against the driver's ~17 µs.

The lane answers one question, `ControlLane.admit`: would the general path run this call on
the driver unchanged (or with only a post-hook on the answer)? It checks, from the 32-byte
header the front end read into its own memory, everything the general path checks before it
would call the driver — the session and its tenant (not revoked, the same sandbox, the GPU
not revoked), the escape row (RM_CONTROL allowed, on this node), the client and the object
(the tenant's, on a GPU it still has), the control row (allowed, granted, not reserved by the
driver), the parameter size (the layout's) and the parameter pointer (not NULL) — and takes
the tenant's rate-limit token last. Anything else — a refusal, an unknown client (adoption),
a broker answer or run, a charge, a control with an fd or a pointer inside an array in its
parameters, an empty token bucket — is `None`: the front end sends the call down the
general path, which makes every refusal with its audit record. So the lane can only ever
allow what the general path allows, and never refuses anything itself.

*Checked* controls (NVML's GPU-id controls cost 150–330 µs each on the H200 down
the general path): a control whose parameters name client handles, GPU ids or pointers, or
whose row has a pre-hook, is admitted on its header and then `ControlLane.check`ed on the
front end's private copy of its parameters before the driver call — the same tests, in
the same order, as handlers.rm_control (every client handle the tenant's, the pre-hook,
which may rewrite the copy, every GPU id the tenant's), every pointer NULL (so the driver
touches no memory but the copy; a buffer behind one goes the general way, which copies
it), and the rate token last. A failed check is `False`: the general way again.

*Allocations* (the allocation lane: a CUDA init's RM_ALLOCs cost ~330–520 µs
each over the driver down the general path on the H200, ~60 ms of its ~140 ms extra): an
NV_ESC_RM_ALLOC (NVOS64 or NVOS21 header) is admitted on its header the same way —
`ControlLane._admit_alloc` checks what handlers.rm_alloc checks before the driver call: the
escape row, the client (the tenant's), the parent (one of its objects, on a GPU it still
has), the new handle (not one it holds), the class row (allowed, granted), the object limit,
no access rights asked for (NVOS64's pRightsRequested NULL), a parameter block of the
class's size (paramsSize 0, as CUDA sends it, makes the driver read its class's own size)
— for the classes `_alloc_plan` lets through: not a root client, not bound to the caller
through RM_ALLOC, whose class check reads only the call (LANE_CLASS_CHECKS) and whose
after-hook can be told from the header to have nothing to do (LANE_AFTER_HOOKS: a channel
of a tenant stopped for a high-priority one goes the general way). A class whose layout
names client handles or pointers, or with a class check, is checked on the private copy
(`_check_alloc`: client handles, the class check, pointers NULL; a device's deviceId
one of the tenant's GPUs, which the new object then belongs to). Device memory (charged
classes: NV01_MEMORY_LOCAL_USER, cudaMalloc's) is always checked: its size as the driver
takes it from the card must fit the tenant's quota on the parent's GPU, and a placeholder
object holds those bytes in the books from the check to `finish` (or `release`, when the
front end sends the call the general way after all), as handlers.rm_alloc's `_reserved`
holds them while the driver runs. `finish` puts the new
object into the tenant's books (the handle from the driver's answer, the parent's GPU)
before the tenant has the answer, as handlers.rm_alloc does; the front end's private copies
are the same as a control's (the header the driver reads names the broker's copy of the
parameters).

*Header-only calls*: an RM_FREE (NVOS00) of one of the tenant's objects — its root
client included — is admitted on its header (client and object the tenant's, as handlers.rm_free
requires for a file the broker holds; an object the books do not know goes the general
way) and `finish` drops the object and its children from the books after the driver's
NV_OK; a *plain escape* (`plain_escape`: NV_ESC_NUMA_INFO, NV_ESC_WAIT_OPEN_COMPLETE) is
admitted on its row alone, its argument being the whole call. Neither has a parameter
block (Header.params_offset -1): the front end reads and writes the header only.

What the lane leaves to the front end: the private copies (header and parameters read once
into broker memory, the driver sees only those, the tenant's memory is written after), the
check that the caller is still the thread that made the call, and the driver call itself
(`Backend.run_control`). `tests/test_fastlane.py` runs every control of the recorded PyTorch
and NVML traces through both paths and compares the decisions.
"""
from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from devbroker.abi import ioc, registry
from devbroker.abi import status as nvstatus
from devbroker.abi.driver import NV_IOCTL_MAGIC
from devbroker.abi.errors import DecodeError
from devbroker.abi.nodes import NodeKind
from devbroker.backends.base import DriverResult

from . import compute, handlers, limits, preemption, rewrite, rules
from .effects import STATE_LOCK, HandOver, locked, run_blocking
from .refusal import Refusal

log = logging.getLogger("devbroker.fastlane")

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
    case `ControlLane._admit_escape` sends the general way, from the argument's bytes),
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
# driver's own channel group only for a channel under a device, both of which the lane
# sends the general way (compute.lane_leaves_channel; a tenant stopped between the admission and the driver's
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


@dataclass(frozen=True)
class _HookContext:
    """What an after-hook run by the lane reads of its call (handlers.CallContext's part)."""
    broker: Any
    session: Any
    req: Any


def _mirrored(name: str, handler: Callable) -> rules.EscapeRule | None:
    """The escape row `name` when the lane can stand for it: its handler is `handler` (whose
    checks the lane repeats), with no rewrite and no in-caller reason; None else."""
    row = rules.ESCAPES.get(name)
    return (row if row is not None and row.handler is handler and row.rewrite is None
            and not row.in_caller else None)


class ControlLane:
    """The broker's side of the control lane (module docstring). One per broker; its methods
    run on seccomp listener threads and take the state lock themselves."""

    def __init__(self, broker: Broker):
        self.broker = broker
        # The lane mirrors handlers.rm_control (rm_alloc, rm_free): if an escape row ever gets
        # another handler, a rewrite of its own or an in-caller reason, that part of the lane
        # is off rather than wrong.
        self.escape = _mirrored(RM_CONTROL, handlers.rm_control)
        self.alloc_escape = _mirrored(RM_ALLOC, handlers.rm_alloc)
        self.free_escape = _mirrored(RM_FREE, handlers.rm_free)
        self.admitted = 0
        self.passed = 0  # declined: sent down the general path
        self.allocations = 0  # of the admitted: RM_ALLOCs (the allocation lane)
        self.frees = 0  # of the admitted: RM_FREEs
        self.settled = 0  # of the admitted: by a front end's settled decision (settleable)
        self._plans: dict[tuple, tuple | None] = {}  # (abi, cmd) -> _plan's answer
        self._alloc_plans: dict[tuple, tuple | None] = {}  # (abi, class) -> _alloc_plan's
        self._null_only: dict[tuple, bool] = {}  # (abi, class) -> _null_checked_only's
        self._same_escape: dict[int, bool] = {}  # ioctl number -> settleable_escape's
        self._no_refs: dict[int, tuple] = {}  # id(layout) -> (layout, _names_nothing's)

    def ioctl_cmds(self, versions) -> frozenset[int]:
        """The ioctl numbers the lane may take, over the given ABIs (front ends test the
        number before reading anything)."""
        out = set()
        for abi in versions:
            for h in headers_of(abi).values():
                row = {"control": self.escape, "alloc": self.alloc_escape,
                       "free": self.free_escape}.get(h.kind, True)
                if row is not None:
                    out.add(h.ioctl_cmd)
        return frozenset(out)

    def admit(self, session_id: int, caller: Caller, ioctl_cmd: int,
              hdr: bytes, max_params: int | None = None,
              run_hooks: bool = False) -> Admitted | None:
        """The call if the general path would run it on the driver as sent; None sends it
        down the general path (which decides it again, refusals and audit included).
        max_params: the largest parameter block the front end can copy (a larger one goes
        the general way, before a rate token is taken). run_hooks: the front end runs an
        allocation's after-hook of LANE_RUN_AFTER_HOOKS itself (`run_after`) before the
        tenant has its answer; without it such an allocation goes the general way."""
        with STATE_LOCK:
            got = self._admit(session_id, caller, ioctl_cmd, hdr, max_params, run_hooks)
            if got is None:
                self.passed += 1
            else:
                self.admitted += 1
                self.allocations += got.alloc is not None
                self.frees += got.header.kind == "free"
        return got

    def _admit(self, session_id: int, caller: Caller, ioctl_cmd: int,
               hdr: bytes, max_params: int | None = None,
               run_hooks: bool = False) -> Admitted | None:
        b = self.broker
        s = _usable_session(b, session_id, caller)
        if s is None:
            return None
        tenant = s.tenant
        if s.node is NodeKind.GPU and s.minor not in tenant.gpus:
            return None
        if not b.backend.can_run_control(s.file):  # (a relayed file without a thread channel)
            return None
        abi = b._abi(s)
        h = headers_of(abi).get(ioctl_cmd)
        if h is None or len(hdr) != h.size:
            return None
        if h.kind == "alloc":
            return self._admit_alloc(s, abi, h, hdr, max_params, run_hooks)
        if h.kind == "free":
            return self._admit_free(s, abi, h, hdr)
        if h.kind == "escape":
            return self._admit_escape(s, abi, h, hdr)
        escape = self.escape
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
        plan = self._plan(abi, cmd)
        if plan is None or plan[0] not in caps:
            return None
        _cap, post, size, pre, checked, ptrs, embedded, gpu_id_off, embedded_only = plan
        if params_size != size or params_ptr == 0 or (
                max_params is not None and size > max_params):
            return None
        # Last, as the general path's own first step does: a token, or the general way (it
        # waits for one there). A checked control takes it in `check`, after its last test.
        if not checked and not tenant.limiter.try_acquire():
            return None
        return Admitted(s, abi, h, client, h_object, cmd, params_ptr, params_size, obj.gpu,
                        post, checked=checked, pre=pre, null_ptrs=ptrs,
                        embedded_fields=embedded, gpu_id_off=gpu_id_off,
                        embedded_only=embedded_only)

    def _admit_alloc(self, s: Session, abi: DriverABI, h: Header, hdr: bytes,
                     max_params: int | None, run_hooks: bool = False) -> Admitted | None:
        """The allocation lane: an RM_ALLOC the general path (handlers.rm_alloc) would run
        on the driver as sent, decided on its header as the control lane decides a control
        (module docstring, "Allocations"). None: the general way."""
        b, tenant = self.broker, s.tenant
        escape = self.alloc_escape
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
        plan = self._alloc_plan(abi, cls)
        if plan is None or plan[0] not in caps:
            return None
        _cap, size, checked, ptrs, rule = plan
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
        if rule.after in LANE_AFTER_HOOKS and compute.lane_leaves_channel(b, tenant.name,
                                                                          parent):
            return None  # a channel of a stopped tenant, or one under a device: its
            # after-hook stops it, or finds the group the driver made for it, there
        if limits.alloc_refusal(tenant, root_client=False) is not None:
            return None
        if not checked and not tenant.limiter.try_acquire():
            return None
        return Admitted(s, abi, h, client, h_parent, cls, params_ptr, size, parent.gpu, None,
                        checked=checked, null_ptrs=ptrs, alloc=rule)

    def _admit_free(self, s: Session, abi: DriverABI, h: Header, hdr: bytes) -> Admitted | None:
        """An RM_FREE the general path (handlers.rm_free) would run as sent: the client is
        the tenant's and the object one of its objects or the client itself (NVML frees
        its root clients three times per init: ~420 µs each over the driver the general
        way on the H200). A GPU taken from the tenant does not stop it: freeing stays
        allowed there, as on the general path."""
        tenant, escape = s.tenant, self.free_escape
        if escape is None or not escape.granted(tenant.policy.capabilities) \
                or s.node not in escape.nodes:
            return None
        h_root, _h_parent, h_old = h.unpack(hdr)
        client = tenant.clients.get(h_root)
        if client is None or h_old not in client.objects:  # (the root is one of them)
            return None
        if not tenant.limiter.try_acquire():
            return None
        return Admitted(s, abi, h, client, h_old, 0, 0, 0, client.objects[h_old].gpu, None)

    def _admit_escape(self, s: Session, abi: DriverABI, h: Header,
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
            host = self.broker.backend.memblock_size
            asked = abi.escape(h.escape).params.decode(hdr).memblock_size
            if host is not None and asked != host:
                return None  # the general way refuses it, with its record
        if not tenant.limiter.try_acquire():
            return None
        # an fd escape: the front end's check carries its fds (`fd_target`), or declines;
        # an answered one: the front end's check takes it only if it answers without the
        # driver (the native loop), or declines
        return Admitted(s, abi, h, None, 0, 0, 0, 0, None, None,
                        checked=bool(h.fd_offsets) or answered, answered=answered)

    def _alloc_plan(self, abi: DriverABI, cls: int) -> tuple | None:
        """(capability, parameter size, checked, pointer offsets, class row) of a class the
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
        key = (abi, cls)
        try:
            return self._alloc_plans[key]
        except KeyError:
            pass
        plan = None
        op = abi.rm_class(cls)
        if (cls not in handlers.ROOT_CLIENT_CLASSES
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
                plan = (rule.capability, op.size, checked, ptrs, rule)
        self._alloc_plans[key] = plan
        return plan

    def check(self, adm: Admitted, params: bytearray, embedded_ok: bool = False) -> bool:
        """For a checked control, on the front end's private copy of its parameters, before
        the driver call: what handlers.rm_control does between reading the parameters and
        calling the driver — every client handle the tenant's (`Broker._check_clients`), the
        row's pre-hook (which may rewrite `params`, in place here), every GPU id the
        tenant's (`rewrite.require_own_gpu_ids`) — then the rate token. False: the call
        goes the general way, which decides it again from the start and makes the refusal
        with its audit record (the lane never refuses anything itself).

        embedded_ok: the front end copies *embedded buffers* in and back itself (the native
        loop, which makes the driver call: FIFO_GET_CHANNELLIST's handle and channel lists,
        CUDA's 20 per init, ~435 µs each over the driver the general way on the H200). Their
        pointers may then be set: `adm.embedded` lists each buffer as the general path sizes
        it (handlers.embedded_buffers: the count field of this private copy), at most
        EMBEDDED_MAX buffers of EMBEDDED_BYTES in all; the front end reads them into copies
        of its own, gives the driver those, and writes them back after an NV_OK, as the
        general path does (`_read_embedded`, rm_control's write-back)."""
        if adm.alloc is not None:
            return self._check_alloc(adm, params)
        if adm.header.kind == "escape":  # an fd escape: only a front end that carries fds
            with STATE_LOCK:              # (it asks `fd_target` for each file instead)
                self._declined()
            return False
        with STATE_LOCK:
            b, s = self.broker, adm.session
            if not self._copy_usable(adm, params,
                                     embedded_ok and bool(adm.embedded_fields)):
                return False
            spec = adm.abi.control(adm.cmd).params
            where = f"RM_CONTROL {adm.abi.control_name(adm.cmd)}"
            try:
                value = spec.decode(params)
                b._check_clients(s, value, where=where)
                if adm.pre is not None:
                    value = adm.pre(rewrite.ControlContext(
                        b, s, adm.abi, adm.cmd, value, adm.gpu, adm.client, adm.h_object),
                        value)
                rewrite.require_own_gpu_ids(b, s, adm.abi, adm.cmd, value)
                embedded = self._embedded(adm, value) if embedded_ok else ()
            except (Refusal, DecodeError):
                self._declined()
                return False
            if embedded is None:
                self._declined()
                return False
            if adm.pre is not None:
                out = value.encode()
                if len(out) != len(params):
                    return False
                params[:] = out
            if not s.tenant.limiter.try_acquire():
                return False
            adm.params_value = value
            adm.embedded = embedded
            return True

    def unknown_client(self, session_id: int, ioctl_cmd: int, hdr: bytes) -> int | None:
        """The root client a control, allocation or free header names on a ctl file when the
        tenant does not hold it yet but may have allocated it itself (a continued call the
        broker did not see answered: Broker._may_adopt); None else. A front end that holds
        a duplicate of the file may then have the broker adopt it
        (`Broker.adopt_client_here`) before `admit`, which sends a call of an unknown
        client the general way (where the same adoption is made)."""
        with STATE_LOCK:
            b = self.broker
            s = b.sessions.get(session_id)
            if s is None or s.closed or s.node is not NodeKind.CTL:
                return None
            h = headers_of(b._abi(s)).get(ioctl_cmd)
            if h is None or len(hdr) != h.size or h.kind not in ("control", "alloc", "free"):
                return None
            fields = h.unpack(hdr)
            if h.kind == "alloc" and fields[3] in handlers.ROOT_CLIENT_CLASSES:
                return None  # (a new root client: nothing to adopt yet)
            client = fields[0]
            if not client or client in s.tenant.clients or not b._may_adopt(s, client):
                return None
            return client

    def fd_target(self, adm: Admitted, session_id: int | None) -> bool:
        """For an fd escape (`fd_escape`) in a front end that carries fds: whether the file
        an fd field names — found by the front end from its own duplicate of that very file
        — is one of the tenant's NVIDIA files (`Broker._translate_fds`'s test); the front
        end then gives the driver that duplicate. False: the general way (which refuses
        with its record)."""
        with STATE_LOCK:
            s = adm.session
            ok = (not s.closed and not s.tenant.revoked
                  and self.broker.tenant_file(s.tenant, session_id) is not None)
            if not ok:
                self._declined()
            return ok

    EMBEDDED_MAX = 4  # buffers per control (native/lane.c DVB_EMBED_MAX)
    EMBEDDED_BYTES = 64 << 10  # in all (CUDA's channel lists: 2 x 4 bytes per channel)

    def _embedded(self, adm: Admitted, value) -> tuple | None:
        """The embedded buffers the check's copy names: ((offset, pointer, bytes), ...) for
        each set pointer field of rules.lane_embedded, sized as the general path sizes them;
        None when they are more or larger than a front end carries (the general way)."""
        if not adm.embedded_fields:
            return ()
        sizes = dict(handlers.embedded_buffers(adm.abi, value))
        out = tuple((off, int(getattr(value, name)), sizes[name])
                    for off, name in adm.embedded_fields if name in sizes)
        if len(out) > self.EMBEDDED_MAX or sum(n for _o, _p, n in out) > self.EMBEDDED_BYTES:
            return None
        return out

    def _check_alloc(self, adm: Admitted, params: bytearray) -> bool:
        """A checked allocation, on the private copy of its parameters: what
        handlers.rm_alloc does between reading them and calling the driver — every client
        handle the tenant's, then the class's own check — and the rate token last. False:
        the general way (which refuses, with the audit record)."""
        with STATE_LOCK:
            b, s = self.broker, adm.session
            if not self._copy_usable(adm, params):
                return False
            where = f"RM_ALLOC {adm.abi.class_name(adm.cmd)}"
            try:
                value = adm.abi.rm_class(adm.cmd).params.decode(params)
                b._check_clients(s, value, where=where)
                if adm.alloc.check is not None:
                    adm.alloc.check(None, handlers.AllocCall(adm.cmd, adm.client,
                                                             adm.client.handle, value, where))
                charge = handlers._alloc_charge(value) if adm.alloc.charge else 0
            except (Refusal, DecodeError):
                self._declined(adm)
                return False
            if adm.cmd == handlers.DEVICE_CLASS:
                # handlers.rm_alloc's device test: the driver's device instance names one of
                # the tenant's GPUs, which the new object belongs to (NVML allocates a
                # device per init: ~570 µs over the driver the general way on the H200)
                gpu = b.backend.gpu_index_of_instance(int(value.deviceId))
                if gpu is None or gpu not in s.tenant.gpus:
                    self._declined(adm)
                    return False
                adm.gpu = gpu
            if adm.alloc.charge:
                # handlers.rm_alloc's quota test (b._reserved): the size as the driver takes
                # it from the card, against what the tenant holds on the parent's GPU
                # including the other allocations in flight; a refusal is the general way's
                gpu, tenant = adm.gpu, s.tenant
                if (gpu is None or adm.h_object not in adm.client.objects
                        or (int(value.size) > 0 and not charge)
                        or tenant.used().get(gpu, 0) + charge > tenant.quota(gpu)):
                    self._declined(adm)
                    return False
            if not s.tenant.limiter.try_acquire():
                return False
            if adm.alloc.charge and charge:
                adm.charge = charge
                adm.reserved = -next(b._ids)
                adm.client.add(adm.reserved, adm.cmd, adm.h_object, gpu=adm.gpu,
                               charged=charge)
            adm.params_value = value
            return True

    def sent_back(self, adm: Admitted) -> None:
        """A checked call whose check passed but which its front end then sent the general
        way (an embedded buffer it could not read): counted as declined, not admitted, as a
        call the check sends there is."""
        with STATE_LOCK:
            self._declined(adm)

    def release(self, adm: Admitted | None) -> None:
        """An admitted allocation that will not reach `finish` (the front end sent it the
        general way after its check, or its caller went away): the quota it held is given
        back. Safe to call more than once, and for any admitted call."""
        if adm is None or not adm.reserved:
            return
        with STATE_LOCK:
            if adm.reserved:
                adm.client.remove(adm.reserved)
                adm.reserved = 0

    def _copy_usable(self, adm: Admitted, params: bytearray, embedded_ok: bool = False) -> bool:
        """What `check` and `_check_alloc` test first (under the state lock): the session
        still open, the tenant still in the policy, and every pointer field of the private
        copy NULL (a buffer behind one goes the general way, which copies it) — but those
        of embedded buffers when the front end carries them (embedded_ok)."""
        s = adm.session
        if s.closed or s.tenant.revoked:
            return False
        carried = {off for off, _name in adm.embedded_fields} if embedded_ok else ()
        for off in adm.null_ptrs:
            if off not in carried and any(params[off:off + 8]):
                self._declined(adm)
                return False
        return True

    def _declined(self, adm: Admitted | None = None) -> None:
        """An admitted call its check sent the general way after all (for the counters)."""
        self.admitted -= 1
        self.passed += 1
        if adm is not None and adm.alloc is not None:
            self.allocations -= 1

    def _plan(self, abi: DriverABI, cmd: int) -> tuple | None:
        """(capability, post-hook, parameter size, pre-hook, checked, pointer offsets,
        embedded buffers, the offset of its one GPU id when that is all its check reads
        (`_gpu_id_only`, else -1)) of a
        control the lane may take in this ABI, None for one it may not. It may take a
        control whose row is on the allowlist, not reserved by the driver's flags, neither
        answered, run nor charged by the broker, and whose layout has no fd and no pointer
        inside an array (rules.lane_pointers). It is *checked* (ControlLane.check on the
        private copy before the driver call) when its row has a pre-hook or its layout
        holds something the broker looks at: client handles, GPU ids, pointers (which must
        then be NULL); else the header alone decides. A post-hook on the answer is allowed.
        The tables do not change while the broker runs, so this is computed once per (ABI,
        control) on the allowlist (a number not on it costs a lookup, and is not
        remembered)."""
        row = rules.CONTROLS.get(cmd)
        if row is None:
            return None
        key = (abi, cmd)
        try:
            return self._plans[key]
        except KeyError:
            pass
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
            plan = (rule.capability, rule.post, op.size, rule.pre, checked, ptrs, embedded,
                    gpu_id_off, embedded_only)
        self._plans[key] = plan
        return plan

    def table_patch(self, adm: Admitted):
        """The row's post-hook as data (rewrite.TablePatch) for a front end that applies it
        itself after an NV_OK answer, with the values as of now; None when the hook has no
        such form or a recording wants the answer through `finish`."""
        as_patch = rewrite.AS_TABLE_PATCH.get(adm.post)
        if as_patch is None or self.broker.recorder is not None:
            return None
        with STATE_LOCK:
            return as_patch(adm.session, adm.gpu, adm.abi.control(adm.cmd).params)

    def needs_finish(self, adm: Admitted, patched: bool = False) -> bool:
        """Whether `finish` has anything to do besides counting the request: a post-hook
        (unless the front end applies it as a TablePatch), or a recording."""
        return (adm.alloc is not None or adm.header.kind == "free" or adm.answered
                or (adm.post is not None and not patched) or self.broker.recorder is not None)

    def books_only(self, adm: Admitted) -> bool:
        """Whether `finish` only writes the books — an allocation's new object and the quota
        it held, a free's removal, the request counted — and gives the tenant back the
        driver's answer unchanged: then a front end may call it after the tenant has its
        answer, provided no decision is made in between on books that lack it
        (native/lane.c FINISH_AFTER)."""
        return ((adm.alloc is not None or adm.header.kind == "free") and not adm.answered
                and adm.post is None and self.broker.recorder is None
                and (adm.alloc is None or adm.alloc.after not in LANE_RUN_AFTER_HOOKS))

    def answered(self, adm: Admitted, err: int, end_ns: int) -> None:
        """A call the front end answered without `finish` was answered at end_ns
        (time.perf_counter_ns's clock) with errno err: nothing to do here (the call
        counters' wrapper records its row)."""

    def settleable(self, adm: Admitted) -> bool:
        """Whether this admitted control's decision may be *settled*: repeated by a front
        end, without asking again, for the same control on the same object until the books
        say that something it read changed (objects.BOOKS: the policy epoch, the ring of
        removals; native/lane.c, struct dvb_settled). An allocation: `_settleable_alloc`.
        Otherwise: a control (not a free or escape) decided on its header alone — its row,
        the tenant's capabilities,
        the client and object in the books and on one of the tenant's GPUs, all of which
        those cover — with no check of its parameters but, at most, that its one GPU id is
        one of the tenant's (`Admitted.gpu_id_off`: the front end repeats that test on its
        private copy, with the tenant's GPU ids of the policy epoch) or, for a layout with
        embedded buffers, their sizes (`Admitted.embedded_only`: the front end reads them
        itself into copies of its own, as it does for a checked one) or its GPU-id list
        (`id_list_check`: ATTACH_IDS, DETACH_IDS, whose pre-hook is that check), no other
        pre-hook and a post-hook only as data — a TablePatch, an IdFilter (`_id_filter_only`) or an IdFlag
        (`id_flag`) — and nothing else for `finish` to do (no recording)."""
        if adm.alloc is not None:
            return self._settleable_alloc(adm)
        if adm.header.kind == "free":
            # `_admit_free` decided on the header alone: the client the tenant's and the
            # object one of its objects or the client itself — an object fact on this file
            # is that (facts of freed objects go with their removal from the books); the
            # books follow the driver's answer after it (`book_settled`)
            return self.broker.recorder is None
        id_filter = self._id_filter_only(adm)
        id_list = self.id_list_check(adm) is not None
        return (adm.header.kind == "control" and adm.alloc is None
                and (not adm.checked or adm.gpu_id_off >= 0 or bool(adm.embedded_only)
                     or id_filter or id_list)
                and (adm.pre is None or id_list) and not adm.answered
                and (not adm.embedded_fields or bool(adm.embedded_only))
                and (adm.post is None or adm.post in rewrite.AS_TABLE_PATCH or id_filter
                     or self.id_flag(adm) is not None)
                and self.broker.recorder is None)

    def settleable_escape(self, adm: Admitted) -> bool:
        """Whether a plain escape this lane admitted (`_admit_escape`) may be settled: its
        decision reads the session, its row (allowed, granted, on this node) and, for the
        version check and SYS_PARAMS, the argument — so a front end may repeat it for the
        same argument byte for byte on another of the tenant's files of the same node
        (native/lane.c struct dvb_escape_fact) — for an fd escape with one fd field
        (REGISTER_FD), but for that field, whose file the front end checks each time (a
        file of the tenant's, `fd_target`'s test). Not while recording. The loop does not know which driver version a
        file's process asked for (its version check: `Tenant.abi_by_tgid`), so either every
        version the broker knows reads this ioctl number as this same escape, or no process
        of the tenant's asked for another version than the broker's (NVML's and CUDA's
        WAIT_OPEN_COMPLETE is not in 535's tables); a process that does so later moves the
        policy epoch (handlers.version), and every settled fact with it."""
        h = adm.header
        if h.kind != "escape" or len(h.fd_offsets) > 1 or self.broker.recorder is not None:
            return False
        same = self._same_escape.get(h.ioctl_cmd)
        if same is None:
            same = self._same_escape[h.ioctl_cmd] = all(
                (g := headers_of(registry.get(v)).get(h.ioctl_cmd)) is not None
                and g.kind == "escape" and g.escape == h.escape
                for v in registry.versions())
        return same or not adm.session.tenant.abi_by_tgid

    def id_list_check(self, adm: Admitted):
        """The pre-hook of a control as an IdListCheck (rewrite.AS_ID_LIST_CHECK:
        restrict_attach_ids), when that list is all its check reads — no post-hook, pointer,
        embedded buffer, fd or client handle — for a front end that repeats it on its
        private copy with the tenant's GPU ids; None for any other."""
        as_check = rewrite.AS_ID_LIST_CHECK.get(adm.pre)
        if as_check is None or adm.post is not None or adm.null_ptrs or adm.embedded_fields:
            return None
        spec = adm.abi.control(adm.cmd).params
        if not self._names_nothing(spec):
            return None
        return as_check(spec)

    def id_flag(self, adm: Admitted):
        """The post-hook of a control whose check is its one GPU id (`Admitted.gpu_id_off`)
        as an IdFlag on that same id (rewrite.AS_ID_FLAG: GET_ID_INFO's IN_USE flag), for a
        front end that applies it itself with the GPU ids the tenant holds a device of;
        None for any other."""
        as_flag = rewrite.AS_ID_FLAG.get(adm.post)
        if as_flag is None or adm.gpu_id_off < 0 or adm.pre is not None:
            return None
        flag = as_flag(adm.abi.control(adm.cmd).params)
        return flag if flag is not None and flag.id_offset == adm.gpu_id_off else None

    def _id_filter_only(self, adm: Admitted) -> bool:
        """A control whose post-hook is an IdFilter (rewrite.AS_ID_FILTER: the GPU-id lists
        the broker answers, GPU_IDS_ANSWERED) and whose check reads nothing — no pointer, fd
        or client handle in its layout, its GPU ids the driver's answer, not the tenant's
        question (rewrite.require_own_gpu_ids skips them): a front end may apply the filter
        itself with the tenant's GPU ids of the policy epoch."""
        flt = rewrite.AS_ID_FILTER.get(adm.post)
        if flt is None or adm.pre is not None or adm.null_ptrs or adm.embedded_fields \
                or adm.cmd not in rewrite.GPU_IDS_ANSWERED:
            return False
        spec = adm.abi.control(adm.cmd).params
        return flt(spec) is not None and self._names_nothing(spec)

    def _names_nothing(self, spec) -> bool:
        """Whether a parameter layout has no pointer, fd or client-handle field (then a
        check that reads only its GPU ids reads nothing else): the layout walked once per
        layout, not at each decided call."""
        got = self._no_refs.get(id(spec))
        if got is None or got[0] is not spec:
            got = (spec, not any(f.kind in ("fd", "ptr") or f.name in rules.CLIENT_HANDLE_FIELDS
                                 for _p, f, _o in spec.walk()))
            self._no_refs[id(spec)] = got
        return got[1]

    def _settleable_alloc(self, adm: Admitted) -> bool:
        """Whether an admitted allocation's decision may be settled: decided on its header
        alone (`_admit_alloc`: the client and parent the tenant's and on its GPUs, the
        class on the allowlist and granted, no access rights asked for, the tenant's
        object limit and pace — the front end keeps an allowance of objects and takes a
        pace token per call), no class check, nothing charged, its parameters not checked
        (`_alloc_plan`: no client handle, GPU id or pointer in them) or checked only for
        NULL pointers (`_check_alloc` then tests nothing else: system memory's `address`;
        the front end repeats that test on its private copy), no after-hook — but a
        channel's, for a tenant the policy never has stopped (compute.never_stops_channels:
        not low priority, no turns; a channel's stopped state is not in the books' epochs,
        the policy is) — and no recording. The handle it
        makes is the driver's to refuse when it exists (the general path's answer is the
        driver's NV_ERR_INSERT_DUPLICATE_NAME too); the front end books the new object with
        `book_settled` after the answer."""
        rule = adm.alloc
        return (rule is not None and rule.check is None and not rule.parents
                and (rule.after is None or (rule.after in LANE_AFTER_HOOKS
                                            and compute.never_stops_channels(
                                                self.broker, adm.session.tenant)))
                and not rule.charge and adm.header.kind == "alloc"
                and (not adm.checked or self._null_checked_only(adm))
                and self.broker.recorder is None)

    def _null_checked_only(self, adm: Admitted) -> bool:
        """A checked allocation whose `_check_alloc` comes down to its pointers being NULL:
        not a device (its deviceId is looked up), and a layout with no client handle, GPU
        id or fd (`rules.plain_layout` but for pointers), at most SETTLED_NULL_PTRS of
        them."""
        if adm.cmd == handlers.DEVICE_CLASS or len(adm.null_ptrs) > SETTLED_NULL_PTRS:
            return False
        key = (adm.abi, adm.cmd)
        known = self._null_only.get(key)
        if known is None:
            spec = adm.abi.rm_class(adm.cmd).params
            known = self._null_only[key] = not any(
                f.kind == "fd" or f.name in rules.CLIENT_HANDLE_FIELDS
                or f.name in rewrite.GPU_ID_FIELD_NAMES for _p, f, _o in spec.walk())
        return known

    def runs_hook(self, adm: Admitted) -> bool:
        """Whether the front end must run this admitted allocation's after-hook
        (`run_after`) before the tenant has its answer."""
        return adm.alloc is not None and adm.alloc.after in LANE_RUN_AFTER_HOOKS

    def run_after(self, adm: Admitted, hdr_out: bytes, params_in: bytes, req: Any,
                  perform: Callable) -> bool:
        """An allocation a front end admitted with `run_hooks`, after `finish` booked it and
        before the tenant has its answer: the class's after-hook (LANE_RUN_AFTER_HOOKS), as
        handlers.rm_alloc runs it — on the new handle, with the parameters as sent (the
        front end's private copy) — its driver calls performed on this thread through
        `perform` (req: the call's IoctlRequest, whose duplicate of the tenant's file they
        run on). Only on NV_OK. The hook records its own failures (compute._apply); anything
        else is logged and audited, never raised: the allocation stands either way, as on
        the general path. True when a hook ran to its end."""
        rule, h = adm.alloc, adm.header
        if rule is None or rule.after not in LANE_RUN_AFTER_HOOKS:
            return False
        if h.status_offset < 0 or hdr_out[h.status_offset:h.status_offset + 4] != bytes(4):
            return False  # (not NV_OK: nothing was made)
        handle = int.from_bytes(hdr_out[h.new_offset:h.new_offset + 4], "little")
        where = f"RM_ALLOC {adm.abi.class_name(adm.cmd)}"
        try:
            params = (adm.params_value if adm.checked
                      else adm.abi.rm_class(adm.cmd).params.decode(params_in))
        except DecodeError:
            params = None
        ctx = _HookContext(self.broker, adm.session, req)
        call = handlers.AllocCall(adm.cmd, adm.client, adm.client.handle, params, where)
        try:
            run_blocking(locked(rule.after(ctx, call, handle, adm.gpu)), perform)
            return True
        except HandOver as e:  # (a wait this thread cannot do: the steps are dropped)
            e.steps.close()
            why = "its driver calls could not run on the listener's thread"
        except Exception as e:  # a bug must cost the hook, never the tenant's answer
            why = f"{type(e).__name__}: {e}"
        log.error("%s: after-hook failed: %s", where, why)
        self.broker.audit.write("error", tenant=adm.session.tenant.name, what=where,
                                reason=f"handle {handle:#x}: the after-hook "
                                       f"({rule.after.__name__}) did not finish: {why}")
        return False

    def book_settled(self, session_id: int, hdr_out: bytes, ioctl_cmd: int) -> tuple | None:
        """An allocation a front end admitted as settled was answered NV_OK by the driver
        (hdr_out: its header as the driver left it): the new object into the tenant's books,
        as `_finish_alloc` books one (on the parent's GPU, nothing charged), and counted.
        (The broker's session, client, new handle), or None when it was not booked (the
        session or the parent gone meanwhile: a racing free took the new object with it)."""
        with STATE_LOCK:
            s = self.broker.sessions.get(session_id)
            if s is None:
                return None
            h = headers_of(self.broker._abi(s)).get(ioctl_cmd)
            if h is None or h.kind not in ("alloc", "free") or len(hdr_out) != h.size:
                return None
            if h.kind == "free":
                self._book_settled_free(s, h, hdr_out)
                return None
            h_root, h_parent, _h_new, cls, _p, _n = h.unpack(hdr_out)
            handle = int.from_bytes(hdr_out[h.new_offset:h.new_offset + 4], "little")
            client = s.tenant.clients.get(h_root)
            parent = client.objects.get(h_parent) if client is not None else None
            if parent is None or not handle:
                return None
            client.add(handle, cls, h_parent, gpu=parent.gpu, charged=0)
            self.allocations += 1
            return s, client.handle, handle

    def _book_settled_free(self, s: Session, h: Header, hdr_out: bytes) -> None:
        """A free the front end admitted as settled, answered NV_OK: the object and its
        children (or the client and everything under it) leave the books, as
        `_finish_free` has them leave (under the state lock)."""
        h_root, _h_parent, h_old = h.unpack(hdr_out)
        client = s.tenant.clients.get(h_root)
        if client is None or h_old not in client.objects:
            return  # (already gone: a racing free of a parent took it)
        handlers.drop_freed(self.broker, client, h_old)
        self.frees += 1

    def settled_calls(self, tenant, key, ok: int, err: int, sum_ns: int,
                      buckets) -> None:
        """Calls a front end admitted as settled (ok: the driver answered, err: with an
        errno): the tenant's requests and the lane's admissions, as `book` would have
        counted them one by one. (`key`, `sum_ns`, `buckets`: the call counters' row, for
        callstats._CountedLane.)"""
        with STATE_LOCK:
            tenant.requests += ok + err
            self.admitted += ok + err
            self.settled += ok + err

    def book(self, adm: Admitted) -> None:
        """Count the request now, for a front end that will not call `finish` (nothing
        else to do there: `needs_finish` False)."""
        with STATE_LOCK:
            adm.session.tenant.requests += 1
        adm.booked = True

    def finish(self, adm: Admitted, hdr: bytes, params_in: bytes, ret: int, err: int,
               hdr_out: bytes, params_out: bytearray) -> bytes:
        """After the driver answered: the books (a request of the tenant's; the recording,
        when the broker keeps one), and the parameters the tenant gets back: through the
        row's post-hook when there is one and the driver said NV_OK, as handlers.rm_control
        does. (Nothing is written to the tenant when err is set.)"""
        h = adm.header
        status = (int.from_bytes(hdr_out[h.status_offset:h.status_offset + 4], "little")
                  if h.status_offset >= 0 else nvstatus.NV_OK)
        if h.kind == "free":
            return self._finish_free(adm, hdr, params_in, ret, err, hdr_out, status)
        if adm.alloc is not None:
            return self._finish_alloc(adm, hdr, params_in, ret, err, hdr_out, params_out,
                                      status)
        with STATE_LOCK:
            s = adm.session
            if not adm.booked:
                s.tenant.requests += 1
            out = bytes(params_out)
            if adm.post is not None and not err and status == nvstatus.NV_OK:
                spec = adm.abi.control(adm.cmd).params
                asked = adm.params_value if adm.checked else spec.decode(params_in)
                ctx = rewrite.ControlContext(self.broker, s, adm.abi, adm.cmd, asked,
                                             adm.gpu, adm.client, adm.h_object)
                out = adm.post(ctx, spec.decode(out)).encode()
            recorder = self.broker.recorder
        if recorder is not None:
            self._record(recorder, adm, hdr, params_in, ret, err, hdr_out, out)
        return out

    def _finish_alloc(self, adm: Admitted, hdr: bytes, params_in: bytes, ret: int, err: int,
                      hdr_out: bytes, params_out: bytearray, status: int) -> bytes:
        """After the driver answered an allocation: the new object into the tenant's books
        (before the tenant has its answer, as handlers.rm_alloc), the request counted."""
        h = adm.header
        out = bytes(params_out)
        with STATE_LOCK:
            s = adm.session
            if not adm.booked:
                s.tenant.requests += 1
            if adm.reserved:  # the quota held while the driver ran (the object takes it)
                adm.client.remove(adm.reserved)
                adm.reserved = 0
            if not err and status == nvstatus.NV_OK:
                handle = int.from_bytes(hdr_out[h.new_offset:h.new_offset + 4], "little")
                charge = adm.charge
                if adm.alloc.charge:
                    # the books follow the driver if it says it took more (handlers.rm_alloc)
                    granted = handlers._alloc_charge(
                        adm.abi.rm_class(adm.cmd).params.decode(out))
                    if granted > charge:
                        self.broker._once(("charge", adm.cmd), f"RM_ALLOC {adm.abi.class_name(adm.cmd)}: "
                                          f"the driver granted {granted} bytes where {charge} "
                                          "were checked against the quota")
                        charge = granted
                # (a racing free of the parent took the new object with it in the driver:
                # nothing to book then)
                if adm.h_object in adm.client.objects:
                    adm.client.add(handle, adm.cmd, adm.h_object, gpu=adm.gpu,
                                   charged=charge)
            recorder = self.broker.recorder
        if recorder is not None:
            self._record(recorder, adm, hdr, params_in, ret, err, hdr_out, out)
        return out

    def _finish_free(self, adm: Admitted, hdr: bytes, params_in: bytes, ret: int, err: int,
                     hdr_out: bytes, status: int) -> bytes:
        """After the driver freed an object: it and its children leave the books (a charge
        held by one of its duplicates moves there); a root client leaves the client books
        with everything under it — as handlers.rm_free."""
        with STATE_LOCK:
            s = adm.session
            if not adm.booked:
                s.tenant.requests += 1
            if not err and status == nvstatus.NV_OK:
                handlers.drop_freed(self.broker, adm.client, adm.h_object)
            recorder = self.broker.recorder
        if recorder is not None:
            self._record(recorder, adm, hdr, params_in, ret, err, hdr_out, b"")
        return b""  # (no parameter block: the header is the answer)

    @staticmethod
    def _record(recorder, adm: Admitted, hdr: bytes, params_in: bytes, ret: int, err: int,
                hdr_out: bytes, out: bytes) -> None:
        s = adm.session
        call = adm.abi.decode_ioctl(s.node, adm.header.ioctl_cmd, hdr)
        block = adm.header.params_offset >= 0  # (a header-only call has no nested buffer)
        recorder.ioctl(s, call, params_in if block else None,
                       DriverResult(arg=hdr_out, nested=out if block else None, result=ret,
                                    errno=err))

