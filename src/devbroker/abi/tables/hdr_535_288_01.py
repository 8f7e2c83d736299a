"""GENERATED layout table: do not edit by hand; regenerate (see docs/abi.md).

Read from NVIDIA open-gpu-kernel-modules tag 535.288.01 headers by devbroker's header reader, written
in devbroker's own field DSL (see spec.parse_fields).  Only what differs from the 580.142 table (hdr_580_142): changed or added entries, and entries the 535 headers do not have.
"""
# fmt: off
TAG = '535.288.01'
STRUCTS_CHANGED = {
    'NV0000_ALLOC_PARAMETERS': ('hClient:handle processID:u32 processName:bytes[100]', 'src/common/sdk/nvidia/inc/class/cl0000.h'),
    'NV0000_CTRL_GPU_GET_PROBED_IDS_PARAMS': ('gpuIds:u32[32] excludedGpuIds:u32[32]', 'src/common/sdk/nvidia/inc/ctrl/ctrl0000/ctrl0000gpu.h'),
    'NV0080_CTRL_GPU_GET_CLASSLIST_V2_PARAMS': ('numClasses:u32 classList:u32[160]', 'src/common/sdk/nvidia/inc/ctrl/ctrl0080/ctrl0080gpu.h'),
    'NV0080_CTRL_GPU_GET_VIRTUALIZATION_MODE_PARAMS': ('virtualizationMode:u32', 'src/common/sdk/nvidia/inc/ctrl/ctrl0080/ctrl0080gpu.h'),
    'NV00DE_ALLOC_PARAMETERS': ('reserved:u32', 'src/common/sdk/nvidia/inc/class/cl00de.h'),
    'NV00FD_ALLOCATION_PARAMETERS': ('alignment:u64 allocSize:u64 pageSize:u32 allocFlags:u32 numGpus:u32 pOsEvent:ptr', 'src/common/sdk/nvidia/inc/class/cl00fd.h'),
    'NV2080_CTRL_CE_GET_ALL_CAPS_PARAMS': ('capsTbl:bytes[64] present:u32', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080ce.h'),
    'NV2080_CTRL_CMD_BUS_GET_C2C_INFO_PARAMS': ('bIsLinkUp:bool nrLinks:u32 maxNrLinks:u32 linkMask:u32 perLinkBwMBps:u32 perLinkLaneWidth:u32 remoteType:u32', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080bus.h'),
    'NV2080_CTRL_CMD_BUS_GET_PCIE_SUPPORTED_GPU_ATOMICS_PARAMS': ('atomicOp:NV2080_CTRL_CMD_BUS_GET_PCIE_SUPPORTED_GPU_ATOMICS_PARAMS__atomicOp[13]', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080bus.h'),
    'NV2080_CTRL_CMD_BUS_GET_PCIE_SUPPORTED_GPU_ATOMICS_PARAMS__atomicOp': ('bSupported:bool attributes:u32', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080bus.h'),
    'NV2080_CTRL_CMD_GET_GPU_FABRIC_PROBE_INFO_PARAMS': ('state:u8 status:status clusterUuid:bytes[16] fabricPartitionId:u16 fabricCaps:u64', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080gpu.h'),
    'NV2080_CTRL_CMD_NVLINK_GET_NVLINK_STATUS_PARAMS': ('enabledLinkMask:u32 bSublinkStateInst:bool linkInfo:NV2080_CTRL_NVLINK_LINK_STATUS_INFO[32]', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080nvlink.h'),
    'NV2080_CTRL_FB_GET_INFO_V2_PARAMS': ('fbInfoListSize:u32 fbInfoList:NVXXXX_CTRL_XXX_INFO[54]', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080fb.h'),
    'NV2080_CTRL_GPU_GET_ENGINES_V2_PARAMS': ('engineCount:u32 engineList:u32[62]', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080gpu.h'),
    'NV2080_CTRL_GPU_GET_INFO_V2_PARAMS': ('gpuInfoListSize:u32 gpuInfoList:NVXXXX_CTRL_XXX_INFO[64]', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080gpu.h'),
    'NV2080_CTRL_GPU_QUERY_ECC_STATUS_PARAMS': ('units:NV2080_CTRL_GPU_QUERY_ECC_UNIT_STATUS[24] bFatalPoisonError:bool uncorrectableError:u8 flags:u32 grRouteInfo:NV0080_CTRL_GR_ROUTE_INFO', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080gpu.h'),
    'NV2080_CTRL_GPU_SET_PARTITION_INFO': ('swizzId:u32 partitionFlag:u32 bValid:bool placement:NV2080_CTRL_GPU_PARTITION_SPAN', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080gpu.h'),
    'NV2080_CTRL_GR_GET_GLOBAL_SM_ORDER_PARAMS__globalSmId': ('gpcId:u16 localTpcId:u16 localSmId:u16 globalTpcId:u16 virtualGpcId:u16 migratableTpcId:u16', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080gr.h'),
    'NV2080_CTRL_NVLINK_DEVICE_INFO': ('deviceIdFlags:u32 domain:u32 bus:u16 device:u16 function:u16 pciDeviceId:u32 deviceType:u64 deviceUUID:bytes[16]', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080nvlink.h'),
    'NV2080_CTRL_NVLINK_LINK_STATUS_INFO': ('capsTbl:u32 phyType:u8 subLinkWidth:u8 linkState:u32 rxSublinkStatus:u8 txSublinkStatus:u8 bLaneReversal:bool nvlinkVersion:u8 nciVersion:u8 phyVersion:u8 nvlinkLinkClockKHz:u32 nvlinkCommonClockSpeedKHz:u32 nvlinkRefClkSpeedKHz:u32 nvlinkCommonClockSpeedMhz:u32 nvlinkLineRateMbps:u32 nvlinkLinkClockMhz:u32 nvlinkRefClkType:u8 nvlinkLinkDataRateKiBps:u32 nvlinkRefClkSpeedMhz:u32 connected:bool loopProperty:u8 remoteDeviceLinkNumber:u8 localDeviceLinkNumber:u8 remoteLinkSid:u64 localLinkSid:u64 laneRxdetStatusMask:u32 remoteDeviceInfo:NV2080_CTRL_NVLINK_DEVICE_INFO localDeviceInfo:NV2080_CTRL_NVLINK_DEVICE_INFO', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080nvlink.h'),
    'NV2080_CTRL_PERF_RATED_TDP_CONTROL_PARAMS': ('client:u32 input:u32', 'src/common/sdk/nvidia/inc/ctrl/ctrl2080/ctrl2080perf.h'),
    'NVA06F_CTRL_GPFIFO_SCHEDULE_PARAMS': ('bEnable:bool bSkipSubmit:bool', 'src/common/sdk/nvidia/inc/ctrl/ctrla06f/ctrla06fgpfifo.h'),
    'NVOS32_PARAMETERS__data__AllocHintAlignment': ('alignType:u32 alignAttr:u32 alignInputFlags:u32 alignSize:u64 alignHeight:u32 alignWidth:u32 alignPitch:u32 alignPad:u32 alignMask:u32 alignOutputFlags:u32[4] alignBank:u32[4] alignKind:u32 alignAdjust:u32 alignAttr2:u32', 'src/common/sdk/nvidia/inc/nvos.h'),
    'NVOS32_PARAMETERS__data__AllocSize': ('owner:u32 hMemory:handle type:u32 flags:u32 attr:u32 format:u32 comprCovg:u32 zcullCovg:u32 partitionStride:u32 width:u32 height:u32 size:u64 alignment:u64 offset:u64 limit:u64 address:ptr rangeBegin:u64 rangeEnd:u64 attr2:u32 ctagOffset:u32', 'src/common/sdk/nvidia/inc/nvos.h'),
    'NVOS32_PARAMETERS__data__AllocSizeRange': ('owner:u32 hMemory:handle type:u32 flags:u32 attr:u32 format:u32 comprCovg:u32 zcullCovg:u32 partitionStride:u32 size:u64 alignment:u64 offset:u64 limit:u64 rangeBegin:u64 rangeEnd:u64 address:ptr attr2:u32 ctagOffset:u32', 'src/common/sdk/nvidia/inc/nvos.h'),
    'NVOS32_PARAMETERS__data__AllocTiledPitchHeight': ('owner:u32 hMemory:handle type:u32 flags:u32 height:u32 pitch:i32 attr:u32 width:u32 format:u32 comprCovg:u32 zcullCovg:u32 partitionStride:u32 size:u64 alignment:u64 offset:u64 limit:u64 address:ptr rangeBegin:u64 rangeEnd:u64 attr2:u32 ctagOffset:u32', 'src/common/sdk/nvidia/inc/nvos.h'),
    'NVOS32_PARAMETERS__data__Dump': ('flags:u32 pBuffer:ptr numBlocks:u32', 'src/common/sdk/nvidia/inc/nvos.h'),
    'NVOS46_PARAMETERS': ('hClient:handle hDevice:handle hDma:handle hMemory:handle offset:u64 length:u64 flags:u32 dmaOffset:u64 status:status', 'src/common/sdk/nvidia/inc/nvos.h'),
    'NVOS47_PARAMETERS': ('hClient:handle hDevice:handle hDma:handle hMemory:handle flags:u32 dmaOffset:u64 status:status', 'src/common/sdk/nvidia/inc/nvos.h'),
    'NV_CHANNEL_ALLOC_PARAMS': ('hObjectError:handle hObjectBuffer:handle gpFifoOffset:u64 gpFifoEntries:u32 flags:u32 hContextShare:handle hVASpace:handle hUserdMemory:handle[8] userdOffset:u64[8] engineType:u32 cid:u32 subDeviceId:u32 hObjectEccError:handle instanceMem:NV_MEMORY_DESC_PARAMS userdMem:NV_MEMORY_DESC_PARAMS ramfcMem:NV_MEMORY_DESC_PARAMS mthdbufMem:NV_MEMORY_DESC_PARAMS hPhysChannelGroup:handle internalFlags:u32 errorNotifierMem:NV_MEMORY_DESC_PARAMS eccErrorNotifierMem:NV_MEMORY_DESC_PARAMS ProcessID:u32 SubProcessID:u32 encryptIv:u32[3] decryptIv:u32[3] hmacNonce:u32[8]', 'src/common/sdk/nvidia/inc/alloc/alloc_channel.h'),
    'NV_CONF_COMPUTE_CTRL_CMD_SYSTEM_GET_CAPABILITIES_PARAMS': ('cpuCapability:u8 gpusCapability:u8 environment:u8 ccFeature:u8 devToolsMode:u8', 'src/common/sdk/nvidia/inc/ctrl/ctrlcb33.h'),
    'NV_MEMORY_ALLOCATION_PARAMS': ('owner:u32 type:u32 flags:u32 width:u32 height:u32 pitch:i32 attr:u32 attr2:u32 format:u32 comprCovg:u32 zcullCovg:u32 rangeLo:u64 rangeHi:u64 size:u64 alignment:u64 offset:u64 limit:u64 address:ptr ctagOffset:u32 hVASpace:handle internalflags:u32 tag:u32', 'src/common/sdk/nvidia/inc/nvos.h'),
    'NV_VASPACE_ALLOCATION_PARAMETERS': ('index:u32 flags:u32 vaSize:u64 vaStartInternal:u64 vaLimitInternal:u64 bigPageSize:u32 vaBase:u64', 'src/common/sdk/nvidia/inc/nvos.h'),
    'UVM_ALLOC_SEMAPHORE_POOL_PARAMS': ('base:u64 length:u64 perGpuAttributes:UvmGpuMappingAttributes[32] gpuAttributesCount:u64 rmStatus:status', 'kernel-open/nvidia-uvm/uvm_ioctl.h'),
    'UVM_MAP_EXTERNAL_ALLOCATION_PARAMS': ('base:u64 length:u64 offset:u64 perGpuAttributes:UvmGpuMappingAttributes[32] gpuAttributesCount:u64 rmCtrlFd:i32 hClient:u32 hMemory:u32 rmStatus:status', 'kernel-open/nvidia-uvm/uvm_ioctl.h'),
    'UVM_MIGRATE_PARAMS': ('base:u64 length:u64 destinationUuid:NvUuid flags:u32 semaphoreAddress:u64 semaphorePayload:u32 cpuNumaNode:u32 userSpaceStart:u64 userSpaceLength:u64 rmStatus:status', 'kernel-open/nvidia-uvm/uvm_ioctl.h'),
    'UVM_SET_PREFERRED_LOCATION_PARAMS': ('requestedBase:u64 length:u64 preferredLocation:NvUuid rmStatus:status', 'kernel-open/nvidia-uvm/uvm_ioctl.h'),
    'nv_ioctl_export_to_dma_buf_fd_t': ('fd:i32 hClient:handle totalObjects:u32 numObjects:u32 index:u32 totalSize:u64 handles:handle[128] offsets:u64[128] sizes:u64[128] status:status', 'kernel-open/common/inc/nv-ioctl.h'),
}

STRUCTS_REMOVED = ['NV0000_CTRL_GPU_ACTIVE_DEVICE',
 'NV0000_CTRL_GPU_ASYNC_ATTACH_ID_PARAMS',
 'NV0000_CTRL_GPU_GET_ACTIVE_DEVICE_IDS_PARAMS',
 'NV0000_CTRL_NVD_GET_NVLOG_BUFFER_INFO_PARAMS',
 'NV0000_CTRL_NVD_GET_NVLOG_INFO_PARAMS',
 'NV0000_CTRL_NVD_GET_NVLOG_PARAMS',
 'NV0080_CTRL_PERF_CUDA_LIMIT_CONTROL_PARAMS',
 'NV00DE_CTRL_REQUEST_DATA_POLL_PARAMS',
 'NV00F1_ALLOCATION_PARAMETERS',
 'NV2080_CTRL_BUS_PCIE_GPU_ATOMIC_OP_INFO',
 'NV2080_CTRL_ECC_INJECT_ERROR_PARAMS',
 'NV2080_CTRL_GRMGR_GR_FS_INFO_CHIPLET_GRAPHICS_SYSPIPE_MASK_PARAMS',
 'NV2080_CTRL_GRMGR_GR_FS_INFO_GFX_CAPABLE_GPC_MASK_PARAMS',
 'NV2080_CTRL_NVLINK_LINK_MASK',
 'NV_EXPORT_MEM_PACKET',
 'NV_LOCKLESS_DIAGNOSTIC_PARAMS',
 'NV_LOCKLESS_DIAGNOSTIC_PARAMS__params',
 'UVM_ALLOC_DEVICE_P2P_PARAMS',
 'UVM_CLEAR_ALL_ACCESS_COUNTERS_PARAMS',
 'UVM_DISCARD_PARAMS',
 'eccLocation',
 'nv_ioctl_wait_open_complete_t']

CONTROLS_CHANGED = {
}

CONTROLS_REMOVED = [0x288, 0x289, 0x801909, 0xde0001, 0x20803403]

CLASSES_CHANGED = {
}

CLASSES_REMOVED = []

UVM_CHANGED = {
}

UVM_REMOVED = [0x4e, 0x4f, 0x50]

SIZES_CHANGED = {
    'NV0000_ALLOC_PARAMETERS': 108,
    'NV0000_CTRL_GPU_GET_PROBED_IDS_PARAMS': 256,
    'NV0080_CTRL_GPU_GET_CLASSLIST_V2_PARAMS': 644,
    'NV0080_CTRL_GPU_GET_VIRTUALIZATION_MODE_PARAMS': 4,
    'NV00DE_ALLOC_PARAMETERS': 4,
    'NV00FD_ALLOCATION_PARAMETERS': 40,
    'NV2080_CTRL_CE_GET_ALL_CAPS_PARAMS': 68,
    'NV2080_CTRL_CMD_BUS_GET_PCIE_SUPPORTED_GPU_ATOMICS_PARAMS': 104,
    'NV2080_CTRL_CMD_BUS_GET_PCIE_SUPPORTED_GPU_ATOMICS_PARAMS__atomicOp': 8,
    'NV2080_CTRL_CMD_GET_GPU_FABRIC_PROBE_INFO_PARAMS': 40,
    'NV2080_CTRL_CMD_NVLINK_GET_NVLINK_STATUS_PARAMS': 5896,
    'NV2080_CTRL_FB_GET_INFO_V2_PARAMS': 436,
    'NV2080_CTRL_GPU_GET_ENGINES_V2_PARAMS': 252,
    'NV2080_CTRL_GPU_GET_INFO_V2_PARAMS': 516,
    'NV2080_CTRL_GPU_QUERY_ECC_STATUS_PARAMS': 984,
    'NV2080_CTRL_GPU_SET_PARTITIONS_PARAMS': 264,
    'NV2080_CTRL_GPU_SET_PARTITION_INFO': 32,
    'NV2080_CTRL_GR_GET_GLOBAL_SM_ORDER_PARAMS': 6168,
    'NV2080_CTRL_GR_GET_GLOBAL_SM_ORDER_PARAMS__globalSmId': 12,
    'NV2080_CTRL_NVLINK_DEVICE_INFO': 48,
    'NV2080_CTRL_NVLINK_LINK_STATUS_INFO': 184,
    'NV2080_CTRL_PERF_RATED_TDP_CONTROL_PARAMS': 8,
    'NVA06F_CTRL_GPFIFO_SCHEDULE_PARAMS': 2,
    'NVOS32_PARAMETERS__data__AllocHintAlignment': 88,
    'NVOS32_PARAMETERS__data__AllocSize': 112,
    'NVOS32_PARAMETERS__data__AllocSizeRange': 104,
    'NVOS32_PARAMETERS__data__AllocTiledPitchHeight': 112,
    'NVOS32_PARAMETERS__data__Dump': 24,
    'NVOS46_PARAMETERS': 56,
    'NVOS47_PARAMETERS': 40,
    'NV_CHANNEL_ALLOC_PARAMS': 360,
    'NV_CONF_COMPUTE_CTRL_CMD_SYSTEM_GET_CAPABILITIES_PARAMS': 5,
    'NV_MEMORY_ALLOCATION_PARAMS': 120,
    'NV_VASPACE_ALLOCATION_PARAMETERS': 48,
    'UVM_ALLOC_SEMAPHORE_POOL_PARAMS': 1184,
    'UVM_MAP_EXTERNAL_ALLOCATION_PARAMS': 1200,
    'nv_ioctl_export_to_dma_buf_fd_t': 2600,
}

SIZES_REMOVED = ['NV0000_CTRL_GPU_ACTIVE_DEVICE',
 'NV0000_CTRL_GPU_ASYNC_ATTACH_ID_PARAMS',
 'NV0000_CTRL_GPU_GET_ACTIVE_DEVICE_IDS_PARAMS',
 'NV0000_CTRL_NVD_GET_NVLOG_BUFFER_INFO_PARAMS',
 'NV0000_CTRL_NVD_GET_NVLOG_INFO_PARAMS',
 'NV0000_CTRL_NVD_GET_NVLOG_PARAMS',
 'NV0080_CTRL_PERF_CUDA_LIMIT_CONTROL_PARAMS',
 'NV00DE_CTRL_REQUEST_DATA_POLL_PARAMS',
 'NV00F1_ALLOCATION_PARAMETERS',
 'NV2080_CTRL_BUS_PCIE_GPU_ATOMIC_OP_INFO',
 'NV2080_CTRL_ECC_INJECT_ERROR_PARAMS',
 'NV2080_CTRL_GRMGR_GR_FS_INFO_CHIPLET_GRAPHICS_SYSPIPE_MASK_PARAMS',
 'NV2080_CTRL_GRMGR_GR_FS_INFO_GFX_CAPABLE_GPC_MASK_PARAMS',
 'NV2080_CTRL_NVLINK_LINK_MASK',
 'NV_EXPORT_MEM_PACKET',
 'NV_LOCKLESS_DIAGNOSTIC_PARAMS',
 'NV_LOCKLESS_DIAGNOSTIC_PARAMS__params',
 'UVM_ALLOC_DEVICE_P2P_PARAMS',
 'UVM_CLEAR_ALL_ACCESS_COUNTERS_PARAMS',
 'UVM_DISCARD_PARAMS',
 'eccLocation',
 'nv_ioctl_wait_open_complete_t']
