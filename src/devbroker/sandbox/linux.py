"""Thin ctypes wrappers for the Linux calls the sandbox needs and Python 3.11 lacks.

Each wrapper raises OSError with the call's errno and the path it was given, so a setup
failure says which step broke (``mount /proc/driver: EPERM``) rather than just "failed".
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)

# <linux/sched.h>
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000

# <linux/mount.h>
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_SYNCHRONOUS = 16
MS_REMOUNT = 32
MS_MANDLOCK = 64
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MNT_DETACH = 2

# statvfs f_flag bits (ST_*): the first four equal their MS_* twins, the atime ones do not.
_ST_TO_MS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 16: MS_SYNCHRONOUS,
             64: MS_MANDLOCK, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}

# <linux/prctl.h>
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# <linux/capability.h>: name -> number. Names without the CAP_ prefix, lower case.
CAPABILITY_NUMBERS = {
    "chown": 0, "dac_override": 1, "dac_read_search": 2, "fowner": 3, "fsetid": 4,
    "kill": 5, "setgid": 6, "setuid": 7, "setpcap": 8, "linux_immutable": 9,
    "net_bind_service": 10, "net_broadcast": 11, "net_admin": 12, "net_raw": 13,
    "ipc_lock": 14, "ipc_owner": 15, "sys_module": 16, "sys_rawio": 17, "sys_chroot": 18,
    "sys_ptrace": 19, "sys_pacct": 20, "sys_admin": 21, "sys_boot": 22, "sys_nice": 23,
    "sys_resource": 24, "sys_time": 25, "sys_tty_config": 26, "mknod": 27, "lease": 28,
    "audit_write": 29, "audit_control": 30, "setfcap": 31, "mac_override": 32,
    "mac_admin": 33, "syslog": 34, "wake_alarm": 35, "block_suspend": 36, "audit_read": 37,
    "perfmon": 38, "bpf": 39, "checkpoint_restore": 40,
}


def _check(ret: int, what: str, path: str | None = None) -> int:
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)
    return ret


def _b(s: str | os.PathLike[str] | None) -> bytes | None:
    return None if s is None else os.fsencode(s)


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str | os.PathLike[str], fstype: str | None,
          flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)),
           "mount", os.fspath(target))


# The new mount API (<linux/mount.h>; the same numbers on every architecture). Needs 5.12.
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def mount_setattr(path: str | os.PathLike[str], *, set_: int = 0, clear: int = 0,
                  recursive: bool = False, dirfd: int = AT_FDCWD) -> None:
    """Change per-mount flags of the mount at path (of its whole subtree with recursive),
    atomically: `mount -o remount,bind,ro` cannot do a subtree at once. dirfd with path ""
    acts on a detached tree from open_tree."""
    attr = _MountAttr(set_, clear, 0, 0)
    flags = (AT_RECURSIVE if recursive else 0) | (AT_EMPTY_PATH if not os.fspath(path) else 0)
    _check(_libc.syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(dirfd),
                         _b(path), ctypes.c_uint(flags), ctypes.byref(attr),
                         ctypes.c_size_t(ctypes.sizeof(attr))), "mount_setattr",
           os.fspath(path) or f"fd {dirfd}")


def open_tree_clone(path: str | os.PathLike[str], *, recursive: bool = True) -> int:
    """A detached copy of the mount tree at path (what `mount --rbind` would attach), as an
    fd to attach later with move_mount: taken now, before the view changes under path."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | (AT_RECURSIVE if recursive else 0)
    return _check(_libc.syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(AT_FDCWD),
                                _b(path), ctypes.c_uint(flags)), "open_tree", os.fspath(path))


def move_mount(tree_fd: int, target: str | os.PathLike[str]) -> None:
    """Attach a detached tree (from open_tree_clone) at target."""
    _check(_libc.syscall(ctypes.c_long(_SYS_MOVE_MOUNT), ctypes.c_int(tree_fd), b"",
                         ctypes.c_int(AT_FDCWD), _b(target),
                         ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), "move_mount",
           os.fspath(target))


_SYS_PIDFD_GETFD = 438  # same number on every architecture that has it


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """Duplicate file descriptor `fd` of the process `pidfd` names into this process
    (close-on-exec). Needs ptrace access to it. OSError: EBADF (no such fd or a bad
    number), ESRCH (the process has exited), EPERM."""
    if not isinstance(fd, int) or fd < 0 or fd > 0x7FFFFFFF:
        raise OSError(errno.EBADF, f"bad fd {fd!r}")
    return _check(_libc.syscall(ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_long(pidfd),
                                ctypes.c_long(fd), ctypes.c_long(0)), "pidfd_getfd")


def umount2(target: str | os.PathLike[str], flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), ctypes.c_int(flags)), "umount", os.fspath(target))


def mount_flags_of(path: str | os.PathLike[str]) -> int:
    """The per-mount flags of the mount at ``path`` as MS_* bits (for a bind remount, which
    replaces them all: forgetting nosuid/nodev there would silently loosen the mount)."""
    st = os.statvfs(path)
    return sum(ms for st_bit, ms in _ST_TO_MS.items() if st.f_flag & st_bit)


def remount_bind(path: str | os.PathLike[str], add: int) -> None:
    """Remount one mount point with extra flags (e.g. MS_RDONLY), keeping its others."""
    mount(None, path, None, MS_REMOUNT | MS_BIND | mount_flags_of(path) | add)


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                              ctypes.c_ulong(arg4), ctypes.c_ulong(arg5)), "prctl")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def capget() -> tuple[int, int, int]:
    """The calling thread's (effective, permitted, inheritable) capability sets."""
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capget(ctypes.byref(hdr), data), "capget")
    return (data[0].effective | (data[1].effective << 32),
            data[0].permitted | (data[1].permitted << 32),
            data[0].inheritable | (data[1].inheritable << 32))


def capset(effective: int, permitted: int, inheritable: int = 0) -> None:
    """Set the calling thread's capability sets (capset acts on one thread)."""
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    for i in range(2):
        data[i].effective = (effective >> (32 * i)) & 0xFFFFFFFF
        data[i].permitted = (permitted >> (32 * i)) & 0xFFFFFFFF
        data[i].inheritable = (inheritable >> (32 * i)) & 0xFFFFFFFF
    _check(_libc.capset(ctypes.byref(hdr), data), "capset")


def last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return max(CAPABILITY_NUMBERS.values())


def mountinfo() -> list[tuple[str, str, str]]:
    """(mount point, root within its filesystem, filesystem type) for this mount namespace."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            fstype = right.split()[0] if right else ""
            out.append((_unescape(fields[4]), _unescape(fields[3]), fstype))
    return out


def _unescape(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    if "\\" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 3 < len(s) + 1 and s[i + 1:i + 4].isdigit():
            out.append(chr(int(s[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)
