"""What the broker does with each kind of escape: one function per handler, each taking
one CallContext. The escape and UVM rows of rules.py name these functions; the core
(core.py) finds the row, builds the context and runs the handler.

A handler returns an IoctlReply, or is a generator of effects (effects.py: reads and writes
of the tenant's memory, the driver call, fd lookups) that returns one; it refuses by raising
Refusal (audited by the core). It works on the Broker's books through the Broker's own
helpers (`ctx.broker._client_of`, `_call_backend`, ...): handlers are the per-call half of the
Broker, kept beside the rule tables rather than inside the class. The control and class
tables are reached as `ctx.rules` (the rules module, which imports this one).
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from devbroker.abi import registry, vidmem
from devbroker.abi.driver import DriverABI, IoctlCall, NestedRef
from devbroker.abi import status as nvstatus
from devbroker.abi.nodes import NodeKind
from devbroker.broker import limits, rewrite, shares
from devbroker.broker.effects import ResolveFd, Steps
from devbroker.broker.interface import IoctlReply, IoctlRequest, RunInCaller
from devbroker.broker.objects import BOOKS, RmClient, drop_objects, share
from devbroker.broker.refusal import Refusal

if TYPE_CHECKING:  # (core and rules import this module: names for annotations only)
    from devbroker.broker.core import Broker, Session
    from devbroker.broker.rules import EscapeRule

ROOT_CLIENT_CLASSES = frozenset({0x0, 0x41})  # NV01_ROOT, NV01_ROOT_CLIENT
# The client handles the driver hands out itself (RM_ALLOC of a root client with hObjectNew
# 0, as NVML and CUDA ask: 0xc1d000xx in every trace): host-wide, numbered in order. A
# tenant that names one takes the handle another tenant's next client would get.
DRIVER_CLIENT_HANDLES = range(0xC1D00000, 0xC1E00000)


def names_driver_client_handle(h_new: int) -> bool:
    """Whether a root-client allocation names a handle of the driver's own range."""
    return h_new in DRIVER_CLIENT_HANDLES
DEVICE_CLASS = 0x80  # NV01_DEVICE_0
SUBDEVICE_CLASS = 0x2080  # NV20_SUBDEVICE_0
OS_EVENT_CLASS = 0x79  # NV01_EVENT_OS_EVENT
UNKNOWN_CLASS = -1  # an object whose class the books do not know (a duplicate of one made by
#                     a continued call)


@dataclass(frozen=True)
class AllocCall:
    """What rm_alloc decided of an RM_ALLOC, for a class row's `check`."""
    rm_class: int
    client: RmClient  # named by hRoot (the tenant's)
    h_root: int
    params: Any  # the decoded allocation parameters, None without any
    where: str  # "RM_ALLOC <name>", for refusals


@dataclass(frozen=True)
class ControlCall:
    """What rm_control decided of an RM_CONTROL, for a control row's own `run`."""
    client: RmClient  # named by hClient (the tenant's)
    params: Any  # the decoded parameters (after the row's pre-hook), None without any
    ref: NestedRef  # of the parameter block
    where: str  # "RM_CONTROL <name>", for refusals


@dataclass
class CallContext:
    """One decided-to-run call: who sent it, what it is, and the row that allowed it."""
    broker: Broker
    session: Session
    abi: DriverABI  # the caller's
    req: IoctlRequest
    call: IoctlCall  # decoded
    rule: EscapeRule
    rules: Any  # the rules module: CONTROLS, CLASSES, control_rule, ...

    @property
    def fd_fields(self) -> tuple[str, ...]:
        """The fields of this call's argument that hold fds of the tenant's (rule.fd_fields)."""
        value = self.call.value
        return self.rule.fd_fields(value.spec if value is not None else None)


def relay(ctx: CallContext) -> Steps:
    """Escapes with no handles or fds: pass through, rewrite the view if a hook says so."""
    b, s, abi, req, call, rule = ctx.broker, ctx.session, ctx.abi, ctx.req, ctx.call, ctx.rule
    b.check_clients(s, call.value, where=call.name)
    result = yield from b._call_backend(s, call, req=req)
    out = result.arg
    if rule.rewrite is not None and not result.errno:
        out = rule.rewrite(ctx, abi.decode_ioctl(s.node, req.cmd, out).value).encode()
    return IoctlReply(result=result.result, arg_out=out, errno=result.errno)


def version(ctx: CallContext) -> Steps:
    b, s, abi, req, call = ctx.broker, ctx.session, ctx.abi, ctx.req, ctx.call
    result = yield from b._call_backend(s, call, req=req)
    if not result.errno:
        # The emulator speaks the ABI of the version the client asked for, when the
        # registry has it; every later call of this process is decoded with it.
        asked = _cstr(call.value.versionString)
        if asked in registry.versions() and asked != abi.version:
            s.tenant.abi_by_tgid[s.caller.pid] = registry.get(asked)
            # what the native loop settled for the tenant's escapes was decided in the
            # other ABI (ControlLane.settleable_escape): moved on, as by a policy change
            BOOKS.policy_changed()
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def sys_params(ctx: CallContext) -> Steps:
    """SYS_PARAMS sets a host-global, set-once value: never relayed, answered here."""
    b, call = ctx.broker, ctx.call
    host = b.backend.memblock_size
    asked = call.value.memblock_size
    if host is not None and asked != host:
        raise Refusal(f"SYS_PARAMS memblock_size={asked:#x} differs from the host's "
                      f"{host:#x} (a host-global setting)", errno_=errno.EPERM,
                      what=call.name)
    return IoctlReply(arg_out=call.encode())


