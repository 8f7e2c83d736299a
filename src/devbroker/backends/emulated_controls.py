"""The RM controls the emulated driver models, as a table: command -> handler.

Each handler gets (backend, client, object, params) and returns (NV_STATUS, params). The
values mirror what the real driver answered on the H200 (tests/data, docs/nvtrace.md; see
docs/emulator.md), derived from the emulated GPU's configuration. Controls not listed here
are answered NV_ERR_NOT_SUPPORTED by EmulatedBackend.
"""
from __future__ import annotations

import time

from typing import Any, Callable

from devbroker.abi import status as nvs

KiB = 1 << 10
INVALID_GPU_ID = 0xFFFFFFFF  # the driver's "no GPU" id

# Control handlers are data: command number -> function(backend, client, object, params)
# returning (status, params), registered with @control below. EmulatedBackend answers
# NV_ERR_NOT_SUPPORTED for the rest; the broker's control rows (broker/rules.py) show which
# allowed controls the emulator models.
CONTROL_HANDLERS: dict[int, Callable[..., tuple[int, Any]]] = {}

NV0000_CTRL_GPU_ATTACH_ALL_PROBED_IDS = 0x0000FFFF
# NV2080_GPU_CMD_GPU_GET_GID_FLAGS_FORMAT: ASCII "GPU-…" or the 16 raw bytes.
GID_FORMAT_BINARY = 0x2
# The value the H200 reported in GET_ID_INFO_V2.sliStatus for a GPU without SLI.
SLI_STATUS_NONE = 0x41
GPU_ID_INFO_IN_USE = 0x1
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


@control(0x288)  # NV0000_CTRL_CMD_GPU_GET_ACTIVE_DEVICE_IDS
def get_active_device_ids(backend, client, obj, p):
    """Every GPU of the host (the parameters are all output). Not from a trace: modelled on
    ctrl0000gpu.h, where a GPU not in MIG mode is listed with gpuInstanceId and
    computeInstanceId NV0000_CTRL_GPU_INVALID_ID (the broker filters it)."""
    devs = list(p.devices)
    for i, g in enumerate(backend.gpus()[: len(devs)]):
        devs[i] = devs[i].replace(gpuId=g.gpu_id, gpuInstanceId=INVALID_GPU_ID,
                                  computeInstanceId=INVALID_GPU_ID)
    return nvs.NV_OK, p.replace(numDevices=min(len(backend.gpus()), len(devs)), devices=devs)


def _id_info(backend, p):
    g = backend.gpu_by_id(p.gpuId)
    if g is None:
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    # NV0000_CTRL_GPU_ID_INFO_IN_USE (bit 0): some client holds a device object of this GPU
    # (the H200 answered 0 before NVML allocated its device, 1 after). No other flag
    # (SLI, mobile, boot master, SoC, ATS) applies to an emulated PCIe H200.
    flags = GPU_ID_INFO_IN_USE if backend.device_in_use(g.index) else 0
    return nvs.NV_OK, p.replace(gpuFlags=flags, deviceInstance=g.index, subDeviceInstance=0,
                                sliStatus=SLI_STATUS_NONE, boardId=g.gpu_id,
                                gpuInstance=g.index, numaId=-1)


@control(0x202)  # NV0000_CTRL_CMD_GPU_GET_ID_INFO
def get_id_info(backend, client, obj, p):
    if p.szName:
        # The driver would write the name through this user pointer, which the emulator
        # cannot reach (it gets only the parameter block). NVML passes NULL.
        backend._note(("id_info_szName",), "emulator: GET_ID_INFO with szName set is not "
                      "modelled: NV_ERR_NOT_SUPPORTED")
        return nvs.NV_ERR_NOT_SUPPORTED, p
    return _id_info(backend, p)


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
    return nvs.NV_OK, p  # failedId is only written on failure (the H200 left it as sent)


NV0000_CTRL_GPU_DETACH_ALL_ATTACHED_IDS = 0x0000FFFF


