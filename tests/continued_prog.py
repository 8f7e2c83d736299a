"""A tenant program of tests/test_real_lane.py's settled-continuations test, against a
stand-in driver that answers NV_OK to every call the broker makes (nvok_standin.py) and
stand-in nodes whose own ioctls answer the tenant ENOTTY (a continued call reaches the
node: ENOTTY; a refused one gets the broker's answer). A root client of its own (adopted
by the broker at its first control), then UVM commands many times each on its UVM file:
one that names nothing (INITIALIZE), one that names the tenant's client
(REGISTER_GPU), the same naming a client that is not the tenant's; two that the filter
lets the kernel run unasked (CREATE_RANGE_GROUP, and REGISTER_CHANNEL naming a client that
is not the tenant's: rules.kernel_commands); RM_MAP_MEMORY of the
tenant's memory objects through its GPU file or no file, of memory it does not hold, and
through a file that is not one of its NVIDIA files; and — after the
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
out["initialize"] = uvm(u, "UVM_INITIALIZE", REPEAT)
# in-kernel rows (rules.kernel_commands): the filter lets them reach the node unasked, the
# one naming a client that is not the tenant's too (the real driver refuses that one)
out["range_group"] = uvm(u, "UVM_CREATE_RANGE_GROUP", REPEAT)
out["channel_foreign"] = uvm(u, "UVM_REGISTER_CHANNEL", 3, rmCtrlFd=ctl, hClient=FOREIGN)
out["register_own"] = uvm(u, "UVM_REGISTER_GPU", REPEAT, rmCtrlFd=ctl, hClient=CLIENT)
out["register_foreign"] = uvm(u, "UVM_REGISTER_GPU", 3, rmCtrlFd=ctl, hClient=FOREIGN)
# RM_MAP_MEMORY (a continue decision naming the client's device and memory and an fd):
# a device and three system-memory objects (booked by the broker), then mappings of each
# through the tenant's GPU file and with no file (-1), of memory the books do not hold, and
# through a file that is not an NVIDIA file of the tenant's (/dev/null, opened by itself)
DEVICE, MEMORY = 0xC1D000D1, [0xC1D000F1 + i for i in range(3)]
dev_params = ctypes.create_string_buffer(
    abi.struct("NV0080_ALLOC_PARAMETERS").decode(
        bytes(abi.struct("NV0080_ALLOC_PARAMETERS").size)).replace(deviceId=0).encode())
out["device"] = escape(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                       hObjectParent=CLIENT, hObjectNew=DEVICE, hClass=0x80,
                       pAllocParms=ctypes.addressof(dev_params),
                       paramsSize=len(dev_params.raw))[1].status
mem_spec = abi.struct("NV_MEMORY_ALLOCATION_PARAMS")
mem_params = ctypes.create_string_buffer(mem_spec.decode(bytes(mem_spec.size)).replace(
    owner=CLIENT, flags=0xC101, size=1 << 20).encode())
out["memory"] = sorted({escape(ctl, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=CLIENT,
                               hObjectParent=DEVICE, hObjectNew=h, hClass=0x3E,
                               pAllocParms=ctypes.addressof(mem_params),
                               paramsSize=0)[1].status for h in MEMORY})
gpu = os.open("/dev/nvidia0", os.O_RDWR)
null = os.open("/dev/null", os.O_RDWR)


def map_memory(memory: int, fd: int, times: int) -> list:
    seen: list = []
    for _ in range(times):
        spec = abi.struct("nv_ioctl_nvos33_parameters_with_fd")  # (its field named fd)
        buf = bytearray(spec.decode(bytes(spec.size)).replace(
            params={"hClient": CLIENT, "hDevice": DEVICE, "hMemory": memory, "length": 4096},
            fd=fd).encode())
        try:
            fcntl.ioctl(ctl, abi.escape_cmd("NV_ESC_RM_MAP_MEMORY", len(buf)), buf, True)
            err = 0
        except OSError as e:
            err = e.errno or errno.EIO
        time.sleep(0.002)
        got = [err, spec.decode(bytes(buf)).params.status]
        if got not in seen:
            seen.append(got)
    return seen


out["map_own"] = [map_memory(m, gpu, 4) for m in MEMORY]
out["map_no_file"] = map_memory(MEMORY[0], -1, 3)
out["map_unknown_memory"] = map_memory(0xBAD0BAD0, gpu, 3)
out["map_null_file"] = map_memory(MEMORY[1], null, 3)
# OS events (NV_ESC_ALLOC_OS_EVENT / FREE_OS_EVENT: a client handle and an fd): on the
# tenant's GPU file, then on a file that is not an NVIDIA file of the tenant's


def os_event(name: str, fd: int, times: int) -> list:
    seen: list = []
    spec = abi.escape(name).params  # (its field named fd: built here, as map_memory's)
    for _ in range(times):
        buf = bytearray(spec.decode(bytes(spec.size)).replace(
            hClient=CLIENT, hDevice=DEVICE, fd=fd).encode())
        try:
            fcntl.ioctl(ctl, abi.escape_cmd(name, len(buf)), buf, True)
            err = 0
        except OSError as e:
            err = e.errno or errno.EIO
        time.sleep(0.002)
        got = [err, spec.decode(bytes(buf)).Status]
        if got not in seen:
            seen.append(got)
    return seen


out["event_own"] = os_event("NV_ESC_ALLOC_OS_EVENT", gpu, 5)
out["event_free_own"] = os_event("NV_ESC_FREE_OS_EVENT", gpu, 5)
out["event_null_file"] = os_event("NV_ESC_ALLOC_OS_EVENT", null, 3)
# the client freed: the broker forgets it (and what the loop settled on it)
out["free"] = escape(ctl, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=CLIENT,
                     hObjectParent=0, hObjectOld=CLIENT)[1].status
out["register_freed"] = uvm(u, "UVM_REGISTER_GPU", 3, rmCtrlFd=ctl, hClient=CLIENT)
out["initialize_after"] = uvm(u, "UVM_INITIALIZE", 3)
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
