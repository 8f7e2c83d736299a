"""Compute shares: each tenant's GPU time share and priority, enforced with the driver's own
scheduling controls on the tenant's channel groups (the driver facts behind every
number here, with the source lines they were read in: docs/compute-shares.md).

The host scheduler runs each runlist round robin over its channel groups (TSGs, class
KEPLER_CHANNEL_GROUP_A 0xa06c) that have work; a group keeps the engine until its timeslice
runs out (or it runs out of work), then it is preempted and the next group runs. Two busy
groups with timeslices 3:1 therefore share the engine 3:1, and a group's *interleave level*
(LOW / MEDIUM / HIGH) says how often it appears in the runlist. Both are per channel group and
settable by an unprivileged client on its own group (NVA06C_CTRL_CMD_SET_TIMESLICE and
SET_INTERLEAVE_LEVEL, RMCTRL_FLAGS_NON_PRIVILEGED). So the broker:

* after every channel group a tenant allocates, sets that group's timeslice and interleave
  level to the tenant's policy values, on the tenant's own file and client, before the tenant
  gets the handle back (:func:`after_alloc`, the channel-group row's `after` in rules.py);
* rewrites a tenant's own SET_TIMESLICE / SET_INTERLEAVE_LEVEL to the policy's values, with
  an audit record (:func:`schedule_control`, the rows' pre hook in rules.py). The broker executes
  those controls itself on its private copy of the parameters, so a racing thread cannot
  change the value after the decision;
* on a policy change, sets the new values on every running channel group of every tenant
  (:func:`on_policy_change`), in a background task: without a tenant call in flight the
  broker takes the tenant's file with pidfd_getfd (docs/compute-shares.md, "Applying a
  policy change").

What the values are (:func:`schedule_for`): a tenant's timeslice is its weight's part of
ROUND_US (the weights of the policy's tenants on the GPU add up to one round), and divided
among the
tenant's own channel groups on the same engine (N processes of one tenant must not get N
shares). A low-priority tenant on a GPU shared with a high-priority tenant gets the shortest
slice (a submission of the high tenant waits at most one slice of the low one), and levels
follow priority. Every value is clamped to [MIN_SLICE_US, MAX_SLICE_US].
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from devbroker.abi import status as nvstatus
from devbroker.broker.effects import Blocking, Steps, locked, run_async

log = logging.getLogger("devbroker.compute")

KEPLER_CHANNEL_GROUP_A = 0xA06C
NVA06C_CTRL_CMD_SET_TIMESLICE = 0xA06C0103
NVA06C_CTRL_CMD_GET_TIMESLICE = 0xA06C0104
NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL = 0xA06C0107

# Preemption of low-priority tenants (docs/compute-shares.md, "Preemption"): their channels
# are stopped with the driver's FIFO_DISABLE_CHANNELS, sent to their own subdevice.
NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS = 0x2080110B
CHANNEL_CLASSES = frozenset({0xC86F})  # HOPPER_CHANNEL_GPFIFO_A: the allowlist's channels
SUBDEVICE_CLASS = 0x2080
DEVICE_CLASS = 0x80  # NV01_DEVICE_0

# A channel allocated right under a device runs in a channel group the driver makes for it
# (kernel_channel.c kchannelConstruct_IMPL, tags 535.288.01 and 580.142): allocated under
# the same device with a handle the driver picks for the client (RS_UNIQUE_HANDLE_BASE +
# the client's next index, which only grows: rs_client.c clientGenResourceHandle), freed
# with the channel. The answer does not name it: the driver writes the handle into the
# parameters' hPhysChannelGroup and clears that field again before it returns (with the
# other internal fields). So the broker asks the driver which of the client's picked
# handles is a channel group under that device it does not know yet:
# NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO (NON_PRIVILEGED, no GPU lock) on the tenant's own
# client, from the index after the last group found in that client.
NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO = 0xD02
HANDLE_INFO_PARENT, HANDLE_INFO_CLASSID = 1, 2
UNIQUE_HANDLE_BASE, UNIQUE_HANDLE_RANGE = 0xCAF00000, 0x80000
# Picked handles the client no longer holds (freed objects, never reused) in a row after
# which the search ends, and the most handles one search asks about.
SEARCH_MISSES = 256
SEARCH_MAX = 4096
DISABLE_CHANNELS_MAX = 64  # entries of one call (NV2080_CTRL_FIFO_DISABLE_CHANNELS_MAX_ENTRIES)
# How often the broker looks whether a high-priority tenant still holds channel groups (the
# driver tells nothing when a process exits; the books learn it from the file's release).
PREEMPT_TICK_S = 0.25

# NVA06C_CTRL_INTERLEAVE_LEVEL_{LOW,MEDIUM,HIGH} (ctrla06c.h); a new group is MEDIUM
# (kernel_channel_group_api.c, "Default interleave level").
INTERLEAVE_LOW, INTERLEAVE_MEDIUM, INTERLEAVE_HIGH = 0, 1, 2
LEVEL_NAMES = {INTERLEAVE_LOW: "LOW", INTERLEAVE_MEDIUM: "MEDIUM", INTERLEAVE_HIGH: "HIGH"}
PRIORITY_LEVEL = {"high": INTERLEAVE_HIGH, "normal": INTERLEAVE_MEDIUM, "low": INTERLEAVE_LOW}

# The driver's default timeslice of a new channel group on Volta and later:
# NV_RAMRL_ENTRY_TSG_TIMESLICE_TIMEOUT_128 << NV_RAMRL_ENTRY_TSG_TIMESLICE_SCALE_3 µs
# (kernel_fifo_gv100.c, kfifoChannelGroupGetDefaultTimeslice_GV100).
DRIVER_DEFAULT_TIMESLICE_US = 128 << 3
# One round of a GPU's busy tenants: the sum of their slices, divided by weight. Measured on
# the H200 (docs/compute-shares.md, scripts/gpu/compute_sweep.sh): a switch between two busy
# matmul loops costs ~120 µs of GPU time, so a round of 8 ms keeps the two within ~3-4 % of
# one alone, while slices much longer than the time a process's work runs between its
# synchronizations lose their effect (the group gives the engine up when it runs dry):
# 3:1 slices of 3072:1024 gave 3.18, 6144:2048 2.69, 24576:8192 1.0 for a loop that syncs
# every ~6 ms of work.
ROUND_US = 8192
# The shortest slice the broker sets. The kernel-side driver checks no minimum
# (kfifoRunlistGetMinTimeSlice returns 0) and the H200's GSP accepted 1 µs; short slices
# cost switches (two 128 µs loops with 3:1 slices kept 53 % of one alone).
MIN_SLICE_US = 256
# The longest: the hardware encodes a slice as an 8-bit timeout << 4-bit scale (µs).
MAX_SLICE_US = 64 * 1024
# A low-priority tenant's slice on a GPU where a high-priority tenant runs too.
LOW_PRIORITY_SLICE_US = MIN_SLICE_US


@dataclass(frozen=True)
class Schedule:
    """The driver values for one channel group."""
    timeslice_us: int
    interleave: int | None  # None: left as the driver has it (levels refused to the broker)

    def describe(self) -> str:
        level = ("the driver's" if self.interleave is None
                 else LEVEL_NAMES[self.interleave])
        return f"timeslice {self.timeslice_us} µs, interleave {level}"


@dataclass
class ChannelGroup:
    """A channel group of a tenant's, as the broker scheduled it."""
    tenant: str
    session: int  # the session (file) it was allocated through
    client: int
    handle: int
    gpu: int | None
    engine: int  # engineType of its allocation parameters (one runlist per engine)
    applied: Schedule | None = None  # what the driver last accepted from the broker
    error: str = ""  # the last failure to apply, for status
    asked: set = field(default_factory=set)  # tenant values already audited as rewritten
    rewrites: int = 0
    in_hook: bool = False  # after_alloc is setting it: apply_all leaves it to that
    # The channel the driver made it for (a channel allocated right under the device:
    # driver_group_of); None for a group the tenant allocated itself.
    channel: int | None = None


