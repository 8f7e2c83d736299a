"""Where the emulated driver answers otherwise than the real one, on purpose, and why.

The differential replay (devbroker.testing.replay; tests/test_emulator_replay.py, and
`devbroker trace replay FILE`) sends every call of recorded real sessions to the emulator and
compares the answers. Each difference must be covered by an entry here; an entry nothing
covers any more is stale. docs/emulator.md ("Differences from the real driver") is generated
from this table (`devbroker trace replay --explain`).

An entry covers a difference when its patterns (fnmatch) match the call ("RM_CONTROL <name>",
"RM_ALLOC <class>", an escape or UVM name, "open <node>", "mmap of <node>"), the part of the
answer ("status", "errno", "field <path>", "open", "mmap") and the real and emulated values,
and, when `only` names one, its condition holds.
"""
from __future__ import annotations

from devbroker.testing.replay import Difference, Expected

_NOT_SUPPORTED = ("NV_OK", "NV_ERR_NOT_SUPPORTED")


def _unmodelled_control(d: Difference) -> bool:
    from devbroker.backends.emulated import CONTROL_HANDLERS

    return d.op is not None and d.op not in CONTROL_HANDLERS


def _unmodelled_class(d: Difference) -> bool:
    from devbroker.backends.emulated import EmulatedBackend

    return d.op is not None and d.op not in EmulatedBackend.CLASS_ALLOC and d.op not in (0, 0x41)


def _unmodelled_escape(d: Difference) -> bool:
    from devbroker.backends.emulated import EmulatedBackend

    return getattr(EmulatedBackend, d.call, None) is None


CONDITIONS = {
    "control not modelled": _unmodelled_control,
    "class not modelled": _unmodelled_class,
    "call not modelled": _unmodelled_escape,
}

