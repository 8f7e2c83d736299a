"""A tenant program of tests/test_preemption_e2e.py: its own root client (handle argv[1])
and a device on GPU 0, then commands from stdin, one JSON line answered per command:

    alloc MIB HANDLE   device memory (NV01_MEMORY_LOCAL_USER) -> [errno, status]
    control            a plain control on its client (GPU_GET_ATTACHED_IDS) -> [errno, status]
    free HANDLE        -> [errno, status]
    quit

It prints {"ready": ...} once its client and device exist."""
from __future__ import annotations

import json
import os
import sys

import rm_escape

# Client handles are the driver's, host-wide: each tenant process its own (argv[1]).
CLIENT = int(sys.argv[1], 0) if len(sys.argv) > 1 else 0xC1D00001
DEVICE = 0xC1D000D0

ctl = os.open("/dev/nvidiactl", os.O_RDWR)
root = rm_escape.escape(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                        hObjectParent=CLIENT, hObjectNew=CLIENT, hClass=0x41)
device = rm_escape.alloc(ctl, CLIENT, CLIENT, DEVICE, 0x80, "NV0080_ALLOC_PARAMETERS",
                         deviceId=0)
print(json.dumps({"ready": [root[0], root[1].status, *device], "pid": os.getpid()}),
      flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "alloc":
        mib, handle = int(args[0]), int(args[1], 0)
        out = rm_escape.alloc(ctl, CLIENT, DEVICE, handle, 0x40, "NV_MEMORY_ALLOCATION_PARAMS",
                              owner=CLIENT, flags=0x1C101, attr=0x18000000, size=mib << 20,
                              alignment=2 << 20)
    elif cmd == "control":  # GPU_GET_ATTACHED_IDS on the client: a call the lanes take
        out = list(rm_escape.control(ctl, CLIENT, CLIENT, 0x201)[:2])
    elif cmd == "free":
        out = rm_escape.free(ctl, CLIENT, DEVICE, int(args[0], 0))
    else:
        break
    print(json.dumps(out), flush=True)
