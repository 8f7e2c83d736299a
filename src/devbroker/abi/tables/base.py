"""Hand-written facts that the generated header tables do not carry.

* ESCAPE_STRUCTS: escape name -> the param struct typedef it takes, from the `sizeof` checks
  in kernel-open/nvidia/nv.c and src/nvidia/arch/nvalloc/unix/src/escape.c.  The numbers are
  each tag's (the generated ESCAPES table, from nv-ioctl-numbers.h, nv-ioctl-numa.h and
  nv_escape.h).
* ANNOTATIONS: the declarative roles the C types do not say (which u32 is an fd, which
  pointer points at what, sized by which field).  Applied to every version's structs.
* UNPUBLISHED_CONTROLS: controls real clients send (seen in the shared traces, status NV_OK)
  whose numbers appear in no open-gpu-kernel-modules header: the kernel forwards them to GSP
  (GSS legacy numbers) or a BINAPI object does.  Their layout is unknown; they are kept as
  opaque bytes of the size the clients sent, so that paramsSize is checked and they
  round-trip.  Every unpublished number is named by its range (registry.
  unpublished_control_name), with or without an entry here.
"""
from __future__ import annotations

from typing import TypedDict


# escape name -> (argument struct, extra)   extra: {"variants": [struct, ...]} (other sizes the
# driver accepts) or {"array_of": struct} (an array of entries).  The numbers come from each
# tag's headers (the generated ESCAPES table); which struct each escape takes is what the
# `sizeof` checks of kernel-open/nvidia/nv.c and src/nvidia/arch/nvalloc/unix/src/escape.c say.
class EscapeExtra(TypedDict, total=False):
    variants: list[str]
    array_of: str


ESCAPE_STRUCTS: dict[str, tuple[str | None, EscapeExtra]] = {
    # ---- frontend escapes, NV_IOCTL_BASE (200) + n
    "NV_ESC_CARD_INFO": (None, {"array_of": "nv_ioctl_card_info_t"}),
    "NV_ESC_REGISTER_FD": ("nv_ioctl_register_fd_t", {}),
    "NV_ESC_ALLOC_OS_EVENT": ("nv_ioctl_alloc_os_event_t", {}),
    "NV_ESC_FREE_OS_EVENT": ("nv_ioctl_free_os_event_t", {}),
    "NV_ESC_STATUS_CODE": ("nv_ioctl_status_code_t", {}),
    "NV_ESC_CHECK_VERSION_STR": ("nv_ioctl_rm_api_version_t", {}),
    "NV_ESC_IOCTL_XFER_CMD": ("nv_ioctl_xfer_t", {}),
    "NV_ESC_ATTACH_GPUS_TO_FD": (None, {"array_of": "NvU32"}),
    "NV_ESC_QUERY_DEVICE_INTR": ("nv_ioctl_query_device_intr", {}),
    "NV_ESC_SYS_PARAMS": ("nv_ioctl_sys_params_t", {}),
    "NV_ESC_NUMA_INFO": ("nv_ioctl_numa_info_t", {}),
    "NV_ESC_SET_NUMA_STATUS": ("nv_ioctl_set_numa_status_t", {}),
    "NV_ESC_EXPORT_TO_DMABUF_FD": ("nv_ioctl_export_to_dma_buf_fd_t", {}),
    "NV_ESC_WAIT_OPEN_COMPLETE": ("nv_ioctl_wait_open_complete_t", {}),
    # ---- RM escapes
    "NV_ESC_RM_ALLOC_MEMORY": ("nv_ioctl_nvos02_parameters_with_fd", {}),
    "NV_ESC_RM_ALLOC_OBJECT": ("NVOS05_PARAMETERS", {}),
    "NV_ESC_RM_FREE": ("NVOS00_PARAMETERS", {}),
    "NV_ESC_RM_CONTROL": ("NVOS54_PARAMETERS", {}),
    # the driver accepts both sizes and tells them apart by size alone (escape.c)
    "NV_ESC_RM_ALLOC": ("NVOS64_PARAMETERS", {"variants": ["NVOS21_PARAMETERS"]}),
    "NV_ESC_RM_DUP_OBJECT": ("NVOS55_PARAMETERS", {}),
    "NV_ESC_RM_SHARE": ("NVOS57_PARAMETERS", {}),
    "NV_ESC_RM_I2C_ACCESS": ("NVOS_I2C_ACCESS_PARAMS", {}),
    "NV_ESC_RM_IDLE_CHANNELS": ("NVOS30_PARAMETERS", {}),
    "NV_ESC_RM_VID_HEAP_CONTROL": ("NVOS32_PARAMETERS", {}),
    "NV_ESC_RM_ACCESS_REGISTRY": ("NVOS38_PARAMETERS", {}),
    "NV_ESC_RM_MAP_MEMORY": ("nv_ioctl_nvos33_parameters_with_fd", {}),
    "NV_ESC_RM_UNMAP_MEMORY": ("NVOS34_PARAMETERS", {}),
    "NV_ESC_RM_ALLOC_CONTEXT_DMA2": ("NVOS39_PARAMETERS", {}),
    "NV_ESC_RM_MAP_MEMORY_DMA": ("NVOS46_PARAMETERS", {}),
    "NV_ESC_RM_UNMAP_MEMORY_DMA": ("NVOS47_PARAMETERS", {}),
    "NV_ESC_RM_BIND_CONTEXT_DMA": ("NVOS49_PARAMETERS", {}),
    "NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO": ("NVOS56_PARAMETERS", {}),
    "NV_ESC_RM_LOCKLESS_DIAGNOSTIC": ("NV_LOCKLESS_DIAGNOSTIC_PARAMS", {}),
}

