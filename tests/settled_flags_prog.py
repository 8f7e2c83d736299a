"""A tenant program of tests/test_real_lane.py's settled id-flag test, against a stand-in
driver that answers NV_OK to every call the broker makes (nvok_standin.py) and leaves the
parameters as sent: a root client of its own (continued; adopted at its first control),
then GET_ID_INFO and GET_ID_INFO_V2 on its GPU (0x6) N times each in three phases — before
it holds a device object, while it holds one, after it freed it — each time with gpuFlags
"answered" as the opposite of what the broker should show, so that what comes back is the
broker's IN_USE flag; and once with another GPU's id (0x7), which the broker refuses. Then
ATTACH_IDS and DETACH_IDS N times each with its own id (and, after the list's end, another
GPU's, which the driver does not read), with another GPU's id, and "all probed".
Prints one JSON line: the distinct (errno, status, gpuFlags) of each phase and control,
and the distinct (errno, status, first three ids) of each attach/detach list."""
from __future__ import annotations

import json
import os
import sys
import time

import rm_escape

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
CLIENT, DEVICE = 0xC1D00001, 0xC1D000D0
OWN, OTHER = 0x6, 0x7
IN_USE = 0x1
out: dict = {}


def id_info(cmd: int, gpu: int, flags: int) -> list:
    err, status, got = rm_escape.control(ctl, CLIENT, CLIENT, cmd, gpuId=gpu, gpuFlags=flags)
    time.sleep(0.002)  # (the broker writes down what it settles after its answer)
    return [err, status, got.gpuFlags]


def phase(name: str, sent: int) -> None:
    for cmd, label in ((0x202, "v1"), (0x205, "v2")):
        seen = []
        for _ in range(N):
            r = id_info(cmd, OWN, sent)
            if r not in seen:
                seen.append(r)
        out[f"{name}_{label}"] = seen


ctl = os.open("/dev/nvidiactl", os.O_RDWR)
out["root"], out["adopt"] = rm_escape.own_client(ctl, CLIENT)
phase("before", IN_USE)  # (no device yet: the flag must read clear)
out["other_gpu"] = id_info(0x202, OTHER, 0)
out["device"] = rm_escape.alloc(ctl, CLIENT, CLIENT, DEVICE, 0x80, "NV0080_ALLOC_PARAMETERS",
                                size0=False, deviceId=0)
time.sleep(0.002)
phase("holding", 0)  # (its device: set, whatever the driver says)
out["free"] = rm_escape.free(ctl, CLIENT, CLIENT, DEVICE)
time.sleep(0.002)
phase("after", IN_USE)
INVALID, ALL_PROBED = 0xFFFFFFFF, 0x0000FFFF
for label, cmd, ids in (("attach", 0x215, [OWN, INVALID, OTHER]),
                        ("detach", 0x216, [OWN, INVALID, OTHER]),
                        ("attach_other", 0x215, [OWN, OTHER, INVALID]),
                        ("attach_all", 0x215, [ALL_PROBED, INVALID, OTHER])):
    seen = []
    for _ in range(N):
        err, status, got = rm_escape.control(ctl, CLIENT, CLIENT, cmd,
                                             gpuIds=ids + [INVALID] * (32 - len(ids)))
        time.sleep(0.002)
        r = [err, status, list(got.gpuIds)[:3]]
        if r not in seen:
            seen.append(r)
    out[label] = seen
print(json.dumps(out), flush=True)
