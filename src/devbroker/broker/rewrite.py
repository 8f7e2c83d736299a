"""What the tenant sees: rewrites of driver answers, as tables keyed by command.

The same rewrites run over the emulated and the real backend, so CI exercises the code that
hides the physical GPU on real hardware. The rows of rules.py name these functions: each
takes one context (a ControlContext for controls, the handlers.CallContext for escapes:
both carry .broker, .session and .abi) and a decoded StructValue, and returns the value to
hand on; a pre-hook may refuse by raising Refusal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from devbroker.abi import status as nvs
from devbroker.abi.driver import DriverABI
from devbroker.broker.procinfo import pid_in_own_namespace, pid_namespace
from devbroker.broker.refusal import Refusal

if TYPE_CHECKING:  # (core imports this module: names for annotations only)
    from devbroker.broker.core import Broker, Session

INVALID_GPU_ID = 0xFFFFFFFF
ATTACH_ALL_PROBED = 0x0000FFFF  # NV0000_CTRL_GPU_ATTACH_ALL_PROBED_IDS
KiB = 1024


@dataclass(frozen=True)
class ControlContext:
    """What a control's rewrite hook may look at besides the parameters."""
    broker: Broker
    session: Session  # of the call
    abi: DriverABI  # the caller's
    cmd: int
    params_in: Any  # the parameters as sent (after the pre-hook), None when there are none
    gpu: int | None  # the GPU of the object the control was sent to
    client: Any = None  # objects.RmClient the control was sent through
    handle: int = 0  # the object (hObject) the control was sent to


def tenant_gpu_ids(broker, s) -> list[int]:
    gpus = broker.backend.gpus()
    return [gpus[i].gpu_id for i in s.tenant.gpus if i < len(gpus)]


def gpu_index_for_id(broker, gpu_id: int) -> int | None:
    for g in broker.backend.gpus():
        if g.gpu_id == gpu_id:
            return g.index
    return None


# --------------------------------------------------------------------------- escapes
def card_info(ctx, value):
    """NV_ESC_CARD_INFO: entries of GPUs that are not the tenant's read as empty slots.

    On the table's bytes (32 entries of 64 bytes; decoding each into values cost ~130 µs per
    call, and NVML sends it twice per init)."""
    gpus = ctx.session.tenant.gpus
    f = value.spec.by_name["entries"]
    e = f.elem.by_name
    es = f.elem.size
    valid, minor = e["valid"].offset, e["minor_number"].offset
    bars = (e["reg_address"].offset, e["fb_address"].offset)
    table = bytearray(value.raw_field("entries"))
    for base in range(0, f.count * es, es):
        if not table[base + valid]:
            continue
        if int.from_bytes(table[base + minor:base + minor + 4], "little") not in gpus:
            table[base:base + es] = bytes(es)
        else:
            # Physical BAR addresses are of no use to a tenant and help an attacker.
            for off in bars:
                table[base + off:base + off + 8] = bytes(8)
    return value.replace(entries=bytes(table))


# --------------------------------------------------------------------------- controls: pre
def restrict_attach_ids(ctx, params):
    broker, s = ctx.broker, ctx.session
    mine = tenant_gpu_ids(broker, s)
    ids = list(params.gpuIds)
    # The driver reads the list only up to the first
    # INVALID_GPU_ID (client_resource.c, cliresCtrlCmdGpuAttachIds/DetachIds); NVML 535
    # leaves the entries after it uninitialised (zeros), which must not be judged.
    if INVALID_GPU_ID in ids:
        ids = ids[: ids.index(INVALID_GPU_ID)] + [INVALID_GPU_ID] * (len(ids) - ids.index(INVALID_GPU_ID))
    if ATTACH_ALL_PROBED in ids:
        # "all probed GPUs" means all of the tenant's GPUs, never the host's.
        ids = mine + [INVALID_GPU_ID] * (len(ids) - len(mine))
        return params.replace(gpuIds=ids)
    for i in ids:
        if i != INVALID_GPU_ID and i not in mine:
            raise Refusal(f"attach/detach of GPU id {i:#x}, not one of the tenant's",
                           status=nvs.NV_ERR_INSUFFICIENT_PERMISSIONS, what="ATTACH/DETACH")
    return params


