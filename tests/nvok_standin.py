"""Run a command with a stand-in NVIDIA driver that says NV_OK to everything: every ioctl
whose type is 'F' (NV_IOCTL_MAGIC) returns 0 without reaching any file and without
touching its argument, so an RM call comes back with the status its caller put in (0,
NV_OK) and its parameters as sent — what tests/test_real_lane.py's stand-in driver nodes
(/dev/null's device, whose ioctls answer ENOTTY) cannot give. The kernel does it: a seccomp
filter of this process and its children whose action for those calls is ERRNO(0) (the
system call is skipped and returns 0).

Usage: python3 nvok_standin.py COMMAND [ARG...] (root: installs the filter without
no_new_privs, so the command keeps its privileges).

Used for the broker's process only (the tenant's own continued calls meet the stand-in
nodes as before): its listener threads' driver calls on duplicates of tenant files, its
adoption probes, its relay."""
from __future__ import annotations

import ctypes
import os
import sys

from devbroker.sandbox import seccompwire as w

SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000


def nv_ok_filter() -> bytes:
    a = w._Asm()
    a.ld(w.OFF_ARCH)
    a.jmp(w.BPF_JEQ, w.AUDIT_ARCH_X86_64, 0, "allow")
    a.ld(w.OFF_NR)
    a.jmp(w.BPF_JEQ, w.NR["ioctl"], 0, "allow")
    a.ld(w.OFF_ARG_LO(1))
    a.and_(0xFF00)
    a.jmp(w.BPF_JEQ, 0x4600, 0, "allow")
    a.ret(SECCOMP_RET_ERRNO | 0)
    a.label("allow")
    a.ret(SECCOMP_RET_ALLOW)
    return a.assemble()


def install() -> None:
    prog = nv_ok_filter()
    buf = ctypes.create_string_buffer(prog, len(prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(w.NR["seccomp"]), ctypes.c_long(w.SECCOMP_SET_MODE_FILTER),
                    ctypes.c_long(0), ctypes.byref(fprog)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"seccomp(SET_MODE_FILTER): {os.strerror(e)}")


if __name__ == "__main__":
    install()
    os.execvp(sys.argv[1], sys.argv[1:])