EXPECTED: list[Expected] = [
    # ---- what the emulator does not model: the driver's own "cannot do that"
    Expected("RM_CONTROL *", "status", "Controls the emulator does not model (no entry in "
             "emulated_controls.py) are answered NV_ERR_NOT_SUPPORTED, as the driver answers "
             "what it cannot do; no value is made up.", *_NOT_SUPPORTED,
             only="control not modelled"),
    Expected("RM_CONTROL *", "status", "The recorded GPU lacks what was asked for (an "
             "inforom object the H200 does not carry: NV_ERR_OBJECT_NOT_FOUND); the emulator "
             "does not model the control at all.", "NV_ERR_OBJECT_NOT_FOUND",
             "NV_ERR_NOT_SUPPORTED", only="control not modelled"),
    Expected("RM_CONTROL NV2080_CTRL_CMD_FB_GET_INFO_V2", "status", "CUDA asks for FB indices "
             "the emulator does not model (bus width, RAM type, L2 size, LTC/FBP counts, BAR1 "
             "facts): one unmodelled index makes the whole call NV_ERR_NOT_SUPPORTED.",
             *_NOT_SUPPORTED),
    Expected("RM_CONTROL NV2080_CTRL_CMD_GPU_GET_INFO_V2", "status", "CUDA and NVML ask for GPU "
             "info indices the emulator does not model: one unmodelled index makes the whole "
             "call NV_ERR_NOT_SUPPORTED.", *_NOT_SUPPORTED),
    Expected("RM_ALLOC *", "status", "Classes other than the root client, device, subdevice, "
             "RM_USER_SHARED_DATA, local and system memory (channels, engines, VA spaces, "
             "events, MIG capability sessions, BINAPI, P2P, debugger) are NV_ERR_NOT_SUPPORTED: "
             "the emulator runs no GPU work.", *_NOT_SUPPORTED, only="class not modelled"),
    Expected("UVM_*", "status", "UVM beyond INITIALIZE, MM_INITIALIZE, DEINITIALIZE and the "
             "prefetch and advice calls on managed ranges is not modelled (no UVM va space): "
             "rmStatus NV_ERR_NOT_SUPPORTED.", *_NOT_SUPPORTED,
             only="call not modelled"),
    Expected("NV_ESC_*", "status", "Escapes the emulator does not model (ALLOC_OS_EVENT, "
             "RM_ALLOC_MEMORY, UPDATE_DEVICE_MAPPING_INFO…) answer NV_ERR_NOT_SUPPORTED in their "
             "status field.", *_NOT_SUPPORTED, only="call not modelled"),
    Expected("NV_ESC_RM_MAP_MEMORY", "status", "Only RM_USER_SHARED_DATA (0xde) pages are "
             "mapped; a mapping of device or system memory is NV_ERR_NOT_SUPPORTED.",
             *_NOT_SUPPORTED),
    Expected("*", "* (on an object the backend did not make)", "A call on an object the "
             "emulator did not create (a class above it does not model) fails as a "
             "consequence (INVALID_OBJECT_HANDLE, INVALID_OBJECT_PARENT, NOT_SUPPORTED): not "
             "a difference of its own."),
    Expected("mmap of *", "mmap", "Only RM_USER_SHARED_DATA pages can be mapped: device memory, "
             "system memory and USERD mappings need memory the emulator does not have."),
    Expected("open nvidia-cap*", "open", "The emulator has no capability nodes (MIG "
             "administration; the broker refuses them to tenants anyway): ENODEV.", "0", "19"),
    # ---- facts of the recorded machine, not of the emulated GPU
    Expected("NV_ESC_CARD_INFO", "field entries[[]*[]].reg_address", "The BAR0 address of the "
             "recorded machine's PCI device; the emulated GPU has no BARs in this machine (0)."),
    Expected("NV_ESC_CARD_INFO", "field entries[[]*[]].fb_address", "The BAR1 address of the "
             "recorded machine's PCI device; the emulated GPU has none (0)."),
    Expected("NV_ESC_CARD_INFO", "field entries[[]*[]].interrupt_line", "The recorded "
             "machine's interrupt line; the emulated GPU raises none (0)."),
    Expected("NV_ESC_NUMA_INFO", "field memblock_size", "The memory block size of the host "
             "(/sys/devices/system/memory/block_size_bytes): the emulator reports the machine "
             "it runs on, as the driver does."),
    Expected("NV_ESC_RM_MAP_MEMORY", "field params.pLinearAddress", "The mapping cookie the "
             "real driver chose for its mmap; the emulator gives its own (it only has to "
             "find the mapping again on the same file)."),
    Expected("RM_ALLOC NV01_MEMORY_LOCAL_USER", "field offset", "Where RM placed the memory "
             "in the framebuffer; the emulator returns a made-up offset aligned as asked "
             "(nothing is ever accessed there)."),
    Expected("RM_ALLOC NV01_MEMORY_LOCAL_USER", "field attr", "The page-size and location "
             "attributes RM settled on; the emulator charges the same page size "
             "(abi/vidmem.py) but returns the attributes as requested."),
    Expected("RM_ALLOC NV01_MEMORY_LOCAL_USER", "field attr2", "As attr: RM's own decisions "
             "(huge pages, …) written back; the emulator returns the request's."),
    Expected("RM_ALLOC NV01_MEMORY_LOCAL_USER", "field format", "The memory kind RM picked "
             "for the allocation; the emulator returns the requested one."),
    Expected("RM_ALLOC NV01_MEMORY_SYSTEM", "field attr", "The page-size and physicality "
             "attributes RM settled on for host memory; the emulator allocates none and "
             "returns the attributes as requested."),
    Expected("RM_ALLOC NV01_MEMORY_SYSTEM", "field attr2", "As attr: RM's own decisions "
             "written back; the emulator returns the request's."),
    Expected("RM_ALLOC NV01_MEMORY_SYSTEM", "field format", "The memory kind RM picked; the "
             "emulator returns the requested one."),
    Expected("RM_ALLOC NV01_MEMORY_SYSTEM", "field alignment", "The alignment RM used (its "
             "4 KiB page); the emulator returns the requested one."),
    Expected("RM_ALLOC *CHANNEL_GPFIFO*", "field cid", "The channel id RM assigned (a "
             "hardware channel slot); the emulator runs no channel and numbers none (0)."),
    Expected("RM_ALLOC *CHANNEL_GPFIFO*", "field flags", "Flags RM writes back for the "
             "channel it made; the emulator returns the request's."),
    Expected("RM_CONTROL NV0000_CTRL_CMD_SYSTEM_GET_BUILD_VERSION",
             "field officialChangelistNumber", "NVIDIA's internal build number; the emulator "
             "has none (0)."),
    Expected("RM_CONTROL NV0080_CTRL_CMD_GPU_GET_VIRTUALIZATION_MODE", "field virtualizationMode",
             "The recorded H200 is passed through to a VM (NMOS, 1); the emulated GPU is not "
             "(NONE, 0), see \"Required for NVML\".", "1", "0"),
    Expected("RM_CONTROL NV2080_CTRL_CMD_FB_GET_INFO_V2", "field fbInfoList[[]*[]].data",
             "HEAP_SIZE and HEAP_FREE: the real driver keeps about 615 MiB of the H200's memory "
             "for itself (heap below TOTAL_RAM_SIZE); the emulator reserves none, so its heap "
             "is the whole memory."),
    Expected("RM_CONTROL NV2080_CTRL_CMD_GPU_GET_PIDS", "field pidTbl*", "The emulator cannot "
             "create compute objects, so it lists a process that holds device memory as a "
             "compute process (nvidia-smi shows tenants' memory users); the H200 lists only "
             "processes with a compute object (the recorded run held memory without one)."),
    Expected("RM_CONTROL NV2080_CTRL_CMD_TIMER_GET_GPU_CPU_TIME_CORRELATION_INFO",
             "field samples[[]*[]].*Time", "Clock readings taken at replay time, not at "
             "recording time."),
]


def covers(e: Expected, d: Difference) -> bool:
    return e.covers(d) and (not e.only or CONDITIONS[e.only](d))


def explanations_markdown() -> str:
    """docs/emulator.md's table, from EXPECTED."""
    out = ["<!-- generated from src/devbroker/testing/emulated_parity.py by "
           "`devbroker trace replay --explain` -->", "",
           "| call | what differs | real → emulated | condition | why |",
           "| --- | --- | --- | --- | --- |"]
    for e in EXPECTED:
        vals = "" if (e.real, e.emulated) == ("*", "*") else f"{e.real} → {e.emulated}"
        what = e.what.replace("[[]*[]]", "[i]")
        out.append(f"| `{e.call}` | {what} | {vals} | {e.only} | {e.reason} |")
    return "\n".join(out) + "\n"
