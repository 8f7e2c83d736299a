"""A tenant program of tests/test_real_lane.py's settled-controls test, against a stand-in
driver that answers NV_OK to every call the broker makes (nvok_standin.py): a root client
of its own (continued: the stand-in node answers the tenant ENOTTY; the broker adopts the
client at its first control), a device and a subdevice, then the same controls many
times — a plain one on the client, FB_GET_INFO_V2 on the subdevice (its answer patched
with the tenant's quota and use) — around a 64 MiB allocation and its free. Prints one
JSON line: each call's errno and status, and the memory FB info showed at each step."""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time

from rm_escape import ABI as abi, escape

REPEAT = int(sys.argv[1]) if len(sys.argv) > 1 else 20
CLIENT, DEVICE, SUBDEVICE, MEMORY = 0xC1D00001, 0xC1D000D0, 0xC1D000E0, 0xC1D000F0
TOTAL, FREE = 0x08, 0x16  # FB_INFO_INDEX_TOTAL_RAM_SIZE, HEAP_FREE (KiB)
out: dict = {"errors": []}
keep = []  # parameter blocks stay alive while the driver may write them


call = escape  # (tests/rm_escape.py)


def block(data: bytes) -> tuple[ctypes.Array, int]:
    b = ctypes.create_string_buffer(data, len(data))
    keep.append(b)
    return b, ctypes.addressof(b)


def alloc(fd, parent, new, cls, params_name=None, **params) -> tuple[int, int]:
    ptr, size = 0, 0
    if params_name is not None:
        spec = abi.struct(params_name)
        _b, ptr = block(spec.decode(bytes(spec.size)).replace(**params).encode())
        size = spec.size
    err, v = call(fd, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                  hObjectParent=parent, hObjectNew=new, hClass=cls, pAllocParms=ptr,
                  paramsSize=size)
    time.sleep(0.002)  # (as in control())
    return err, v.status


def control(fd, obj, cmd, data: bytes) -> tuple[int, int, bytes]:
    b, ptr = block(data)
    err, v = call(fd, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=CLIENT, hObject=obj,
                  cmd=cmd, params=ptr, paramsSize=len(data))
    # (the broker writes down what it may settle after it answered: a pause, so that the
    # test's counts do not depend on which comes first on a loaded machine)
    time.sleep(0.002)
    return err, v.status, bytes(b.raw)


def fb_info(fd, obj=None) -> list:
    spec = abi.control(0x20801303).params
    v = spec.decode(bytes(spec.size))
    entries = list(v.fbInfoList)
    entries[0] = entries[0].replace(index=TOTAL)
    entries[1] = entries[1].replace(index=FREE)
    data = v.replace(fbInfoListSize=2, fbInfoList=entries).encode()
    seen = []
    for _ in range(REPEAT):
        err, status, got = control(fd, SUBDEVICE if obj is None else obj, 0x20801303, data)
        if err or status:
            out["errors"].append(["FB_GET_INFO_V2", err, status])
        r = spec.decode(got)
        seen.append((r.fbInfoList[0].data, r.fbInfoList[1].data))
    return sorted(set(seen))


ctl = os.open("/dev/nvidiactl", os.O_RDWR)
# the tenant's own root client: the kernel runs it in the tenant (the stand-in node: ENOTTY)
out["root"] = call(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                   hObjectParent=CLIENT, hObjectNew=CLIENT, hClass=0x41)[0]
# a plain control on the client, many times (the first adopts the client)
for _ in range(REPEAT):
    err, status, _got = control(ctl, CLIENT, 0x1F0, bytes(4))  # SYSTEM_GET_FEATURES
    if err or status:
        out["errors"].append(["SYSTEM_GET_FEATURES", err, status])
out["device"] = alloc(ctl, CLIENT, DEVICE, 0x80, "NV0080_ALLOC_PARAMETERS", deviceId=0)
out["subdevice"] = alloc(ctl, DEVICE, SUBDEVICE, 0x2080, "NV2080_ALLOC_PARAMETERS",
                         subDeviceId=0)
out["fb_before"] = fb_info(ctl)
out["memory"] = alloc(ctl, DEVICE, MEMORY, 0x40, "NV_MEMORY_ALLOCATION_PARAMS",
                      owner=CLIENT, flags=0x1C101, attr=0x18000000, size=64 << 20,
                      alignment=2 << 20)
