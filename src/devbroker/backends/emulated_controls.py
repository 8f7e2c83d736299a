"""The RM controls the emulated driver models, as a table: command -> handler.

Each handler gets (backend, client, object, params) and returns (NV_STATUS, params). The
values mirror what the real driver answered on the H200 (../shared/traces, see
docs/emulator.md), derived from the emulated GPU's configuration. Controls not listed here
are answered NV_ERR_NOT_SUPPORTED by EmulatedBackend.
"""
from __future__ import annotations

from devbroker.abi import status as nvs
from devbroker.backends.emulated import CONTROL_HANDLERS, INVALID_GPU_ID, KiB

NV0000_CTRL_GPU_ATTACH_ALL_PROBED_IDS = 0x0000FFFF
# NV2080_GPU_CMD_GPU_GET_GID_FLAGS_FORMAT: ASCII "GPU-…" or the 16 raw bytes.
GID_FORMAT_BINARY = 0x2
# The value the H200 reported in GET_ID_INFO_V2.sliStatus for a GPU without SLI.
SLI_STATUS_NONE = 0x41
# NV2080_CTRL_GPU_GET_PIDS_ID_TYPE_*
PIDS_ID_TYPE_CLASS = 0
PIDS_ID_TYPE_VGPU_GUEST = 1
PIDS_ID_TYPE_MIG_GPU = 2


def control(cmd: int):
    def register(fn):
        CONTROL_HANDLERS[cmd] = fn
        return fn
    return register


def _ids(backend, n: int) -> list[int]:
    ids = [g.gpu_id for g in backend.gpus()]
    return ids + [INVALID_GPU_ID] * (n - len(ids))


@control(0x201)  # NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS
def get_attached_ids(backend, client, obj, p):
    return nvs.NV_OK, p.replace(gpuIds=_ids(backend, len(p.gpuIds)))


@control(0x214)  # NV0000_CTRL_CMD_GPU_GET_PROBED_IDS
def get_probed_ids(backend, client, obj, p):
    return nvs.NV_OK, p.replace(gpuIds=_ids(backend, len(p.gpuIds)),
                                excludedGpuIds=[INVALID_GPU_ID] * len(p.excludedGpuIds))


def _id_info(backend, p):
    g = backend.gpu_by_id(p.gpuId)
    if g is None:
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    return nvs.NV_OK, p.replace(gpuFlags=0, deviceInstance=g.index, subDeviceInstance=0,
                                sliStatus=SLI_STATUS_NONE, boardId=g.gpu_id,
                                gpuInstance=g.index, numaId=-1)


@control(0x205)  # NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2
def get_id_info_v2(backend, client, obj, p):
    return _id_info(backend, p)


@control(0x215)  # NV0000_CTRL_CMD_GPU_ATTACH_IDS
def attach_ids(backend, client, obj, p):
    known = {g.gpu_id for g in backend.gpus()}
    for i in p.gpuIds:
        if i in (INVALID_GPU_ID,):
            break
        if i != NV0000_CTRL_GPU_ATTACH_ALL_PROBED_IDS and i not in known:
            return nvs.NV_ERR_INVALID_ARGUMENT, p.replace(failedId=i)
    return nvs.NV_OK, p.replace(failedId=INVALID_GPU_ID)


@control(0x216)  # NV0000_CTRL_CMD_GPU_DETACH_IDS
def detach_ids(backend, client, obj, p):
    return nvs.NV_OK, p


# NV2080_CTRL_FB_INFO_INDEX_* the emulation models (values in KiB, like the driver's).
def _fb_value(backend, gpu, index):
    total = backend.gpus()[gpu].memory_bytes
    free = total - backend.used[gpu]
    return {
        0x07: total // KiB,  # RAM_SIZE
        0x08: total // KiB,  # TOTAL_RAM_SIZE
        0x09: total // KiB,  # HEAP_SIZE (the emulation reserves nothing)
        0x0A: total // KiB,  # MAPPABLE_HEAP_SIZE
        0x10: 0,  # FB_TAX_SIZE_KB
        0x12: free // KiB,  # LARGEST_FREE_REGION_SIZE_KB (no fragmentation modelled)
        0x16: free // KiB,  # HEAP_FREE
        0x20: total // KiB,  # USABLE_RAM_SIZE
        0x27: 0,  # HEAP_OFFLINE_SIZE
    }.get(index)


@control(0x20801303)  # NV2080_CTRL_CMD_FB_GET_INFO_V2
def fb_get_info_v2(backend, client, obj, p):
    n = p.fbInfoListSize
    if n > len(p.fbInfoList):
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    entries = list(p.fbInfoList)
    for i in range(n):
        value = _fb_value(backend, obj.gpu, entries[i].index)
        if value is None:
            # One unmodelled index makes the whole call unsupported: never a made-up value.
            backend._note(("fbinfo", entries[i].index),
                          f"emulator: FB info index {entries[i].index:#x} is not modelled")
            return nvs.NV_ERR_NOT_SUPPORTED, p
        entries[i] = entries[i].replace(data=min(value, 0xFFFFFFFF))
    return nvs.NV_OK, p.replace(fbInfoList=entries)


@control(0x20800110)  # NV2080_CTRL_CMD_GPU_GET_NAME_STRING
def get_name_string(backend, client, obj, p):
    g = backend.gpus()[obj.gpu]
    union = p.gpuNameString  # {ascii[128], unicode[64]}: kept as raw bytes
    size = len(bytes(union.raw))
    if p.gpuNameStringFlags == 0:  # ASCII
        name = g.name.encode("ascii")[: size - 1]
    else:  # UNICODE (UTF-16LE)
        name = g.name.encode("utf-16-le")[: size - 2]
    return nvs.NV_OK, p.replace(gpuNameString=union.replace(raw=name.ljust(size, b"\0")))


@control(0x2080014A)  # NV2080_CTRL_CMD_GPU_GET_GID_INFO
def get_gid_info(backend, client, obj, p):
    g = backend.gpus()[obj.gpu]
    size = len(bytes(p.data))
    if p.flags & 0x3 == GID_FORMAT_BINARY:
        data = g.uuid_bytes
        length = len(data)
    else:
        data = g.uuid.encode("ascii") + b"\0"
        length = len(data)
    return nvs.NV_OK, p.replace(length=length, data=data.ljust(size, b"\0"))


@control(0x2080018D)  # NV2080_CTRL_CMD_GPU_GET_PIDS
def get_pids(backend, client, obj, p):
    # The emulation runs no GPU work, so "a process using the GPU" is one holding device
    # memory on it — for every id type the driver knows (class, vGPU guest, MIG instance).
    if p.idType not in (PIDS_ID_TYPE_CLASS, PIDS_ID_TYPE_VGPU_GUEST, PIDS_ID_TYPE_MIG_GPU):
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    pids = backend.pids_on(obj.gpu)[: len(p.pidTbl)]
    return nvs.NV_OK, p.replace(pidTblCount=len(pids),
                                pidTbl=pids + [0] * (len(p.pidTbl) - len(pids)))