@control(0x216)  # NV0000_CTRL_CMD_GPU_DETACH_IDS
def detach_ids(backend, client, obj, p):
    # Like cliresCtrlCmdGpuDetachIds: the list ends at the first INVALID id; every id
    # before it must be an attached GPU (all of the emulator's GPUs are).
    if p.gpuIds[0] == NV0000_CTRL_GPU_DETACH_ALL_ATTACHED_IDS:
        return nvs.NV_OK, p
    known = {g.gpu_id for g in backend.gpus()}
    for i in p.gpuIds:
        if i == INVALID_GPU_ID:
            break
        if i not in known:
            return nvs.NV_ERR_INVALID_ARGUMENT, p
    return nvs.NV_OK, p


# NV2080_CTRL_FB_INFO_INDEX_* the emulation models (values in KiB, like the driver's):
# what each index reports, of the GPU's total and free memory.
_FB_TOTAL = frozenset({0x07,  # RAM_SIZE
                       0x08,  # TOTAL_RAM_SIZE
                       0x09,  # HEAP_SIZE (the emulation reserves nothing)
                       0x0A,  # MAPPABLE_HEAP_SIZE
                       0x20})  # USABLE_RAM_SIZE
_FB_FREE = frozenset({0x12,  # LARGEST_FREE_REGION_SIZE_KB (no fragmentation modelled)
                      0x16})  # HEAP_FREE
_FB_ZERO = frozenset({0x10,  # FB_TAX_SIZE_KB
                      0x27})  # HEAP_OFFLINE_SIZE


def _fb_value(backend, gpu, index):
    """One FB info index's value, or None when the emulation does not model it."""
    if index in _FB_TOTAL:
        return backend.gpus()[gpu].memory_bytes // KiB
    if index in _FB_FREE:
        return (backend.gpus()[gpu].memory_bytes - backend.used[gpu]) // KiB
    if index in _FB_ZERO:
        return 0
    return None


@control(0x20801303)  # NV2080_CTRL_CMD_FB_GET_INFO_V2
def fb_get_info_v2(backend, client, obj, spec, nested: bytes):
    """On the parameter block's bytes (a `raw` handler: no decode, no encode): NVML and
    CUDA send this often, for 1-3 of its 128 entries."""
    size_at, table_at, count, es, at_index, at_data = _fb_layout(spec)
    n = int.from_bytes(nested[size_at:size_at + 4], "little")
    if n > count:
        return nvs.NV_ERR_INVALID_ARGUMENT, None
    out = bytearray(nested)
    for i in range(n):
        base = table_at + i * es
        index = int.from_bytes(out[base + at_index:base + at_index + 4], "little")
        value = _fb_value(backend, obj.gpu, index)
        if value is None:
            # One unmodelled index makes the whole call unsupported: never a made-up value.
            backend._note(("fbinfo", index),
                          f"emulator: FB info index {index:#x} is not modelled")
            return nvs.NV_ERR_NOT_SUPPORTED, None
        out[base + at_data:base + at_data + 4] = min(value, 0xFFFFFFFF).to_bytes(4, "little")
    return nvs.NV_OK, bytes(out)


fb_get_info_v2.raw = True
_FB_LAYOUTS: dict[int, tuple] = {}


def _fb_layout(spec) -> tuple:
    """(list size offset, table offset, entries, entry size, index and data offsets in an
    entry) of an FB_GET_INFO_V2 parameter layout, once per layout."""
    got = _FB_LAYOUTS.get(id(spec))
    if got is None or got[0] is not spec:
        f = spec.by_name["fbInfoList"]
        es = f.size // f.count
        got = (spec, (spec.by_name["fbInfoListSize"].offset, f.offset, f.count, es,
                      f.elem.by_name["index"].offset, f.elem.by_name["data"].offset))
        _FB_LAYOUTS[id(spec)] = got
    return got[1]


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
    # With ID_TYPE_CLASS NVML names a class: the chip's compute class (HOPPER_COMPUTE_A on
    # an H200) asks for compute processes, which is what memory holders stand for; no
    # process of the emulation has a graphics (or any other) engine object, so any other
    # class lists none (nvidia-smi shows type "C", not "C+G").
    if p.idType not in (PIDS_ID_TYPE_CLASS, PIDS_ID_TYPE_VGPU_GUEST, PIDS_ID_TYPE_MIG_GPU):
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    pids = backend.pids_on(obj.gpu)[: len(p.pidTbl)]
    if p.idType == PIDS_ID_TYPE_CLASS:
        facts = H200_FACTS.get(backend.gpus()[obj.gpu].pci_device_id, {})
        if p.id != facts.get("compute_class"):
            pids = []
    return nvs.NV_OK, p.replace(pidTblCount=len(pids),
                                pidTbl=pids + [0] * (len(p.pidTbl) - len(pids)))


