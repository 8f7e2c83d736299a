"""Sans-IO tests of the seccomp codec and filter builder (plus loading it into the kernel)."""
from __future__ import annotations

import ctypes
import errno
import os
import struct

import pytest

from devbroker.sandbox import seccompwire as w


def _F(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


def test_ioctl_numbers_match_uapi():
    # values of the uapi header on x86_64
    assert w.SECCOMP_IOCTL_NOTIF_RECV == 0xC0502100
    assert w.SECCOMP_IOCTL_NOTIF_SEND == 0xC0182101
    assert w.SECCOMP_IOCTL_NOTIF_ID_VALID == 0x40082102
    assert w.SECCOMP_IOCTL_NOTIF_ADDFD == 0x40182103


def test_notif_roundtrip_and_padding():
    data = w.syscall_data("ioctl", 5, _F(0x2A, 32), 0x7FFF0000)
    n = w.Notif(id=0x1122334455667788, pid=4242, flags=0, data=data)
    sizes = w.NotifSizes(96, 32, 64)
    raw = n.encode(sizes)
    assert len(raw) == 96
    assert w.Notif.decode(raw) == n
    assert n.syscall == "ioctl"
    assert w.Notif.decode(raw).data.arg_int(0) == 5
    assert len(w.recv_buffer(sizes)) == 96 and not any(w.recv_buffer(sizes))


def test_arg_int_sign_extends():
    d = w.syscall_data("openat", w.AT_FDCWD & 0xFFFFFFFF, 0, 0)
    assert d.arg_int(0) == w.AT_FDCWD
    d = w.syscall_data("openat", w.AT_FDCWD)  # already sign-extended to 64 bits
    assert d.arg_int(0) == w.AT_FDCWD


def test_resp_and_addfd_encoding():
    r = w.NotifResp.fail(7, errno.EPERM)
    assert r.encode() == struct.pack("=QqiI", 7, 0, -errno.EPERM, 0)
    assert w.NotifResp.decode(r.encode()) == r
    assert len(w.NotifResp.ok(1, 3).encode(w.NotifSizes(80, 40, 64))) == 40
    c = w.NotifResp.cont(9)
    assert c.flags == w.SECCOMP_USER_NOTIF_FLAG_CONTINUE
    with pytest.raises(w.WireError):
        w.NotifResp(9, 1, 0, w.SECCOMP_USER_NOTIF_FLAG_CONTINUE).encode()
    with pytest.raises(w.WireError):
        w.NotifResp(9, 0, 5, 0).encode()
    a = w.NotifAddfd(id=3, srcfd=10, newfd_flags=os.O_CLOEXEC)
    assert a.encode() == struct.pack("=QIIII", 3, w.SECCOMP_ADDFD_FLAG_SEND, 10, 0, os.O_CLOEXEC)
    assert w.NotifAddfd.decode(a.encode()) == a


def test_sizes_check():
    assert w.NotifSizes.decode(struct.pack("=HHH", 80, 24, 64)).check() == w.DEFAULT_SIZES
    w.NotifSizes(88, 24, 72).check()  # grown kernel structs are fine
    for bad in ((72, 24, 64), (80, 16, 64), (80, 24, 56), (80, 24, 80)):
        with pytest.raises(w.WireError):
            w.NotifSizes(*bad).check()
    with pytest.raises(w.WireError):
        w.NotifSizes.decode(b"\0\0")


def test_kernel_sizes_are_accepted():
    from devbroker.frontends.seccomp import get_notif_sizes

    s = get_notif_sizes()
    assert s.notif >= 80 and s.resp >= 24 and s.data >= 64


PROG = w.build_filter()
NOTIFY, ALLOW, KILL = w.SECCOMP_RET_USER_NOTIF, w.SECCOMP_RET_ALLOW, w.SECCOMP_RET_KILL_PROCESS
EPERM = w.SECCOMP_RET_ERRNO | errno.EPERM
ENOSYS = w.SECCOMP_RET_ERRNO | errno.ENOSYS


@pytest.mark.parametrize(
    "call,want",
    [
        (("openat", -100, 0x1000, 0), NOTIFY),
        (("open", 0x1000, 0), NOTIFY),
        (("openat2", -100, 0x1000, 0x2000, 24), NOTIFY),
        (("ioctl", 3, _F(0x2A, 32), 0), NOTIFY),  # RM_CONTROL
        (("ioctl", 3, _F(0xD2, 72), 0), NOTIFY),  # CHECK_VERSION_STR
        (("ioctl", 3, 0x30000001, 0), NOTIFY),  # UVM_INITIALIZE
        (("ioctl", 3, 0x30000002, 0), NOTIFY),  # UVM_DEINITIALIZE
        (("ioctl", 3, 75, 0), NOTIFY),  # UVM_MM_INITIALIZE
        (("ioctl", 3, 0x25, 0), NOTIFY),  # UVM_REGISTER_GPU
        (("ioctl", 3, 2047, 0), NOTIFY),
        (("ioctl", 3, 2048, 0), ALLOW),
        (("ioctl", 3, 0, 0), ALLOW),
        (("ioctl", 3, 0x5401, 0), ALLOW),  # TCGETS
        (("ioctl", 3, 0x541B, 0), ALLOW),  # FIONREAD
        (("ioctl", 3, 0x300000FF + 1, 0), ALLOW),
        (("ioctl", 3, (0xDEAD << 32) | 0x5401, 0), ALLOW),  # the kernel ignores high bits
        (("ioctl", 3, (0xDEAD << 32) | _F(0x29, 16), 0), NOTIFY),
        (("mmap", 0, 4096, 1, 0x22, -1, 0), ALLOW),  # MAP_PRIVATE|MAP_ANONYMOUS
        (("mmap", 0, 4096, 3, 0x01, 5, 0), NOTIFY),  # MAP_SHARED on an fd
        (("mknod", 0x1000, 0o20666, os.makedev(195, 255)), EPERM),
        (("mknod", 0x1000, 0o60600, 0), EPERM),
        (("mknod", 0x1000, 0o10666, 0), ALLOW),  # FIFO
        (("mknod", 0x1000, 0o100644, 0), ALLOW),
        (("mknodat", -100, 0x1000, 0o20666, os.makedev(195, 0)), EPERM),
        (("mknodat", -100, 0x1000, 0o140777, 0), ALLOW),  # socket
        (("open_by_handle_at", 3, 0x1000, 0), EPERM),
        (("io_uring_setup", 8, 0x1000), ENOSYS),
        (("io_uring_enter", 3, 1, 0, 0), ENOSYS),
        (("io_uring_register", 3, 0, 0, 0), ENOSYS),
        (("openat2", -100, 0, 0, 0), NOTIFY),
        (("read", 0, 0, 0), ALLOW),
        (("close", 3), ALLOW),
        ((0x40000000 + 257, -100, 0, 0), ENOSYS),  # x32 openat
    ],
)
def test_filter_decisions(call, want):
    assert w.run_filter(PROG, w.syscall_data(*call)) == want, w.action_name(want)


def test_filter_kills_other_architectures():
    assert w.run_filter(PROG, w.syscall_data("read", arch=w.AUDIT_ARCH_I386)) == KILL
    assert w.run_filter(PROG, w.syscall_data(5, arch=0xC00000B7)) == KILL  # aarch64


def test_predicate_matches_filter():
    for cmd in list(range(0, 4200, 7)) + [0x30000000, 0x30000001, 0x30000100, 0xC0104629,
                                           0x80044600, 0x4600, 0x46FF, 0x5401]:
        want = NOTIFY if w.is_nvidia_ioctl(cmd) else ALLOW
        assert w.run_filter(PROG, w.syscall_data("ioctl", 3, cmd, 0)) == want, hex(cmd)


def test_in_kernel_commands_are_allowed_and_nothing_else_changes():
    """rules.kernel_commands for both tables' drivers: exactly those numbers go to the kernel
    unasked (high bits ignored, as the kernel ignores them); every other number decides as
    the default filter; a number outside the UVM raw range is refused at build time."""
    from devbroker.abi import registry
    from devbroker.broker import rules

    caps = frozenset(rules.DEFAULT_CAPABILITIES)
    for version in ("535.309.01", "580.159.04"):
        kernel = rules.kernel_commands(registry.get(version), caps)
        assert {"UVM_REGISTER_CHANNEL", "UVM_CREATE_EXTERNAL_RANGE", "UVM_MAP_EXTERNAL_ALLOCATION"} \
            <= {registry.get(version).uvm(c).name for c in kernel}
        names = {registry.get(version).uvm(c).name for c in kernel}
        # the GPU-binding steps and the va space's own life stay with the broker
        assert not names & {"UVM_REGISTER_GPU", "UVM_REGISTER_GPU_VASPACE", "UVM_INITIALIZE",
                            "UVM_MM_INITIALIZE", "UVM_DEINITIALIZE"}
        prog = w.build_filter(w.FilterOptions(kernel_ioctls=kernel))
        for cmd in list(range(0, 4200)) + [0x30000001, 0x30000002, 0xC0104629, 0x46FF]:
            want = ALLOW if cmd in kernel else w.run_filter(PROG, w.syscall_data("ioctl", 3, cmd, 0))
            for high in (0, 0xDEAD << 32):
                assert w.run_filter(prog, w.syscall_data("ioctl", 3, cmd | high, 0)) == want, hex(cmd)
    assert rules.kernel_commands(registry.get("580.159.04"), frozenset({"nvml", "compute"})) == ()
    for bad in ((0,), (0x800,), (0x30000001,), (0xC0104629,)):
        with pytest.raises(ValueError, match="UVM command numbers"):
            w.FilterOptions(kernel_ioctls=bad)


def test_options_drop_branches():
    prog = w.build_filter(w.FilterOptions(notify_mmap=False, deny_io_uring=False))
    assert w.run_filter(prog, w.syscall_data("mmap", 0, 4096, 3, 1, 5, 0)) == ALLOW
    assert w.run_filter(prog, w.syscall_data("io_uring_setup", 8, 0)) == ALLOW
    assert w.run_filter(prog, w.syscall_data("ioctl", 3, 75, 0)) == NOTIFY


def test_program_shape():
    insns = w.decode_program(PROG)
    assert 10 < len(insns) < 80
    assert insns[0] == w.Insn(w.BPF_LD | w.BPF_W | w.BPF_ABS, 0, 0, w.OFF_ARCH)
    assert insns[-1].code == w.BPF_RET | w.BPF_K
    with pytest.raises(w.WireError):
        w.decode_program(b"\0" * 7)


def test_kernel_accepts_the_filter():
    """Load the program for real (in a forked child: filters cannot be removed)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long

            class FProg(ctypes.Structure):
                _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

            buf = ctypes.create_string_buffer(PROG, len(PROG))
            fp = FProg(len(PROG) // 8, ctypes.addressof(buf))
            if libc.prctl(38, 1, 0, 0, 0) == 0:
                # without a listener: USER_NOTIF then fails with ENOSYS
                r = libc.syscall(ctypes.c_long(317), ctypes.c_long(1), ctypes.c_long(0),
                                 ctypes.byref(fp))
                if r == 0:
                    code = 0
                    try:
                        os.mknod("/nonexistent-dir/x", 0o20666, os.makedev(195, 255))
                        code = 2
                    except PermissionError:
                        pass
                    except OSError:
                        code = 3
                else:
                    code = 10 + ctypes.get_errno()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