# (struct, field) -> DSL type that replaces the generated one.  Only roles change; a test
# checks that sizes and offsets are unchanged by these.
ANNOTATIONS = {
    ("NVOS54_PARAMETERS", "cmd"): "cmd",
    ("NVOS54_PARAMETERS", "params"): "ptr->control@paramsSize",
    ("NVOS54_PARAMETERS", "paramsSize"): "size",
    ("NVOS21_PARAMETERS", "pAllocParms"): "ptr->class@paramsSize",
    ("NVOS21_PARAMETERS", "paramsSize"): "size",
    ("NVOS64_PARAMETERS", "pAllocParms"): "ptr->class@paramsSize",
    ("NVOS64_PARAMETERS", "paramsSize"): "size",
    ("nv_ioctl_xfer_t", "cmd"): "cmd",
    ("nv_ioctl_xfer_t", "ptr"): "ptr->xfer@size",
    ("nv_ioctl_xfer_t", "size"): "size",
    ("nv_ioctl_register_fd_t", "ctl_fd"): "fd",
    ("nv_ioctl_nvos33_parameters_with_fd", "fd"): "fd",
    ("nv_ioctl_nvos02_parameters_with_fd", "fd"): "fd",
    ("nv_ioctl_alloc_os_event_t", "fd"): "fd",
    ("nv_ioctl_free_os_event_t", "fd"): "fd",
    ("nv_ioctl_alloc_os_event_t", "Status"): "status",
    ("nv_ioctl_free_os_event_t", "Status"): "status",
    ("nv_ioctl_export_to_dma_buf_fd_t", "fd"): "fd",
    ("NVOS33_PARAMETERS", "length"): "size64",
    ("NVOS02_PARAMETERS", "limit"): "size64",
    ("NV0005_ALLOC_PARAMETERS", "data"): "ptr",
    ("NV_MEMORY_ALLOCATION_PARAMS", "size"): "size64",
    ("UVM_MAP_EXTERNAL_ALLOCATION_PARAMS", "rmCtrlFd"): "fd",
    ("UVM_MAP_EXTERNAL_ALLOCATION_PARAMS", "hClient"): "handle",
    ("UVM_MAP_EXTERNAL_ALLOCATION_PARAMS", "hMemory"): "handle",
    ("UVM_REGISTER_GPU_PARAMS", "rmCtrlFd"): "fd",
    ("UVM_REGISTER_GPU_PARAMS", "hClient"): "handle",
    ("UVM_REGISTER_GPU_PARAMS", "hSmcPartRef"): "handle",
    ("UVM_REGISTER_GPU_VASPACE_PARAMS", "rmCtrlFd"): "fd",
    ("UVM_REGISTER_GPU_VASPACE_PARAMS", "hClient"): "handle",
    ("UVM_REGISTER_GPU_VASPACE_PARAMS", "hVaSpace"): "handle",
    ("UVM_REGISTER_CHANNEL_PARAMS", "rmCtrlFd"): "fd",
    ("UVM_REGISTER_CHANNEL_PARAMS", "hClient"): "handle",
    ("UVM_REGISTER_CHANNEL_PARAMS", "hChannel"): "handle",
    ("UVM_ALLOC_SEMAPHORE_POOL_PARAMS", "length"): "size64",
    ("UVM_CREATE_EXTERNAL_RANGE_PARAMS", "length"): "size64",
    ("UVM_MM_INITIALIZE_PARAMS", "uvmFd"): "fd",
    # Embedded pointers: the driver copies these buffers in/out itself (embedded_param_copy.c),
    # so the broker must carry them too. "bytes" = an opaque buffer of size_field bytes.
    ("NV0000_CTRL_SYSTEM_GET_BUILD_VERSION_PARAMS", "sizeOfStrings"): "size",
    ("NV0000_CTRL_SYSTEM_GET_BUILD_VERSION_PARAMS", "pDriverVersionBuffer"): "ptr->bytes@sizeOfStrings",
    ("NV0000_CTRL_SYSTEM_GET_BUILD_VERSION_PARAMS", "pVersionBuffer"): "ptr->bytes@sizeOfStrings",
    ("NV0000_CTRL_SYSTEM_GET_BUILD_VERSION_PARAMS", "pTitleBuffer"): "ptr->bytes@sizeOfStrings",
    # A list of {index, data} entries, sizeField entries long.
    ("NV2080_CTRL_BUS_GET_INFO_PARAMS", "busInfoList"): "ptr->NVXXXX_CTRL_XXX_INFO@busInfoListSize",
    ("NV2080_CTRL_GR_GET_INFO_PARAMS", "grInfoList"): "ptr->NVXXXX_CTRL_XXX_INFO@grInfoListSize",
    # NV2080_CTRL_BIOS_INFO is {index, data}, the same two NvU32 as NVXXXX_CTRL_XXX_INFO
    # (ctrl2080bios.h); the header declares the params without a MESSAGE_ID.
    ("NV2080_CTRL_BIOS_GET_INFO_PARAMS", "biosInfoList"): "ptr->NVXXXX_CTRL_XXX_INFO@biosInfoListSize",
    # Two NvU32 arrays of numChannels entries (ctrl0080fifo.h; embedded_param_copy.c copies
    # both). CUDA sends it at context creation: seen on the H200 through the seccomp front end.
    ("NV0080_CTRL_FIFO_GET_CHANNELLIST_PARAMS", "numChannels"): "size",
    ("NV0080_CTRL_FIFO_GET_CHANNELLIST_PARAMS", "pChannelHandleList"): "ptr->NvU32@numChannels",
    ("NV0080_CTRL_FIFO_GET_CHANNELLIST_PARAMS", "pChannelList"): "ptr->NvU32@numChannels",
    # NV0041_CTRL_SURFACE_INFO is {index, data}, two NvU32 (ctrl0041.h), copied in and out by
    # embedded_param_copy.c. NCCL's CUDA asks it of imported memory (seen on the two-H200 host).
    ("NV0041_CTRL_GET_SURFACE_INFO_PARAMS", "surfaceInfoListSize"): "size",
    ("NV0041_CTRL_GET_SURFACE_INFO_PARAMS", "surfaceInfoList"): "ptr->NVXXXX_CTRL_XXX_INFO@surfaceInfoListSize",
}

# cmd -> observed params size (the same at 535 and 580 where both were seen).
UNPUBLISHED_CONTROLS = {
    0x20809001: 8,
    0x20809009: 8,
    0x20809038: 4,
    0x20809064: 520,
    0x20808159: 332,
    0x20808162: 1,
    0x2080A026: 532,
    0x2080A084: 4,
    0x20810108: 992,
    # nvidia-smi's queries (535.309.01 run here and the 580.159.04 relay run on the
    # H200, tests/data/h200-580.159.04-relay.nvtrace: the same size in both).
    0x2080852E: 528,
}
# An unpublished control whose size differs between versions has no entry: 0x2080A612
# (3608 bytes from NVML 535, 11680 from 580).
