"""A tenant program of tests/test_real_lane.py's quota-watch test, against a stand-in driver
that answers NV_OK to every call the broker makes (nvok_standin.py) and stand-in nodes whose
own ioctls answer the tenant ENOTTY. A root client (adopted by the broker at its first
control) and a device, then NV_ESC_RM_ALLOC_MEMORY of an OS descriptor (class 0x71): the
broker decides it and the kernel runs it in the tenant (the stand-in node: ENOTTY), and the
process is now watched (broker/quotawatch.py). It stays a while, so that the watch looks.
Prints one JSON line."""
from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import sys
import time

import rm_escape

abi = rm_escape.ABI
CLIENT, DEVICE = 0xC1D00021, 0xC1D000D2
STAY = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
out: dict = {}
ctl = os.open("/dev/nvidiactl", os.O_RDWR)
out["root"] = rm_escape.escape(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                               hObjectParent=CLIENT, hObjectNew=CLIENT, hClass=0x41)[0]
block = ctypes.create_string_buffer(4)
err, v = rm_escape.escape(ctl, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=CLIENT,
                          hObject=CLIENT, cmd=0x1F0, params=ctypes.addressof(block),
                          paramsSize=4)
out["adopted"] = [err, v.status]
dev_spec = abi.struct("NV0080_ALLOC_PARAMETERS")
dev_params = ctypes.create_string_buffer(dev_spec.decode(bytes(dev_spec.size))
                                         .replace(deviceId=0).encode())
out["device"] = rm_escape.escape(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                                 hObjectParent=CLIENT, hObjectNew=DEVICE, hClass=0x80,
                                 pAllocParms=ctypes.addressof(dev_params),
                                 paramsSize=len(dev_params.raw))[1].status
pages = mmap.mmap(-1, 1 << 20)
base = ctypes.addressof(ctypes.c_char.from_buffer(pages))
params = abi.struct("NVOS02_PARAMETERS")
p = params.decode(bytes(params.size)).replace(hRoot=CLIENT, hObjectParent=DEVICE,
                                              hObjectNew=0xC1D000E1, hClass=0x71,
                                              flags=0x40001010, pMemory=base,
                                              limit=(1 << 20) - 1)
spec = abi.struct("nv_ioctl_nvos02_parameters_with_fd")  # (its field named fd)
buf = bytearray(spec.decode(bytes(spec.size)).replace(params=p, fd=-1).encode())
try:
    fcntl.ioctl(ctl, abi.escape_cmd("NV_ESC_RM_ALLOC_MEMORY", len(buf)), buf, True)
    out["os_descriptor"] = 0
except OSError as e:
    out["os_descriptor"] = e.errno
time.sleep(STAY)  # watched: the quota watch looks 50 ms after the call, then every second
print(json.dumps(out), flush=True)
