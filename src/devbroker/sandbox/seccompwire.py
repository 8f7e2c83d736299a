"""Sans-IO codec for seccomp user notification, and the BPF filter of the seccomp front end.

Nothing here makes a system call: the structs are bytes in, values out, and the filter
builder is a pure function returning the ``struct sock_filter`` array. ``run_filter`` is a
small classic-BPF interpreter (only the instructions the builder emits) so that the filter's
decisions can be unit-tested without the kernel; the tests also load it into the kernel.

Layouts (``include/uapi/linux/seccomp.h``)::

    struct seccomp_data        { int nr; u32 arch; u64 instruction_pointer; u64 args[6]; }  64
    struct seccomp_notif       { u64 id; u32 pid; u32 flags; struct seccomp_data data; }   80
    struct seccomp_notif_resp  { u64 id; s64 val; s32 error; u32 flags; }                  24
    struct seccomp_notif_addfd { u64 id; u32 flags; u32 srcfd; u32 newfd; u32 newfd_flags; } 24
    struct seccomp_notif_sizes { u16 seccomp_notif; u16 seccomp_notif_resp; u16 seccomp_data; }

The kernel reports its own sizes through ``SECCOMP_GET_NOTIF_SIZES``; :class:`NotifSizes`
checks them (a kernel may only ever grow them) and the codec pads buffers to the kernel's
size (``RECV`` requires a zeroed buffer of the kernel's size; extra response bytes are zero).
"""
from __future__ import annotations

import errno as _errno
import struct
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------

SECCOMP_SET_MODE_FILTER = 1
SECCOMP_GET_NOTIF_SIZES = 3

SECCOMP_FILTER_FLAG_TSYNC = 1 << 0
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV = 1 << 5  # Linux 5.19

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_KILL_THREAD = 0x00000000
SECCOMP_RET_TRAP = 0x00030000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_USER_NOTIF = 0x7FC00000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ACTION_FULL = 0xFFFF0000
SECCOMP_RET_DATA = 0x0000FFFF

SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1 << 0
SECCOMP_ADDFD_FLAG_SETFD = 1 << 0
SECCOMP_ADDFD_FLAG_SEND = 1 << 1

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
X32_SYSCALL_BIT = 0x40000000

PR_SET_NO_NEW_PRIVS = 38

# x86_64 system call numbers used by the filter and the adapter.
NR = {
    "read": 0,
    "open": 2,
    "close": 3,
    "stat": 4,
    "fstat": 5,
    "lstat": 6,
    "mmap": 9,
    "ioctl": 16,
    "mknod": 133,
    "openat": 257,
    "mknodat": 259,
    "newfstatat": 262,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "seccomp": 317,
    "statx": 332,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "openat2": 437,
    "pidfd_getfd": 438,
}
NR_NAME = {v: k for k, v in NR.items()}

MAP_ANONYMOUS = 0x20
S_IFMT = 0o170000
S_IFCHR = 0o020000
S_IFBLK = 0o060000
AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_NO_AUTOMOUNT = 0x800
AT_EMPTY_PATH = 0x1000
AT_STATX_SYNC_TYPE = 0x6000

# The system calls that report a file's type and device number (x86_64). NVML 535 uses
# stat(2) on /dev/nvidiactl and /dev/nvidia<N>; glibc's stat/lstat/fstat are newfstatat,
# coreutils and newer libcs use statx. access/faccessat* only check permissions.
STAT_SYSCALLS = ("stat", "fstat", "lstat", "newfstatat", "statx")

# ---------------------------------------------------------------------------------------
# ioctl numbers (asm-generic encoding: nr 8 bits, type 8, size 14, dir 2)
# ---------------------------------------------------------------------------------------

from devbroker.abi.ioc import (  # noqa: E402,F401  (the arithmetic's one home)
    IOC_READ as _IOC_READ, IOC_WRITE as _IOC_WRITE, ioc as _IOC, ioc_dir as IOC_DIR,
    ioc_nr as IOC_NR, ioc_size as IOC_SIZE, ioc_type as IOC_TYPE,
)