@dataclass
class _Siblings:
    """A tenant's channel groups on one engine of one GPU (they split its slice), and how
    many of them the driver has at each applied value: all of them want the same value, so
    whether any still differs is one lookup (an allocation costs O(1), not a walk over the
    tenant's groups: a tenant holding a thousand groups made every allocation a quadratic
    walk under the state lock, and other tenants wait on that lock)."""
    groups: dict[tuple[str, int, int], ChannelGroup] = field(default_factory=dict)
    applied: dict[Schedule | None, int] = field(default_factory=dict)

    def count(self, value: Schedule | None, sign: int) -> None:
        n = self.applied.get(value, 0) + sign
        if n:
            self.applied[value] = n
        else:
            self.applied.pop(value, None)

    def all_at(self, value: Schedule | None) -> bool:
        return self.applied.get(value, 0) == len(self.groups)


@dataclass
class _Books:
    groups: dict[tuple[str, int, int], ChannelGroup] = field(default_factory=dict)
    # Indexes of `groups` (kept by _enter/_leave alone): by tenant, and by (tenant, GPU,
    # engine) with the applied values' counts.
    by_tenant: dict[str, dict[tuple[str, int, int], ChannelGroup]] = field(default_factory=dict)
    sets: dict[tuple[str, int | None, int], _Siblings] = field(default_factory=dict)
    discovered: bool = False  # _discover ran once (what a predecessor's tenants hold)
    installed: bool = False
    # One background apply at a time (schedule_apply): `pending` while one is scheduled or
    # runs, `again` when another was asked for meanwhile (it runs once more before it ends:
    # two at once computed a group's value from a sibling count that had moved, and the
    # older one's value could land last — found by tests/test_real_lane.py's channel test)
    pending: bool = False
    again: bool = False
    dirty: set = field(default_factory=set)  # sets of siblings to apply (schedule_apply)
    dirty_all: bool = False  # every group (a policy change)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The driver refused SET_INTERLEAVE_LEVEL to the broker (the H200 does to a caller
    # without CAP_SYS_ADMIN: the control is PRIVILEGED_IF_RS_ACCESS_DISABLED there, and the
    # relay runs without capabilities): priorities are then timeslices alone.
    levels_refused: bool = False
    # Preemption: the channels the broker stopped, by (tenant, GPU): {(client, channel)};
    # the (tenant, GPU) pairs now preempted (for status and the audit); whether the watching
    # task runs; the low tenants' (tenant, GPU) pairs looked at once (the first look lets
    # run whatever a predecessor broker may have left stopped: a live upgrade carries the
    # objects, not these books).
    stopped: dict[tuple[str, int], set[tuple[int, int]]] = field(default_factory=dict)
    preempted: set[tuple[str, int]] = field(default_factory=set)
    watching: bool = False
    seen: set[tuple[str, int]] = field(default_factory=set)  # low (tenant, GPU)s looked at
    # Turns (turns.py): GPU -> the tenant whose turn it is, GPU -> the tenants taking turns,
    # the channels stopped for turns by (tenant, GPU), the (tenant, GPU)s looked at once,
    # whether the turns task runs
    turn: dict[int, str] = field(default_factory=dict)
    turn_members: dict[int, set[str]] = field(default_factory=dict)
    turn_stopped: dict[tuple[str, int], set[tuple[int, int]]] = field(default_factory=dict)
    turn_seen: set[tuple[str, int]] = field(default_factory=set)
    turning: bool = False
    # Called after each channel group's allocation (turns.install: a second tenant on a GPU
    # starts turns). Hooks, not an import: turns.py stands on this module.
    on_new_group: list = field(default_factory=list)


_BOOKS: "weakref.WeakKeyDictionary[Any, _Books]" = weakref.WeakKeyDictionary()


def books(broker: Any) -> _Books:
    b = _BOOKS.get(broker)
    if b is None:
        b = _BOOKS[broker] = _Books()
    return b


