"""The OCI ``linux.seccomp`` sections that put a container under devbroker (sans-IO).

A container runtime (runc, crun) compiles an OCI seccomp section with libseccomp, installs it
in the container's init just before ``execve`` and, when a rule says ``SCMP_ACT_NOTIFY``,
sends the listener to ``listenerPath`` (devbroker's agent, :mod:`devbroker.oci.agent`). The
rules here are derived from the same :class:`~devbroker.sandbox.seccompwire.FilterOptions`
and constants as the BPF programs ``devbroker exec`` installs itself, so that the broker's
supervisors see exactly the system calls they expect:

* ``frontend="seccomp"``: :func:`seccompwire.build_filter` (the seccomp front end: opens,
  NVIDIA ioctls and file-backed mmaps notified; device mknod, ``open_by_handle_at`` and
  io_uring refused);
* ``frontend="fuse"``: :func:`seccompwire.build_stat_shim_filter` (the stat family notified,
  for NVML's ``stat(/dev/nvidiactl)`` on FUSE node files).

tests/test_oci_profile.py compiles these sections with libseccomp the way runc does and checks,
system call by system call, that the result decides as the hand-written BPF does (and where it
differs: system calls of other architectures, below).

Two things libseccomp forces on the translation:

* One rule can hold one comparison per argument; runc turns two comparisons of the same
  argument into two separate rules (an OR). The numeric UVM ioctl range 1..2047 is therefore
  written as aligned power-of-two blocks, each one ``SCMP_CMP_MASKED_EQ`` (11 rules), and a
  mask never covers the upper 32 bits of the ioctl command, which the kernel ignores too
  (``cmd`` is an ``unsigned int``).
* Architectures are named, not tested: the front end's section lists only x86_64, so libseccomp
  answers every other one (i386 ``int 0x80``, x32) with its "bad architecture" action, which
  runc leaves at KILL_THREAD (devbroker exec's filter: KILL_PROCESS for i386, ENOSYS for x32).
  Either way no call of another architecture runs unseen. The stat section also lists i386 and
  x32: that filter is not a boundary (a faked stat grants nothing), so 32-bit programs keep
  working and the shim lets their calls through.
"""
from __future__ import annotations

import dataclasses
import errno as _errno

from devbroker.sandbox import seccompwire as w

FRONTENDS = ("seccomp", "fuse")
# What the broker's agent reads from listenerMetadata ("key=value;key=value").
METADATA_PREFIX = "devbroker"

_NOTIFY = "SCMP_ACT_NOTIFY"
_ERRNO = "SCMP_ACT_ERRNO"
_MASKED_EQ = "SCMP_CMP_MASKED_EQ"
_U32 = 0xFFFFFFFF


