"""A tenant program of tests/test_real_lane.py's channel test, against a stand-in driver that
answers NV_OK to every call the broker makes (nvok_standin.py): a root client of its own
(continued; adopted at its first control), a device, then N rounds of a channel group
(KEPLER_CHANNEL_GROUP_A, whose after-hook gives it the tenant's compute share) with two GPFIFO
channels in it (HOPPER_CHANNEL_GPFIFO_A, paramsSize 0 as CUDA sends it), and on each channel,
as CUDA does, one copy engine object (HOPPER_DMA_COPY_A) and one GET_WORK_SUBMIT_TOKEN: a call
each object gets once. Prints one JSON line
of the statuses with "ready": true and waits for a line on stdin (the test looks at the
broker's books meanwhile), then frees the groups and prints the final JSON line."""
from __future__ import annotations

import functools
import json
import os
import sys

import rm_escape
from rm_escape import escape as call

N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
CLIENT, DEVICE = 0xC1D00001, 0xC1D000D0
GROUP, CHANNEL, COPY = 0xC1A60000, 0xC1C60000, 0xC1CE0000
GET_WORK_SUBMIT_TOKEN = 0xC36F0108


ctl = os.open("/dev/nvidiactl", os.O_RDWR)
alloc = functools.partial(rm_escape.alloc, ctl, CLIENT)  # (parent, new, class, layout, ...)
free = functools.partial(rm_escape.free, ctl, CLIENT)  # (parent, old)
out: dict = {}
out["root"], out["adopt"] = rm_escape.own_client(ctl, CLIENT)  # (adopted at its control)
out["device"] = alloc(CLIENT, DEVICE, 0x80, "NV0080_ALLOC_PARAMETERS", False, deviceId=0)
out["groups"], out["channels"], out["copies"], out["tokens"] = [], [], [], []
for i in range(N):
    out["groups"].append(alloc(DEVICE, GROUP + i, 0xA06C,
                               "NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", False,
                               engineType=1))
    for k in (2 * i, 2 * i + 1):
        out["channels"].append(alloc(GROUP + i, CHANNEL + k, 0xC86F,
                                     "NV_CHANNEL_ALLOC_PARAMS", True))
        out["copies"].append(alloc(CHANNEL + k, COPY + k, 0xC8B5,
                                   "NVB0B5_ALLOCATION_PARAMETERS", True, engineType=1))
        out["tokens"].append(rm_escape.control(ctl, CLIENT, CHANNEL + k,
                                               GET_WORK_SUBMIT_TOKEN)[:2])
print(json.dumps({**out, "ready": True}), flush=True)
sys.stdin.readline()
out["frees"] = sorted({tuple(free(DEVICE, GROUP + i)) for i in range(N)})
print(json.dumps(out), flush=True)