def stops_new_channels(broker: Any, tenant: str, gpu: int) -> bool:
    """Whether a channel the tenant allocates on `gpu` now is stopped before it has the
    handle (after_channel_alloc): the tenant is stopped there for a high-priority tenant,
    or it is another tenant's turn (turns.py)."""
    if _in_checkpoint(broker, tenant):
        return False
    return (tenant, gpu) in books(broker).preempted or out_of_turn(broker, tenant, gpu)


def _in_checkpoint(broker: Any, tenant: str) -> bool:
    """Whether the tenant is being checkpointed, is in host memory or is being restored
    (broker/preemption.py). Its channels are not stopped for compute priority then: the
    driver's lock waits for the process's work on them to finish, so a stopped channel
    makes the lock time out (CUDA_ERROR_NOT_READY on the H200), and the restore enables
    them again itself."""
    pre = getattr(broker, "preemption", None)
    return pre is not None and tenant in pre.entries


def never_stops_channels(broker: Any, tenant: Any) -> bool:
    """Whether after_channel_alloc has nothing to do for `tenant`'s channels on any GPU
    until the policy changes: only a low-priority tenant is ever preempted (preempt_all),
    only turns (turns.py, `compute_turns_ms` > 0) stop a tenant otherwise, and neither
    holds anything of it stopped now. A settled allocation of a channel
    (ControlLane._settleable_alloc) rests on this, and a policy change moves the epoch that
    makes it stale."""
    if getattr(tenant.policy, "priority", "normal") == "low" or turns_ms(broker):
        return False
    b = books(broker)
    return (not any(k[0] == tenant.name for k in b.preempted)
            and not any(out_of_turn(broker, tenant.name, gpu) for gpu in list(b.turn)))


def out_of_turn(broker: Any, tenant: str, gpu: int) -> bool:
    """Whether a channel of `tenant` on `gpu` must be stopped now for turns (turns.py):
    another member's turn there."""
    b = books(broker)
    cur = b.turn.get(gpu)
    return cur is not None and cur != tenant and tenant in b.turn_members.get(gpu, ())


# --------------------------------------------------------------------------- values
def _policy_tenants_on(policy: Any, gpu: int | None) -> list[Any]:
    if policy is None:
        return []
    return [t for t in policy.tenants.values() if gpu is None or gpu in t.gpus]


def tenant_slice(policy: Any, tenant: Any, gpu: int | None) -> int:
    """The tenant's whole timeslice on `gpu` (µs), before it is divided among its groups."""
    weight = int(getattr(tenant, "compute_weight", 1))
    sharing = _policy_tenants_on(policy, gpu) or [tenant]
    if tenant.name not in {t.name for t in sharing}:
        sharing = [*sharing, tenant]
    total = sum(int(getattr(t, "compute_weight", 1)) for t in sharing)
    us = ROUND_US * weight // max(total, 1)
    if (getattr(tenant, "priority", "normal") == "low"
            and any(getattr(t, "priority", "normal") == "high" for t in sharing)):
        us = min(us, LOW_PRIORITY_SLICE_US)
    return max(MIN_SLICE_US, min(MAX_SLICE_US, us))


def schedule_for(policy: Any, tenant: Any, gpu: int | None, groups: int = 1) -> Schedule:
    """Driver values for one of `groups` channel groups a tenant holds on one engine of a
    GPU: the tenant's slice divided among them (never more than the policy in all)."""
    us = tenant_slice(policy, tenant, gpu) // max(1, groups)
    return Schedule(max(MIN_SLICE_US, us),
                    PRIORITY_LEVEL.get(getattr(tenant, "priority", "normal"),
                                       INTERLEAVE_MEDIUM))


def share_of(policy: Any, tenant: Any, gpu: int) -> float:
    """The fraction of the GPU's time the tenant gets when every tenant on it is busy."""
    sharing = _policy_tenants_on(policy, gpu) or [tenant]
    slices = {t.name: tenant_slice(policy, t, gpu) for t in sharing}
    slices.setdefault(tenant.name, tenant_slice(policy, tenant, gpu))
    return slices[tenant.name] / sum(slices.values())


# --------------------------------------------------------------------------- books
def _set_key(g: ChannelGroup) -> tuple[str, int | None, int]:
    return (g.tenant, g.gpu, g.engine)


def _enter(broker: Any, g: ChannelGroup, obj: Any = None) -> None:
    """Put a group into the books and their indexes; its object's removal from the broker's
    object books takes it out again (RmObject.watch), so no walk has to find freed groups."""
    b = books(broker)
    key = (g.tenant, g.client, g.handle)
    old = b.groups.get(key)
    if old is not None:
        _leave(b, old)
    b.groups[key] = g
    b.by_tenant.setdefault(g.tenant, {})[key] = g
    sib = b.sets.setdefault(_set_key(g), _Siblings())
    sib.groups[key] = g
    sib.count(g.applied, 1)
    if obj is not None:
        ref = weakref.ref(b)

        def gone(_obj: Any, g: ChannelGroup = g) -> None:
            books_now = ref()
            if books_now is not None:
                _leave(books_now, g)

        obj.watch = gone


def _leave(b: _Books, g: ChannelGroup) -> None:
    key = (g.tenant, g.client, g.handle)
    if b.groups.get(key) is not g:
        return
    del b.groups[key]
    mine = b.by_tenant.get(g.tenant)
    if mine is not None:
        mine.pop(key, None)
        if not mine:
            del b.by_tenant[g.tenant]
    sib = b.sets.get(_set_key(g))
    if sib is not None and sib.groups.pop(key, None) is g:
        sib.count(g.applied, -1)
        if not sib.groups:
            del b.sets[_set_key(g)]


def _set_applied(broker: Any, g: ChannelGroup, value: Schedule | None) -> None:
    """g.applied = value, with its set's counts following (for a group in the books)."""
    b = books(broker)
    sib = b.sets.get(_set_key(g))
    if sib is not None and sib.groups.get((g.tenant, g.client, g.handle)) is g:
        sib.count(g.applied, -1)
        sib.count(value, 1)
    g.applied = value