def fd(ctx: CallContext) -> Steps:
    """Escapes carrying an fd of the tenant's (REGISTER_FD, ALLOC_OS_EVENT…)."""
    b, s, req, call = ctx.broker, ctx.session, ctx.req, ctx.call
    b.check_clients(s, call.value, where=call.name)
    fd_files = yield from b._translate_fds(s, req, call.value, ctx.fd_fields, call.name)
    result = yield from b._call_backend(s, call, fd_files=fd_files, req=req)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def rm_control(ctx: CallContext) -> Steps:
    b, s, abi, req, call = ctx.broker, ctx.session, ctx.abi, ctx.req, ctx.call
    v = call.value
    where = f"RM_CONTROL {abi.control_name(v.cmd)}"
    client = yield from b._client_of(s, v.hClient, where, req)
    if v.hObject not in client.objects:
        raise Refusal(f"{where}: object {v.hObject:#x} is not in client {v.hClient:#x}",
                      status=nvstatus.NV_ERR_INVALID_OBJECT_HANDLE, what=where)
    b._refuse_revoked(s, client.objects[v.hObject].gpu, where)
    row = ctx.rules.CONTROLS.get(v.cmd)
    nested0 = None  # read once: what is decided on is what runs
    if row is not None and row.relay_if is not None and row.capability in s.tenant.capabilities():
        ref0 = abi.nested(call)
        nested0 = yield from b._read_nested(s, req, ref0)
        p0 = ref0.spec.decode(nested0) if nested0 is not None and ref0.spec else None
        if not row.relay_if(p0):
            # Host-global effect: NV_OK without the driver (parameters left as sent).
            b.once(("answered", s.tenant.name, v.cmd),
                       f"tenant {s.tenant.name}: {where} answered by the broker: "
                       f"{row.reason}")
            return b._status_reply(abi, call, nvstatus.NV_OK)
    ctl_rule = ctx.rules.control_rule(v.cmd, abi)
    if ctl_rule is None or not ctl_rule.granted(s.tenant.capabilities()):
        reason, status = ctx.rules.control_refusal(ctl_rule)
        raise Refusal(f"{where} ({v.cmd:#x}): {reason}", status=status, what=where)
    spec = abi.control(v.cmd)
    if spec is not None and spec.params is not None and v.paramsSize != spec.size:
        raise Refusal(f"{where}: paramsSize {v.paramsSize} != {spec.size}",
                      status=nvstatus.NV_ERR_INVALID_PARAM_STRUCT, what=where)
    ref = abi.nested(call)
    nested = nested0 if nested0 is not None else (yield from b._read_nested(s, req, ref))
    params = None
    # Most of what CUDA sends is a control whose row changes nothing and whose layout holds
    # nothing the broker checks: those pass through as the bytes read, decoded by nobody but
    # the driver (rules.reads_params, the same test as rules.simple_control).
    if nested is not None and ref.spec is not None and ctx.rules.reads_params(ctl_rule, ref.spec):
        params = ref.spec.decode(nested)
        b.check_clients(s, params, where=where)
        if ctl_rule.pre is not None:
            params = ctl_rule.pre(rewrite.ControlContext(
                b, s, abi, v.cmd, params, client.objects[v.hObject].gpu, client, v.hObject),
                params)
            nested = params.encode()
        # Every GPU id the parameters name must be one of the tenant's (by the ABI's
        # fields, for every control).
        rewrite.require_own_gpu_ids(b, s, abi, v.cmd, params)
    if ctl_rule.run is not None:  # the row executes it itself (fds in its parameters)
        return (yield from ctl_rule.run(ctx, ControlCall(client, params, ref, where)))
    embedded = yield from b._read_embedded(s, req, abi, params, where)
    result = yield from b._call_backend(s, call, nested, embedded=embedded, req=req)
    out_nested = result.nested
    ok = False
    if params is not None:  # (else: no post-hook and no embedded buffers to write back)
        ok = (not result.errno and out_nested is not None
              and abi.decode_ioctl(s.node, req.cmd, result.arg).value.status == nvstatus.NV_OK)
        if ok and ctl_rule.post is not None:
            hook_ctx = rewrite.ControlContext(b, s, abi, v.cmd, params,
                                              client.objects[v.hObject].gpu, client, v.hObject)
            out_nested = ctl_rule.post(hook_ctx, ref.spec.decode(out_nested)).encode()
    if out_nested is not None and not result.errno:
        yield from b._mem_write(s, req, ref.ptr, out_nested)
        if ok:
            for name, buf in embedded.items():
                yield from b._mem_write(s, req, getattr(params, name), bytes(buf))
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def rm_alloc(ctx: CallContext) -> Steps:
    b, s, abi, req, call = ctx.broker, ctx.session, ctx.abi, ctx.req, ctx.call
    v = call.value
    cls = v.hClass
    where = f"RM_ALLOC {abi.class_name(cls)}"
    if cls in ROOT_CLIENT_CLASSES:
        if s.node is not NodeKind.CTL:
            raise Refusal(f"{where}: root clients are allocated on nvidiactl",
                          status=nvstatus.NV_ERR_INVALID_ARGUMENT, what=where)
        owner = b.clients.owner(v.hObjectNew) if v.hObjectNew else None
        if owner is not None and owner != s.tenant.name:
            # Another tenant's client handle. The driver keeps client
            # handles host-wide, so it cannot be given out; the answer is exactly the
            # driver's answer to a duplicate of the caller's own handle (which goes to
            # the driver: the same NV_ERR_INSERT_DUPLICATE_NAME in the status, the rest
            # of the argument as sent, ioctl() == 0), so the tenant cannot tell whose
            # handle it hit. Only the audit record (the operator's) says more.
            raise Refusal(f"{where}: client handle {v.hObjectNew:#x} is held by another "
                          "tenant (answered as the driver answers a duplicate handle)",
                          status=nvstatus.NV_ERR_INSERT_DUPLICATE_NAME, what=where)
        if names_driver_client_handle(v.hObjectNew):
            # A squat on the handles the driver numbers in order for callers that ask it to
            # choose (NVML and CUDA ask so). Let through: the driver (and the emulator)
            # skip a handle in use, so no other tenant's allocation fails; recorded, so
            # that the operator sees a tenant taking handles others would get.
            b.note_client_squat(s, v.hObjectNew, where)
        if over := limits.alloc_refusal(s.tenant, root_client=True):
            raise Refusal(over, status=nvstatus.NV_ERR_INSUFFICIENT_RESOURCES, what=where)
        f = s.file
        if (getattr(f, "runs_in_caller", False) and not f.continued_root_allocs
                and not b.clients.of_session(s.id)):
            # The driver records the caller's pid as the client's owner, and RM_MAP_MEMORY
            # and UVM later insist on it: the tenant must make this call itself. Safe
            # against a racing thread only because this file holds no client yet: a
            # rewritten argument can then name no parent, so it can only ever allocate
            # a root client (docs/seccomp.md). Later root clients on the same file are
            # allocated by the broker (owner: the broker's pid).
            f.continued_root_allocs += 1
            raise RunInCaller(where)
        nested = yield from b._read_nested(s, req, abi.nested(call))
        result = yield from b._call_backend(s, call, nested, req=req)
        out = abi.decode_ioctl(s.node, req.cmd, result.arg).value
        if not result.errno and out.status == nvstatus.NV_OK:
            b.clients.new(s, out.hObjectNew)
        return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)

    client = yield from b._client_of(s, v.hRoot, where, req)
    if v.hObjectParent not in client.objects:
        raise Refusal(f"{where}: parent {v.hObjectParent:#x} is not in client {v.hRoot:#x}",
                      status=nvstatus.NV_ERR_INVALID_OBJECT_PARENT, what=where)
    b._refuse_revoked(s, client.objects[v.hObjectParent].gpu, where)
    cls_rule = ctx.rules.class_rule(cls)
    if cls_rule is None or not cls_rule.granted(s.tenant.capabilities()):
        reason = ("not on the class allowlist" if cls_rule is None
                  else f"needs capability '{cls_rule.capability}'")
        raise Refusal(f"{where} ({cls:#x}): {reason}",
                      status=nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS, what=where)
    parent_class = client.objects[v.hObjectParent].rm_class
    if cls_rule.parents and parent_class not in cls_rule.parents:
        raise Refusal(f"{where} ({cls:#x}): parent {v.hObjectParent:#x} is "
                      f"{abi.class_name(parent_class)} ({parent_class:#x}), not one of "
                      + ", ".join(f"{abi.class_name(c)} ({c:#x})" for c in sorted(cls_rule.parents))
                      + " (the driver would wrap it in a group the broker never sees)",
                      status=nvstatus.NV_ERR_INVALID_OBJECT_PARENT, what=where)
    if v.hObjectNew and v.hObjectNew in client.objects:
        raise Refusal(f"{where}: handle {v.hObjectNew:#x} already exists",
                      status=nvstatus.NV_ERR_INSERT_DUPLICATE_NAME, what=where)
    if over := limits.alloc_refusal(s.tenant, root_client=False):
        raise Refusal(over, status=nvstatus.NV_ERR_INSUFFICIENT_RESOURCES, what=where)
    ref = abi.nested(call)
    nested = yield from b._read_nested(s, req, ref)
    params = ref.spec.decode(nested) if (nested is not None and ref.spec is not None) else None
    if params is not None:
        b.check_clients(s, params, where=where)
    if cls_rule.check is not None:  # what this class's parameters may name
        cls_rule.check(ctx, AllocCall(cls, client, v.hRoot, params, where))
    gpu = client.objects[v.hObjectParent].gpu
    if cls == DEVICE_CLASS:
        # deviceId is the driver's device instance, which is not the GPU's minor number
        # (numbered at attach time: on the two-H200 host minor 0 was instance 1).
        instance = params.deviceId if params is not None else 0
        gpu = b.backend.gpu_index_of_instance(instance)
        if gpu is None or gpu not in s.tenant.gpus:
            raise Refusal(f"{where}: device instance {instance} (GPU {gpu}) is not one of "
                          f"the tenant's GPUs {list(s.tenant.gpus)}",
                          status=nvstatus.NV_ERR_INVALID_ARGUMENT, what=where)
    memory = cls_rule.charge
    # The quota is checked on what the driver will take from the card: the size rounded
    # up to its page size. The requested alignment only places the allocation
    # (checking the size but charging size-rounded-to-alignment would let 1 byte with a 135 GiB
    # alignment pass a 256 MiB quota and then hold 135 GiB).
    charge = _alloc_charge(params) if memory else 0
    if memory and params is not None and int(params.size) > 0 and not charge:
        raise Refusal(f"{where}: attr {int(params.attr):#x}/attr2 {int(params.attr2):#x} "
                      "ask for a page size the driver does not offer",
                      status=nvstatus.NV_ERR_INVALID_ARGUMENT, what=where)
    if cls_rule.no_memory is not None and charge:
        # Room a preempted tenant is being given back is not offered to others (its restore
        # reserved it first: broker/preemption.py); answered as the driver would.
        if why := b.preemption.room_refusal(gpu, charge):
            raise Refusal(f"{where}: {why}", status=nvstatus.NV_ERR_NO_MEMORY, what=where)
    pinned = pinned_check(s.tenant, cls_rule, pinned_charge(params), where)
    with b._reserved(s, client, cls, v.hObjectParent, gpu, charge, where):
        try:
            result = yield from b._call_backend(s, call, nested, req=req, rm_class=cls)
        except RunInCaller:
            book_continued_pinned(b, client, v.hObjectNew, cls, v.hObjectParent, gpu, pinned)
            raise
        if cls_rule.no_memory is not None and charge:
            result = yield from cls_rule.no_memory(
                ctx, gpu, charge, where, result,
                lambda: b._call_backend(s, call, nested, req=req, rm_class=cls))
    out = abi.decode_ioctl(s.node, req.cmd, result.arg).value
    if not result.errno and out.status == nvstatus.NV_OK:
        out_params = (result.nested is not None and ref is not None
                      and ref.spec is not None)
        if out_params and memory:
            # The books follow the driver if it says it took more than predicted (said
            # once: the prediction in abi/vidmem.py would be wrong for that driver).
            granted = _alloc_charge(ref.spec.decode(result.nested))
            if granted > charge:
                b.once(("charge", cls), f"{where}: the driver granted {granted} "
                           f"bytes where {charge} were checked against the quota")
                charge = granted
        # Into the books before the parameters go back: that write may fail (EFAULT, a
        # read-only page, the memory gate's deadline), and the object exists regardless.
        client.add(out.hObjectNew, cls, v.hObjectParent, gpu=gpu, charged=charge,
                   pinned=pinned)
        if out_params:
            yield from b._mem_write(s, req, ref.ptr, result.nested)
        if cls_rule.after is not None:  # e.g. a channel group's compute share
            yield from cls_rule.after(ctx, AllocCall(cls, client, v.hRoot, params, where),
                                      out.hObjectNew, gpu)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def debugger_on_own_context(ctx: CallContext, alloc: AllocCall) -> None:
    """GT200_DEBUGGER: only on the tenant's own context (hAppClient the allocating client,
    hClass3dObject one of its objects), and never without parameters."""
    p, where, cls = alloc.params, alloc.where, alloc.rm_class
    if p is None:
        raise Refusal(f"{where} ({cls:#x}): a debugger needs its parameters (the context "
                      "it may act on)", status=nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS,
                      what=where)
    if p.hAppClient != alloc.h_root or p.hClass3dObject not in alloc.client.objects:
        raise Refusal(f"{where} ({cls:#x}): a debugger only on the tenant's own context "
                      f"(hAppClient {p.hAppClient:#x}, object {p.hClass3dObject:#x})",
                      status=nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS, what=where)


