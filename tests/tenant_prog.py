"""Tenant-side programs the end-to-end tests run inside `devbroker exec`.

Each sub-command does real syscalls on /dev/nvidia* and prints one JSON object per line.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import sys

from devbroker.abi import iowr
from devbroker.abi import status as nvs
from devbroker.tools.probe import Client, NvError


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def refusals() -> None:
    """A refused escape (errno), a refused class and a refused control (driver status)."""
    c = Client()
    c.check_version()
    c.open_root()
    gpu_id = c.attached_ids()[0]
    g = c.open_gpu(gpu_id)
    # NV_ESC_RM_ACCESS_REGISTRY: refused as an escape -> EPERM, like the driver refuses
    reg = c.abi.escape("NV_ESC_RM_ACCESS_REGISTRY").params
    buf = bytearray(reg.size)
    try:
        fcntl.ioctl(c.ctl, iowr(0x4D, reg.size), buf, True)
        out(what="registry", errno=0)
    except OSError as e:
        out(what="registry", errno=e.errno)
    # the debugger class 0x83de -> NV_ERR_INSUFFICIENT_PERMISSIONS in the status field
    try:
        c.alloc(g["hsubdevice"], 0x83DE)
        out(what="debugger", status=0)
    except NvError as e:
        out(what="debugger", status=e.status)
    # an ECC configuration control -> NV_ERR_INSUFFICIENT_PERMISSIONS
    cmd = 0x20800134
    spec = c.abi.control(cmd)
    params = spec.params.decode(bytes(spec.size)) if spec and spec.params else None
    try:
        if params is None:
            raise NvError("no params", nvs.NV_ERR_NOT_SUPPORTED)
        c.control(g["hsubdevice"], cmd, params)
        out(what="ecc", status=0)
    except NvError as e:
        out(what="ecc", status=e.status)


def hold(size: str) -> None:
    """Allocate device memory, report, and hold it until stdin closes or we are killed."""
    from devbroker.tools.probe import parse_size

    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    c.alloc_device_memory(g["hdevice"], parse_size(size))
    out(what="holding", pid=os.getpid(), client=c.hclient, memory=c.memory(g["hsubdevice"]))
    sys.stdin.read()


def ioctl_after_line() -> None:
    """Open the nodes, say ready, wait for a line, then try a control: report the errno."""
    c = Client()
    c.check_version()
    c.open_root()
    out(what="ready")
    sys.stdin.readline()
    try:
        c.attached_ids()
        out(what="after", errno=0)
    except OSError as e:
        out(what="after", errno=e.errno)


def foreign_client(handle: str) -> None:
    """Use another tenant's client handle: the broker must refuse it."""
    c = Client()
    c.check_version()
    c.open_root()
    mine = c.hclient
    c.hclient = int(handle, 0)
    try:
        c.attached_ids()
        out(what="foreign", status=0)
    except NvError as e:
        out(what="foreign", status=e.status)
    c.hclient = mine


def cuda_rules() -> None:
    """Calls CUDA makes whose treatment is decided case by case (broker/allow.py): PERF_BOOST
    (CUDA's own boost reaches the driver, any other is answered by the broker), a debugger
    object on the tenant's own context or on none, an OS event whose notifier is not one."""
    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    for name, flags, duration in (("boost-other", 0x01, 10), ("boost-cuda", 0x12, 0xFFFFFFFF)):
        try:
            c.control(g["hsubdevice"], 0x2080200A,
                      c.params(0x2080200A, flags=flags, duration=duration))
            out(what=name, status=0)
        except NvError as e:
            out(what=name, status=e.status)
    for name, app, obj in (("debugger-own", c.hclient, g["hsubdevice"]),
                           ("debugger-none", 0, 0)):
        try:
            c.alloc(g["hdevice"], 0x83DE, c.new("NV83DE_ALLOC_PARAMETERS", hAppClient=app,
                                                hClass3dObject=obj))
            out(what=name, status=0)
        except NvError as e:
            out(what=name, status=e.status)
    try:
        c.alloc(g["hsubdevice"], 0x79, c.new("NV0005_ALLOC_PARAMETERS", hParentClient=c.hclient,
                                             hSrcResource=g["hsubdevice"], hClass=0x78,
                                             notifyIndex=1, data=3))
        out(what="event-kernel-callback", status=0)
    except NvError as e:
        out(what="event-kernel-callback", status=e.status)


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    {"refusals": refusals, "hold": hold, "ioctl-after-line": ioctl_after_line,
     "foreign-client": foreign_client, "cuda-rules": cuda_rules}[cmd](*rest)