def _object_of(broker: Any, g: ChannelGroup) -> Any:
    t = broker.tenants.get(g.tenant)
    client = t.clients.get(g.client) if t is not None else None
    return client.objects.get(g.handle) if client is not None else None


def _alive(broker: Any, g: ChannelGroup) -> bool:
    obj = _object_of(broker, g)
    return obj is not None and obj.rm_class == KEPLER_CHANNEL_GROUP_A


def live_groups(broker: Any, tenant: str | None = None) -> list[ChannelGroup]:
    """The channel groups still in the books (freed ones are dropped here too, should one
    have left the object books without its watch: a revoked tenant's successor)."""
    b = books(broker)
    source = b.groups if tenant is None else b.by_tenant.get(tenant, {})
    out = []
    for g in list(source.values()):
        if not _alive(broker, g):
            _leave(b, g)
            continue
        out.append(g)
    return out


def _discover(broker: Any) -> None:
    """Put into the books the channel groups the broker's object books hold but these do not
    (after a live upgrade the successor has the objects, not this module's books). Once per
    broker's trio run (a successor adopts its predecessor's objects before its run starts):
    every group allocated since enters by after_alloc (or _group_for), and a walk over every
    object per allocation (apply_all) is what other tenants would wait for."""
    b = books(broker)
    if b.discovered:
        return
    b.discovered = broker.spawn is not None
    for t in list(broker.tenants.values()):
        for client in list(t.clients.values()):
            for h, obj in list(client.objects.items()):
                if (obj.rm_class == KEPLER_CHANNEL_GROUP_A
                        and (t.name, client.handle, h) not in b.groups):
                    # (one the driver made for a channel is that channel's child here)
                    up = client.objects.get(obj.parent)
                    chan = obj.parent if up is not None and up.rm_class in CHANNEL_CLASSES \
                        else None
                    _enter(broker, ChannelGroup(t.name, client.session, client.handle, h,
                                                obj.gpu, 0, channel=chan), obj)


def _siblings(broker: Any, g: ChannelGroup) -> list[ChannelGroup]:
    sib = books(broker).sets.get(_set_key(g))
    return list(sib.groups.values()) if sib is not None else []


def _wanted(broker: Any, g: ChannelGroup) -> Schedule | None:
    t = broker.tenants.get(g.tenant)
    if t is None or not hasattr(t.policy, "compute_weight"):
        return None  # a revoked tenant: its calls are refused anyway
    sib = books(broker).sets.get(_set_key(g))
    want = schedule_for(broker.policy, t.policy, g.gpu,
                        len(sib.groups) if sib is not None else 1)
    if books(broker).levels_refused:
        return Schedule(want.timeslice_us, None)
    return want


# --------------------------------------------------------------------------- driver calls
def _control(broker: Any, s: Any, req: Any, g: ChannelGroup, cmd: int, **values: Any) -> Steps:
    """Issue one RM control on the tenant's own file and client (as the tenant's calls are
    executed: Broker._call_backend), with the broker's own parameter buffer. Returns the
    NV_STATUS (or raises OSError for an errno)."""
    return (yield from _control_on(broker, s, req, g.client, g.handle, cmd, **values))


def _control_on(broker: Any, s: Any, req: Any, client: int, handle: int, cmd: int,
                **values: Any) -> Steps:
    from devbroker.abi.nodes import NodeKind

    abi = broker.abi_of(s)
    spec = abi.control(cmd)
    nested = spec.params.decode(bytes(spec.size)).replace(**values).encode()
    node = s.node if s.node in (NodeKind.CTL, NodeKind.GPU) else NodeKind.CTL
    call = abi.own_control(node, client, handle, cmd, spec.size)
    result = yield from broker._call_backend(s, call, nested, req=req)
    if result.errno:
        raise OSError(result.errno, os.strerror(result.errno))
    return abi.decode_ioctl(node, call.cmd, result.arg).value.status


def _apply(broker: Any, s: Any, req: Any, g: ChannelGroup, want: Schedule, why: str) -> Steps:
    """Set one group's timeslice and level; failures are recorded, never raised (the
    tenant's own call must not fail because of the broker's)."""
    try:
        st = yield from _control(broker, s, req, g, NVA06C_CTRL_CMD_SET_TIMESLICE,
                                 timesliceUs=want.timeslice_us)
        lv = nvstatus.NV_OK
        if want.interleave is not None:
            lv = yield from _control(broker, s, req, g, NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL,
                                     tsgInterleaveLevel=want.interleave)
            if lv == nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS:
                _levels_refused(broker, s)
                want, lv = Schedule(want.timeslice_us, None), nvstatus.NV_OK
    except Exception as e:  # an OSError of the driver call, a Refusal (file changed), ...
        st = lv = None
        err = f"{type(e).__name__}: {e}"
    else:
        err = "" if st == nvstatus.NV_OK and lv == nvstatus.NV_OK else (
            f"SET_TIMESLICE {nvstatus.name(st)}, SET_INTERLEAVE_LEVEL {nvstatus.name(lv)}")
    if err:
        g.error = err
        if st == nvstatus.NV_OK:  # the share held even if the level did not
            _set_applied(broker, g, Schedule(want.timeslice_us, g.applied.interleave
                                             if g.applied else INTERLEAVE_MEDIUM))
        broker.audit.write("error", tenant=g.tenant, pid=s.caller.pid, what="compute share",
                           reason=f"channel group {g.handle:#x} ({why}): could not set "
                                  f"{want.describe()}: {err}")
        return False
    _set_applied(broker, g, want)
    g.error = ""
    return True


def _levels_refused(broker: Any, s: Any) -> None:
    """Said once per broker: the driver keeps interleave levels from unprivileged callers."""
    b = books(broker)
    if not b.levels_refused:
        b.levels_refused = True
        schedule_apply(broker)  # (every group's wanted level changed: the driver's)
        broker.audit.write("notice", tenant=s.tenant.name, what="compute share",
                           reason="the driver refuses SET_INTERLEAVE_LEVEL to the broker's "
                                  "unprivileged calls (NV_ERR_INSUFFICIENT_PERMISSIONS): "
                                  "priorities are set as timeslices only")


