"""Compile an OCI ``linux.seccomp`` section with the system's libseccomp, the way runc 1.1
does (libcontainer/seccomp: seccomp_init(default action), the listed architectures, one
``seccomp_rule_add_array`` per rule with every comparison of the rule, or one rule per
comparison where two compare the same argument), and export the BPF program it would load.

runc prepends an ENOSYS stub only when the default action is not "allow"; devbroker's
sections allow by default, so the exported program is what runc installs. libseccomp2 is a
dependency of Debian's runc (scripts/install-container-runtimes.sh).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import tempfile

ACTIONS = {"SCMP_ACT_ALLOW": 0x7FFF0000, "SCMP_ACT_NOTIFY": 0x7FC00000,
           "SCMP_ACT_KILL": 0x00000000, "SCMP_ACT_KILL_THREAD": 0x00000000,
           "SCMP_ACT_KILL_PROCESS": 0x80000000, "SCMP_ACT_ERRNO": 0x00050000,
           "SCMP_ACT_TRAP": 0x00030000, "SCMP_ACT_LOG": 0x7FFC0000}
ARCHES = {"SCMP_ARCH_X86_64": 0xC000003E, "SCMP_ARCH_X86": 0x40000003,
          "SCMP_ARCH_X32": 0x4000003E}
OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4,
       "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7}
SCMP_FLTATR_CTL_NNP = 3


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _lib():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _action(name: str, errno_ret: int | None) -> int:
    act = ACTIONS[name]
    if name == "SCMP_ACT_ERRNO":
        act |= errno.EPERM if errno_ret is None else errno_ret
    return act


def compile_section(section: dict) -> bytes:
    """The BPF program (struct sock_filter[] bytes) runc would install for ``section``."""
    lib = _lib()
    default = _action(section["defaultAction"], section.get("defaultErrnoRet"))
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        for arch in section.get("architectures", []):
            rc = lib.seccomp_arch_add(ctx, ARCHES[arch])
            if rc not in (0, -errno.EEXIST):
                raise OSError(-rc, f"seccomp_arch_add {arch}")
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0)
        for rule in section.get("syscalls", []):
            act = _action(rule["action"], rule.get("errnoRet"))
            if act == default:
                continue  # runc skips rules that repeat the default action
            conds = [ArgCmp(a["index"], OPS[a["op"]], a["value"], a.get("valueTwo", 0))
                     for a in rule.get("args", [])]
            same_arg = len({c.arg for c in conds}) != len(conds)
            groups = [[c] for c in conds] if same_arg else [conds]
            for name in rule["names"]:
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr < 0:
                    continue  # runc: unknown to this libseccomp, ignored
                for group in groups:
                    arr = (ArgCmp * max(1, len(group)))(*group)
                    rc = lib.seccomp_rule_add_array(ctx, act, nr, len(group), arr)
                    if rc != 0:
                        raise OSError(-rc, f"seccomp_rule_add_array {name} {rule}")
        with tempfile.TemporaryFile() as f:
            rc = lib.seccomp_export_bpf(ctx, f.fileno())
            if rc != 0:
                raise OSError(-rc, "seccomp_export_bpf")
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)
