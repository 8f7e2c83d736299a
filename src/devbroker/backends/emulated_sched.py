"""Channel groups in the emulated driver: allocation and the scheduling controls the broker's
compute shares use (broker/compute.py), answered as the 580 driver on a GSP GPU
(the H200) answers them. Sources, tag 580.142 (docs/compute-shares.md has the lines):

- KEPLER_CHANNEL_GROUP_A (0xa06c) needs a device parent: kchangrpapiConstruct looks the
  parent up with deviceGetByHandle and answers NV_ERR_INVALID_ARGUMENT otherwise. A new group
  has the default timeslice (1024 µs, kfifoChannelGroupGetDefaultTimeslice_GV100) and the
  MEDIUM interleave level.
- SET_TIMESLICE: the kernel-side driver checks no range (kfifoRunlistGetMinTimeSlice is 0);
  on a GSP client it forwards the control and, when GSP accepts, keeps the value, which
  GET_TIMESLICE returns exactly (ctrla06c.h: "the exact value passed"). Which values GSP
  refuses is not in the open source; scripts/gpu/compute_shares.sh measures it.
- SET_INTERLEAVE_LEVEL: refused with NV_ERR_INSUFFICIENT_PERMISSIONS to a caller without
  CAP_SYS_ADMIN (seen on the H200; the 580 table flags it PRIVILEGED_IF_RS_ACCESS_DISABLED).
  From root: LOW/MEDIUM/HIGH; another value is refused by GSP, and the GSP client turns any
  failed forward into NV_ERR_NOT_SUPPORTED (kchangrpapiCtrlCmdSetInterleaveLevel).
- GET_INTERLEAVE_LEVEL has no entry in the channel group's exported method table in 580:
  NV_ERR_NOT_SUPPORTED (the emulator's answer for any control it does not list).
- A scheduling control on an object that is not a channel group: the control lookup fails,
  NV_ERR_NOT_SUPPORTED.
- HOPPER_CHANNEL_GPFIFO_A (0xc86f), a channel, is allocated under a channel group, or right
  under a device: the driver then makes a KEPLER_CHANNEL_GROUP_A of its own under that device
  to wrap the channel (kernel_channel.c kchannelConstruct_IMPL: the group's handle is one the
  driver picks for the client, RS_UNIQUE_HANDLE_BASE + its next index; engineType and
  hVASpace are the channel's; a context share is refused there, NV_ERR_INVALID_ARGUMENT).
  The answer does not name that group: the driver clears hPhysChannelGroup (and the other
  internal fields) before it returns. Freeing the channel frees the group
  (kchannelDestruct_IMPL, bAllocatedByRm) and freeing the group frees the channel (it is
  the group's dependant). The channel runs with its group's timeslice (the emulator models
  no work: a channel is a handle with a stopped flag and the group it runs in).
- NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO on the client: an object's parent or class
  (client_resource.c cliresCtrlCmdClientGetHandleInfo_IMPL); NV_ERR_OBJECT_NOT_FOUND for a
  handle the client does not hold, NV_ERR_INVALID_ARGUMENT for another index.
- NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS on a subdevice stops (bDisable 1) or lets run
  (bDisable 0) the channels it lists by client and handle; measured on the H200: NV_OK, the
  channels' work stops at once and goes on after (docs/compute-shares.md, "Stopping a
  tenant's channels"). A listed handle that is no channel: NV_ERR_INVALID_CHANNEL (as
  CliGetKernelChannel fails); more than 64: NV_ERR_INVALID_ARGUMENT.
"""
from __future__ import annotations

from devbroker.abi import status as nvs
from devbroker.backends.emulated_controls import CONTROL_HANDLERS

CHANNEL_GROUP = 0xA06C
DEVICE = 0x80
DEFAULT_TIMESLICE_US = 128 << 3
LEVELS = (0, 1, 2)  # NVA06C_CTRL_INTERLEAVE_LEVEL_LOW, MEDIUM, HIGH
DEFAULT_LEVEL = 1