@dataclass(frozen=True)
class IdListCheck:
    """A pre-hook as data: restrict_attach_ids' check, in a form a front end may repeat
    on its private copy with the tenant's GPU ids of the policy epoch (native/lane.c
    settled_list_check): the u32 list at `ids_offset` (`count` entries), read up to its
    first INVALID_GPU_ID, holds only the tenant's ids and not ATTACH_ALL_PROBED (which the
    hook rewrites: that call is the broker's). A list that passes is left as sent, as the
    hook leaves it; one that does not goes to the broker, which refuses or rewrites it."""
    ids_offset: int
    count: int


def id_list_check(spec) -> IdListCheck | None:
    """ATTACH_IDS' and DETACH_IDS' IdListCheck: a top-level u32 list `gpuIds` and no other
    GPU id in the layout; None else."""
    f = spec.by_name.get("gpuIds")
    if f is None or f.kind != "array" or not f.count or f.size != 4 * f.count:
        return None
    if any(g.name in GPU_ID_FIELD_NAMES and g is not f for _p, g, _o in spec.walk()):
        return None
    return IdListCheck(f.offset, f.count)


def pid_info_to_host(ctx, params):
    """GET_PID_INFO names pids: the tenant's own processes only.

    The pids come from GET_PIDS, which hands them out in the
    caller's pid namespace (gpu_pids below): translate them back to the broker's numbering
    here (and forward again in pid_info_to_tenant), else NVML's process list is refused."""
    s = ctx.session
    view = _tenant_pids_in_callers_ns(s)  # broker pid -> pid as the caller sees it
    to_host = {ns: host for host, ns in view.items()}
    n = getattr(params, "pidInfoListCount", 0)
    entries = list(params.pidInfoList)
    for i, e in enumerate(entries[:n]):
        if e.pid not in to_host:
            raise Refusal(f"GET_PID_INFO for pid {e.pid}, not the tenant's",
                           status=nvs.NV_ERR_INSUFFICIENT_PERMISSIONS, what="GET_PID_INFO")
        entries[i] = e.replace(pid=to_host[e.pid])
    return params.replace(pidInfoList=entries)


def _tenant_pids_in_callers_ns(s) -> dict[int, int]:
    """The tenant's processes that live in the caller's pid
    namespace, as {broker pid: pid in that namespace}. Processes of another `devbroker
    exec` (another pid namespace) are not visible to the caller, as with containers."""
    caller_ns = pid_namespace(s.caller.pid)
    out = {}
    for pid in s.tenant.tgids():
        if caller_ns is not None and pid_namespace(pid) != caller_ns:
            continue
        out[pid] = pid_in_own_namespace(pid)
    return out


# --------------------------------------------------------------------------- GPU ids
# Which parameters name a GPU is decided here, once, from the ABI's field
# names, for every control (not by a hook per control: 0x13a, 0x288 and 0x289 passed other
# GPUs' ids while GET_PCI_INFO refused them). A field holds a GPU id when its ABI name is
# one of these (scalar or array, at any depth of nested structs):
GPU_ID_FIELD_NAMES = frozenset({"gpuId", "gpuIds", "gpuIdGrpA", "gpuIdGrpB"})
# The sibling field that says how many entries of an array are meant (the driver reads no
# further, and callers leave the rest uninitialised). Arrays without one end at the first
# INVALID_GPU_ID, as the driver reads them (cliresCtrlCmdGpuAttachIds).
GPU_ID_COUNT_FIELDS = {
    "gpuIdGrpA": "grpACount",  # SYSTEM_GET_P2P_CAPS_MATRIX
    "gpuIdGrpB": "grpBCount",
    "gpuIds": "gpuCount",  # SYSTEM_GET_P2P_CAPS, SYNC_GPU_BOOST_GROUP_CONFIG
    "devices": "numDevices",  # GPU_GET_ACTIVE_DEVICE_IDS (array of structs with a gpuId)
}
# Controls whose GPU ids are answers, not requests: what the tenant sent there is not
# read by the driver; the answer is filtered to the tenant's GPUs by the post-hook.
GPU_IDS_ANSWERED = frozenset({
    0x201,  # NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS (attached_ids)
    0x214,  # NV0000_CTRL_CMD_GPU_GET_PROBED_IDS (probed_ids)
    0x288,  # NV0000_CTRL_CMD_GPU_GET_ACTIVE_DEVICE_IDS (active_device_ids)
    # NV0000_CTRL_CMD_SYNC_GPU_BOOST_GROUP_INFO: lists boost groups (none on the hosts this
    # runs on; its answer is not filtered yet, see docs/security.md).
    0xA04,
})


