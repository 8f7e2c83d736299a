"""A tenant program of tests/test_real_lane.py's settled embedded-buffer test, against a
stand-in driver that answers NV_OK to every call the broker makes (nvok_standin.py): a root
client of its own (continued; adopted at its first control), a device, then CUDA's
FIFO_GET_CHANNELLIST on the device many times — two embedded lists of numChannels handles
(the broker copies both in, gives the driver its copies, and writes them back on NV_OK) —
with a NULL output list, with a list in memory the tenant does not have, and with lists
past what the lane carries. Prints one JSON line: each call's errno, status and the lists
as the call left them."""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time

from rm_escape import ABI as abi, escape as call

REPEAT = int(sys.argv[1]) if len(sys.argv) > 1 else 20
CLIENT, DEVICE = 0xC1D00001, 0xC1D000D0
CHANNELLIST = 0x80170D
spec = abi.control(CHANNELLIST).params
out: dict = {"errors": []}
keep = []


def u32s(values) -> tuple[ctypes.Array, int]:
    b = (ctypes.c_uint32 * max(1, len(values)))(*values)
    keep.append(b)
    return b, ctypes.addressof(b)


def channellist(n: int, handles_ptr: int, list_ptr: int) -> tuple[int, int]:
    params = ctypes.create_string_buffer(spec.decode(bytes(spec.size)).replace(
        numChannels=n, pChannelHandleList=handles_ptr, pChannelList=list_ptr).encode(),
        spec.size)
    keep.append(params)
    err, v = call(ctl, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=CLIENT,
                  hObject=DEVICE, cmd=CHANNELLIST, params=ctypes.addressof(params),
                  paramsSize=spec.size)
    # the parameter block as the call left it: the tenant's own pointers, never the broker's
    got = spec.decode(params.raw[:spec.size])
    if (got.pChannelHandleList, got.pChannelList, got.numChannels) != (handles_ptr, list_ptr, n):
        out["errors"].append(["pointers changed", got.pChannelHandleList, got.pChannelList])
    time.sleep(0.002)  # (the broker writes down what it settles after its answer)
    return err, v.status


ctl = os.open("/dev/nvidiactl", os.O_RDWR)
out["root"] = call(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                   hObjectParent=CLIENT, hObjectNew=CLIENT, hClass=0x41)[0]
dev = ctypes.create_string_buffer(abi.struct("NV0080_ALLOC_PARAMETERS").size)
err, v = call(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT, hObjectParent=CLIENT,
              hObjectNew=DEVICE, hClass=0x80, pAllocParms=ctypes.addressof(dev),
              paramsSize=len(dev.raw))
out["device"] = [err, v.status]
# the same call many times; the stand-in leaves the lists as the driver got them, so what
# comes back is the broker's copy of what was sent, written back on NV_OK
seen = []
for i in range(REPEAT):
    handles, hp = u32s([0xCAFE0000 + i, 0xCAFE1000 + i, 0xCAFE2000 + i])
    ids, ip = u32s([0xEEEE0000 + i] * 3)
    err, status = channellist(3, hp, ip)
    r = [err, status, list(handles) == [0xCAFE0000 + i, 0xCAFE1000 + i, 0xCAFE2000 + i],
         list(ids) == [0xEEEE0000 + i] * 3]
    if r not in seen:
        seen.append(r)
out["lists"] = seen
# a NULL output list: reaches the driver as NULL (no buffer behind it)
handles, hp = u32s([1, 2])
out["null_list"] = list(channellist(2, hp, 0))
# an output list in memory the tenant does not have (unmapped after the mapping)
m = mmap.mmap(-1, 4096)
gone = ctypes.addressof(ctypes.c_char.from_buffer(m))
del m  # (no live export of the buffer: the page is unmapped now)
out["unmapped_list"] = list(channellist(2, hp, gone))
# 12,000 channels: 48,000 bytes per list, 96,000 in all — past what the lane carries (64
# KiB), within what the general path copies per buffer
big = 12000
bh, bhp = u32s(list(range(big)))
bi, bip = u32s([7] * big)
r = channellist(big, bhp, bip)
out["big"] = [*r, list(bh[:3]) == [0, 1, 2], bi[big - 1] == 7]
# once more the common case (the fact still stands)
handles, hp = u32s([5, 6, 7])
ids, ip = u32s([0, 0, 0])
out["again"] = [*channellist(3, hp, ip), list(handles) == [5, 6, 7]]
out["last"] = call(ctl, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=0, hObjectParent=0,
                   hObjectOld=0)[1].status
print(json.dumps(out), flush=True)
