"""A tenant program of tests/test_real_lane.py's settled-continuations test, against a
stand-in driver that answers NV_OK to every call the broker makes (nvok_standin.py) and
stand-in nodes whose own ioctls answer the tenant ENOTTY (a continued call reaches the
node: ENOTTY; a refused one gets the broker's answer). A root client of its own (adopted
by the broker at its first control), then UVM commands many times each on its UVM file:
one that names nothing (CREATE_RANGE_GROUP), one that names the tenant's client
(REGISTER_GPU), the same naming a client that is not the tenant's, and — after the
tenant freed its client — the one naming it again; and one without an argument
(DEINITIALIZE). Prints one JSON line: each group's
answers as (errno, rmStatus) pairs, deduplicated in order."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import time

import rm_escape

abi = rm_escape.ABI
REPEAT = int(sys.argv[1]) if len(sys.argv) > 1 else 10
CLIENT, FOREIGN = 0xC1D00011, 0xDEAD0011
out: dict = {}


def escape(fd: int, name: str, spec_name: str, **fields) -> tuple[int, object]:
    got = rm_escape.escape(fd, name, spec_name, **fields)
    time.sleep(0.002)  # (settled_prog.control's pause: the broker writes facts after answering)
    return got


UVM = {s.name: (cmd, s) for cmd, s in abi.uvm_cmds.items()}


def uvm(fd: int, name: str, times: int, **fields) -> list:
    cmd, spec = UVM[name]
    seen: list = []
    for _ in range(times):
        buf = bytearray(spec.params.decode(bytes(spec.size)).replace(**fields).encode())
        try:
            fcntl.ioctl(fd, cmd, buf, True)
            err = 0
        except OSError as e:
            err = e.errno or errno.EIO
        got = [err, spec.params.decode(bytes(buf)).rmStatus]
        if got not in seen:
            seen.append(got)
        time.sleep(0.002)
    return seen


ctl = os.open("/dev/nvidiactl", os.O_RDWR)
out["root"] = escape(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                     hObjectParent=CLIENT, hObjectNew=CLIENT, hClass=0x41)[0]
# a control on the client: the broker adopts it (the stand-in answers NV_OK)
import ctypes  # noqa: E402

block = ctypes.create_string_buffer(4)
err, v = escape(ctl, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=CLIENT, hObject=CLIENT,
                cmd=0x1F0, params=ctypes.addressof(block), paramsSize=4)
out["adopted"] = [err, v.status]
u = os.open("/dev/nvidia-uvm", os.O_RDWR)
out["range_group"] = uvm(u, "UVM_CREATE_RANGE_GROUP", REPEAT)
out["register_own"] = uvm(u, "UVM_REGISTER_GPU", REPEAT, rmCtrlFd=ctl, hClient=CLIENT)
out["register_foreign"] = uvm(u, "UVM_REGISTER_GPU", 3, rmCtrlFd=ctl, hClient=FOREIGN)
# the client freed: the broker forgets it (and what the loop settled on it)
out["free"] = escape(ctl, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=CLIENT,
                     hObjectParent=0, hObjectOld=CLIENT)[1].status
out["register_freed"] = uvm(u, "UVM_REGISTER_GPU", 3, rmCtrlFd=ctl, hClient=CLIENT)
out["range_group_after"] = uvm(u, "UVM_CREATE_RANGE_GROUP", 3)
# a command without an argument (UVM_DEINITIALIZE): continued as well
seen_bare: list = []
for _ in range(5):
    try:
        fcntl.ioctl(u, UVM["UVM_DEINITIALIZE"][0], 0)
        got_bare = 0
    except OSError as e:
        got_bare = e.errno or errno.EIO
    if got_bare not in seen_bare:
        seen_bare.append(got_bare)
    time.sleep(0.002)
out["deinitialize"] = seen_bare
# last, a call the broker answers on its general path: what the loop counted before it is
# in the broker's books when this returns
out["last"] = escape(ctl, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=0, hObjectParent=0,
                     hObjectOld=0)[1].status
print(json.dumps(out), flush=True)
