"""A tenant program of tests/test_fastlane.py: a racing thread flips the GPU id in the
parameter block of NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2 between the tenant's own GPU and
another GPU's while the main thread sends the control again and again. The broker decides a
checked control on its private copy and the driver answers that copy, so every answer must
be either the own GPU's (deviceInstance 0) or a refusal; an answer for the other GPU
(deviceInstance 1) would mean the decision and the driver saw different ids.

    race_ids_prog.py OWN_ID OTHER_ID N

Prints one JSON line: counts of own answers, refusals, and answers for the other GPU.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import sys
import threading

from devbroker.tools.probe import Client

GET_ID_INFO_V2 = 0x205
SENTINEL = 0xFFFF


def main(own: int, other: int, n: int) -> int:
    c = Client()
    c.check_version()
    c.open_root()
    spec = c.abi.control(GET_ID_INFO_V2).params
    f = spec.by_name
    buf = ctypes.create_string_buffer(spec.size)
    base = ctypes.addressof(buf)
    id_at, inst_at = f["gpuId"].offset, f["deviceInstance"].offset
    hdr = bytearray(c.new("NVOS54_PARAMETERS", hClient=c.hclient, hObject=c.hclient,
                          cmd=GET_ID_INFO_V2, params=base, paramsSize=spec.size).encode())
    nr = c.abi.escape_cmd("NV_ESC_RM_CONTROL", len(hdr))
    stop = threading.Event()

    def racer() -> None:
        ids = [ctypes.c_uint32(own), ctypes.c_uint32(other)]
        k = 0
        while not stop.is_set():
            ctypes.memmove(base + id_at, ctypes.byref(ids[k & 1]), 4)
            k += 1

    got = {"own": 0, "refused": 0, "other": 0, "errno": 0}
    t = threading.Thread(target=racer, daemon=True)
    t.start()
    try:
        for _ in range(n):
            ctypes.c_uint32.from_address(base + inst_at).value = SENTINEL
            arg = bytearray(hdr)
            try:
                fcntl.ioctl(c.ctl, nr, arg, True)
            except OSError:
                got["errno"] += 1
                continue
            status = int.from_bytes(arg[28:32], "little")
            inst = ctypes.c_uint32.from_address(base + inst_at).value
            if status != 0:
                got["refused"] += 1
            elif inst == 0:
                got["own"] += 1
            elif inst == 1:
                got["other"] += 1
    finally:
        stop.set()
        t.join()
    print(json.dumps({"what": "race", **got}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1], 0), int(sys.argv[2], 0), int(sys.argv[3])))