out["fb_holding"] = fb_info(ctl)
out["free"] = call(ctl, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=CLIENT,
                   hObjectParent=DEVICE, hObjectOld=MEMORY)[1].status
out["fb_after"] = fb_info(ctl)
# the same again: this free is the loop's (a settled free: the free's decision was written
# down at the first one, the new memory's fact at its booking), and the books follow it
out["memory2"] = alloc(ctl, DEVICE, MEMORY + 1, 0x40, "NV_MEMORY_ALLOCATION_PARAMS",
                       owner=CLIENT, flags=0x1C101, attr=0x18000000, size=64 << 20,
                       alignment=2 << 20)
out["fb_holding2"] = fb_info(ctl)
out["free2"] = call(ctl, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=CLIENT,
                    hObjectParent=DEVICE, hObjectOld=MEMORY + 1)[1].status
out["fb_after2"] = fb_info(ctl)
# the client's control again: what the free removed was another object, so the client's
# facts still stand
for _ in range(5):
    err, status, _got = control(ctl, CLIENT, 0x1F0, bytes(4))
    if err or status:
        out["errors"].append(["SYSTEM_GET_FEATURES again", err, status])
# a control whose check is its one GPU id (GET_PCI_INFO): the tenant's GPU (0x6, the
# stand-in's 0000:00:06.0) many times, then another GPU's id (refused every time, by the
# broker's general path: the loop's check on its private copy sends it there)
pci = abi.control(0x21B).params
for what, gpu_id, times in (("pci_own", 0x6, REPEAT), ("pci_foreign", 0x7, 3)):
    seen = []
    for _ in range(times):
        err, status, got = control(ctl, CLIENT, 0x21B,
                                   pci.decode(bytes(pci.size)).replace(gpuId=gpu_id).encode())
        if [err, status] not in seen:
            seen.append([err, status])
    out[what] = seen
# a second client with its own device and subdevice: MC_GET_ARCH_INFO once on the first
# subdevice, then on the second one three times (the second subdevice's object fact is
# written at its booking, the control's at a first or second admission: the counts say
# which)
CLIENT2, DEVICE2, SUBDEVICE2 = 0xC1D00002, 0xC1D000D2, 0xC1D000E2
out["root2"] = call(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT2,
                    hObjectParent=CLIENT2, hObjectNew=CLIENT2, hClass=0x41)[0]
_b, ptr = block(bytes(4))
err, v = call(ctl, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=CLIENT2, hObject=CLIENT2,
              cmd=0x1F0, params=ptr, paramsSize=4)
out["client2"] = [err, v.status]
CLIENT, keep_client = CLIENT2, CLIENT  # (alloc() and control() name CLIENT)
out["device2"] = alloc(ctl, CLIENT2, DEVICE2, 0x80, "NV0080_ALLOC_PARAMETERS", deviceId=0)
out["subdevice2"] = alloc(ctl, DEVICE2, SUBDEVICE2, 0x2080, "NV2080_ALLOC_PARAMETERS",
                          subDeviceId=0)
CLIENT = keep_client
arch = []
for client, obj, times in ((CLIENT, SUBDEVICE, 1), (CLIENT2, SUBDEVICE2, 3)):
    CLIENT, keep_client = client, CLIENT
    for _ in range(times):
        err, status, _got = control(ctl, obj, 0x20801701, bytes(16))  # MC_GET_ARCH_INFO
        arch.append([err, status])
    CLIENT = keep_client
out["arch"] = arch
# NVML's memory query on a new subdevice (the second client's): its quota view's values
# were written with the subdevice's fact at its booking, so the loop answers it from the
# first call
CLIENT, keep_client = CLIENT2, CLIENT
out["fb_new_subdevice"] = fb_info(ctl, SUBDEVICE2)
CLIENT = keep_client
# last, a call the broker answers on its general path (a free naming no client of the
# tenant's): what the loop counted before it is in the broker's books when this returns
out["last"] = call(ctl, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=0, hObjectParent=0,
                   hObjectOld=0)[1].status
print(json.dumps(out), flush=True)