# --------------------------------------------------------------------------- hooks
def after_alloc(ctx: Any, alloc: Any, handle: int, gpu: int | None) -> Steps:
    """CLASSES[0xA06C].after (rules.py): a channel group of the tenant's was allocated (the
    driver said NV_OK). Give it the policy's values before the tenant has the handle, and the
    tenant's other groups on the same engine their smaller part."""
    params = alloc.params
    engine = int(getattr(params, "engineType", 0) or 0) if params is not None else 0
    yield from _police(ctx, alloc.client, handle, gpu, engine)


def _police(ctx: Any, client: Any, handle: int, gpu: int | None, engine: int,
            channel: int | None = None) -> Steps:
    """A channel group of the tenant's is new in the books (its own, or one the driver made
    for `channel`): the policy's values on it, and on its siblings their smaller part."""
    broker, s, req = ctx.broker, ctx.session, ctx.req
    b = books(broker)
    g = ChannelGroup(s.tenant.name, s.id, client.handle, handle, gpu, engine,
                     in_hook=True, channel=channel)
    _enter(broker, g, client.objects.get(handle))
    try:
        want = _wanted(broker, g)
        if want is None:
            return
        yield from _apply(broker, s, req, g, want, "allocated")
    finally:
        g.in_hook = False
    # (itself too: a sibling made while its driver call ran has changed its part). All of
    # them want what g wants: one lookup in the set's counts, whatever their number.
    sib = b.sets.get(_set_key(g))
    if sib is not None and not sib.all_at(_wanted(broker, g)):
        schedule_apply(broker, _set_key(g))
    if s.tenant.policy.priority == "high":
        schedule_preempt(broker)  # low tenants on this GPU: stopped by the watching task
    for hook in b.on_new_group:
        hook()  # a second tenant on this GPU: turns start (when on)


def _group_for(broker: Any, s: Any, client: Any, handle: int) -> ChannelGroup | None:
    obj = client.objects.get(handle)
    if obj is None or obj.rm_class != KEPLER_CHANNEL_GROUP_A:
        return None  # the driver answers for a control on another class
    b = books(broker)
    g = b.groups.get((s.tenant.name, client.handle, handle))
    if g is None:  # allocated before the broker kept these books (a live upgrade)
        g = ChannelGroup(s.tenant.name, s.id, client.handle, handle, obj.gpu, 0)
        _enter(broker, g, obj)
    return g


def schedule_control(ctx: Any, params: Any) -> Any:
    """The pre hook of SET_TIMESLICE / SET_INTERLEAVE_LEVEL (rules.CONTROLS): a tenant's own
    call on one of its channel groups; the value that reaches the driver is the policy's.
    Audited once per group and asked value (a tenant looping on it cannot fill the log);
    counted in status. It works on the broker's decoded copy, which is what is relayed."""
    broker, s, client, handle, cmd = ctx.broker, ctx.session, ctx.client, ctx.handle, ctx.cmd
    g = _group_for(broker, s, client, handle)
    if g is None:
        return params
    want = _wanted(broker, g)
    if want is None:
        return params
    if cmd == NVA06C_CTRL_CMD_SET_TIMESLICE:
        name, asked, value = "timesliceUs", int(params.timesliceUs), want.timeslice_us
    else:
        # the policy's level even where the driver keeps levels from the broker: the
        # tenant's call then meets the driver's refusal, not a level of its own choosing
        name, asked = "tsgInterleaveLevel", int(params.tsgInterleaveLevel)
        value = PRIORITY_LEVEL.get(s.tenant.policy.priority, INTERLEAVE_MEDIUM)
        if asked not in LEVEL_NAMES:
            return params  # not a level: the driver refuses it as it would without us
    if asked == value:
        return params
    g.rewrites += 1
    if (cmd, asked) not in g.asked and len(g.asked) < 16:
        g.asked.add((cmd, asked))
        broker.audit.write("rewrite", tenant=g.tenant, pid=s.caller.pid, node=s.node_name,
                           what=f"RM_CONTROL {broker.abi_of(s).control_name(cmd)}",
                           reason=f"channel group {handle:#x}: {name} {asked} asked, the "
                                  f"policy's {value} set (compute_weight "
                                  f"{s.tenant.policy.compute_weight}, priority "
                                  f"{s.tenant.policy.priority})")
    return params.replace(**{name: value})


# --------------------------------------------------------------------------- policy changes
def install(broker: Any) -> None:
    """Called by Broker.__init__: every policy change re-applies the values."""
    b = books(broker)
    if not b.installed:
        b.installed = True
        broker.on_policy_change.append(lambda policy: schedule_apply(broker))
        broker.on_policy_change.append(lambda policy: schedule_preempt(broker))


def turns_ms(broker: Any) -> int:
    """The policy's turn length (`[broker] compute_turns_ms`, turns.py); 0: no turns."""
    policy = getattr(broker, "policy", None)
    return int(getattr(getattr(policy, "broker", None), "compute_turns_ms", 0) or 0)


def schedule_apply(broker: Any, only: tuple | None = None) -> None:
    """Bring every live channel group to its wanted values — or only those of one set of
    siblings (`only`, a tenant's groups on one engine of a GPU: what a new group changes) —
    in a background task (the policy apply path holds the state lock; the driver calls wait
    on nothing of the broker's)."""
    b = books(broker)
    if broker.spawn is None:
        return
    with b.lock:  # (asked from listener threads and the trio thread alike)
        if only is None:
            b.dirty_all = True
        else:
            b.dirty.add(only)
        if b.pending:
            b.again = True
            return
        b.pending, b.again = True, False

    async def task() -> None:
        while True:
            with b.lock:
                keys = None if b.dirty_all else set(b.dirty)
                b.dirty_all = False
                b.dirty.clear()
            try:
                await run_async(locked(apply_all(broker, keys)), broker.perform)
            except Exception as e:  # a bug must cost this apply, never the broker
                log.exception("compute: applying the policy's values failed")
                broker.audit.write("error", what="compute share",
                                   reason=f"internal error: {type(e).__name__}: {e}")
            with b.lock:
                if not b.again:
                    b.pending = False
                    return
                b.again = False

    broker._start_soon(task)