@control(0x21B)  # NV0000_CTRL_CMD_GPU_GET_PCI_INFO
def get_pci_info(backend, client, obj, p):
    g = backend.gpu_by_id(p.gpuId)
    if g is None:
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    return nvs.NV_OK, p.replace(domain=g.domain, bus=g.bus, slot=g.slot)


NV0000_CTRL_GPU_DRAIN_STATE_DISABLED = 0


@control(0x279)  # NV0000_CTRL_CMD_GPU_QUERY_DRAIN_STATE
def query_drain_state(backend, client, obj, p):
    # The emulator has no drain state (MODIFY_DRAIN_STATE is refused to tenants): a GPU of
    # it is never being drained, which is what DISABLED means.
    if backend.gpu_by_id(p.gpuId) is None:
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    return nvs.NV_OK, p.replace(drainState=NV0000_CTRL_GPU_DRAIN_STATE_DISABLED, flags=0)


# ------------------------------------------------------------------ device (0x0080) controls
NV0080_CTRL_GPU_VIRTUALIZATION_MODE_NONE = 0


@control(0x800289)  # NV0080_CTRL_CMD_GPU_GET_VIRTUALIZATION_MODE
def get_virtualization_mode(backend, client, obj, p):
    # NVML will not use a device whose virtualization mode it cannot read. The emulated GPU
    # is neither a vGPU, nor a vGPU host, nor a device passed through to a VM: NONE. (The
    # traced H200 said NMOS=1 because it is passed through to a Firecracker VM; that is a
    # fact of that deployment, not of the emulated device.) 580 adds isGridBuild: 0, not a
    # GRID driver build.
    fields = {"virtualizationMode": NV0080_CTRL_GPU_VIRTUALIZATION_MODE_NONE}
    if hasattr(p, "isGridBuild"):
        fields["isGridBuild"] = 0
    return nvs.NV_OK, p.replace(**fields)