def _names_gpu_ids(spec) -> bool:
    """Whether a struct layout has a GPU-id field at any depth: a fact of the layout,
    computed once per layout, so that most controls (FB_GET_INFO_V2's 128 entries, say)
    are not walked at all."""
    known = _GPU_ID_LAYOUTS.get(spec)
    if known is None:
        known = _GPU_ID_LAYOUTS[spec] = any(
            f.name in GPU_ID_FIELD_NAMES for _path, f, _off in spec.walk())
    return known


_GPU_ID_LAYOUTS: dict = {}  # StructSpec (hashed by identity) -> bool


def gpu_ids_named(params, prefix: str = "") -> list[tuple[str, int]]:
    """(field path, id) of every GPU id the parameters name, by the rules above.
    A pure function of the decoded value (tests/test_tenant_isolation.py checks it over every
    allowed control of every ABI)."""
    out: list[tuple[str, int]] = []
    if not _names_gpu_ids(params.spec):
        return out
    for f in params.spec.fields:
        value = getattr(params, f.name)
        count_field = GPU_ID_COUNT_FIELDS.get(f.name)
        if count_field is not None and count_field in params.spec.by_name:
            n = int(getattr(params, count_field))
        else:
            n = None
        if f.kind == "struct":
            out += gpu_ids_named(value, f"{prefix}{f.name}.")
        elif f.kind == "array" and not isinstance(f.elem, str):  # array of structs
            for i, e in enumerate(value[: len(value) if n is None else n]):
                out += gpu_ids_named(e, f"{prefix}{f.name}[{i}].")
        elif f.name not in GPU_ID_FIELD_NAMES:
            continue
        elif f.kind == "array":
            ids = list(value)
            if n is not None:
                ids = ids[:n]
            elif INVALID_GPU_ID in ids:
                ids = ids[: ids.index(INVALID_GPU_ID)]
            out += [(f"{prefix}{f.name}[{i}]", int(x)) for i, x in enumerate(ids)]
        elif isinstance(value, int):
            out.append((f"{prefix}{f.name}", value))
    return out


def require_own_gpu_ids(broker, s, abi, cmd: int, params) -> None:
    """Refuse a control that names a GPU id not of the tenant's GPUs, with the status the
    driver gives an unknown id (NV_ERR_INVALID_ARGUMENT): to the tenant another GPU is not
    there. Runs after the control's own pre-hook (ATTACH_IDS turns "all probed" into the
    tenant's ids and refuses others itself)."""
    if cmd in GPU_IDS_ANSWERED:
        return
    mine = tenant_gpu_ids(broker, s)
    for path, gpu_id in gpu_ids_named(params):
        if gpu_id not in mine:
            raise Refusal(f"{path}={gpu_id:#x} is not one of the tenant's GPUs",
                           status=nvs.NV_ERR_INVALID_ARGUMENT,
                           what=f"RM_CONTROL {abi.control_name(cmd)}")


# GET_ID_INFO, GET_ID_INFO_V2, GET_PCI_INFO, QUERY_DRAIN_STATE, P2P_CAPS(_MATRIX), ASYNC_ATTACH
# and the rest need no pre-hook: require_own_gpu_ids covers every control.

# Pre-hooks that can also be given as data (IdListCheck) whose values are the tenant's GPU
# ids: hook -> fn(params spec) -> IdListCheck | None.
AS_ID_LIST_CHECK = {restrict_attach_ids: id_list_check}


# --------------------------------------------------------------------------- controls: post
@dataclass(frozen=True)
class IdFilter:
    """A post-hook as data: the GPU-id list of a control's answer keeps, in the driver's
    order, only the tenant's GPU ids, padded with INVALID_GPU_ID — what attached_ids and
    probed_ids do, in a form a front end may apply itself after an NV_OK answer with the
    tenant's GPU ids of the policy epoch (native/lane.c apply_id_filter). `ids_offset`:
    the list (`count` u32 entries); `along_offset`: a list of per-GPU u32 values that move
    with their ids (PROBED_IDS' gpuFlags; emptied slots 0; -1: none); `clear_offset`: a
    list of `count` u32 that reads all INVALID_GPU_ID (PROBED_IDS' excludedGpuIds; -1:
    none)."""
    ids_offset: int
    count: int
    along_offset: int = -1
    clear_offset: int = -1

    def apply_block(self, params: bytearray, keep) -> None:
        n = self.count
        ids = [int.from_bytes(params[self.ids_offset + 4 * i:self.ids_offset + 4 * i + 4],
                              "little") for i in range(n)]
        along = ([int.from_bytes(params[self.along_offset + 4 * i:self.along_offset + 4 * i + 4],
                                 "little") for i in range(n)] if self.along_offset >= 0 else None)
        kept = [i for i in range(n) if ids[i] in keep]
        new_ids = [ids[i] for i in kept] + [INVALID_GPU_ID] * (n - len(kept))
        params[self.ids_offset:self.ids_offset + 4 * n] = b"".join(
            v.to_bytes(4, "little") for v in new_ids)
        if along is not None:
            new_along = [along[i] for i in kept] + [0] * (n - len(kept))
            params[self.along_offset:self.along_offset + 4 * n] = b"".join(
                v.to_bytes(4, "little") for v in new_along)
        if self.clear_offset >= 0:
            params[self.clear_offset:self.clear_offset + 4 * n] = \
                INVALID_GPU_ID.to_bytes(4, "little") * n