def _to_apply(broker: Any, keys: set | None) -> list[ChannelGroup]:
    """The live groups of these sets of siblings (all when None) whose set is not all at its
    wanted value already (one lookup per set)."""
    b = books(broker)
    if keys is None:
        return live_groups(broker)
    out = []
    for key in keys:
        sib = b.sets.get(key)
        if sib is None or not sib.groups:
            continue
        first = next(iter(sib.groups.values()))
        if sib.all_at(_wanted(broker, first)):
            continue
        out.extend(g for g in list(sib.groups.values()) if _alive(broker, g))
    return out


def apply_all(broker: Any, keys: set | None = None) -> Steps:
    """Steps: set the wanted values on every live group (of the sets of siblings `keys`,
    when given) whose applied values differ. Returns how many groups were changed."""
    changed = 0
    _discover(broker)
    for g in _to_apply(broker, keys):
        if g.in_hook:
            continue  # a new group whose own after-hook is setting it (after_alloc)
        want = _wanted(broker, g)
        if want is None or want == g.applied:
            continue
        s = broker.sessions.get(g.session)
        if s is None or s.closed:
            continue
        req = None
        if getattr(s.file, "runs_in_caller", False):
            # The tenant's own driver file: no call of the tenant's lends it now, so the
            # broker takes a duplicate from a process that holds it (checked by inode).
            lent = yield Blocking(lend_tenant_file, (s,), g.tenant,
                                  f"find the file of channel group {g.handle:#x}")
            if lent is None:
                g.error = "no process of the tenant holds the group's file any more"
                continue
            req = lent
        try:
            if (yield from _apply(broker, s, req, g, want, "policy change")):
                changed += 1
        finally:
            if req is not None:
                req.close()
    return changed


def lend_tenant_file(s: Any) -> Any:
    """Find a process of the tenant that holds the session's file (its inode key), and lend it
    to `_execute_on_tenant_file` the way a tenant call does (fd number + pidfd_getfd).
    Only /proc of the tenant's own processes is read, with stat that never waits on a file
    system server."""
    from devbroker.broker.procinfo import stat_nosync
    from devbroker.broker.procmem import pidfd_getfd

    key = getattr(s.file, "key", None)
    if key is None:
        return None
    pids = [s.caller.pid] + sorted(s.tenant.tgids() - {s.caller.pid})
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                st = stat_nosync(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) != key:
                continue
            # _execute_on_tenant_file dups it (checking the inode again) and closes the dup.
            return SimpleNamespace(fd=int(name), confirm=None, close=lambda: None,
                                   dup_fd=lambda number, pid=pid: pidfd_getfd(pid, number))
    return None


# --------------------------------------------------------------------------- preemption
# A `low` tenant yields its GPU to `high` ones: while a high-priority tenant holds a channel
# group (a CUDA context) on a GPU, the channels of every low-priority tenant there are
# stopped with the driver's FIFO_DISABLE_CHANNELS (measured on the H200: the low tenant's
# work stops at once and goes on when they are let run again; the neighbour's latency is
# then what it is alone, docs/compute-shares.md). Time-slicing alone left a high tenant 16.5×
# its latency alone next to a busy low one. The broker cannot see when a high tenant is
# busy (its work reaches the GPU through doorbells, not calls), so holding a context counts.
#
# The control lists channels by client and handle, any client's; tenants may not send it
# (rules.REFUSED_CONTROLS). The broker sends it for one tenant's own channels of one client,
# to that client's own subdevice, on the tenant's own file, from a thread without the
# driver-checked capabilities: what any tenant could do to itself.

def _high_holders(broker: Any) -> dict[int, list[str]]:
    """GPU -> the high-priority tenants holding channel groups there (sorted)."""
    out: dict[int, set[str]] = {}
    for g in live_groups(broker):
        t = broker.tenants.get(g.tenant)
        if t is not None and getattr(t.policy, "priority", "normal") == "high" \
                and g.gpu is not None:
            out.setdefault(g.gpu, set()).add(g.tenant)
    return {gpu: sorted(names) for gpu, names in out.items()}


def _channels_on(tenant: Any, gpu: int) -> dict[int, list[int]]:
    """A tenant's channels on one GPU, by client handle (from the broker's object books)."""
    out: dict[int, list[int]] = {}
    for client in tenant.clients.values():
        hs = [h for h, o in client.objects.items()
              if o.rm_class in CHANNEL_CLASSES and o.gpu == gpu]
        if hs:
            out[client.handle] = hs
    return out


def _subdevice_of(client: Any, gpu: int) -> int | None:
    for h, o in client.objects.items():
        if o.rm_class == SUBDEVICE_CLASS and o.gpu == gpu:
            return h
    return None


