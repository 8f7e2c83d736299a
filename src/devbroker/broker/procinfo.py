"""What the broker reads about a caller from /proc (pid namespaces and their numbering)."""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass


def pid_namespace(pid: int) -> str | None:
    """The pid namespace of a process ("pid:[4026531836]"), or None if it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def pid_in_own_namespace(pid: int) -> int:
    """The innermost pid of a process (NSpid's last field), as the process itself sees it."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except OSError:
        pass
    return pid


# -- stat that never waits on a file system's server ----------------------------------------

class _Statx(ctypes.Structure):
    # struct statx (include/uapi/linux/stat.h), the fields used here; 256 bytes in all
    _fields_ = [("mask", ctypes.c_uint32), ("blksize", ctypes.c_uint32),
                ("attributes", ctypes.c_uint64), ("nlink", ctypes.c_uint32),
                ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32), ("mode", ctypes.c_uint16),
                ("_spare0", ctypes.c_uint16), ("ino", ctypes.c_uint64),
                ("_rest1", ctypes.c_uint8 * 88),
                ("rdev_major", ctypes.c_uint32), ("rdev_minor", ctypes.c_uint32),
                ("dev_major", ctypes.c_uint32), ("dev_minor", ctypes.c_uint32),
                ("_rest2", ctypes.c_uint8 * 112)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                        ctypes.c_void_p]
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_STATX_DONT_SYNC = 0x4000
_STATX_BASIC_STATS = 0x7FF


@dataclass(frozen=True)
class Stat:
    st_dev: int
    st_ino: int
    st_mode: int
    st_rdev: int


def stat_nosync(path: str = "", fd: int = _AT_FDCWD) -> Stat:
    """stat(2) of a tenant's file (a path such as /proc/<tid>/fd/<n>, or an fd of the
    broker's with no path) that never asks a file system's server: with
    AT_STATX_DONT_SYNC, FUSE (and NFS, 9p) answer from the attributes they have. A plain
    stat of a file on a FUSE server the tenant runs would wait for that server.
    Device, inode, mode and rdev never change, so cached ones are right."""
    st = _Statx()
    flags = _AT_STATX_DONT_SYNC | (0 if path else _AT_EMPTY_PATH)
    if _libc.statx(fd, path.encode(), flags, _STATX_BASIC_STATS, ctypes.byref(st)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"statx {path or f'fd {fd}'}: {os.strerror(err)}")
    return Stat(os.makedev(st.dev_major, st.dev_minor), st.ino, st.mode,
                os.makedev(st.rdev_major, st.rdev_minor))
