"""One RM escape from a tenant program (tests/settled_prog.py, tests/continued_prog.py):
the layout's fields as given, every other byte zero, the ioctl made on the fd."""
from __future__ import annotations

import errno
import fcntl

from devbroker.abi import registry

ABI = registry.get("580.159.04")


def escape(fd: int, name: str, spec_name: str, **fields) -> tuple[int, object]:
    """(errno, or 0; the argument as the call left it, decoded)."""
    spec = ABI.struct(spec_name)
    buf = bytearray(spec.decode(bytes(spec.size)).replace(**fields).encode())
    try:
        fcntl.ioctl(fd, ABI.escape_cmd(name, len(buf)), buf, True)
        err = 0
    except OSError as e:
        err = e.errno or errno.EIO
    return err, spec.decode(bytes(buf))


_KEEP: list = []  # (parameter blocks the driver may still be given: kept alive)


def alloc(fd: int, client: int, parent: int, new: int, cls: int, params: str,
          size0: bool = True, **fields) -> list[int]:
    """NV_ESC_RM_ALLOC of `cls` under `parent` with the parameter layout `params` (its fields
    as given, every other byte zero); paramsSize 0 when size0, as CUDA sends it (the driver
    reads the class's own size). [errno, status]."""
    import ctypes

    spec = ABI.struct(params)
    b = ctypes.create_string_buffer(spec.decode(bytes(spec.size)).replace(**fields).encode(),
                                    spec.size)
    _KEEP.append(b)
    err, v = escape(fd, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=client,
                    hObjectParent=parent, hObjectNew=new, hClass=cls,
                    pAllocParms=ctypes.addressof(b), paramsSize=0 if size0 else spec.size)
    return [err, v.status]


def control(fd: int, client: int, obj: int, cmd: int, **fields) -> tuple[int, int, object]:
    """NV_ESC_RM_CONTROL `cmd` on `obj`, its parameters the control's layout with the fields
    as given (every other byte zero). (errno, status, the parameters as the call left them,
    decoded)."""
    import ctypes

    spec = ABI.control(cmd).params
    b = ctypes.create_string_buffer(spec.decode(bytes(spec.size)).replace(**fields).encode(),
                                    spec.size)
    _KEEP.append(b)
    err, v = escape(fd, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=client, hObject=obj,
                    cmd=cmd, params=ctypes.addressof(b), paramsSize=spec.size)
    return err, v.status, spec.decode(bytes(b.raw))


def free(fd: int, client: int, parent: int, old: int) -> list[int]:
    """NV_ESC_RM_FREE of `old`. [errno, status]."""
    err, v = escape(fd, "NV_ESC_RM_FREE", "NVOS00_PARAMETERS", hRoot=client,
                    hObjectParent=parent, hObjectOld=old)
    return [err, v.status]


def own_client(fd: int, client: int) -> tuple[int, list[int]]:
    """The tenant's own root client as CUDA and NVML make it (the kernel runs the allocation
    in the caller: against the stand-in node, ENOTTY), then a plain control on it
    (SYSTEM_GET_FEATURES), which makes the broker adopt it. (The allocation's errno,
    [errno, status] of the control.)"""
    import ctypes

    root = escape(fd, "NV_ESC_RM_ALLOC", "NVOS64_PARAMETERS", hRoot=client,
                  hObjectParent=client, hObjectNew=client, hClass=0x41)[0]
    b = ctypes.create_string_buffer(4)
    _KEEP.append(b)
    err, v = escape(fd, "NV_ESC_RM_CONTROL", "NVOS54_PARAMETERS", hClient=client,
                    hObject=client, cmd=0x1F0, params=ctypes.addressof(b), paramsSize=4)
    return root, [err, v.status]