SECCOMP_DATA_SIZE = 64
SECCOMP_NOTIF_SIZE = 80
SECCOMP_NOTIF_RESP_SIZE = 24
SECCOMP_NOTIF_ADDFD_SIZE = 24

_SECCOMP_IOC_MAGIC = ord("!")
SECCOMP_IOCTL_NOTIF_RECV = _IOC(_IOC_READ | _IOC_WRITE, _SECCOMP_IOC_MAGIC, 0, SECCOMP_NOTIF_SIZE)
SECCOMP_IOCTL_NOTIF_SEND = _IOC(_IOC_READ | _IOC_WRITE, _SECCOMP_IOC_MAGIC, 1, SECCOMP_NOTIF_RESP_SIZE)
SECCOMP_IOCTL_NOTIF_ID_VALID = _IOC(_IOC_WRITE, _SECCOMP_IOC_MAGIC, 2, 8)
SECCOMP_IOCTL_NOTIF_ADDFD = _IOC(_IOC_WRITE, _SECCOMP_IOC_MAGIC, 3, SECCOMP_NOTIF_ADDFD_SIZE)
SECCOMP_IOCTL_NOTIF_SET_FLAGS = _IOC(_IOC_WRITE, _SECCOMP_IOC_MAGIC, 4, 8)
# Linux 6.6: wake the listener on the notifying task's CPU and the task on the listener's
# when answered (the task sleeps meanwhile), instead of two cross-CPU wake-ups per call.
SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP = 1

# NVIDIA ioctls the filter sends to the supervisor.
NV_IOCTL_MAGIC = ord("F")
# UVM commands are raw numbers: UVM_IOCTL_BASE(i) == i for 1..2047 (UVM_IS_8_SUPPORTED is
# 2047), and UVM_INITIALIZE/UVM_DEINITIALIZE are 0x30000001/0x30000002.
UVM_RAW_MAX = 0x7FF
UVM_HIGH_BASE = 0x30000000
UVM_HIGH_MAX = 0x300000FF


def is_nvidia_ioctl(cmd: int) -> bool:
    """The same predicate as the filter's ioctl branch (on the low 32 bits of cmd)."""
    cmd &= 0xFFFFFFFF
    return (
        IOC_TYPE(cmd) == NV_IOCTL_MAGIC
        or 1 <= cmd <= UVM_RAW_MAX
        or UVM_HIGH_BASE <= cmd <= UVM_HIGH_MAX
    )


# ---------------------------------------------------------------------------------------
# Struct codec
# ---------------------------------------------------------------------------------------


class WireError(ValueError):
    pass


@dataclass(frozen=True)
class NotifSizes:
    notif: int
    resp: int
    data: int

    _FMT = struct.Struct("=HHH")

    @classmethod
    def decode(cls, buf: bytes) -> "NotifSizes":
        if len(buf) < cls._FMT.size:
            raise WireError(f"seccomp_notif_sizes needs 6 bytes, got {len(buf)}")
        return cls(*cls._FMT.unpack_from(buf))

    def check(self) -> "NotifSizes":
        """Refuse a kernel whose structs are smaller than the layouts this codec knows."""
        for name, have, need in (
            ("seccomp_notif", self.notif, SECCOMP_NOTIF_SIZE),
            ("seccomp_notif_resp", self.resp, SECCOMP_NOTIF_RESP_SIZE),
            ("seccomp_data", self.data, SECCOMP_DATA_SIZE),
        ):
            if have < need:
                raise WireError(f"kernel {name} is {have} bytes, codec needs >= {need}")
        if self.notif - self.data < SECCOMP_NOTIF_SIZE - SECCOMP_DATA_SIZE:
            raise WireError(f"inconsistent sizes {self}")
        return self


DEFAULT_SIZES = NotifSizes(SECCOMP_NOTIF_SIZE, SECCOMP_NOTIF_RESP_SIZE, SECCOMP_DATA_SIZE)

_DATA = struct.Struct("=iIQ6Q")
_NOTIF_HEAD = struct.Struct("=QII")
_RESP = struct.Struct("=QqiI")
_ADDFD = struct.Struct("=QIIII")