# ------------------------------------------------------------------ H200 hardware facts
# What the real H200 (PCI device 0x2335) answered in tests/data/h200-580.159.04-nvml.nvtrace:
# they describe the chip and the board, so an emulated H200 answers the same. A GPU of
# another PCI device id has no recorded facts: NOT_SUPPORTED.
H200_FACTS = {
    0x2335: {
        # NV2080_CTRL_MC_ARCH_INFO_ARCHITECTURE_GH100 (0x180), implementation 0,
        # revision 0xa1, subrevision 3 (NV2080_CTRL_MC_ARCH_INFO_SUBREVISION_R)
        "arch": (0x180, 0x0, 0xA1, 0x3),
        "subsystem": 0x18BF10DE,  # pciSubSystemId (board 0x18bf, vendor NVIDIA)
        "revision": 0xA1,  # pciRevisionId
        "compute_class": 0xCBC0,  # HOPPER_COMPUTE_A, the class NVML named in GET_PIDS
        # CARD_INFO reg_size / fb_size: the sizes of BAR0 (registers) and BAR1 (the
        # framebuffer aperture, 256 GiB on the H200 board; not the memory size)
        "bar0_size": 16 << 20,
        "bar1_size": 256 << 30,
        # NV0080_CTRL_CMD_GPU_GET_CLASSLIST_V2: the 103 classes the H200 listed (nvml trace,
        # record #109), in its order. NVML 535 looks for the compute class (HOPPER_COMPUTE_A,
        # 0xcbc0) in it and names that class in GET_PIDS (ID_TYPE_CLASS) to list running
        # processes; without it, "Not Supported". Listing a class is a fact of the chip;
        # allocating one the emulator does not model stays NOT_SUPPORTED.
        "classes": (
            0x100, 0x101, 0x2, 0x80, 0x5, 0x78, 0x7E, 0x79, 0x81, 0x3E, 0x71, 0x0, 0x41, 0x1,
            0x2080, 0xC639, 0xC638, 0xC640, 0xC637, 0xF, 0x906F, 0x90CC, 0x83DE, 0xC863, 0x90,
            0xB1CC, 0xB2CC, 0xC763, 0x900E, 0x20, 0x92, 0x90CE, 0xF3, 0x76, 0xB1, 0x82, 0x83,
            0xC2, 0x3F, 0x4, 0x2081, 0x2082, 0x208F, 0x30F1, 0xDB, 0x402C, 0x9010, 0xA0BC,
            0xA0BD, 0x50, 0xCBCA, 0x90CD, 0xF1, 0xE0, 0x42, 0xF8, 0xFB, 0xF9, 0xFE, 0xFD, 0xDA,
            0xC574, 0xC365, 0xC56F, 0xC561, 0x9067, 0x902D, 0x90F1, 0x844C, 0x90E7, 0x90E6,
            0x9074, 0x9096, 0xC076, 0xCB97, 0xC86F, 0xCBC0, 0xC8B5, 0xCBA2, 0xC661, 0xA06C,
            0xA080, 0xA140, 0xC369, 0x60, 0x40, 0x70, 0x7D, 0x5080, 0x50A0, 0x503B, 0x503C,
            0xA081, 0xA084, 0xB8B0, 0xB8D1, 0xB8FA, 0xCB33, 0xDE, 0xC46F, 0xC461, 0xC36F,
            0xC361,
        ),
    },
}


def _facts(backend, obj):
    g = backend.gpus()[obj.gpu]
    facts = H200_FACTS.get(g.pci_device_id)
    if facts is None:
        backend._note(("facts", g.pci_device_id), f"emulator: no recorded hardware facts for "
                      f"PCI device {g.pci_device_id:#x}: NV_ERR_NOT_SUPPORTED")
    return g, facts


@control(0x20801701)  # NV2080_CTRL_CMD_MC_GET_ARCH_INFO
def mc_get_arch_info(backend, client, obj, p):
    g, facts = _facts(backend, obj)
    if facts is None:
        return nvs.NV_ERR_NOT_SUPPORTED, p
    a, i, r, s = facts["arch"]
    return nvs.NV_OK, p.replace(architecture=a, implementation=i, revision=r, subRevision=s)


@control(0x20801801)  # NV2080_CTRL_CMD_BUS_GET_PCI_INFO
def bus_get_pci_info(backend, client, obj, p):
    g, facts = _facts(backend, obj)
    if facts is None:
        return nvs.NV_ERR_NOT_SUPPORTED, p
    return nvs.NV_OK, p.replace(pciDeviceId=(g.pci_device_id << 16) | 0x10DE,
                                pciSubSystemId=facts["subsystem"],
                                pciRevisionId=facts["revision"],
                                pciExtDeviceId=g.pci_device_id)


# NV2080_CTRL_GPU_INFO_INDEX_* the emulation models.
NV2080_CTRL_GPU_INFO_INDEX_UNPUBLISHED_0x11 = 0x11
NV2080_CTRL_GPU_INFO_INDEX_GPU_SMC_MODE = 0x2A
NV2080_CTRL_GPU_INFO_GPU_SMC_MODE_DISABLED = 2