def os_event_notifier(ctx: CallContext, alloc: AllocCall) -> None:
    """NV01_EVENT_OS_EVENT: the notifier kind decides what the driver makes of `data` (an fd
    key for OS events; a kernel callback pointer for others): only OS events."""
    p = alloc.params
    if p is not None and getattr(p, "hClass", OS_EVENT_CLASS) != OS_EVENT_CLASS:
        raise Refusal(f"{alloc.where}: notifier class {p.hClass:#x} is not an OS event",
                      status=nvstatus.NV_ERR_INVALID_CLASS, what=alloc.where)


def rm_free(ctx: CallContext) -> Steps:
    b, s, abi, req, call = ctx.broker, ctx.session, ctx.abi, ctx.req, ctx.call
    v = call.value
    where = "RM_FREE"
    client = yield from b._client_of(s, v.hRoot, where, req)
    if v.hObjectOld not in client.objects and not getattr(s.file, "runs_in_caller", False):
        raise Refusal(f"{where}: object {v.hObjectOld:#x} is not in client {v.hRoot:#x}",
                      status=nvstatus.NV_ERR_INVALID_OBJECT_HANDLE, what=where)
    # With a file that lives in the tenant, the tenant may hold objects the broker never
    # saw (made by calls it continued, e.g. OS descriptors): freeing a handle of its own
    # client is the driver's to validate, and there is nothing in the books to give back.
    result = yield from b._call_backend(s, call, req=req)
    out = abi.decode_ioctl(s.node, req.cmd, result.arg).value
    if not result.errno and out.status == nvstatus.NV_OK:
        drop_freed(b, client, v.hObjectOld)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def drop_freed(broker, client, handle: int) -> None:
    """The driver freed `handle` of `client` (NV_OK): it and its children leave the books
    (a charge held by one of its duplicates moves there); the root client itself leaves the
    client books with everything under it. The general path's, the lane's and a settled
    free's booking (fastlane.ControlLane) all end here."""
    if handle == client.handle:
        broker.clients.remove(handle)
    else:
        drop_objects(client.remove(handle))