@dataclass(frozen=True)
class SeccompData:
    nr: int
    arch: int
    instruction_pointer: int
    args: tuple[int, int, int, int, int, int]

    def encode(self) -> bytes:
        return _DATA.pack(self.nr, self.arch, self.instruction_pointer, *self.args)

    @classmethod
    def decode(cls, buf: bytes, offset: int = 0) -> "SeccompData":
        if len(buf) - offset < _DATA.size:
            raise WireError("short seccomp_data")
        nr, arch, ip, *args = _DATA.unpack_from(buf, offset)
        return cls(nr, arch, ip, tuple(args))

    def arg_int(self, i: int) -> int:
        """args[i] as a C int (fd, dirfd): low 32 bits, sign-extended."""
        v = self.args[i] & 0xFFFFFFFF
        return v - (1 << 32) if v & 0x80000000 else v

    def arg_u32(self, i: int) -> int:
        return self.args[i] & 0xFFFFFFFF


@dataclass(frozen=True)
class Notif:
    id: int
    pid: int  # the notifying *thread*, in the listener owner's pid namespace
    flags: int
    data: SeccompData

    @property
    def syscall(self) -> str:
        return NR_NAME.get(self.data.nr, f"nr{self.data.nr}")

    def encode(self, sizes: NotifSizes = DEFAULT_SIZES) -> bytes:
        out = _NOTIF_HEAD.pack(self.id, self.pid, self.flags) + self.data.encode()
        return out.ljust(sizes.notif, b"\0")

    @classmethod
    def decode(cls, buf: bytes) -> "Notif":
        if len(buf) < SECCOMP_NOTIF_SIZE:
            raise WireError(f"seccomp_notif needs {SECCOMP_NOTIF_SIZE} bytes, got {len(buf)}")
        nid, pid, flags = _NOTIF_HEAD.unpack_from(buf)
        return cls(nid, pid, flags, SeccompData.decode(buf, _NOTIF_HEAD.size))


def recv_buffer(sizes: NotifSizes = DEFAULT_SIZES) -> bytearray:
    """A zeroed buffer for SECCOMP_IOCTL_NOTIF_RECV (the kernel insists on zeroes)."""
    return bytearray(max(sizes.notif, SECCOMP_NOTIF_SIZE))


@dataclass(frozen=True)
class NotifResp:
    id: int
    val: int = 0
    error: int = 0  # a negative errno, or 0
    flags: int = 0

    def encode(self, sizes: NotifSizes = DEFAULT_SIZES) -> bytes:
        if self.error > 0:
            raise WireError("seccomp_notif_resp.error must be a negative errno or 0")
        if self.flags & SECCOMP_USER_NOTIF_FLAG_CONTINUE and (self.error or self.val):
            raise WireError("CONTINUE responses must have val == error == 0")
        return _RESP.pack(self.id, self.val, self.error, self.flags).ljust(sizes.resp, b"\0")

    @classmethod
    def decode(cls, buf: bytes) -> "NotifResp":
        if len(buf) < _RESP.size:
            raise WireError("short seccomp_notif_resp")
        return cls(*_RESP.unpack_from(buf))

    @classmethod
    def ok(cls, nid: int, val: int = 0) -> "NotifResp":
        return cls(nid, val, 0, 0)

    @classmethod
    def fail(cls, nid: int, err: int) -> "NotifResp":
        if err <= 0:
            err = _errno.EIO
        return cls(nid, 0, -err, 0)

    @classmethod
    def cont(cls, nid: int) -> "NotifResp":
        return cls(nid, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE)


@dataclass(frozen=True)
class NotifAddfd:
    id: int
    srcfd: int
    flags: int = SECCOMP_ADDFD_FLAG_SEND
    newfd: int = 0
    newfd_flags: int = 0  # O_CLOEXEC or 0

    def encode(self) -> bytes:
        return _ADDFD.pack(self.id, self.flags, self.srcfd, self.newfd, self.newfd_flags)

    @classmethod
    def decode(cls, buf: bytes) -> "NotifAddfd":
        if len(buf) < _ADDFD.size:
            raise WireError(f"seccomp_notif_addfd needs {_ADDFD.size} bytes, got {len(buf)}")
        nid, flags, srcfd, newfd, newfd_flags = _ADDFD.unpack_from(buf)
        return cls(nid, srcfd, flags, newfd, newfd_flags)


