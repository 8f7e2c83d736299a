"""A tenant program of tests/test_real_lane.py's root-client test, against a stand-in driver
that answers NV_OK to every call the broker makes (nvok_standin.py): what NVML does on each
init, three times — open a fresh nvidiactl, allocate a root client itself (the kernel runs
it in the tenant: the stand-in node answers ENOTTY), name it in a control (the broker adopts
it) — then a second root client on the same file (the broker allocates that one itself:
NV_OK from the stand-in), and a control on it. Prints one JSON line: per round, the first
root's errno, the adopting control's [errno, status], the second root's [errno, status],
the control on it."""
from __future__ import annotations

import ctypes
import json
import os

import rm_escape
from rm_escape import escape

rounds = []
for i in range(3):
    ctl = os.open("/dev/nvidiactl", os.O_RDWR)
    first, second = 0xC1D00010 + i, 0xC1D00020 + i
    root, adopt = rm_escape.own_client(ctl, first)
    err, v = escape(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=second,
                    hObjectParent=second, hObjectNew=second, hClass=0x41)
    b = ctypes.create_string_buffer(4)
    c_err, c = escape(ctl, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=second,
                      hObject=second, cmd=0x1F0, params=ctypes.addressof(b), paramsSize=4)
    rounds.append([root, adopt, [err, v.status], [c_err, c.status]])
print(json.dumps({"rounds": rounds}), flush=True)