CHANNEL = 0xC86F  # HOPPER_CHANNEL_GPFIFO_A
SUBDEVICE = 0x2080
MAX_DISABLE_CHANNELS = 64  # NV2080_CTRL_FIFO_DISABLE_CHANNELS_MAX_ENTRIES


def alloc_channel(backend, c, parent, params):
    """EmulatedBackend.CLASS_ALLOC's entry for a GPFIFO channel: in a channel group, or under
    a device (channel_made wraps it in a group of the driver's)."""
    if parent.rm_class == DEVICE:
        if params is not None and int(params.hContextShare):
            return nvs.NV_ERR_INVALID_ARGUMENT, None, 0, params  # "Non-TSG channels can't
            # use context share"
        return nvs.NV_OK, parent.gpu, 0, params
    if parent.rm_class != CHANNEL_GROUP:
        return nvs.NV_ERR_INVALID_OBJECT_PARENT, None, 0, params
    return nvs.NV_OK, parent.gpu, 0, params


# The fields kchannelConstruct_IMPL clears before it returns ("only needed internally").
_INTERNAL_FIELDS = ("hPhysChannelGroup", "internalFlags", "ProcessID", "SubProcessID")


def channel_made(backend, c, parent, chan, params):
    """EmulatedBackend.CLASS_MADE's entry for a channel: the group it runs in, made by the
    driver when its parent is a device. Returns the parameters of the answer."""
    from devbroker.backends.emulated_objects import EmuObject

    if parent.rm_class == CHANNEL_GROUP:
        chan.group = parent.handle
    else:
        h = c.generate_handle()
        group = EmuObject(h, CHANNEL_GROUP, parent.handle, gpu=parent.gpu, client=c)
        c.objects[h] = group
        parent.children.add(h)
        group.tied.add(chan.handle)
        chan.tied.add(h)
        chan.group = h
    if params is None:
        return None
    clear = {f: 0 for f in _INTERNAL_FIELDS if f in params.spec.by_name}
    return params.replace(**clear)


def channel_timeslice(backend, client: int, handle: int) -> int | None:
    """The timeslice a channel runs with: its group's (None: no such channel)."""
    c = backend.clients.get(client)
    ch = c.objects.get(handle) if c is not None else None
    if ch is None or ch.rm_class != CHANNEL:
        return None
    group = _group_of(c, ch)
    return _sched(group)["timeslice"] if group is not None else None


def _group_of(c, ch):
    h = getattr(ch, "group", None)
    if h is None:  # (carried over a live upgrade: the tie, or the parent, names it)
        h = next(iter(ch.tied), None) if ch.tied else ch.parent
    group = c.objects.get(h)
    return group if group is not None and group.rm_class == CHANNEL_GROUP else None


def alloc_channel_group(backend, c, parent, params):
    """EmulatedBackend.CLASS_ALLOC's entry for KEPLER_CHANNEL_GROUP_A."""
    if parent.rm_class != DEVICE:
        return nvs.NV_ERR_INVALID_ARGUMENT, None, 0, params
    return nvs.NV_OK, parent.gpu, 0, params


def _sched(obj) -> dict:
    """The group's scheduling state, created with the driver's defaults."""
    state = getattr(obj, "sched", None)
    if state is None:
        state = obj.sched = {"timeslice": DEFAULT_TIMESLICE_US, "level": DEFAULT_LEVEL}
    return state


def _control(cmd: int):
    def register(fn):
        CONTROL_HANDLERS[cmd] = fn
        return fn
    return register


@_control(0xA06C0103)  # NVA06C_CTRL_CMD_SET_TIMESLICE
def set_timeslice(backend, client, obj, p):
    if obj.rm_class != CHANNEL_GROUP:
        return nvs.NV_ERR_NOT_SUPPORTED, p
    _sched(obj)["timeslice"] = int(p.timesliceUs)
    return nvs.NV_OK, p