def aligned_blocks(lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi] as (mask, value) pairs over 32 bits: x is in the range iff
    ``x & mask == value`` for one pair (the usual prefix decomposition of a range)."""
    if not 0 <= lo <= hi <= _U32:
        raise ValueError(f"bad range {lo:#x}..{hi:#x}")
    out = []
    while lo <= hi:
        size = lo & -lo if lo else 1 << 32
        while size > 1 and lo + size - 1 > hi:
            size >>= 1
        out.append((_U32 & ~(size - 1), lo))
        lo += size
    return out


def _masked(index: int, mask: int, value: int) -> dict:
    # OCI/runc/crun: for SCMP_CMP_MASKED_EQ "value" is the mask and "valueTwo" the datum.
    return {"index": index, "value": mask, "valueTwo": value, "op": _MASKED_EQ}


def syscall_rules(opts: w.FilterOptions = w.FilterOptions()) -> list[dict]:
    """The ``syscalls`` array for ``opts`` (everything not listed is allowed)."""
    rules: list[dict] = []
    if opts.notify_open:
        rules.append({"names": ["open", "openat", "openat2"], "action": _NOTIFY})
    if opts.notify_ioctl:
        # 'F' type (frontend and RM escapes), then the UVM numbers (raw 1..uvm_raw_max and
        # UVM_INITIALIZE/DEINITIALIZE's 0x300000xx block): seccompwire.is_nvidia_ioctl.
        # A real-file tenant's in-kernel UVM rows (opts.kernel_ioctls) are cut out of the raw
        # block: libseccomp lets the more restrictive action win where two rules match.
        blocks = [(0xFF00, w.NV_IOCTL_MAGIC << 8)]
        lo = 1
        for cmd in sorted(set(opts.kernel_ioctls)) + [opts.uvm_raw_max + 1]:
            if lo <= cmd - 1:
                blocks += aligned_blocks(lo, cmd - 1)
            lo = cmd + 1
        blocks += aligned_blocks(w.UVM_HIGH_BASE, w.UVM_HIGH_MAX)
        for mask, value in blocks:
            rules.append({"names": ["ioctl"], "action": _NOTIFY,
                          "args": [_masked(1, mask, value)]})
    if opts.notify_mmap:
        rules.append({"names": ["mmap"], "action": _NOTIFY,
                      "args": [_masked(3, w.MAP_ANONYMOUS, 0)]})
    if opts.notify_stat:
        rules.append({"names": list(w.STAT_SYSCALLS), "action": _NOTIFY})
    if opts.deny_device_mknod:
        for name, mode_arg in (("mknod", 1), ("mknodat", 2)):
            for kind in (w.S_IFCHR, w.S_IFBLK):
                rules.append({"names": [name], "action": _ERRNO, "errnoRet": _errno.EPERM,
                              "args": [_masked(mode_arg, w.S_IFMT, kind)]})
    if opts.deny_open_by_handle:
        rules.append({"names": ["open_by_handle_at"], "action": _ERRNO,
                      "errnoRet": _errno.EPERM})
    if opts.deny_io_uring:
        rules.append({"names": ["io_uring_setup", "io_uring_enter", "io_uring_register"],
                      "action": _ERRNO, "errnoRet": _errno.ENOSYS})
    return rules


# The filters devbroker exec installs, by front end.
FRONTEND_OPTIONS = {
    "seccomp": w.FilterOptions(),
    "fuse": w.FilterOptions(notify_open=False, notify_ioctl=False, notify_mmap=False,
                            deny_device_mknod=False, deny_open_by_handle=False,
                            deny_io_uring=False, notify_stat=True),
}
ARCHITECTURES = {
    "seccomp": ["SCMP_ARCH_X86_64"],
    "fuse": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
}


# listenerMetadata ``tenant_from=cdi``: the agent names the tenant by the CDI device the
# runtime applied (devbroker.oci.state.hook_tenants), for one section shared by containers
# of many tenants (a Kubernetes Localhost seccomp profile; docs/kubernetes.md).
TENANT_FROM_CDI = "cdi"


def encode_metadata(frontend: str, tenant: str | None = None, *,
                    tenant_from_cdi: bool = False) -> str:
    items = [f"{METADATA_PREFIX}=1", f"frontend={frontend}"]
    if tenant:
        items.append(f"tenant={tenant}")
    if tenant_from_cdi:
        items.append(f"tenant_from={TENANT_FROM_CDI}")
    return ";".join(items)


def _options(frontend: str, kernel_ioctls: tuple[int, ...], tenant_from_cdi: bool):
    opts = FRONTEND_OPTIONS[frontend]
    if kernel_ioctls:
        opts = dataclasses.replace(opts, kernel_ioctls=tuple(kernel_ioctls))
    if tenant_from_cdi:
        opts = dataclasses.replace(opts, deny_device_mknod=True)
    return opts


def seccomp_section(frontend: str, listener_path: str, *, tenant: str | None = None,
                    flags: list[str] | tuple[str, ...] = (),
                    kernel_ioctls: tuple[int, ...] = (), tenant_from_cdi: bool = False) -> dict:
    """The ``linux.seccomp`` object of a container's config.json.

    ``tenant`` goes into ``listenerMetadata`` (one of the places the broker's agent takes
    the tenant's name from; an annotation ``devbroker.io/tenant`` or a CDI device request
    are the others). ``flags``: OCI seccomp flags, e.g.
    ``SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV`` where the runtime knows it (runc 1.1 and
    crun 1.8 do not). ``kernel_ioctls``: UVM command numbers the kernel runs without a
    notification (seccomp front end with the real backend: rules.kernel_commands); empty,
    every NVIDIA-looking ioctl is notified. ``tenant_from_cdi``: the section names no
    tenant; the broker takes the one whose CDI device the runtime applied. Such a section is
    a cluster's profile for every pod that claims a GPU, where the runtime grants
    ``CAP_MKNOD`` (containerd's default set; runc's own spec does not), so it also refuses
    mknod of devices with the FUSE nodes, as the seccomp front end's section always does.
    """
    if frontend not in FRONTENDS:
        raise ValueError(f"front end {frontend!r}: one of {', '.join(FRONTENDS)}")
    if not listener_path.startswith("/"):
        raise ValueError(f"listenerPath {listener_path!r} must be absolute")
    section = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": list(ARCHITECTURES[frontend]),
        "listenerPath": listener_path,
        "listenerMetadata": encode_metadata(frontend, tenant,
                                            tenant_from_cdi=tenant_from_cdi),
        "syscalls": syscall_rules(_options(frontend, kernel_ioctls, tenant_from_cdi)),
    }
    if flags:
        section["flags"] = list(flags)
    return section