def encode_id(nid: int) -> bytes:
    """The argument of SECCOMP_IOCTL_NOTIF_ID_VALID."""
    return struct.pack("=Q", nid)


# ---------------------------------------------------------------------------------------
# Classic BPF
# ---------------------------------------------------------------------------------------

BPF_LD, BPF_LDX, BPF_ALU, BPF_JMP, BPF_RET, BPF_MISC = 0x00, 0x01, 0x04, 0x05, 0x06, 0x07
BPF_W, BPF_ABS, BPF_K, BPF_X = 0x00, 0x20, 0x00, 0x08
BPF_AND = 0x50
BPF_JEQ, BPF_JGT, BPF_JGE, BPF_JSET = 0x10, 0x20, 0x30, 0x40
BPF_TAX, BPF_TXA = 0x00, 0x80

_INSN = struct.Struct("=HBBI")

OFF_NR = 0
OFF_ARCH = 4


def OFF_ARG_LO(i: int) -> int:
    """Offset of the low 32 bits of args[i] (little endian)."""
    return 16 + 8 * i


@dataclass(frozen=True)
class Insn:
    code: int
    jt: int = 0
    jf: int = 0
    k: int = 0

    def encode(self) -> bytes:
        return _INSN.pack(self.code, self.jt, self.jf, self.k & 0xFFFFFFFF)


def decode_program(buf: bytes) -> list[Insn]:
    if len(buf) % _INSN.size:
        raise WireError("BPF program length is not a multiple of 8")
    return [Insn(*_INSN.unpack_from(buf, i)) for i in range(0, len(buf), _INSN.size)]


class _Asm:
    """A tiny assembler with symbolic labels for forward jumps."""

    def __init__(self) -> None:
        # a label's name, or an instruction: (code, jt, jf, k), jumps by label or offset
        self.items: list[str | tuple[int, str | int, str | int, int]] = []

    def label(self, name: str) -> None:
        self.items.append(name)

    def ld(self, off: int) -> None:
        self.items.append((BPF_LD | BPF_W | BPF_ABS, 0, 0, off))

    def and_(self, k: int) -> None:
        self.items.append((BPF_ALU | BPF_AND | BPF_K, 0, 0, k))

    def tax(self) -> None:
        self.items.append((BPF_MISC | BPF_TAX, 0, 0, 0))

    def txa(self) -> None:
        self.items.append((BPF_MISC | BPF_TXA, 0, 0, 0))

    def jmp(self, op: int, k: int, jt: str | int, jf: str | int) -> None:
        """Jump to label jt if (A op k) else to label jf; 0 means 'the next instruction'."""
        self.items.append((BPF_JMP | op | BPF_K, jt, jf, k))

    def ret(self, k: int) -> None:
        self.items.append((BPF_RET | BPF_K, 0, 0, k))

    def assemble(self) -> bytes:
        pos: dict[str, int] = {}
        n = 0
        for it in self.items:
            if isinstance(it, str):
                pos[it] = n
            else:
                n += 1
        out = []
        i = 0
        for it in self.items:
            if isinstance(it, str):
                continue
            code, jt, jf, k = it

            def rel(t: str | int) -> int:
                if isinstance(t, int):
                    return t
                d = pos[t] - (i + 1)
                if not 0 <= d <= 255:
                    raise WireError(f"jump to {t} out of range ({d})")
                return d

            out.append(Insn(code, rel(jt), rel(jf), k).encode())
            i += 1
        if n > 4096:
            raise WireError("BPF program too long")
        return b"".join(out)