def _stop(broker: Any, tenant: Any, gpu: int, chans: dict[int, list[int]], stop: bool,
          req: Any = None) -> Steps:
    """Stop (or let run) these channels of one tenant: one FIFO_DISABLE_CHANNELS per client
    (and per 64 channels), on that client's subdevice and file. Returns the (client,
    channel) pairs the driver took; failures are audited (`error`), never raised."""
    done: set[tuple[int, int]] = set()
    for ch, handles in chans.items():
        client = tenant.clients.get(ch)
        sub = _subdevice_of(client, gpu) if client is not None else None
        s = broker.sessions.get(client.session) if client is not None else None
        if sub is None or s is None or s.closed:
            broker.audit.write("error", tenant=tenant.name, what="preemption",
                               reason=f"client {ch:#x}: no subdevice of GPU {gpu} or no open "
                                      f"file to stop its {len(handles)} channel(s) with")
            continue
        lent = req
        try:
            if lent is None and getattr(s.file, "runs_in_caller", False):
                lent = yield Blocking(lend_tenant_file, (s,), tenant.name,
                                      f"find the file of client {ch:#x}")
                if lent is None:
                    continue  # no process holds it any more: nothing of it runs
            for i in range(0, len(handles), DISABLE_CHANNELS_MAX):
                part = handles[i:i + DISABLE_CHANNELS_MAX]
                pad = [0] * (DISABLE_CHANNELS_MAX - len(part))
                try:
                    st = yield from _control_on(
                        broker, s, lent, ch, sub, NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS,
                        bDisable=int(stop), numChannels=len(part),
                        hClientList=[ch] * len(part) + pad, hChannelList=part + pad)
                except Exception as e:  # an OSError of the driver call, a changed file, ...
                    st, err = None, f"{type(e).__name__}: {e}"
                else:
                    err = "" if st == nvstatus.NV_OK else nvstatus.name(st)
                if err:
                    broker.audit.write("error", tenant=tenant.name, pid=s.caller.pid,
                                       what="preemption",
                                       reason=f"FIFO_DISABLE_CHANNELS bDisable={int(stop)} on "
                                              f"{len(part)} channel(s) of client {ch:#x}, GPU "
                                              f"{gpu}: {err}")
                    continue
                done.update((ch, h) for h in part)
        finally:
            if lent is not None and lent is not req:
                lent.close()
    return done


def _driver_group(ctx: Any, alloc: Any, chan: Any, device: Any, gpu: int | None) -> Steps:
    """The group the driver made for a channel allocated under `device`: found, put into the
    object books as the channel's child (the driver frees it with the channel, and the
    channel with it), and given the policy's values as any group of the tenant's. Not
    found: an `error` record (the channel then runs with the driver's default timeslice)."""
    broker, s = ctx.broker, ctx.session
    client = alloc.client
    try:
        found, asked = yield from driver_group_of(broker, s, ctx.req, client, device.handle)
    except Exception as e:  # an OSError of the driver call, a changed file, ...
        found, asked = None, f"{type(e).__name__}: {e}"
    if found is None:
        broker.audit.write("error", tenant=s.tenant.name, pid=s.caller.pid,
                           what="compute share",
                           reason=f"channel {chan.handle:#x} under device {device.handle:#x}: "
                                  f"the channel group the driver made for it was not found "
                                  f"({asked}); it runs with the driver's default timeslice")
        return
    client.add(found, KEPLER_CHANNEL_GROUP_A, chan.handle, gpu=gpu)
    params = alloc.params
    engine = int(getattr(params, "engineType", 0) or 0) if params is not None else 0
    yield from _police(ctx, client, found, gpu, engine, channel=chan.handle)


def driver_group_of(broker: Any, s: Any, req: Any, client: Any, device: int) -> Steps:
    """Steps: (the handle of a channel group under `device` that the driver picked for the
    client and the books do not hold, or None; what was asked, for the audit). Asks about
    the client's picked handles in order from `client.groups_from` (the index after the last
    group found: indexes only grow, so none below holds a group still to find), until
    SEARCH_MISSES in a row are not held or SEARCH_MAX were asked about."""
    misses = asked = 0
    index = client.groups_from
    while misses < SEARCH_MISSES and asked < SEARCH_MAX:
        h = UNIQUE_HANDLE_BASE + index % UNIQUE_HANDLE_RANGE
        index += 1
        asked += 1
        if h in client.objects:
            misses = 0
            continue
        st, cls = yield from _handle_info(broker, s, req, client.handle, h,
                                          HANDLE_INFO_CLASSID)
        if st != nvstatus.NV_OK:
            misses += 1
            continue
        misses = 0
        if cls != KEPLER_CHANNEL_GROUP_A:
            continue
        st, parent = yield from _handle_info(broker, s, req, client.handle, h,
                                             HANDLE_INFO_PARENT)
        if st == nvstatus.NV_OK and parent == device:
            client.groups_from = index
            return h, f"{asked} handle(s) asked about"
    return None, (f"{asked} handle(s) from {UNIQUE_HANDLE_BASE + client.groups_from:#x} "
                  f"asked about, the last {misses} not held")


def _handle_info(broker: Any, s: Any, req: Any, client: int, handle: int,
                 index: int) -> Steps:
    """(status, value) of GET_HANDLE_INFO for one handle of the client."""
    abi = broker._abi(s)
    from devbroker.abi.nodes import NodeKind

    spec = abi.control(NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO)
    nested = spec.params.decode(bytes(spec.size)).replace(hObject=handle,
                                                          index=index).encode()
    node = s.node if s.node in (NodeKind.CTL, NodeKind.GPU) else NodeKind.CTL
    call = abi.own_control(node, client, client, NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO,
                           spec.size)
    result = yield from broker._call_backend(s, call, nested, req=req)
    if result.errno:
        raise OSError(result.errno, os.strerror(result.errno))
    st = abi.decode_ioctl(node, call.cmd, result.arg).value.status
    if st != nvstatus.NV_OK or result.nested is None:
        return st, None
    data = spec.params.decode(result.nested).data
    return st, int.from_bytes(bytes(data.raw)[:8], "little")


def lane_leaves_channel(broker: Any, tenant: str, parent: Any) -> bool:
    """Whether the control lane leaves a channel allocation under `parent` to the general
    path, whose after-hook (after_channel_alloc) has work to do: the tenant is stopped on
    that GPU, or the parent is a device (the driver makes a group the hook must find)."""
    if parent.rm_class == DEVICE_CLASS:
        return True
    return parent.gpu is not None and stops_new_channels(broker, tenant, parent.gpu)