def rm_map(ctx: CallContext) -> Steps:
    """RM_MAP_MEMORY: the mapping context is created on the file named by the fd field."""
    b, s, req, call = ctx.broker, ctx.session, ctx.req, ctx.call
    p = call.value.params
    where = "RM_MAP_MEMORY"
    client = yield from b._client_of(s, p.hClient, where, req)
    for name in ("hDevice", "hMemory"):
        h = getattr(p, name)
        if h not in client.objects:
            raise Refusal(f"{where}: {name}={h:#x} is not in client {p.hClient:#x}",
                          status=nvstatus.NV_ERR_INVALID_OBJECT_HANDLE, what=where)
        b._refuse_revoked(s, client.objects[h].gpu, where)
    fd_files = yield from b._translate_fds(s, req, call.value, ctx.fd_fields, where)
    result = yield from b._call_backend(s, call, fd_files=fd_files, req=req)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def rm_alloc_memory(ctx: CallContext) -> Steps:
    """NV_ESC_RM_ALLOC_MEMORY (NVOS02): the older memory allocator. Same class allowlist
    and quota as RM_ALLOC: the size is limit + 1."""
    b, s, abi, req, call = ctx.broker, ctx.session, ctx.abi, ctx.req, ctx.call
    p = call.value.params
    where = f"NV_ESC_RM_ALLOC_MEMORY {abi.class_name(p.hClass)}"
    client = yield from b._client_of(s, p.hRoot, where, req)
    if p.hObjectParent not in client.objects:
        raise Refusal(f"{where}: parent {p.hObjectParent:#x} is not in client {p.hRoot:#x}",
                      status=nvstatus.NV_ERR_INVALID_OBJECT_PARENT, what=where)
    b._refuse_revoked(s, client.objects[p.hObjectParent].gpu, where)
    cls_rule = ctx.rules.class_rule(p.hClass)
    if cls_rule is None or not cls_rule.granted(s.tenant.capabilities()):
        raise Refusal(f"{where} ({p.hClass:#x}): not on the class allowlist",
                      status=nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS, what=where)
    if p.hObjectNew in client.objects:
        raise Refusal(f"{where}: handle {p.hObjectNew:#x} already exists",
                      status=nvstatus.NV_ERR_INSERT_DUPLICATE_NAME, what=where)
    if over := limits.alloc_refusal(s.tenant, root_client=False):
        raise Refusal(over, status=nvstatus.NV_ERR_INSUFFICIENT_RESOURCES, what=where)
    gpu = client.objects[p.hObjectParent].gpu
    charge = int(p.limit) + 1 if cls_rule.charge else 0
    pinned = pinned_check(s.tenant, cls_rule, int(p.limit) + 1, where)
    fd_files = yield from b._translate_fds(s, req, call.value, ctx.fd_fields, where)
    with b._reserved(s, client, p.hClass, p.hObjectParent, gpu, charge, where):
        try:
            result = yield from b._call_backend(s, call, fd_files=fd_files, req=req,
                                                rm_class=p.hClass)
        except RunInCaller:
            book_continued_pinned(b, client, p.hObjectNew, p.hClass, p.hObjectParent, gpu,
                                  pinned)
            raise
    out = abi.decode_ioctl(s.node, req.cmd, result.arg).value.params
    if not result.errno and out.status == nvstatus.NV_OK:
        client.add(out.hObjectNew, p.hClass, p.hObjectParent, gpu=gpu, charged=charge,
                   pinned=pinned)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def rm_dup(ctx: CallContext) -> Steps:
    """NV_ESC_RM_DUP_OBJECT (NVOS55): object hObjectSrc of client hClientSrc gets a new
    handle hObject under hParent of client hClient. The driver lets a client duplicate what
    the object's share policy grants it; the broker allows it only inside the tenant: both
    clients, the source object and the parent must be its own, and a broad share the tenant
    made is given to this one client just before (broker/shares.py). The new
    handle shares the source's charge (objects.share): the memory stays charged until its
    last handle is freed, whichever that is."""
    b, s, abi, req, call = ctx.broker, ctx.session, ctx.abi, ctx.req, ctx.call
    v = call.value
    where = "RM_DUP_OBJECT"
    b.check_clients(s, v, where=where)
    dst = yield from b._client_of(s, v.hClient, where, req)
    src = b._client(s, v.hClientSrc, where)
    if v.hParent not in dst.objects:
        raise Refusal(f"{where}: parent {v.hParent:#x} is not in client {v.hClient:#x}",
                      status=nvstatus.NV_ERR_INVALID_OBJECT_PARENT, what=where)
    obj = src.objects.get(v.hObjectSrc)
    unknown = (obj is None and v.hObjectSrc != v.hClientSrc
               and getattr(s.file, "runs_in_caller", False))
    if (obj is None and not unknown) or v.hObjectSrc == v.hClientSrc:
        raise Refusal(f"{where}: object {v.hObjectSrc:#x} is not an object of client "
                      f"{v.hClientSrc:#x}", status=nvstatus.NV_ERR_INVALID_OBJECT_HANDLE,
                      what=where)
    # With files that live in the tenant, its clients hold objects made by calls the
    # kernel continued (system memory, OS descriptors: no video memory, nothing charged),
    # which the books never saw; the source client is the tenant's, so the driver, which
    # resolves the handle in that client, is the one to validate it.
    if obj is not None:
        b._refuse_revoked(s, obj.gpu, where)
    b._refuse_revoked(s, dst.objects[v.hParent].gpu, where)
    if v.hObject and v.hObject in dst.objects:
        raise Refusal(f"{where}: handle {v.hObject:#x} already exists",
                      status=nvstatus.NV_ERR_INSERT_DUPLICATE_NAME, what=where)
    if obj is not None and obj.tenant_share & shares.ACCESS_DUP_OBJECT and src is not dst:
        # A broad share the broker kept inside the tenant (rm_share): now, for this client
        # of the tenant's only. (A failure leaves the duplicate to the driver's own check.)
        st = yield from shares.grant_for_dup(b, s, req, src, v.hObjectSrc, v.hClient)
        if st != nvstatus.NV_OK:
            b.audit.write("error", tenant=s.tenant.name, pid=s.caller.pid, what=where,
                          reason=f"{where}: the share of object {v.hObjectSrc:#x} with client "
                                 f"{v.hClient:#x} was not granted "
                                 f"({'no file' if st is None else nvstatus.name(st)})")
    result = yield from b._call_backend(s, call, req=req)
    out = abi.decode_ioctl(s.node, req.cmd, result.arg).value
    if not result.errno and out.status == nvstatus.NV_OK and out.hObject:
        if obj is not None:
            share(obj, dst.add(out.hObject, obj.rm_class, v.hParent, gpu=obj.gpu))
        else:  # class unknown to the books (see above); no charge to share
            dst.add(out.hObject, UNKNOWN_CLASS, v.hParent)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