@dataclass(frozen=True)
class FilterOptions:
    notify_open: bool = True  # open, openat, openat2
    notify_ioctl: bool = True  # 'F' type and UVM command numbers
    notify_mmap: bool = True  # file-backed mmap (the adapter fills emulated pages first)
    deny_device_mknod: bool = True  # mknod/mknodat of S_IFCHR/S_IFBLK -> EPERM
    deny_open_by_handle: bool = True  # open_by_handle_at -> EPERM (bypasses path checks)
    deny_io_uring: bool = True  # io_uring_* -> ENOSYS (its openat bypasses seccomp)
    uvm_raw_max: int = UVM_RAW_MAX
    notify_stat: bool = False  # STAT_SYSCALLS -> USER_NOTIF (the stat shim, statshim.py)
    # UVM command numbers the kernel runs without a notification: a real-file tenant's
    # in-kernel rows (rules.kernel_commands). Each must be a raw UVM number (1..uvm_raw_max).
    kernel_ioctls: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = [c for c in self.kernel_ioctls
               if not isinstance(c, int) or not 1 <= c <= self.uvm_raw_max]
        if bad:
            raise ValueError(f"kernel_ioctls must be UVM command numbers 1..{self.uvm_raw_max}: "
                             f"{bad}")


def build_filter(opts: FilterOptions = FilterOptions()) -> bytes:
    """The seccomp filter of the seccomp front end, as ``struct sock_filter[]`` bytes.

    Decision table (x86_64 only; any other audit arch is SECCOMP_RET_KILL_PROCESS; x32 system
    calls (nr >= 0x40000000) fail with ENOSYS):

    ===================== ===================================================================
    open/openat/openat2   USER_NOTIF (the supervisor reads the path, opens or CONTINUEs)
    ioctl                 ALLOW for the numbers in kernel_ioctls (a real-file tenant's
                          in-kernel UVM rows); USER_NOTIF when cmd's type is 'F' or cmd
                          is a UVM number (1..uvm_raw_max, 0x30000000..0x300000ff); else
                          ALLOW
    mmap                  USER_NOTIF unless MAP_ANONYMOUS, else ALLOW
    mknod/mknodat         ERRNO(EPERM) for S_IFCHR/S_IFBLK, else ALLOW
    open_by_handle_at     ERRNO(EPERM)
    io_uring_*            ERRNO(ENOSYS)
    STAT_SYSCALLS         USER_NOTIF, only with notify_stat (off by default)
    anything else         ALLOW
    ===================== ===================================================================
    """
    a = _Asm()
    notify = SECCOMP_RET_USER_NOTIF
    a.ld(OFF_ARCH)
    a.jmp(BPF_JEQ, AUDIT_ARCH_X86_64, 0, "kill")
    a.ld(OFF_NR)
    a.jmp(BPF_JGE, X32_SYSCALL_BIT, "enosys", 0)
    if opts.notify_open:
        for name in ("openat", "open", "openat2"):
            a.jmp(BPF_JEQ, NR[name], "notify", 0)
    if opts.notify_ioctl:
        a.jmp(BPF_JEQ, NR["ioctl"], "ioctl", 0)
    if opts.notify_mmap:
        a.jmp(BPF_JEQ, NR["mmap"], "mmap", 0)
    if opts.notify_stat:
        for name in STAT_SYSCALLS:
            a.jmp(BPF_JEQ, NR[name], "notify", 0)
    if opts.deny_device_mknod:
        a.jmp(BPF_JEQ, NR["mknod"], "mknod", 0)
        a.jmp(BPF_JEQ, NR["mknodat"], "mknodat", 0)
    if opts.deny_open_by_handle:
        a.jmp(BPF_JEQ, NR["open_by_handle_at"], "eperm", 0)
    if opts.deny_io_uring:
        a.jmp(BPF_JGE, NR["io_uring_setup"], 0, "allow")
        a.jmp(BPF_JGT, NR["io_uring_register"], "allow", "enosys")
    a.label("allow")
    a.ret(SECCOMP_RET_ALLOW)

    if opts.notify_ioctl:
        a.label("ioctl")
        a.ld(OFF_ARG_LO(1))  # the kernel's ioctl cmd is an unsigned int: low 32 bits
        a.tax()
        a.and_(0xFF00)
        a.jmp(BPF_JEQ, NV_IOCTL_MAGIC << 8, "notify", 0)
        a.txa()
        a.jmp(BPF_JGE, UVM_HIGH_BASE, 0, "ioctl_low")
        a.jmp(BPF_JGT, UVM_HIGH_MAX, "allow2", "notify")
        a.label("ioctl_low")
        a.jmp(BPF_JGE, 1, 0, "allow2")
        kernel = sorted(set(opts.kernel_ioctls))
        a.jmp(BPF_JGT, opts.uvm_raw_max, "allow2", "uvm_raw" if kernel else "notify")
        if kernel:  # only raw UVM numbers come this far ('F' ioctls are decided above)
            a.label("uvm_raw")
            for i, cmd in enumerate(kernel):  # cmd is a register: nothing re-reads it
                a.jmp(BPF_JEQ, cmd, "allow2", "notify" if i == len(kernel) - 1 else 0)
    if opts.notify_mmap:
        a.label("mmap")
        a.ld(OFF_ARG_LO(3))
        a.jmp(BPF_JSET, MAP_ANONYMOUS, "allow2", "notify")
    if opts.deny_device_mknod:
        for label, argi in (("mknod", 1), ("mknodat", 2)):  # mode is args[1] / args[2]
            a.label(label)
            a.ld(OFF_ARG_LO(argi))
            a.and_(S_IFMT)
            a.jmp(BPF_JEQ, S_IFCHR, "eperm", 0)
            a.jmp(BPF_JEQ, S_IFBLK, "eperm", "allow2")
    a.label("allow2")
    a.ret(SECCOMP_RET_ALLOW)
    a.label("notify")
    a.ret(notify)
    a.label("eperm")
    a.ret(SECCOMP_RET_ERRNO | _errno.EPERM)
    a.label("enosys")
    a.ret(SECCOMP_RET_ERRNO | _errno.ENOSYS)
    a.label("kill")
    a.ret(SECCOMP_RET_KILL_PROCESS)
    return a.assemble()