def _id_filter(spec, along: str | None = None, clear: str | None = None) -> IdFilter | None:
    """The IdFilter of a layout whose `gpuIds` is a list of u32 (and whose `along` and
    `clear` lists, where it has them, are u32 lists of the same length); None else."""
    f = spec.by_name.get("gpuIds")
    if f is None or f.kind != "array" or not f.count or f.size != 4 * f.count:
        return None
    offs = []
    for name in (along, clear):
        g = spec.by_name.get(name) if name else None
        if g is not None and (g.kind != "array" or g.count != f.count or g.size != f.size):
            return None
        offs.append(g.offset if g is not None else -1)
    return IdFilter(f.offset, f.count, *offs)


def _filter_ids(ctx, out, flt: IdFilter | None):
    if flt is None:  # (a layout without a u32 id list: nothing this hook knows to filter)
        return out
    block = bytearray(out.encode())
    flt.apply_block(block, set(tenant_gpu_ids(ctx.broker, ctx.session)))
    return out.spec.decode(bytes(block))


def attached_ids_filter(spec) -> IdFilter | None:
    return _id_filter(spec)


def probed_ids_filter(spec) -> IdFilter | None:
    return _id_filter(spec, along="gpuFlags", clear="excludedGpuIds")


def attached_ids(ctx, out):
    return _filter_ids(ctx, out, attached_ids_filter(out.spec))


def probed_ids(ctx, out):
    """GET_PROBED_IDS: the tenant's GPUs only; their flags (580: gpuFlags, one per id) move
    with them; no GPU is listed as excluded."""
    return _filter_ids(ctx, out, probed_ids_filter(out.spec))


# Post-hooks that can also be given as data (IdFilter) whose values are the tenant's GPU
# ids: hook -> fn(params spec) -> IdFilter | None.
AS_ID_FILTER = {attached_ids: attached_ids_filter, probed_ids: probed_ids_filter}


# NV2080_CTRL_FB_INFO_INDEX_* whose value is a size of device memory (KiB), and what the
# tenant sees instead: its quota as the card, its own use as the only use.
_FB_TOTAL = {0x07, 0x08, 0x09, 0x0A, 0x20}  # RAM_SIZE, TOTAL_RAM_SIZE, HEAP_SIZE,
#                                              MAPPABLE_HEAP_SIZE, USABLE_RAM_SIZE
_FB_FREE = {0x12, 0x16}  # LARGEST_FREE_REGION_SIZE_KB, HEAP_FREE
_FB_ZERO = {0x10, 0x27}  # FB_TAX_SIZE_KB, HEAP_OFFLINE_SIZE (reserved memory: none visible)


@dataclass(frozen=True)
class TablePatch:
    """A post-hook as data: in the parameter block's table of (index, data) entries, the
    first `count` entries (a u32 field at `count_offset`, bounded by `capacity`) whose index
    is in `values` get that value as data (u32). What fb_info does, in a form a front end
    may apply itself after the driver answered NV_OK (native/lane.c apply_patch; fb_info
    below applies it to the table's bytes)."""
    table_offset: int
    entry_size: int
    index_offset: int
    data_offset: int
    capacity: int
    count_offset: int
    values: tuple[tuple[int, int], ...]  # (index, value)

    def apply_block(self, params: bytearray) -> bool:
        """Patch a whole parameter block in place (what native/lane.c's apply_patch does):
        the count read from the block, bounded by the table's capacity."""
        count = int.from_bytes(params[self.count_offset:self.count_offset + 4], "little")
        end = self.table_offset + self.capacity * self.entry_size
        table = bytearray(params[self.table_offset:end])
        if not self.apply_table(table, count):
            return False
        params[self.table_offset:end] = table
        return True

    def apply_table(self, table: bytearray, count: int) -> bool:
        """Patch the table's own bytes, `count` entries asked for."""
        values = dict(self.values)
        changed = False
        for i in range(min(count, self.capacity)):
            base = i * self.entry_size
            index = int.from_bytes(table[base + self.index_offset:base + self.index_offset + 4],
                                   "little")
            new = values.get(index)
            if new is not None:
                at = base + self.data_offset
                table[at:at + 4] = new.to_bytes(4, "little")
                changed = True
        return changed


