"""The ``createContainer`` hook: the tenant's driver views inside a container.

NVML decides whether a driver is there, and how to treat ``/dev/nvidia*``, from files a
container runtime cannot provide with plain mounts: ``/sys/module/nvidia/initstate`` (sysfs
refuses a mount point that does not exist), ``/proc/driver/nvidia/params`` with
``ModifyDeviceFiles: 0`` and ``/proc/devices`` with an ``nvidia-uvm`` line (runc refuses
mounts under ``/proc`` outside a short list). So, as NVIDIA's own CDI specs do for
``params`` (nvidia-cdi-hook ``disable-device-node-modification``), a hook does it. The
runtime runs ``createContainer`` hooks in the container's mount namespace after the
configured mounts and before ``pivot_root``, the state on stdin. The hook

1. reads the state (``bundle``) and the bundle's ``config.json`` (``root.path``);
2. opens the container's ``proc`` and ``sys`` *inside* the root (``openat2`` with
   ``RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS``: an image cannot redirect them to the host) and
   checks they are procfs and sysfs (the runtime's mounts, not directories of the image);
3. mounts there, through ``/proc/self/fd/N``, what ``devbroker exec`` mounts in its sandbox
   (the same functions: ``sandbox.mount_proc_driver_view`` / ``mount_sys_module_view``):
   ``/proc/driver`` holding only the tenant's ``nvidia/`` view, ``/proc/devices`` with the
   NVIDIA majors, ``/sys/module`` holding ``nvidia/initstate``, ``version`` and
   ``nvidia_uvm/initstate``; all read-only.

The views come from the broker's FUSE tree (``RUN_DIR/nodes/<tenant>/proc/driver/nvidia``),
the ``nvidia-uvm`` major from the same function the broker's stat shim uses, so the numbers
agree.
"""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

PROC_SUPER_MAGIC = 0x9FA0
SYSFS_MAGIC = 0x62656572
_NR_OPENAT2 = 437
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_IN_ROOT = 0x10
_O_PATH = getattr(os, "O_PATH", 0o10000000)


class HookError(RuntimeError):
    pass


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _open_in_root(rootfd: int, rel: str) -> int:
    how = _OpenHow(_O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0,
                   RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS)
    fd = _libc.syscall(ctypes.c_long(_NR_OPENAT2), ctypes.c_long(rootfd),
                       ctypes.c_char_p(rel.encode()), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise HookError(f"{rel} in the container root: {os.strerror(err)}")
    return int(fd)


def _fs_type(fd: int) -> int:
    buf = _Statfs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        raise HookError(f"fstatfs: {os.strerror(ctypes.get_errno())}")
    return buf.f_type & 0xFFFFFFFF


def container_root(state: dict) -> Path:
    """The container's root file system from the runtime's state (bundle + root.path)."""
    bundle = state.get("bundle")
    if not isinstance(bundle, str) or not bundle.startswith("/"):
        raise HookError(f"state without an absolute bundle path: {bundle!r}")
    try:
        config = json.loads((Path(bundle) / "config.json").read_text())
        root = config["root"]["path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HookError(f"{bundle}/config.json: no root.path ({e})") from None
    return Path(root) if root.startswith("/") else Path(bundle) / root


def install_views(root: Path, tenant_dir: Path, *, host_proc_devices: str | None = None) -> dict:
    """Mount the tenant's views into the container root (in this mount namespace)."""
    from devbroker.sandbox.statshim import proc_devices_view
    from devbroker.sandbox.sandbox import (_driver_version_from, mount_proc_driver_view,
                                           mount_sys_module_view)

    if not (tenant_dir / "proc" / "driver" / "nvidia").is_dir():
        raise HookError(f"{tenant_dir}: not a tenant directory of a running broker")
    if host_proc_devices is None:
        with open("/proc/devices") as f:
            host_proc_devices = f.read()
    devices, uvm = proc_devices_view(host_proc_devices)
    rootfd = os.open(root, _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        proc = _open_in_root(rootfd, "proc")
        try:
            if _fs_type(proc) != PROC_SUPER_MAGIC:
                raise HookError(f"{root}/proc is not a procfs (mount proc there in config.json)")
            mount_proc_driver_view(f"/proc/self/fd/{proc}", tenant_dir, devices)
        finally:
            os.close(proc)
        # Mounts go on children of the fd's directory: a path through /proc/self/fd/N lands on
        # N's own mount and dentry and does not see a mount stacked on that very dentry.
        sys_fd = _open_in_root(rootfd, "sys")
        try:
            if _fs_type(sys_fd) != SYSFS_MAGIC:
                raise HookError(f"{root}/sys is not a sysfs (mount sysfs on /sys)")
            mount_sys_module_view(f"/proc/self/fd/{sys_fd}/module", tenant_dir,
                                  _driver_version_from(tenant_dir))
        finally:
            os.close(sys_fd)
    finally:
        os.close(rootfd)
    return {"root": str(root), "uvm_major": uvm}


def run_hook(state_text: str, tenant_dir: Path) -> dict:
    try:
        state = json.loads(state_text)
    except ValueError as e:
        raise HookError(f"the runtime's state on stdin is not JSON: {e}") from None
    if not isinstance(state, dict):
        raise HookError("the runtime's state on stdin is not a JSON object")
    return install_views(container_root(state), tenant_dir)