# The name every broker gives the seccomp front end's node placeholders (memfd_create), and
# how /proc/<pid>/fd shows one. A memfd's name is fixed when it is made: a file that shows
# this name is a broker's placeholder (or a tenant's own file named to look like one).
PLACEHOLDER_PREFIX = "devbroker:"
PLACEHOLDER_LINK = "/memfd:" + PLACEHOLDER_PREFIX


def build_stat_shim_filter(*, notify_mmap: bool = False) -> bytes:
    """The sandbox's stat shim filter: the stat family goes to the supervisor, everything else
    is allowed.

    ===================== ===================================================================
    STAT_SYSCALLS         USER_NOTIF (x86_64 numbers, audit arch x86_64)
    mmap                  with `notify_mmap`: USER_NOTIF unless MAP_ANONYMOUS (the shim
                          refuses a broker placeholder that reached the tenant)
    anything else         ALLOW, other audit archs (i386 ``int 0x80``) and x32 included
    ===================== ===================================================================

    Unlike :func:`build_filter` this filter is not a boundary: faking a stat result grants
    nothing (the open still goes to the broker's node), so a stat the filter does not see
    (an i386 or x32 ``stat``) merely reports the node as what it really is, a regular file.
    """
    a = _Asm()
    a.ld(OFF_ARCH)
    a.jmp(BPF_JEQ, AUDIT_ARCH_X86_64, 0, "allow")
    a.ld(OFF_NR)
    for name in STAT_SYSCALLS:
        a.jmp(BPF_JEQ, NR[name], "notify", 0)
    if notify_mmap:
        a.jmp(BPF_JEQ, NR["mmap"], 0, "allow")
        a.ld(OFF_ARG_LO(3))
        a.jmp(BPF_JSET, MAP_ANONYMOUS, "allow", "notify")
    a.label("allow")
    a.ret(SECCOMP_RET_ALLOW)
    a.label("notify")
    a.ret(SECCOMP_RET_USER_NOTIF)
    return a.assemble()