def fb_info_patch(session, gpu, spec) -> TablePatch | None:
    """fb_info's rewrite for this session's tenant and GPU, as a TablePatch of the
    parameter layout `spec` (None: no GPU, nothing to rewrite). The tenant sees its quota
    as the card's memory and its own use as the only use."""
    if gpu is None:
        return None
    quota = session.tenant.quota(gpu)
    used = session.tenant.used().get(gpu, 0)
    total_kib = min(quota // KiB, 0xFFFFFFFF)
    free_kib = min(max(0, quota - used) // KiB, 0xFFFFFFFF)
    layout = _FB_LAYOUTS.get(id(spec))
    if layout is None:  # the specs live as long as the ABI tables: one layout per spec
        f = spec.by_name["fbInfoList"]
        elem = f.elem.by_name
        layout = _FB_LAYOUTS[id(spec)] = (
            f.offset, f.size // f.count, elem["index"].offset, elem["data"].offset, f.count,
            spec.by_name["fbInfoListSize"].offset, spec)
    key = (id(spec), total_kib, free_kib)
    patch = _FB_PATCHES.get(key)
    if patch is None:  # (one object per layout and values: a front end compares by identity)
        values = tuple([(i, total_kib) for i in sorted(_FB_TOTAL)]
                       + [(i, free_kib) for i in sorted(_FB_FREE)]
                       + [(i, 0) for i in sorted(_FB_ZERO)])
        if len(_FB_PATCHES) >= 256:
            _FB_PATCHES.clear()
        patch = _FB_PATCHES[key] = TablePatch(*layout[:6], values)
    return patch


_FB_LAYOUTS: dict[int, tuple] = {}
_FB_PATCHES: dict[tuple, TablePatch] = {}


def fb_info(ctx, out):
    # Only the entries the caller asked for (fbInfoListSize, bounded by the array): the
    # driver leaves the rest as sent. Patched in the block's bytes (one control NVML and
    # CUDA send often: no value per entry).
    patch = fb_info_patch(ctx.session, ctx.gpu, out.spec)
    if patch is None:
        return out
    table = bytearray(out.raw_field("fbInfoList"))
    return out.replace(fbInfoList=bytes(table)) if patch.apply_table(table, out.fbInfoListSize) \
        else out


# Post-hooks that can also be given as data (TablePatch) computed before the driver call:
# hook -> fn(session, gpu, params spec) -> TablePatch | None.
AS_TABLE_PATCH = {fb_info: fb_info_patch}


def gpu_pids(ctx, out):
    """GET_PIDS: only the tenant's own processes, as its own pid namespace numbers them."""
    broker, s = ctx.broker, ctx.session
    mine = s.tenant.tgids()
    count = out.pidTblCount
    if not broker.backend.reports_tenant_pids:
        # The real driver credits every relayed object to the relay process, so the
        # driver's list says nothing about tenants: answer from the broker's own books
        # (processes of this tenant holding objects on this GPU).
        kept = sorted({c.tgid for c in s.tenant.clients.values()
                       if any(o.gpu == ctx.gpu for o in c.objects.values())})
    else:
        kept = [p for p in list(out.pidTbl)[:count] if p in mine]
    # Only processes in the caller's pid namespace, numbered as the caller sees them:
    # another pid namespace's processes are not visible to the caller, as with containers.
    view = _tenant_pids_in_callers_ns(s)
    kept = [view[p] for p in kept if p in view]
    table = kept + [0] * (len(out.pidTbl) - len(kept))
    return out.replace(pidTblCount=len(kept), pidTbl=table)


def pid_info_to_tenant(ctx, out):
    """GET_PID_INFO's answer names the pids the pre-hook
    translated: give them back in the caller's numbering."""
    s = ctx.session
    view = _tenant_pids_in_callers_ns(s)
    n = out.pidInfoListCount
    entries = list(out.pidInfoList)
    for i, e in enumerate(entries[:n]):
        entries[i] = e.replace(pid=view.get(e.pid, 0))
    return out.replace(pidInfoList=entries)


def active_device_ids(ctx, out):
    """GET_ACTIVE_DEVICE_IDS: only the tenant's GPUs are listed."""
    broker, s = ctx.broker, ctx.session
    mine = tenant_gpu_ids(broker, s)
    n = out.numDevices
    kept = [d for d in list(out.devices)[:n] if d.gpuId in mine]
    empty = out.devices[0].spec.decode(bytes(out.devices[0].spec.size))
    return out.replace(numDevices=len(kept),
                       devices=kept + [empty] * (len(out.devices) - len(kept)))


# NV0000_CTRL_GPU_ID_INFO_IN_USE (bit 0 of gpuFlags): the driver sets it when any client on
# the host holds a device object of the GPU. On a shared GPU that tells a tenant whether
# another tenant is using it: it is rewritten to what the tenant alone
# would see, i.e. whether the tenant itself holds a device object of that GPU.
GPU_ID_INFO_IN_USE = 0x1


def id_info_in_use(ctx, out):
    broker, s = ctx.broker, ctx.session
    index = gpu_index_for_id(broker, out.gpuId)
    # O(the tenant's clients): each keeps a count of its device objects per GPU.
    mine = index is not None and any(c.holds_device(index) for c in s.tenant.clients.values())
    flags = (out.gpuFlags & ~GPU_ID_INFO_IN_USE) | (GPU_ID_INFO_IN_USE if mine else 0)
    return out.replace(gpuFlags=flags)


def device_gpu_ids(broker, tenant) -> list[int]:
    """The GPU ids of the tenant's GPUs it holds a device object of: what id_info_in_use
    sets IN_USE for (read under STATE_LOCK, with objects.BOOKS.devices_now())."""
    clients = tenant.clients.values()
    return [g.gpu_id for g in broker.backend.gpus()
            if any(c.holds_device(g.index) for c in clients)]


@dataclass(frozen=True)
class IdFlag:
    """A post-hook as data: after an NV_OK answer, the u32 at `flags_offset` has `bit` set
    exactly when the u32 at `id_offset` (the answer's GPU id) is one the tenant holds a
    device object of, and cleared otherwise — what id_info_in_use does, in a form a front
    end may apply itself with the list `device_gpu_ids` gave as of the books' devices epoch
    (native/lane.c apply_id_flag)."""
    flags_offset: int
    id_offset: int
    bit: int = GPU_ID_INFO_IN_USE

    def apply_block(self, params: bytearray, held) -> None:
        o, i = self.flags_offset, self.id_offset
        flags = int.from_bytes(params[o:o + 4], "little")
        gpu_id = int.from_bytes(params[i:i + 4], "little")
        flags = (flags & ~self.bit) | (self.bit if gpu_id in held else 0)
        params[o:o + 4] = flags.to_bytes(4, "little")


def id_info_flag(spec) -> IdFlag | None:
    """GET_ID_INFO(_V2)'s IdFlag: a top-level u32 `gpuFlags` and `gpuId`; None else."""
    flags, gpu_id = spec.by_name.get("gpuFlags"), spec.by_name.get("gpuId")
    if flags is None or gpu_id is None or flags.size != 4 or gpu_id.size != 4 \
            or flags.kind not in ("u32", "i32") or gpu_id.kind not in ("u32", "i32"):
        return None
    return IdFlag(flags.offset, gpu_id.offset)


# Post-hooks that can also be given as data (IdFlag) whose values are the GPU ids the
# tenant holds a device of: hook -> fn(params spec) -> IdFlag | None.
AS_ID_FLAG = {id_info_in_use: id_info_flag}


def nvlink_caps(ctx, out):
    """NVLINK_GET_NVLINK_CAPS for a tenant that does not have every GPU of the host: no
    NVLink at all. Seen on the two-H200 host: with the links shown, NVML and CUDA
    in a one-GPU tenant went on to open the peer across them (a device object on a GPU that
    is not the tenant's: refused) and failed to start. A tenant with all the GPUs sees the
    driver's answer."""
    broker, s = ctx.broker, ctx.session
    if set(s.tenant.gpus) >= set(range(len(broker.backend.gpus()))):
        return out
    zero = {f.name: bytes(f.size) for f in out.spec.fields
            if f.name in ("discoveredLinks", "enabledLinks")}
    return out.replace(capsTbl=0, discoveredLinkMask=0, enabledLinkMask=0, **zero)