def _gpu_info_value(backend, gpu, index):
    return {
        # Index 0x11 is in no open header (GSP-side). NVML 535 reads it before it lists
        # processes and gives up ("Not Supported") without it. The traced H200 answered 1 in
        # the nvml trace, a static value of the chip: the emulated H200 answers the same.
        NV2080_CTRL_GPU_INFO_INDEX_UNPUBLISHED_0x11: 1,
        # MIG: the emulator never partitions a GPU, and MIG partitioning is refused to
        # tenants; the traced H200 had MIG disabled too.
        NV2080_CTRL_GPU_INFO_INDEX_GPU_SMC_MODE: NV2080_CTRL_GPU_INFO_GPU_SMC_MODE_DISABLED,
    }.get(index)


@control(0x20800102)  # NV2080_CTRL_CMD_GPU_GET_INFO_V2
def gpu_get_info_v2(backend, client, obj, p):
    n = p.gpuInfoListSize
    if n > len(p.gpuInfoList):
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    entries = list(p.gpuInfoList)
    for i in range(n):
        value = _gpu_info_value(backend, obj.gpu, entries[i].index)
        if value is None:
            backend._note(("gpuinfo", entries[i].index),
                          f"emulator: GPU info index {entries[i].index:#x} is not modelled")
            return nvs.NV_ERR_NOT_SUPPORTED, p
        entries[i] = entries[i].replace(data=value)
    return nvs.NV_OK, p.replace(gpuInfoList=entries)


NV2080_TIMER_GPU_CPU_TIME_CPU_CLK_ID_OSTIME = 0x1
NV2080_CTRL_TIMER_GPU_CPU_TIME_MAX_SAMPLES = 16