# ---------------------------------------------------------------------------------------
# struct stat / struct statx (x86_64), for the stat shim
# ---------------------------------------------------------------------------------------
#
#   struct stat (asm/stat.h, x86_64)                      144 bytes
#     u64 st_dev @0, u64 st_ino @8, u64 st_nlink @16, u32 st_mode @24, u32 st_uid @28,
#     u32 st_gid @32, pad @36, u64 st_rdev @40, s64 st_size @48, s64 st_blksize @56,
#     s64 st_blocks @64, {s64 sec, u64 nsec} atime @72, mtime @88, ctime @104, s64[3] @120
#   struct statx (linux/stat.h)                           256 bytes
#     u32 stx_mask @0, u32 stx_blksize @4, u64 stx_attributes @8, u32 stx_nlink @16,
#     u32 stx_uid @20, u32 stx_gid @24, u16 stx_mode @28, u64 stx_ino @32, u64 stx_size @40,
#     u64 stx_blocks @48, u64 stx_attributes_mask @56, timestamps @64/@80/@96/@112,
#     u32 stx_rdev_major @128, u32 stx_rdev_minor @132, u32 stx_dev_major @136,
#     u32 stx_dev_minor @140, …

STAT_SIZE = 144
STATX_SIZE = 256
STATX_TYPE = 0x1
STATX_MODE = 0x2
STATX_INO = 0x100
STATX_BASIC_STATS = 0x7FF

_STAT_HEAD = struct.Struct("=QQQIII4xQqqq")
_STAT_MODE = struct.Struct("=I")
_STAT_RDEV = struct.Struct("=Q")
_STAT_OFF_MODE, _STAT_OFF_RDEV = 24, 40
_STATX_HEAD = struct.Struct("=IIQIIIH2xQQQQ")
_STATX_MODE = struct.Struct("=H")
_STATX_DEVS = struct.Struct("=IIII")
_STATX_OFF_MODE, _STATX_OFF_DEVS = 28, 128


def makedev(major: int, minor: int) -> int:
    """glibc's makedev (and the kernel's new_encode_dev for 32-bit dev_t)."""
    return ((major & 0xFFF) << 8) | ((major & ~0xFFF) << 32) | (minor & 0xFF) | ((minor & ~0xFF) << 12)


def dev_major(dev: int) -> int:
    return ((dev & 0x00000000000FFF00) >> 8) | ((dev & 0xFFFFF00000000000) >> 32)


def dev_minor(dev: int) -> int:
    return (dev & 0xFF) | ((dev & 0x00000FFFFFF00000) >> 12)


@dataclass(frozen=True)
class StatFields:
    """The fields of a struct stat / struct statx the stat shim and its tests look at."""

    dev: int
    ino: int
    mode: int
    rdev_major: int
    rdev_minor: int
    size: int
    uid: int
    gid: int


def decode_stat(buf: bytes) -> StatFields:
    if len(buf) < STAT_SIZE:
        raise WireError(f"struct stat needs {STAT_SIZE} bytes, got {len(buf)}")
    dev, ino, _nlink, mode, uid, gid, rdev, size, _blksize, _blocks = _STAT_HEAD.unpack_from(buf)
    return StatFields(dev, ino, mode, dev_major(rdev), dev_minor(rdev), size, uid, gid)


def decode_statx(buf: bytes) -> StatFields:
    if len(buf) < STATX_SIZE:
        raise WireError(f"struct statx needs {STATX_SIZE} bytes, got {len(buf)}")
    (_mask, _blksize, _attrs, _nlink, uid, gid, mode, ino, size, _blocks,
     _amask) = _STATX_HEAD.unpack_from(buf)
    rmaj, rmin, dmaj, dmin = _STATX_DEVS.unpack_from(buf, _STATX_OFF_DEVS)
    return StatFields(makedev(dmaj, dmin), ino, mode, rmaj, rmin, size, uid, gid)


def _chr_mode(mode: int) -> int:
    return S_IFCHR | (mode & 0o7777)


def fake_chr_stat(buf: bytes, major: int, minor: int) -> bytes:
    """A struct stat with the file type set to S_IFCHR (permission bits kept) and st_rdev set
    to major:minor; every other field is buf's."""
    if len(buf) < STAT_SIZE:
        raise WireError(f"struct stat needs {STAT_SIZE} bytes, got {len(buf)}")
    out = bytearray(buf[:STAT_SIZE])
    (mode,) = _STAT_MODE.unpack_from(out, _STAT_OFF_MODE)
    _STAT_MODE.pack_into(out, _STAT_OFF_MODE, _chr_mode(mode))
    _STAT_RDEV.pack_into(out, _STAT_OFF_RDEV, makedev(major, minor))
    return bytes(out)


