"""Hand-written facts that the generated header tables do not carry.

* ESCAPES: escape number -> (driver name, param struct typedef).  Numbers from
  kernel-open/common/inc/nv-ioctl-numbers.h, nv-ioctl-numa.h (frontend, 'F' 200+n) and
  src/nvidia/arch/nvalloc/unix/include/nv_escape.h (RM, 'F' 0x27..0x5f); the struct each one
  takes from the `sizeof` checks in kernel-open/nvidia/nv.c and
  src/nvidia/arch/nvalloc/unix/src/escape.c.
* ANNOTATIONS: the declarative roles the C types do not say (which u32 is an fd, which
  pointer points at what, sized by which field).  Applied to every version's structs.
* UNPUBLISHED_CONTROLS: controls real clients send (seen in the shared traces, status NV_OK)
  whose numbers appear in no open-gpu-kernel-modules header: GSP firmware implements them.
  Their layout is unknown; we keep them as opaque bytes of the size the client sent, so that
  they are named (not "unknown") and round-trip, and policy can decide on them by number.
"""

# nr: (name, struct, extra)   extra: {"variants": [struct, ...]} or {"array_of": struct}
ESCAPES = {
    # ---- frontend escapes, NV_IOCTL_BASE (200) + n
    200: ("NV_ESC_CARD_INFO", None, {"array_of": "nv_ioctl_card_info_t"}),
    201: ("NV_ESC_REGISTER_FD", "nv_ioctl_register_fd_t", {}),
    206: ("NV_ESC_ALLOC_OS_EVENT", "nv_ioctl_alloc_os_event_t", {}),
    207: ("NV_ESC_FREE_OS_EVENT", "nv_ioctl_free_os_event_t", {}),
    209: ("NV_ESC_STATUS_CODE", "nv_ioctl_status_code_t", {}),
    210: ("NV_ESC_CHECK_VERSION_STR", "nv_ioctl_rm_api_version_t", {}),
    211: ("NV_ESC_IOCTL_XFER_CMD", "nv_ioctl_xfer_t", {}),
    212: ("NV_ESC_ATTACH_GPUS_TO_FD", None, {"array_of": "NvU32"}),
    213: ("NV_ESC_QUERY_DEVICE_INTR", "nv_ioctl_query_device_intr", {}),
    214: ("NV_ESC_SYS_PARAMS", "nv_ioctl_sys_params_t", {}),
    215: ("NV_ESC_NUMA_INFO", "nv_ioctl_numa_info_t", {}),
    216: ("NV_ESC_SET_NUMA_STATUS", "nv_ioctl_set_numa_status_t", {}),
    217: ("NV_ESC_EXPORT_TO_DMABUF_FD", "nv_ioctl_export_to_dma_buf_fd_t", {}),
    218: ("NV_ESC_WAIT_OPEN_COMPLETE", "nv_ioctl_wait_open_complete_t", {}),  # 580 only
    # ---- RM escapes
    0x27: ("NV_ESC_RM_ALLOC_MEMORY", "nv_ioctl_nvos02_parameters_with_fd", {}),
    0x28: ("NV_ESC_RM_ALLOC_OBJECT", "NVOS05_PARAMETERS", {}),
    0x29: ("NV_ESC_RM_FREE", "NVOS00_PARAMETERS", {}),
    0x2A: ("NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", {}),
    # the driver accepts both sizes and tells them apart by size alone (escape.c)
    0x2B: ("NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", {"variants": ["NVOS21_PARAMETERS"]}),
    0x32: ("NV_ESC_RM_CONFIG_GET", None, {}),
    0x33: ("NV_ESC_RM_CONFIG_SET", None, {}),
    0x34: ("NV_ESC_RM_DUP_OBJECT", "NVOS55_PARAMETERS", {}),
    0x35: ("NV_ESC_RM_SHARE", "NVOS57_PARAMETERS", {}),
    0x37: ("NV_ESC_RM_CONFIG_GET_EX", None, {}),
    0x38: ("NV_ESC_RM_CONFIG_SET_EX", None, {}),
    0x39: ("NV_ESC_RM_I2C_ACCESS", "NVOS_I2C_ACCESS_PARAMS", {}),
    0x41: ("NV_ESC_RM_IDLE_CHANNELS", "NVOS30_PARAMETERS", {}),
    0x4A: ("NV_ESC_RM_VID_HEAP_CONTROL", "NVOS32_PARAMETERS", {}),
    0x4D: ("NV_ESC_RM_ACCESS_REGISTRY", "NVOS38_PARAMETERS", {}),
    0x4E: ("NV_ESC_RM_MAP_MEMORY", "nv_ioctl_nvos33_parameters_with_fd", {}),
    0x4F: ("NV_ESC_RM_UNMAP_MEMORY", "NVOS34_PARAMETERS", {}),
    0x52: ("NV_ESC_RM_GET_EVENT_DATA", None, {}),
    0x54: ("NV_ESC_RM_ALLOC_CONTEXT_DMA2", "NVOS39_PARAMETERS", {}),
    0x56: ("NV_ESC_RM_ADD_VBLANK_CALLBACK", None, {}),
    0x57: ("NV_ESC_RM_MAP_MEMORY_DMA", "NVOS46_PARAMETERS", {}),
    0x58: ("NV_ESC_RM_UNMAP_MEMORY_DMA", "NVOS47_PARAMETERS", {}),
    0x59: ("NV_ESC_RM_BIND_CONTEXT_DMA", "NVOS49_PARAMETERS", {}),
    0x5C: ("NV_ESC_RM_EXPORT_OBJECT_TO_FD", None, {}),
    0x5D: ("NV_ESC_RM_IMPORT_OBJECT_FROM_FD", None, {}),
    0x5E: ("NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO", "NVOS56_PARAMETERS", {}),
    0x5F: ("NV_ESC_RM_LOCKLESS_DIAGNOSTIC", "NV_LOCKLESS_DIAGNOSTIC_PARAMS", {}),
}

# Per-version escape changes (nv-ioctl-numbers.h / nv_escape.h at the 535.288.01 tag).
ESCAPES_535 = {
    218: None,  # NV_ESC_WAIT_OPEN_COMPLETE does not exist before the 550 series
    0x5F: ("NV_ESC_RM_NVLOG_CTRL", None, {}),
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
}

# cmd -> (name, observed params size).  Name: <class prefix>_CTRL_CMD_UNPUBLISHED_<cmd>.
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
    # issue 4: nvidia-smi's queries (535.309.01 run here and the 580.159.04 relay run on the
    # H200, tests/data/h200-580.159.04-relay.nvtrace: the same size in both).
    0x2080852E: 528,
}
# Unpublished controls whose size differs between versions are left unnamed until the
# registry can take per-version sizes: 0x2080A612 (3608 bytes from NVML 535, 11680 from 580).
# 0x20800145 is in src/nvidia/generated/g_subdevice_nvoc.c's exported method table as
# subdeviceCtrlCmdGpuAcquireComputeModeReservation with paramSize 0 (580.142); the header
# name follows the driver's naming of that function.
NAMED_FROM_NVOC = {
    0x20800145: "NV2080_CTRL_CMD_GPU_ACQUIRE_COMPUTE_MODE_RESERVATION",
    0x20800146: "NV2080_CTRL_CMD_GPU_RELEASE_COMPUTE_MODE_RESERVATION",
}
