"""A tenant program of tests/test_real_lane.py's settled id-filter test, against a stand-in
driver that answers NV_OK to every call the broker makes (nvok_standin.py) and leaves the
parameters as sent: a root client of its own (continued; adopted at its first control),
then GET_PROBED_IDS and GET_ATTACHED_IDS many times, each with lists the stand-in "answers"
as the tenant filled them — another GPU's id (0x7) first, the tenant's (0x6) second, a
flag per id, an excluded id — so that what comes back is the broker's filter of them.
Prints one JSON line: the distinct answers of each control."""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time

from rm_escape import ABI as abi, escape as call

REPEAT = int(sys.argv[1]) if len(sys.argv) > 1 else 20
CLIENT = 0xC1D00001
INVALID = 0xFFFFFFFF
keep = []
out: dict = {"errors": []}


def control(cmd: int, **fields) -> list:
    spec = abi.control(cmd).params
    b = ctypes.create_string_buffer(spec.decode(bytes(spec.size)).replace(**fields).encode(),
                                    spec.size)
    keep.append(b)
    err, v = call(ctl, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=CLIENT,
                  hObject=CLIENT, cmd=cmd, params=ctypes.addressof(b), paramsSize=spec.size)
    time.sleep(0.002)  # (the broker writes down what it settles after its answer)
    got = spec.decode(b.raw[:spec.size])
    return [err, v.status] + [list(getattr(got, f.name))[:3] for f in spec.fields]


def ids(*first) -> list:
    return list(first) + [INVALID] * (32 - len(first))


ctl = os.open("/dev/nvidiactl", os.O_RDWR)
out["root"] = call(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                   hObjectParent=CLIENT, hObjectNew=CLIENT, hClass=0x41)[0]
for name, cmd, fields in (
        ("probed", 0x214, {"gpuIds": ids(0x7, 0x6), "excludedGpuIds": ids(0x9),
                           "gpuFlags": [0x11, 0x22] + [0x33] * 30}),
        ("attached", 0x201, {"gpuIds": ids(0x7, 0x6, 0x8)})):
    seen = []
    for _ in range(REPEAT):
        r = control(cmd, **fields)
        if r not in seen:
            seen.append(r)
    out[name] = seen
out["last"] = call(ctl, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=0, hObjectParent=0,
                   hObjectOld=0)[1].status
print(json.dumps(out), flush=True)