@_control(0xA06C0104)  # NVA06C_CTRL_CMD_GET_TIMESLICE
def get_timeslice(backend, client, obj, p):
    if obj.rm_class != CHANNEL_GROUP:
        return nvs.NV_ERR_NOT_SUPPORTED, p
    return nvs.NV_OK, p.replace(timesliceUs=_sched(obj)["timeslice"])


@_control(0xA06C0107)  # NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL
def set_interleave_level(backend, client, obj, p):
    if obj.rm_class != CHANNEL_GROUP:
        return nvs.NV_ERR_NOT_SUPPORTED, p
    if not backend.privileged_caller:
        # The H200 (580.159.04) refused every level, valid or not, to a caller without
        # CAP_SYS_ADMIN (the broker's relay) and took 0-2 from root (docs/compute-shares.md).
        return nvs.NV_ERR_INSUFFICIENT_PERMISSIONS, p
    if int(p.tsgInterleaveLevel) not in LEVELS:
        return nvs.NV_ERR_NOT_SUPPORTED, p  # GSP refuses; the client maps it to this
    _sched(obj)["level"] = int(p.tsgInterleaveLevel)
    return nvs.NV_OK, p


@_control(0xA06C0101)  # NVA06C_CTRL_CMD_GPFIFO_SCHEDULE (CUDA enables each group it made)
def gpfifo_schedule(backend, client, obj, p):
    if obj.rm_class != CHANNEL_GROUP:
        return nvs.NV_ERR_NOT_SUPPORTED, p
    _sched(obj)["enabled"] = bool(p.bEnable)
    return nvs.NV_OK, p


def schedule_of(backend, client: int, handle: int) -> dict | None:
    """What the emulated driver holds for a channel group (tests compare the broker's books
    with it)."""
    c = backend.clients.get(client)
    obj = c.objects.get(handle) if c is not None else None
    if obj is None or obj.rm_class != CHANNEL_GROUP:
        return None
    return dict(_sched(obj))


@_control(0x2080110B)  # NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS
def disable_channels(backend, client, obj, p):
    if obj.rm_class != SUBDEVICE:
        return nvs.NV_ERR_NOT_SUPPORTED, p
    n = int(p.numChannels)
    if n > MAX_DISABLE_CHANNELS:
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    chans = []
    for h_client, h_chan in zip(list(p.hClientList)[:n], list(p.hChannelList)[:n]):
        c = backend.clients.get(h_client)
        ch = c.objects.get(h_chan) if c is not None else None
        if ch is None or ch.rm_class != CHANNEL:
            return nvs.NV_ERR_INVALID_CHANNEL, p
        chans.append(ch)
    for ch in chans:
        ch.stopped = bool(p.bDisable)
    return nvs.NV_OK, p


def channel_stopped(backend, client: int, handle: int) -> bool | None:
    """Whether the emulated driver holds a channel stopped (None: no such channel)."""
    c = backend.clients.get(client)
    ch = c.objects.get(handle) if c is not None else None
    if ch is None or ch.rm_class != CHANNEL:
        return None
    return bool(getattr(ch, "stopped", False))



GET_HANDLE_INFO_PARENT, GET_HANDLE_INFO_CLASSID = 1, 2


@_control(0xD02)  # NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO
def get_handle_info(backend, client, obj, p):
    if obj.rm_class != 0x41:
        return nvs.NV_ERR_NOT_SUPPORTED, p
    target = client.objects.get(int(p.hObject))
    if target is None:
        return nvs.NV_ERR_OBJECT_NOT_FOUND, p
    if int(p.index) == GET_HANDLE_INFO_PARENT:
        value = target.parent
    elif int(p.index) == GET_HANDLE_INFO_CLASSID:
        value = target.rm_class
    else:
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    return nvs.NV_OK, p.replace(data=p.data.replace(raw=int(value).to_bytes(8, "little")))