def after_channel_alloc(ctx: Any, alloc: Any, handle: int, gpu: int | None) -> Steps:
    """CLASSES[0xC86F].after (rules.py): a channel allocated right under the device gets
    the policy's values on the group the driver made for it (driver_group_of), as any
    group of the tenant's; a channel of a tenant that is stopped on this GPU is stopped
    before the tenant has its handle (else a low tenant could make new contexts to run
    between two looks of the watching task)."""
    broker, s = ctx.broker, ctx.session
    b = books(broker)
    chan = alloc.client.objects.get(handle)
    parent = alloc.client.objects.get(chan.parent) if chan is not None else None
    if parent is not None and parent.rm_class == DEVICE_CLASS:
        yield from _driver_group(ctx, alloc, chan, parent, gpu)
    key = (s.tenant.name, gpu)
    if gpu is None or not stops_new_channels(broker, s.tenant.name, gpu):
        return
    done = yield from _stop(broker, s.tenant, gpu, {alloc.client.handle: [handle]}, True,
                            ctx.req)
    # held by each mechanism that wants it stopped (it runs again when neither does)
    if key in b.preempted:
        b.stopped.setdefault(key, set()).update(done)
    if out_of_turn(broker, s.tenant.name, gpu):
        b.turn_stopped.setdefault(key, set()).update(done)


def preempt_all(broker: Any) -> Steps:
    """Steps: stop the channels of low-priority tenants on every GPU where a high-priority
    tenant holds channel groups, and let run again the ones the broker stopped elsewhere.
    Returns whether anything is left to watch (a high tenant's groups, or stopped ones)."""
    b = books(broker)
    _discover(broker)
    high = _high_holders(broker)
    for t in list(broker.tenants.values()):
        low = (getattr(t.policy, "priority", "normal") == "low" and not t.revoked
               and not _in_checkpoint(broker, t.name))
        for gpu in sorted(set(t.gpus) | {k[1] for k in b.stopped if k[0] == t.name}):
            key = (t.name, gpu)
            chans = _channels_on(t, gpu)
            live = {(c, h) for c, hs in chans.items() for h in hs}
            first = low and bool(live) and key not in b.seen
            if first:
                b.seen.add(key)
            held = b.stopped.get(key, set()) & live
            if low and gpu in high:
                todo: dict[int, list[int]] = {}
                for c, h in sorted(live - held):
                    todo.setdefault(c, []).append(h)
                if todo:
                    held |= yield from _stop(broker, t, gpu, todo, True)
                if key not in b.preempted:
                    b.preempted.add(key)
                    broker.audit.write("preempt", tenant=t.name, what="compute priority",
                                       reason=f"GPU {gpu}: {len(held)} channel(s) stopped: "
                                              f"high-priority tenant(s) {', '.join(high[gpu])} "
                                              "hold channel groups there")
                b.stopped[key] = held
                continue
            # let run what the broker stopped (the first pass: everything of low tenants,
            # which a predecessor broker may have left stopped)
            release = (live if first else held) - b.turn_stopped.get(key, set())
            if release:
                todo = {}
                for c, h in sorted(release):
                    todo.setdefault(c, []).append(h)
                yield from _stop(broker, t, gpu, todo, False)
            if key in b.preempted:
                b.preempted.discard(key)
                broker.audit.write("preempt", tenant=t.name, what="compute priority",
                                   reason=f"GPU {gpu}: {len(held)} channel(s) running again: "
                                          "no high-priority tenant holds channel groups there")
            b.stopped.pop(key, None)
    priorities = {getattr(t.policy, "priority", "normal") for t in broker.tenants.values()}
    return bool(b.stopped) or {"high", "low"} <= priorities


def schedule_preempt(broker: Any) -> None:
    """Keep `preempt_all` running every PREEMPT_TICK_S while the policy has both high- and
    low-priority tenants (or channels are stopped), in a background task: started when the
    broker's trio run begins, by a high tenant's channel group and by policy changes."""
    b = books(broker)
    if b.watching or broker.spawn is None:
        return
    b.watching = True

    async def task() -> None:
        import trio

        try:
            while True:
                try:
                    more = await run_async(locked(preempt_all(broker)), broker.perform)
                except Exception as e:  # a bug must cost the watch, never the broker
                    log.exception("compute: preemption pass failed")
                    broker.audit.write("error", what="preemption",
                                       reason=f"internal error: {type(e).__name__}: {e}; "
                                              "watching again at the next channel group or "
                                              "policy change")
                    more = False
                if not more:
                    return
                await trio.sleep(PREEMPT_TICK_S)
        finally:
            b.watching = False

    broker._start_soon(task)


# --------------------------------------------------------------------------- status
def tenant_status(broker: Any, t: Any) -> dict:
    """For `devbroker status`: the tenant's weight, priority, share of each GPU when every
    tenant there is busy, and its channel groups with the values the driver accepted."""
    p = t.policy
    if not hasattr(p, "compute_weight"):
        return {}
    _discover(broker)
    groups = live_groups(broker, t.name)
    return {"compute": {
        "weight": p.compute_weight,
        "priority": p.priority,
        "share": {str(gpu): round(share_of(broker.policy, p, gpu), 4) for gpu in t.gpus},
        "channel_groups": [{
            "handle": g.handle, "gpu": g.gpu, "engine": g.engine,
            "timeslice_us": g.applied.timeslice_us if g.applied else None,
            "interleave": (LEVEL_NAMES.get(g.applied.interleave, "driver's")
                           if g.applied else None),
            "rewrites": g.rewrites, **({"error": g.error} if g.error else {}),
            **({"channel": g.channel} if g.channel is not None else {}),
        } for g in groups],
        **({"stopped": {str(gpu): len(chs) for (name, gpu), chs in books(broker).stopped.items()
                        if name == t.name}}
           if any(name == t.name for name, _gpu in books(broker).preempted) else {}),
        **({"turns": turns_now} if (turns_now := _turns_status(broker, t.name)) else {}),
    }}


def _turns_status(broker: Any, tenant: str) -> dict:
    """Per GPU where the tenant takes turns (turns.py), whether it is its turn."""
    b = books(broker)
    return {str(gpu): ("running" if b.turn.get(gpu) == tenant else "waiting")
            for gpu, names in sorted(b.turn_members.items()) if tenant in names}