# Controls whose parameters name one of the caller's nvidiactl files by fd (`fd`): objects
# exported into that file's slots and imported from them by another process of the tenant
# (cuMemExportToShareableHandle with POSIX fds: NCCL, CUDA IPC). The driver looks the
# fd up in the calling process (nv_get_file_private), so the broker passes its own duplicate.
EXPORT_OBJECTS_TO_FD = 0x3D0B  # NV0000_CTRL_CMD_OS_UNIX_EXPORT_OBJECTS_TO_FD
IMPORT_OBJECTS_FROM_FD = 0x3D0C  # NV0000_CTRL_CMD_OS_UNIX_IMPORT_OBJECTS_FROM_FD
GET_EXPORT_OBJECT_INFO = 0x3D08  # NV0000_CTRL_CMD_OS_UNIX_GET_EXPORT_OBJECT_INFO


def export_holder_handle(sid: int) -> int:
    """The books' stand-in for the driver's export slots of one ctl file: a client handle no
    driver handle can equal (driver handles are u32)."""
    return -1 - sid


def object_fd_control(ctx: CallContext, ctl: ControlCall) -> Steps:
    """EXPORT_OBJECTS_TO_FD / IMPORT_OBJECTS_FROM_FD / GET_EXPORT_OBJECT_INFO.

    The fd must be one of this tenant's nvidiactl files (so the slots hold only this
    tenant's objects and only its processes import them). The driver's export keeps the
    memory alive in its own internal client until the export file is closed or the slot
    is overwritten, whatever the exporter frees: the books give each filled slot a handle
    in a holder client owned by the export file's session, sharing the object's charge
    (objects.share), so the quota counts the memory until the driver lets it go. An
    import gives the importer a handle that shares the slot's charge, like RM_DUP_OBJECT.
    """
    b, s, abi, req, call = ctx.broker, ctx.session, ctx.abi, ctx.req, ctx.call
    client, params, ref, where = ctl.client, ctl.params, ctl.ref, ctl.where
    v = call.value
    tenant_fd = int(params.fd)
    sid = None
    if tenant_fd >= 0 and req.resolve_fd is not None:
        sid = yield ResolveFd(req.resolve_fd, tenant_fd)
    target = b.sessions.get(sid) if sid is not None else None
    if (target is None or target.closed or target.tenant is not s.tenant
            or target.node is not NodeKind.CTL):
        raise Refusal(f"{where}: fd {tenant_fd} is not one of the tenant's nvidiactl "
                      "files", status=nvstatus.NV_ERR_INVALID_PARAMETER, what=where)
    in_caller = getattr(s.file, "runs_in_caller", False)
    if b.backend.tenant_files and not in_caller:
        # Relayed real files (FUSE front end): the relay has no file the tenant's fd
        # could be translated to.
        raise Refusal(f"{where}: exporting objects through an fd needs the seccomp front "
                      "end (driver files in the tenant)",
                      status=nvstatus.NV_ERR_NOT_SUPPORTED, what=where)
    holder = s.tenant.clients.get(export_holder_handle(target.id))
    if v.cmd == EXPORT_OBJECTS_TO_FD:
        n = int(params.numObjects)
        for h in list(params.objects)[:n]:
            if h and h not in client.objects and not in_caller:
                raise Refusal(f"{where}: object {h:#x} is not in client {v.hClient:#x}",
                              status=nvstatus.NV_ERR_INVALID_OBJECT_HANDLE, what=where)
            if h and h in client.objects:
                b._refuse_revoked(s, client.objects[h].gpu, where)
    elif v.cmd == IMPORT_OBJECTS_FROM_FD:
        if params.hParent not in client.objects:
            raise Refusal(f"{where}: parent {params.hParent:#x} is not in client "
                          f"{v.hClient:#x}", status=nvstatus.NV_ERR_INVALID_OBJECT_PARENT,
                          what=where)
        b._refuse_revoked(s, client.objects[params.hParent].gpu, where)
        for h in list(params.objects)[:int(params.numObjects)]:
            if h and h in client.objects:
                raise Refusal(f"{where}: handle {h:#x} already exists",
                              status=nvstatus.NV_ERR_INSERT_DUPLICATE_NAME, what=where)
    fd_offset = ref.spec.by_name["fd"].offset
    result = yield from b._call_backend(
        s, call, params.encode(), fd_files={"params.fd": target.file}, req=req,
        nested_fds={fd_offset: (tenant_fd, target.file)})
    out_value = abi.decode_ioctl(s.node, req.cmd, result.arg).value
    ok = not result.errno and out_value.status == nvstatus.NV_OK
    if ok and result.nested is not None:
        out = ref.spec.decode(result.nested)
        if v.cmd == EXPORT_OBJECTS_TO_FD:
            if holder is None:
                h = export_holder_handle(target.id)
                holder = b.clients.new(target, h)
            base = int(params.index)
            for i, h in enumerate(list(params.objects)[:int(params.numObjects)]):
                slot = base + i + 1  # (0 would be the holder's own handle)
                drop_objects(holder.remove(slot))  # a slot written again lets go
                obj = client.objects.get(h) if h else None
                if obj is not None:
                    share(obj, holder.add(slot, obj.rm_class, holder.handle, gpu=obj.gpu))
                elif h:
                    holder.add(slot, UNKNOWN_CLASS, holder.handle)
        elif v.cmd == IMPORT_OBJECTS_FROM_FD:
            base = int(params.index)
            for i, h in enumerate(list(out.objects)[:int(params.numObjects)]):
                if not h:
                    continue
                src = holder.objects.get(base + i + 1) if holder is not None else None
                if src is not None and src.rm_class != UNKNOWN_CLASS:
                    share(src, client.add(h, src.rm_class, params.hParent, gpu=src.gpu))
                else:
                    client.add(h, UNKNOWN_CLASS, params.hParent)
        out = out.replace(fd=tenant_fd)  # the tenant sees its own fd number again
        yield from b._mem_write(s, req, ref.ptr, out.encode())
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def rm_share(ctx: CallContext) -> Steps:
    """NV_ESC_RM_SHARE (NVOS57): the share policy of one of the tenant's own objects, kept
    inside the tenant (broker/shares.py): a grant to every client, or to every client of the
    same user, is kept in the broker's books and answered NV_OK without the driver; one to a
    client not the tenant's is refused; the rest reach the driver as sent."""
    b, s, req, call = ctx.broker, ctx.session, ctx.req, ctx.call
    v = call.value
    where = call.name
    client = b._client(s, v.hClient, where)
    obj = client.objects.get(v.hObject)
    if obj is None and not getattr(s.file, "runs_in_caller", False):
        raise Refusal(f"{where}: object {v.hObject:#x} is not in client {v.hClient:#x}",
                      status=nvstatus.NV_ERR_INVALID_OBJECT_HANDLE, what=where)
    if obj is not None:
        b._refuse_revoked(s, obj.gpu, where)
    verdict = shares.judge_for(b, s, v.sharePolicy)
    if verdict.action == "refuse":
        raise Refusal(f"{where}: {verdict.why}: a share policy may not reach beyond the tenant",
                      status=nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS, what=where)
    if verdict.action == "confine":
        if obj is None:  # (made by a call the kernel continued: no books to keep it in)
            raise Refusal(f"{where}: {verdict.why} of object {v.hObject:#x}, which the "
                          "broker's books do not hold: a share policy may not reach beyond "
                          "the tenant", status=nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS,
                          what=where)
        if not obj.tenant_share:
            b.audit.write("notice", tenant=s.tenant.name, pid=s.caller.pid, node=s.node_name,
                          message=f"{where}: {verdict.why} of object {v.hObject:#x} kept "
                                  "inside the tenant: granted to the tenant's own client "
                                  "that duplicates it, never passed to the driver")
        obj.tenant_share |= shares.access_mask(v.sharePolicy)
        return b._status_reply(ctx.abi, call, nvstatus.NV_OK)
    result = yield from b._call_backend(s, call, req=req)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def attach_gpus(ctx: CallContext) -> Steps:
    """NV_ESC_ATTACH_GPUS_TO_FD: the ctl file holds the GPUs it names open (CUDA does it
    for the GPUs a process uses). Only the tenant's own GPU ids, else EINVAL as the
    driver answers an id it does not know. Zero entries are skipped, as by the driver
    (CUDA sends a fixed-size array padded with zeros)."""
    b, s, req, call = ctx.broker, ctx.session, ctx.req, ctx.call
    mine = set(rewrite.tenant_gpu_ids(b, s))
    for e in call.value.entries:
        if e.value and e.value not in mine:  # (the driver skips zero entries)
            raise Refusal(f"{call.name}: GPU id {e.value:#x} is not one of the tenant's",
                          errno_=errno.EINVAL, what=call.name)
    result = yield from b._call_backend(s, call, req=req)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def rm_objects(ctx: CallContext) -> Steps:
    """Escapes naming a client and objects in it (UNMAP, DUP within the tenant, …)."""
    b, s, req, call = ctx.broker, ctx.session, ctx.req, ctx.call
    b.check_clients(s, call.value, where=call.name)
    inner = getattr(call.value, "params", None)
    if inner is not None:
        b.check_clients(s, inner, where=call.name)
    fd_files = yield from b._translate_fds(s, req, call.value, ctx.fd_fields, call.name)
    result = yield from b._call_backend(s, call, fd_files=fd_files, req=req)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def uvm(ctx: CallContext) -> Steps:
    b, s, req, call = ctx.broker, ctx.session, ctx.req, ctx.call
    # hClient 0: UVM registers the GPU without an RM client of the caller's (CUDA 13).
    b.check_clients(s, call.value, where=call.name, zero_ok=True)
    fd_files = yield from b._translate_fds(s, req, call.value, ctx.fd_fields, call.name)
    result = yield from b._call_backend(s, call, fd_files=fd_files, req=req)
    return IoctlReply(result=result.result, arg_out=result.arg, errno=result.errno)