@control(0x20800406)  # NV2080_CTRL_CMD_TIMER_GET_GPU_CPU_TIME_CORRELATION_INFO
def timer_gpu_cpu_time_correlation(backend, client, obj, p):
    # The real PTIMER counts wall-clock nanoseconds (the H200 trace: gpuTime == cpuTime*1000
    # to within the call's latency). The emulated GPU has no clock of its own: its PTIMER *is*
    # the host's wall clock, so both halves of each sample are read from it. Only the OSTIME
    # source (microseconds since the epoch, processor CPU) is modelled; TSC, platform API and
    # GSP sources are NOT_SUPPORTED.
    if p.cpuClkId != NV2080_TIMER_GPU_CPU_TIME_CPU_CLK_ID_OSTIME:
        backend._note(("timer_clk", p.cpuClkId), f"emulator: time correlation for CPU clock "
                      f"id {p.cpuClkId:#x} is not modelled: NV_ERR_NOT_SUPPORTED")
        return nvs.NV_ERR_NOT_SUPPORTED, p
    n = p.sampleCount
    if n > NV2080_CTRL_TIMER_GPU_CPU_TIME_MAX_SAMPLES:
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    samples = list(p.samples)
    for i in range(n):
        ns = time.time_ns()
        samples[i] = samples[i].replace(cpuTime=ns // 1000, gpuTime=ns)
    return nvs.NV_OK, p.replace(samples=samples)


NV2080_CTRL_GPU_COMPUTE_MODE_RULES_NONE = 0


@control(0x20800131)  # NV2080_CTRL_CMD_GPU_QUERY_COMPUTE_MODE_RULES
def query_compute_mode_rules(backend, client, obj, p):
    # The emulator enforces no exclusive-compute or prohibited rule (SET_COMPUTE_MODE_RULES is
    # not allowed to tenants): "Default" compute mode, RULES_NONE.
    return nvs.NV_OK, p.replace(rules=NV2080_CTRL_GPU_COMPUTE_MODE_RULES_NONE)


@control(0x101)  # NV0000_CTRL_CMD_SYSTEM_GET_BUILD_VERSION
def get_build_version(backend, client, obj, p, embedded, abi=None):
    """The driver copies three strings to the caller's buffers (embedded pointers, carried
    by the broker in `embedded`), as rmapi_deprecated_control.c's converter does: if any of
    the three pointers is NULL it only reports the size needed (sizeOfStrings = the longest
    string + 1, NV_OK); a sizeOfStrings below that is NV_ERR_INVALID_PARAM_STRUCT.

    The version is the one this client's handshake (CHECK_VERSION_STR) agreed on: the
    emulator speaks that version's ABI to the process, so it is that driver to it. The
    branch (versionBuffer) and title of a real build are NVIDIA's; the emulator has none
    and says what it is instead."""
    version = (abi.version if abi is not None else backend.version).encode()
    strings = {"pDriverVersionBuffer": version,
               "pVersionBuffer": version,
               "pTitleBuffer": b"devbroker emulated driver " + version}
    need = max(len(x) for x in strings.values()) + 1
    if any(name not in embedded for name in strings):
        return nvs.NV_OK, p.replace(sizeOfStrings=need)
    if p.sizeOfStrings < need:
        return nvs.NV_ERR_INVALID_PARAM_STRUCT, p
    for name, buf in embedded.items():
        text = strings[name]
        buf[: len(text) + 1] = text + b"\0"
    # The changelist numbers identify NVIDIA's internal build; the emulation has none.
    return nvs.NV_OK, p.replace(changelistNumber=0, officialChangelistNumber=0)


get_build_version.wants_embedded = True


@control(0x800292)  # NV0080_CTRL_CMD_GPU_GET_CLASSLIST_V2
def get_classlist_v2(backend, client, obj, p):
    g, facts = _facts(backend, obj)
    if facts is None or "classes" not in facts:
        return nvs.NV_ERR_NOT_SUPPORTED, p
    classes = list(facts["classes"])
    cap = len(p.classList)  # 200 at 580, 160 at 535
    if len(classes) > cap:
        return nvs.NV_ERR_INVALID_PARAM_STRUCT, p
    return nvs.NV_OK, p.replace(numClasses=len(classes),
                                classList=classes + [0] * (cap - len(classes)))


NV2080_CTRL_GPU_PID_INFO_INDEX_VIDEO_MEMORY_USAGE = 0
NV2080_CTRL_GPU_PARTITION_ID_INVALID = 0xFFFFFFFF


@control(0x2080018E)  # NV2080_CTRL_CMD_GPU_GET_PID_INFO
def get_pid_info(backend, client, obj, p):
    """Per-process video memory: what the process's clients hold on this GPU (the emulator's
    own accounting; nothing is shared or duped, no protected memory). As
    subdeviceCtrlCmdGpuGetPidInfo / gpuFindClientInfoWithPidIterator: a count of 0 or above
    the list is NV_ERR_INVALID_ARGUMENT; per entry, pid 0 or an index other than
    VIDEO_MEMORY_USAGE is NV_ERR_INVALID_ARGUMENT, any other pid NV_OK with what it holds
    (0 when it holds nothing: the H200 answered so). No MIG: subscription INVALID."""
    n = p.pidInfoListCount
    if n <= 0 or n > len(p.pidInfoList):
        return nvs.NV_ERR_INVALID_ARGUMENT, p
    held = backend.memory_by_pid(obj.gpu)
    entries = list(p.pidInfoList)
    for i in range(n):
        e = entries[i]
        sub = e.smcSubscription.replace(computeInstanceId=NV2080_CTRL_GPU_PARTITION_ID_INVALID,
                                        gpuInstanceId=NV2080_CTRL_GPU_PARTITION_ID_INVALID)
        if e.index != NV2080_CTRL_GPU_PID_INFO_INDEX_VIDEO_MEMORY_USAGE:
            entries[i] = e.replace(result=nvs.NV_ERR_INVALID_ARGUMENT, smcSubscription=sub)
            continue
        raw = len(bytes(e.data.raw))
        if e.pid == 0:
            entries[i] = e.replace(result=nvs.NV_ERR_INVALID_ARGUMENT, smcSubscription=sub,
                                   data=e.data.replace(raw=bytes(raw)))
            continue
        data = held.get(e.pid, 0).to_bytes(8, "little").ljust(raw, b"\0")  # memPrivate
        entries[i] = e.replace(result=nvs.NV_OK, data=e.data.replace(raw=data),
                               smcSubscription=sub)
    return nvs.NV_OK, p.replace(pidInfoList=entries)