def fake_chr_statx(buf: bytes, major: int, minor: int) -> bytes:
    """A struct statx with stx_mode's type set to S_IFCHR and stx_rdev_* to major:minor
    (stx_mask is the kernel's: the rdev fields are always filled, whatever the mask)."""
    if len(buf) < STATX_SIZE:
        raise WireError(f"struct statx needs {STATX_SIZE} bytes, got {len(buf)}")
    out = bytearray(buf[:STATX_SIZE])
    (mode,) = _STATX_MODE.unpack_from(out, _STATX_OFF_MODE)
    _STATX_MODE.pack_into(out, _STATX_OFF_MODE, _chr_mode(mode))
    rmaj, rmin, dmaj, dmin = _STATX_DEVS.unpack_from(out, _STATX_OFF_DEVS)
    _STATX_DEVS.pack_into(out, _STATX_OFF_DEVS, major, minor, dmaj, dmin)
    return bytes(out)


def run_filter(prog: bytes, data: SeccompData) -> int:
    """Interpret a classic-BPF seccomp program on one seccomp_data; returns the action word.

    Supports the instructions :func:`build_filter` emits (LD W ABS, ALU AND K, JEQ/JGT/JGE/JSET K, TAX,
    TXA, RET K). Meant for tests and for explaining decisions, not for speed.
    """
    insns = decode_program(prog)
    raw = data.encode()
    A = X = 0
    pc = 0
    for _ in range(len(insns) + 1):
        if not 0 <= pc < len(insns):
            raise WireError(f"pc {pc} out of the program")
        ins = insns[pc]
        cls = ins.code & 0x07
        if ins.code == BPF_LD | BPF_W | BPF_ABS:
            if ins.k % 4 or ins.k + 4 > len(raw):
                raise WireError(f"bad load offset {ins.k}")
            A = struct.unpack_from("=I", raw, ins.k)[0]
            pc += 1
        elif ins.code == BPF_ALU | BPF_AND | BPF_K:
            A &= ins.k
            pc += 1
        elif ins.code == BPF_MISC | BPF_TAX:
            X = A
            pc += 1
        elif ins.code == BPF_MISC | BPF_TXA:
            A = X
            pc += 1
        elif cls == BPF_JMP:
            op = ins.code & 0xF0
            if op == BPF_JEQ:
                taken = A == ins.k
            elif op == BPF_JGT:
                taken = A > ins.k
            elif op == BPF_JGE:
                taken = A >= ins.k
            elif op == BPF_JSET:
                taken = bool(A & ins.k)
            else:
                raise WireError(f"unsupported jump {ins.code:#x}")
            pc += 1 + (ins.jt if taken else ins.jf)
        elif ins.code == BPF_RET | BPF_K:
            return ins.k
        else:
            raise WireError(f"unsupported instruction {ins.code:#x}")
    raise WireError("program did not return")


def action_name(action: int) -> str:
    act = action & SECCOMP_RET_ACTION_FULL
    if act == SECCOMP_RET_ERRNO:
        return f"ERRNO({action & SECCOMP_RET_DATA})"
    return {
        SECCOMP_RET_KILL_PROCESS: "KILL_PROCESS",
        SECCOMP_RET_KILL_THREAD: "KILL_THREAD",
        SECCOMP_RET_TRAP: "TRAP",
        SECCOMP_RET_USER_NOTIF: "USER_NOTIF",
        SECCOMP_RET_ALLOW: "ALLOW",
    }.get(act, f"{action:#x}")


def syscall_data(name_or_nr: str | int, *args: int, arch: int = AUDIT_ARCH_X86_64) -> SeccompData:
    """Build a seccomp_data for tests: ``syscall_data("ioctl", 3, 0xc0104629, 0)``."""
    nr = NR[name_or_nr] if isinstance(name_or_nr, str) else name_or_nr
    full = [a & 0xFFFFFFFFFFFFFFFF for a in args] + [0] * (6 - len(args))
    return SeccompData(nr, arch, 0, tuple(full[:6]))  # type: ignore[arg-type]