def embedded_buffers(abi, params) -> list[tuple[str, int]]:
    """(pointer field, byte size) of each non-NULL embedded buffer the ABI marks in params."""
    out = []
    for f in params.spec.fields:
        if f.kind != "ptr" or not f.size_field or not isinstance(f.points_to, str):
            continue
        if f.points_to in ("control", "class", "xfer"):
            continue  # first-level nested buffers: handled by DriverABI.nested
        if getattr(params, f.name) == 0:
            continue
        count = int(getattr(params, f.size_field))
        elem = 1 if f.points_to == "bytes" else abi.struct(f.points_to).size
        out.append((f.name, count * elem))
    return out


def _cstr(b: bytes) -> str:
    return bytes(b).split(b"\0", 1)[0].decode("ascii", "replace")


def pinned_charge(params: Any) -> int:
    """Host memory a system-memory (NV_MEMORY_ALLOCATION_PARAMS: size) or OS-descriptor
    (NV_OS_DESC_MEMORY_ALLOCATION_PARAMS: limit, the last byte) allocation pins."""
    if params is None:
        return 0
    names = params.spec.by_name
    if "size" in names:
        return int(params.size)
    if "limit" in names:
        return int(params.limit) + 1
    return 0


def pinned_check(tenant: Any, cls_rule: Any, size: int, where: str) -> int:
    """The bytes a pinned class's allocation adds to the tenant's pinned host memory (0
    for any other class); beyond its pinned_host_memory, refused as the driver answers an
    allocation it cannot back (NV_ERR_NO_MEMORY: CUDA's out-of-memory)."""
    if not cls_rule.pinned or size <= 0:
        return 0
    held, limit = tenant.pinned(), tenant.pinned_limit()
    if held + size > limit:
        raise Refusal(f"{where}: {size} bytes of pinned host memory would exceed the "
                      f"tenant's pinned_host_memory ({held} of {limit} held)",
                      status=nvstatus.NV_ERR_NO_MEMORY, what=where)
    return size


def book_continued_pinned(b: Any, client: RmClient, handle: int, cls: int, parent: int,
                          gpu: int | None, pinned: int) -> None:
    """A pinned allocation the kernel runs in the tenant (its answer unseen): booked now,
    with the handle the tenant chose, so its pinned bytes count until it is freed (RM_FREE
    or its client's end drop it from the books). A call the driver then fails is counted
    until its client goes: the safe side."""
    if pinned and parent in client.objects:
        client.add(handle or -next(b._ids), cls, parent, gpu=gpu, pinned=pinned)


def _alloc_charge(params: Any) -> int:
    """Device memory a class-0x40 allocation takes from the card, as the driver sizes it
    (abi/vidmem.py: size rounded up to the page size; alignment costs nothing)."""
    return vidmem.charged(params)
