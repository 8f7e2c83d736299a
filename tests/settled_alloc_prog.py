"""A tenant program of tests/test_real_lane.py's settled-allocations test, against a stand-in
driver that answers NV_OK to every call the broker makes (nvok_standin.py): a root client of
its own (continued; adopted at its first control), a device, then HOPPER_DMA_COPY_A objects
(a class the allocation lane takes on its header alone) in three rounds — under the device,
then one under each object of the first round (new parents; each after a control
on the device), system memory, then under the device again
until the broker refuses one (the tenant's limits.rm_objects) — then frees of every object it
made (the broker frees only what its books hold: each allocation must have been booked,
whoever admitted it). Prints one JSON line: each round's statuses and errnos."""
from __future__ import annotations

import ctypes
import json
import os
import sys

import rm_escape
from rm_escape import ABI as abi, escape as call

N = int(sys.argv[1]) if len(sys.argv) > 1 else 12
CLIENT, DEVICE = 0xC1D00001, 0xC1D000D0
COPY = 0xC8B5  # HOPPER_DMA_COPY_A: NVB0B5_ALLOCATION_PARAMETERS, nothing the broker checks


def alloc(parent: int, new: int, cls: int = COPY, params: str = "NVB0B5_ALLOCATION_PARAMETERS",
          size0: bool = True, **fields) -> list[int]:
    return rm_escape.alloc(ctl, CLIENT, parent, new, cls, params, size0, **fields)


def free(parent: int, old: int) -> list[int]:
    return rm_escape.free(ctl, CLIENT, parent, old)


ctl = os.open("/dev/nvidiactl", os.O_RDWR)
out: dict = {}
out["root"], out["adopt"] = rm_escape.own_client(ctl, CLIENT)  # (adopted at its control)
out["device"] = alloc(CLIENT, DEVICE, 0x80, "NV0080_ALLOC_PARAMETERS", size0=False, deviceId=0)
if len(sys.argv) > 2 and sys.argv[2] == "race":
    # One thread allocates, another frees each new object the moment the first has its
    # answer (with two listener threads, the free's decision may come while the
    # allocation's booking is still being written): every free must find it booked.
    import queue
    import threading

    handles: queue.SimpleQueue = queue.SimpleQueue()
    got: list = []

    def freer() -> None:
        while (h := handles.get()) is not None:
            got.append(free(DEVICE, h))

    th = threading.Thread(target=freer)
    th.start()
    allocs = []
    for i in range(N):
        r = alloc(DEVICE, 0xC1A00000 + i)
        allocs.append(r)
        handles.put(0xC1A00000 + i)
    handles.put(None)
    th.join()
    out["race_allocs"] = sorted(set(map(tuple, allocs)))
    out["race_frees"] = sorted(set(map(tuple, got)))
    out["race_count"] = len(got)
    print(json.dumps(out), flush=True)
    sys.exit(0)
first = [0xC1E00000 + i for i in range(N)]
out["under_device"] = [alloc(DEVICE, h) for h in first]
# each preceded by a control on the device (the first the broker decides, with nothing to
# do after it: the loop's next call, a settled allocation, follows a decision that never
# reached on_finish — NVML's init does this)
virt = abi.control(0x800289).params  # NV0080_CTRL_CMD_GPU_GET_VIRTUALIZATION_MODE
under_new, controls = [], []
for p in first:
    vb = ctypes.create_string_buffer(bytes(virt.size), virt.size)
    err, v = call(ctl, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=CLIENT,
                  hObject=DEVICE, cmd=0x800289, params=ctypes.addressof(vb),
                  paramsSize=virt.size)
    controls.append([err, v.status])
    under_new.append(alloc(p, p + 0x8000))
out["under_new"] = under_new
out["controls"] = sorted(set(map(tuple, controls)))
made = [(DEVICE, h) for h in first] + [(p, p + 0x8000) for p in first]
# system memory (NV01_MEMORY_SYSTEM, whose check is its `address` pointer being NULL): four
# with it NULL, then one with it set (the loop's own check sends that one the broker's way)
SYSMEM = [0xC1B00000 + i for i in range(5)]
out["sysmem"] = [alloc(DEVICE, h, 0x3E, "NV_MEMORY_ALLOCATION_PARAMS", owner=CLIENT,
                       flags=0xC101, size=1 << 20, address=0x1000 if i == 4 else 0)
                 for i, h in enumerate(SYSMEM)]
made += [(DEVICE, h) for h, r in zip(SYSMEM, out["sysmem"]) if r == [0, 0]]
until = []
for i in range(200):  # (the limit comes first)
    h = 0xC1F00000 + i
    r = alloc(DEVICE, h)
    until.append(r)
    if r != [0, 0]:
        break
    made.append((DEVICE, h))
out["until_refused"] = [len(until) - 1, until[-1]]
out["frees"] = sorted({tuple(free(p, h)) for p, h in reversed(made)})
out["made"] = len(made)
# last, a call the broker answers on its general path (a free naming no client of the
# tenant's): what the loop counted before it is in the broker's books when this returns
err, v = call(ctl, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=0, hObjectParent=0,
              hObjectOld=0)
out["last"] = [err, v.status]
print(json.dumps(out), flush=True)
