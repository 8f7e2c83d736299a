"""The attacks, as data. Each entry says what it tries, which §5.3.1 item it tests, what
refusal is expected (errno or NV_STATUS), which layer should refuse it, and which audit
record proves the refusal; its function performs the attack with real syscalls from inside
the tenant's sandbox and reports what happened.

An attack function returns an Outcome (escape/outcome.py: refused, escaped or error).

Functions run in the attacker's process (``python -m devbroker.escape.tenant``); the victim's
facts (its client and object handles, GPU ids, pids, the socket it hands its fds out on)
arrive in :class:`Ctx`.
"""
from __future__ import annotations

import array
import ctypes
import fcntl
import json
import os
import signal
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from devbroker.abi import iowr
from devbroker.abi import status as nvs
from devbroker.escape import races as _races
from devbroker.escape.outcome import Outcome, ename, escaped, refused

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.syscall.restype = ctypes.c_long

MiB = 1 << 20
TWO_MIB = 2 * MiB
PAGE = 4096
SYS_open_by_handle_at = 304
SYS_io_uring_setup = 425
SYS_process_vm_readv = 310
SYS_pidfd_open = 434
SYS_pidfd_getfd = 438
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
NVIDIA_MAJOR = 195
UVM_MAJOR_DEFAULT = 238  # BRIEF §1: /dev/nvidia-uvm is 238:0 on the H200 host

# §5.3.1 items (our reading, docs/security.md): e = isolation of tenants' device access,
# f = refusal and audit of privileged operations.
E, F = "5.3.1 e", "5.3.1 f"


@dataclass
class Ctx:
    """What the attacker knows: passed by the harness as JSON (DEVBROKER_ESCAPE_CTX)."""

    frontend: str = "fuse"
    run_dir: str = ""
    broker_pid: int = 0
    own_gpu: int = 0  # a GPU the attacker has (shared with the victim)
    victim_gpu: int = 1  # a GPU only the victim has
    quota: int = 256 * MiB  # the attacker's per-GPU quota
    victim: dict = field(default_factory=dict)  # client, hdevice, hsubdevice, hmemory, ...
    # In the QEMU guest (kmod/CUSE; devbroker.escape.guest): the broker's control socket and
    # audit log (not in a run dir the tenant could name by ctx.run_dir) and the victim's uid.
    control_sock: str = ""
    audit_log: str = ""
    victim_uid: int = 0
    _client: object = None

    @classmethod
    def from_json(cls, text: str) -> "Ctx":
        d = json.loads(text) if text else {}
        return cls(**{k: v for k, v in d.items() if not k.startswith("_")})

    def client(self):
        """A working NVML-style client of the attacker's own: root client, own GPU opened."""
        if self._client is None:
            from devbroker.tools.probe import Client

            c = Client()
            c.check_version()
            c.open_root()
            ids = c.attached_ids()
            c.gpu = c.open_gpu(ids[0])
            self._client = c
        return self._client


# ------------------------------------------------------------------------ raw helpers
def raw_ioctl(fd: int, cmd: int, buf: bytearray) -> int:
    """ioctl(2) with buf as the argument; 0 or the errno."""
    try:
        fcntl.ioctl(fd, cmd, buf, True)
        return 0
    except OSError as e:
        return e.errno


def escape_buf(c, name: str, **fields) -> tuple[int, bytearray, object]:
    spec = c.abi.escape(name)
    value = spec.params.decode(bytes(spec.params.size)).replace(**fields)
    return iowr(spec.number, spec.params.size), bytearray(value.encode()), spec.params


def rm_control(c, hobj: int, cmd: int, params: bytes | None, *, size: int | None = None,
               ptr: int | None = None, hclient: int | None = None,
               fd: int | None = None) -> tuple[str, int]:
    """RM_CONTROL by hand. Returns ("errno", e) or ("status", NV_STATUS)."""
    keep = ctypes.create_string_buffer(params, len(params)) if params else None
    p = ptr if ptr is not None else (ctypes.addressof(keep) if keep is not None else 0)
    v = c.new("NVOS54_PARAMETERS", hClient=c.hclient if hclient is None else hclient,
              hObject=hobj, cmd=cmd, params=p,
              paramsSize=len(params or b"") if size is None else size)
    buf = bytearray(v.encode())
    e = raw_ioctl(c.ctl if fd is None else fd, iowr(0x2A, len(buf)), buf)
    if e:
        return "errno", e
    return "status", v.spec.decode(bytes(buf)).status


def rm_alloc(c, parent: int, cls: int, params: bytes | None, *, root: int | None = None,
             handle: int | None = None, size: int = 0, ptr: int | None = None,
             fd: int | None = None) -> tuple[str, int, int]:
    """RM_ALLOC (NVOS64) by hand. Returns (kind, code, hObjectNew)."""
    keep = ctypes.create_string_buffer(params, len(params)) if params else None
    p = ptr if ptr is not None else (ctypes.addressof(keep) if keep is not None else 0)
    v = c.new("NVOS64_PARAMETERS", hRoot=c.hclient if root is None else root,
              hObjectParent=parent, hObjectNew=c.handle() if handle is None else handle,
              hClass=cls, pAllocParms=p, paramsSize=size)
    buf = bytearray(v.encode())
    e = raw_ioctl(c.ctl if fd is None else fd, iowr(0x2B, len(buf)), buf)
    if e:
        return "errno", e, 0
    out = v.spec.decode(bytes(buf))
    if keep is not None:
        c.last_raw_params = keep.raw
    return "status", out.status, out.hObjectNew


def rm_free(c, parent: int, handle: int, *, root: int | None = None) -> tuple[str, int]:
    v = c.new("NVOS00_PARAMETERS", hRoot=c.hclient if root is None else root,
              hObjectParent=parent, hObjectOld=handle)
    buf = bytearray(v.encode())
    e = raw_ioctl(c.ctl, iowr(0x29, len(buf)), buf)
    return ("errno", e) if e else ("status", v.spec.decode(bytes(buf)).status)


def code_name(kind: str, code: int) -> str:
    return ename(code) if kind == "errno" else nvs.name(code)


def judge(kind: str, code: int, what: str = "") -> Outcome:
    """One attempt: success (ioctl 0 and NV_OK) is an escape, anything else a refusal."""
    if kind == "status" and code == nvs.NV_OK:
        return escaped(f"{what} succeeded (NV_OK)", "NV_OK")
    return refused(code_name(kind, code), what)


def combine(outs: list[Outcome]) -> Outcome:
    esc = [o for o in outs if o.result == "escaped"]
    if esc:
        return escaped("; ".join(o.detail for o in esc), esc[0].got)
    err = [o for o in outs if o.result == "error"]
    if err:
        return Outcome("error", err[0].got, "; ".join(o.detail for o in err))
    gots = []
    for o in outs:
        if o.got not in gots:
            gots.append(o.got)
    return refused("/".join(gots), "; ".join(o.detail for o in outs if o.detail))


def unmapped_address() -> int:
    """An address that was just mapped and then unmapped (so certainly not mapped now)."""
    addr = libc.mmap(None, PAGE * 4, 3, 0x22, -1, 0)  # PROT_RW, MAP_PRIVATE|MAP_ANONYMOUS
    libc.munmap(addr, PAGE * 4)
    return addr


def page_before_hole() -> int:
    """The address of a mapped page whose successor is unmapped."""
    addr = libc.mmap(None, PAGE * 2, 3, 0x22, -1, 0)
    libc.munmap(addr + PAGE, PAGE)
    return addr


def victim_fds(ctx: Ctx) -> list[int]:
    """Ask the victim (another tenant, over an abstract Unix socket) for its NVIDIA fds."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect("\0" + ctx.victim["sock"])
    fds = array.array("i")
    msg, anc, _flags, _addr = s.recvmsg(64, socket.CMSG_SPACE(16 * 4))
    for level, typ, data in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % 4])
    s.close()
    return list(fds)


# ------------------------------------------------------------------------ sandbox layer
def a_open_real_nodes(ctx: Ctx) -> Outcome:
    """Real (or other tenants') NVIDIA nodes by every path a tenant could try."""
    paths = [f"/dev/nvidia{ctx.victim_gpu}", "/dev/nvidia-caps/nvidia-cap1",
             "/dev/nvidia-caps/nvidia-cap2", "/dev/char/195:255", "/dev/char/195:0",
             "/dev/char/238:0", "/dev/nvidia-modeset", "/dev/dri/card0"]
    if ctx.run_dir:
        paths += [f"{ctx.run_dir}/nodes/{ctx.victim.get('tenant', 'alice')}/nvidiactl",
                  f"{ctx.run_dir}/nodes/{ctx.victim.get('tenant', 'alice')}/nvidia{ctx.victim_gpu}"]
    outs = []
    for p in paths:
        try:
            fd = os.open(p, os.O_RDWR)
        except OSError as e:
            outs.append(refused(ename(e.errno)))
            continue
        st = os.fstat(fd)
        os.close(fd)
        outs.append(escaped(f"opened {p} (mode {st.st_mode:o} rdev "
                            f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)})"))
    return combine(outs)


def _mknod(major: int, minor: int) -> Outcome:
    outs = []
    for d in ("/tmp", "/dev/shm", "/dev"):
        path = f"{d}/escape-{major}-{minor}-{os.getpid()}"
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        except OSError as e:
            outs.append(refused(ename(e.errno)))
            continue
        try:
            fd = os.open(path, os.O_RDWR)
            os.close(fd)
            outs.append(escaped(f"mknod {path} c {major}:{minor} and open worked"))
        except OSError as e:
            # The node exists: that alone is the failure the sandbox must prevent (on a
            # host with the driver the open would reach it).
            outs.append(escaped(f"mknod {path} c {major}:{minor} succeeded "
                                f"(open: {ename(e.errno)})"))
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
    return combine(outs)


def _uvm_major() -> int:
    try:
        for line in open("/proc/devices"):
            parts = line.split()
            if len(parts) == 2 and parts[1] == "nvidia-uvm":
                return int(parts[0])
    except OSError:
        pass
    return UVM_MAJOR_DEFAULT


def a_mknod_ctl(ctx):
    return _mknod(NVIDIA_MAJOR, 255)


def a_mknod_gpu0(ctx):
    return _mknod(NVIDIA_MAJOR, 0)


def a_mknod_uvm(ctx):
    if ctx.frontend in ("kmod", "cuse"):  # the guest's UVM major is dynamic: take the node's
        try:
            return _mknod(os.major(os.stat("/dev/nvidia-uvm").st_rdev), 0)
        except OSError:
            pass
    return _mknod(_uvm_major(), 0)


def a_proc_broker(ctx: Ctx) -> Outcome:
    """The broker's memory, fds and root through /proc; any process outside the sandbox."""
    outs = []
    pid = ctx.broker_pid
    for p in (f"/proc/{pid}/mem", f"/proc/{pid}/environ", f"/proc/{pid}/root/etc/hostname",
              f"/proc/{pid}/fd/0", f"/proc/{pid}/cwd"):
        try:
            fd = os.open(p, os.O_RDONLY)
            os.close(fd)
            outs.append(escaped(f"opened {p}"))
        except OSError as e:
            outs.append(refused(ename(e.errno)))
    # Any process of the broker visible by name?
    seen = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ")
            except OSError:
                continue
            if b"devbroker" in cmd and b" run" in cmd:
                seen.append(d)
    if seen:
        outs.append(escaped(f"broker process visible in /proc: {seen}"))
    # The broker's /dev/fuse fd through /proc/<pid>/fd of the sandbox's ancestors.
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                if os.readlink(f"/proc/{d}/fd/{fd}") in ("/dev/fuse",):
                    outs.append(escaped(f"/dev/fuse fd visible as /proc/{d}/fd/{fd}"))
        except OSError:
            pass
    return combine(outs)


def a_control_socket(ctx: Ctx) -> Outcome:
    """The broker's control socket and audit log in its run directory."""
    outs = []
    if not ctx.run_dir:
        return Outcome("error", "", "no run dir given")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(5)
        s.connect(f"{ctx.run_dir}/control.sock")
        s.sendall(b'{"op": "status"}\n')
        data = s.recv(4096)
        outs.append(escaped(f"control socket answered: {data[:80]!r}") if data
                    else refused("closed"))
    except OSError as e:
        outs.append(refused(ename(e.errno)))
    finally:
        s.close()
    for name, flags in (("audit.log", os.O_WRONLY | os.O_APPEND), ("audit.log", os.O_RDONLY)):
        try:
            fd = os.open(f"{ctx.run_dir}/{name}", flags)
            os.close(fd)
            outs.append(escaped(f"opened {ctx.run_dir}/{name} "
                                f"({'write' if flags & os.O_WRONLY else 'read'})"))
        except OSError as e:
            outs.append(refused(ename(e.errno)))
    return combine(outs)


def a_umount_node(ctx: Ctx) -> Outcome:
    """Unmount the bind-mounted node (to reach what is beneath) or remount /dev writable."""
    outs = []
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    for target in (b"/dev/nvidiactl", b"/dev", b"/proc"):
        if libc.umount2(target, 2) == 0:  # MNT_DETACH
            outs.append(escaped(f"umount {target.decode()} succeeded"))
        else:
            outs.append(refused(ename(ctypes.get_errno())))
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
    if libc.mount(None, b"/dev", None, 0x20 | 0x1000, None) == 0:  # MS_REMOUNT|MS_BIND rw
        outs.append(escaped("remounted /dev read-write"))
    else:
        outs.append(refused(ename(ctypes.get_errno())))
    return combine(outs)


def in_child(work: Callable[[], bytes]) -> tuple[bytes, int]:
    """Run `work` in a forked child (a user namespace, another driver's ABI, a page whose
    touch may end the process: none of it reaches this process) and return the bytes it
    returned — none when it raised or a signal ended it first — and the child's wait
    status. The child ends with _exit(0) whatever `work` does."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.write(w, work())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return data, status


def _userns_child() -> bytes:
    """In a forked child: new user+mount namespace, then try to get at a real node."""
    res: dict[str, str] = {}
    uid, gid = os.getuid(), os.getgid()  # 0 in the FUSE sandbox, the tenant's uid in the guest

    def step(name, fn):
        try:
            r = fn()
            res[name] = "ok" if r in (None, 0) else ename(ctypes.get_errno())
        except OSError as e:
            res[name] = ename(e.errno)
        return res[name] == "ok"

    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
    try:
        if step("unshare", lambda: libc.unshare(0x10000000 | 0x00020000)):
            def idmap():
                with open("/proc/self/setgroups", "w") as f:
                    f.write("deny")
                with open("/proc/self/uid_map", "w") as f:
                    f.write(f"0 {uid} 1")
                with open("/proc/self/gid_map", "w") as f:
                    f.write(f"0 {gid} 1")
            step("idmap", idmap)
            step("umount", lambda: libc.umount2(b"/dev/nvidiactl", 2))
            if step("mount", lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)):
                if step("mknod", lambda: os.mknod("/tmp/nvidiactl", stat.S_IFCHR | 0o666,
                                                  os.makedev(195, 255))):
                    step("open", lambda: os.close(os.open("/tmp/nvidiactl", os.O_RDWR)))
    except Exception as e:  # noqa: BLE001 - what it got so far, and why it stopped
        res["error"] = f"{type(e).__name__}: {e}"
    return json.dumps(res).encode()


def a_userns_umount(ctx: Ctx) -> Outcome:
    """A new user namespace (root there): umount the node; mount a tmpfs and mknod 195:255
    in it; open that node. Only the open would matter (user-ns mounts are nodev)."""
    data, _ = in_child(_userns_child)
    res = json.loads(data or b"{}")
    detail = ", ".join(f"{k}: {v}" for k, v in res.items())
    if res.get("umount") == "ok":
        return escaped(f"umount of /dev/nvidiactl in a user namespace succeeded ({detail})")
    if res.get("open") == "ok" or res.get("open") == "ENXIO":
        return escaped(f"a 195:255 node made in a user namespace could be opened ({detail})")
    last = [v for v in res.values() if v != "ok"]
    return refused(last[-1] if last else "?", detail)


def a_open_by_handle(ctx: Ctx) -> Outcome:
    """open_by_handle_at: open an inode by handle, past any path check."""
    # struct file_handle {u32 handle_bytes; i32 handle_type; u8 f_handle[]} — any handle:
    # the call needs CAP_DAC_READ_SEARCH before it looks at it.
    fh = ctypes.create_string_buffer(struct.pack("=Ii", 8, 1) + bytes(8))
    dfd = os.open("/", os.O_RDONLY)
    try:
        r = libc.syscall(ctypes.c_long(SYS_open_by_handle_at), ctypes.c_long(dfd),
                         ctypes.c_void_p(ctypes.addressof(fh)), ctypes.c_long(os.O_RDONLY))
        if r >= 0:
            os.close(r)
            return escaped("open_by_handle_at returned an fd")
        return refused(ename(ctypes.get_errno()))
    finally:
        os.close(dfd)


def a_io_uring(ctx: Ctx) -> Outcome:
    """io_uring's OPENAT is not seen by seccomp: the filter must refuse io_uring itself."""
    params = ctypes.create_string_buffer(120)
    r = libc.syscall(ctypes.c_long(SYS_io_uring_setup), ctypes.c_long(4),
                     ctypes.c_void_p(ctypes.addressof(params)))
    if r >= 0:
        os.close(r)
        return escaped("io_uring_setup worked (its OPENAT bypasses the open interception)")
    return refused(ename(ctypes.get_errno()))


# ------------------------------------------------------------------------ the QEMU guest
# There the tenants are plain processes of different uids in one pid and mount namespace,
# on one set of real char nodes (the module's or CUSE's, 195:x), mapped to tenants by uid.
def a_proc_other_uids(ctx: Ctx) -> Outcome:
    """The broker's and the victim's /proc entries, fds and memory, from another uid."""
    outs = []
    for who, pid in (("broker", ctx.broker_pid), ("victim", ctx.victim.get("pid"))):
        if not pid:
            return Outcome("error", "", f"no {who} pid given")
        for p in (f"/proc/{pid}/mem", f"/proc/{pid}/environ", f"/proc/{pid}/root/etc/hostname",
                  f"/proc/{pid}/cwd/.", f"/proc/{pid}/fd/0", f"/proc/{pid}/fd/3",
                  f"/proc/{pid}/fd/4", f"/proc/{pid}/map_files"):
            try:
                fd = os.open(p, os.O_RDONLY)
                os.close(fd)
                outs.append(escaped(f"opened {p} ({who})"))
            except OSError as e:
                outs.append(refused(ename(e.errno)))
        try:
            names = os.listdir(f"/proc/{pid}/fd")
            outs.append(escaped(f"listed the {who}'s fds: {names[:8]}"))
        except OSError as e:
            outs.append(refused(ename(e.errno)))
        # pidfd_getfd: what the broker itself uses to reach a tenant's files
        pidfd = libc.syscall(ctypes.c_long(SYS_pidfd_open), ctypes.c_long(pid), ctypes.c_long(0))
        if pidfd < 0:
            outs.append(refused(ename(ctypes.get_errno())))
        else:
            try:
                for n in range(0, 12):
                    r = libc.syscall(ctypes.c_long(SYS_pidfd_getfd), ctypes.c_long(pidfd),
                                     ctypes.c_long(n), ctypes.c_long(0))
                    if r >= 0:
                        st = os.fstat(r)
                        os.close(r)
                        outs.append(escaped(f"pidfd_getfd took the {who}'s fd {n} (rdev "
                                            f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)})"))
                    else:
                        outs.append(refused(ename(ctypes.get_errno())))
            finally:
                os.close(pidfd)
        # process_vm_readv of its memory (any address: the permission check comes first)
        buf = ctypes.create_string_buffer(64)
        local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
        remote = (ctypes.c_void_p * 2)(0x400000, 64)
        r = libc.syscall(ctypes.c_long(SYS_process_vm_readv), ctypes.c_long(pid), local,
                         ctypes.c_long(1), remote, ctypes.c_long(1), ctypes.c_long(0))
        if r >= 0:
            outs.append(escaped(f"process_vm_readv read the {who}'s memory"))
        else:
            outs.append(refused(ename(ctypes.get_errno())))
    o = combine(outs)
    if o.result == "refused":
        o.detail = ("other uids' processes are visible in /proc (one pid namespace; hidepid "
                    "would hide them) but not reachable")
    return o


def a_control_socket_guest(ctx: Ctx) -> Outcome:
    """The broker's control socket (status, policy) and its audit log, from another uid."""
    if not ctx.control_sock or not ctx.audit_log:
        return Outcome("error", "", "no control socket / audit log path given")
    outs = []
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(5)
        s.connect(ctx.control_sock)
        s.sendall(b'{"op": "status"}\n')
        data = s.recv(4096)
        outs.append(escaped(f"control socket answered: {data[:80]!r}") if data
                    else refused("closed", "control socket: closed"))
    except OSError as e:
        outs.append(refused(ename(e.errno), f"control socket: {ename(e.errno)}"))
    finally:
        s.close()
    for flags in (os.O_WRONLY | os.O_APPEND, os.O_RDONLY):
        how = "write" if flags & os.O_WRONLY else "read"
        try:
            fd = os.open(ctx.audit_log, flags)
            os.close(fd)
            outs.append(escaped(f"opened {ctx.audit_log} ({how})"))
        except OSError as e:
            outs.append(refused(ename(e.errno), f"audit log {how}: {ename(e.errno)}"))
    return combine(outs)


def _userns_uid_child(as_uid: int, victim_gpu: int) -> bytes:
    res: dict[str, object] = {}
    uid, gid = os.getuid(), os.getgid()
    try:
        if libc.unshare(CLONE_NEWUSER) != 0:
            res["unshare"] = ename(ctypes.get_errno())
            return json.dumps(res).encode()
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{as_uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{as_uid} {gid} 1")
        res["uid_in_ns"] = os.getuid()
        try:
            os.close(os.open(f"/dev/nvidia{victim_gpu}", os.O_RDWR))
            res["open_victim_gpu"] = "ok"
        except OSError as e:
            res["open_victim_gpu"] = ename(e.errno)
        try:  # a client on nvidiactl: whose GPUs does it see?
            from devbroker.tools.probe import Client

            c = Client()
            c.check_version()
            c.open_root()
            res["ctl_gpus"] = len(c.attached_ids())
        except OSError as e:
            res["ctl"] = ename(e.errno)
    except Exception as e:  # noqa: BLE001 - what it got so far, and why it stopped
        res["error"] = f"{type(e).__name__}: {e}"
    return json.dumps(res).encode()


def a_userns_uid(ctx: Ctx) -> Outcome:
    """In a new user namespace the attacker's uid reads as the victim's (uid_map
    "<victim uid> <own uid> 1", allowed without privilege): the front end must still name the
    caller by its real uid. Open the victim's GPU node; count the GPUs a new client sees."""
    if not ctx.victim_uid:
        return Outcome("error", "", "no victim uid given")
    data, _ = in_child(lambda: _userns_uid_child(ctx.victim_uid, ctx.victim_gpu))
    res = json.loads(data or b"{}")
    detail = ", ".join(f"{k}: {v}" for k, v in res.items())
    if "error" in res or "unshare" in res or res.get("uid_in_ns") != ctx.victim_uid:
        return Outcome("error", res.get("unshare", ""),
                       f"could not take the victim's uid in a user namespace ({detail})")
    if res.get("open_victim_gpu") == "ok":
        return escaped(f"opened /dev/nvidia{ctx.victim_gpu} (the victim's GPU) as uid "
                       f"{ctx.victim_uid} of a user namespace ({detail})")
    if res.get("ctl_gpus", 0) > 1:
        return escaped(f"a client opened in the user namespace sees the victim's GPUs ({detail})")
    return refused(res.get("open_victim_gpu", "?"), detail)


# ------------------------------------------------------------------------ fds and handles
def a_fd_pass(ctx: Ctx) -> Outcome:
    """The victim's nvidiactl fd, received over a Unix socket, used with the victim's client."""
    fds = victim_fds(ctx)
    if not fds:
        return Outcome("error", "", "victim sent no fds")
    from devbroker.tools.probe import Client

    c = Client.__new__(Client)
    mine = ctx.client()
    c.__dict__.update(mine.__dict__)
    c.ctl = fds[0]
    c.hclient = ctx.victim["client"]
    outs = []
    # read through the victim's file with the victim's client
    p = c.params(0x201)
    outs.append(judge(*rm_control(c, c.hclient, 0x201, p.encode()),
                      "GET_ATTACHED_IDS on the victim's fd with its client"))
    # free the victim's memory through its file
    outs.append(judge(*rm_free(c, ctx.victim["hdevice"], ctx.victim["hmemory"]),
                      "RM_FREE of the victim's memory through its fd"))
    for fd in fds:
        os.close(fd)
    return combine(outs)


def a_fd_pass_register(ctx: Ctx) -> Outcome:
    """The victim's ctl fd (received) named as REGISTER_FD.ctl_fd / RM_MAP_MEMORY.fd on the
    attacker's own files."""
    fds = victim_fds(ctx)
    c = ctx.client()
    outs = []
    gfd = c.gpu_fds[ctx.own_gpu]
    cmd, buf, _ = escape_buf(c, "NV_ESC_REGISTER_FD", ctl_fd=fds[0])
    e = raw_ioctl(gfd, cmd, buf)
    outs.append(refused(ename(e)) if e else escaped("REGISTER_FD accepted the victim's ctl fd"))
    for fd in fds:
        os.close(fd)
    return combine(outs)


def _touch_page(addr: int, *, write: bool) -> str:
    """Read (or write) a mapped page in a forked child: a refused page ends the child with
    SIGBUS, which is the refusal; otherwise what was read ("wrote" for a write)."""
    def touch() -> bytes:
        if not write:
            return ctypes.string_at(addr, 64)
        ctypes.memmove(addr, b"bob!", 4)
        return b"wrote"

    data, status = in_child(touch)
    if os.WIFSIGNALED(status):
        return signal.Signals(os.WTERMSIG(status)).name
    return data.split(b"\0", 1)[0].decode(errors="replace")


def a_fd_pass_mmap(ctx: Ctx) -> Outcome:
    """The victim's mapped node file (NVML's shared-data page, faulted in and written by the
    victim), received over a Unix socket and mapped: read and write its pages."""
    fds = victim_fds(ctx)
    idx = ctx.victim.get("map_fd_index")
    try:
        if idx is None or idx >= len(fds):
            return Outcome("error", "", f"the victim has no mapped file to give "
                           f"({ctx.victim.get('map_error', 'none sent')})")
        ctx.client()  # a client of the attacker's own: its sandbox is known to the broker
        addr = libc.mmap(None, PAGE, 3, 1, fds[idx], 0)  # PROT_RW, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return refused(ename(ctypes.get_errno()), "mmap of the victim's file")
        vec = (ctypes.c_ubyte * 1)()
        libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(PAGE), vec)
        read = _touch_page(addr, write=False)
        write = _touch_page(addr, write=True)
    finally:
        for fd in fds:
            os.close(fd)
    detail = f"resident {vec[0] & 1}, read: {read}, write: {write}"
    if ctx.victim.get("map_secret", "\0") in read:
        return escaped(f"read the victim's page through its passed file ({detail})")
    if write == "wrote" or read not in ("SIGBUS",):
        return escaped(f"the victim's page was mapped for the attacker ({detail})")
    return refused("SIGBUS", detail)


def a_foreign_client(ctx: Ctx) -> Outcome:
    """The victim's client handle on the attacker's own nvidiactl."""
    c = ctx.client()
    vc = ctx.victim["client"]
    outs = [judge(*rm_control(c, vc, 0x201, c.params(0x201).encode(), hclient=vc),
                  "control with the victim's hClient"),
            judge(*rm_free(c, vc, vc, root=vc), "RM_FREE of the victim's client"),
            judge(*rm_alloc(c, vc, 0x80, c.new("NV0080_ALLOC_PARAMETERS",
                                               deviceId=ctx.own_gpu).encode(), root=vc)[:2],
                  "RM_ALLOC under the victim's client")]
    return combine(outs)


def a_foreign_object(ctx: Ctx) -> Outcome:
    """The victim's object handles (device, subdevice, memory) under the attacker's client."""
    c = ctx.client()
    v = ctx.victim
    outs = [judge(*rm_control(c, v["hsubdevice"], 0x20801303,
                              c.params(0x20801303).encode()), "FB info on victim's subdevice"),
            judge(*rm_free(c, v["hdevice"], v["hmemory"]), "RM_FREE of the victim's memory"),
            judge(*rm_alloc(c, v["hdevice"], 0x2080,
                            c.new("NV2080_ALLOC_PARAMETERS").encode())[:2],
                  "RM_ALLOC under the victim's device")]
    # RM_MAP_MEMORY naming the victim's memory with the attacker's client
    spec = c.abi.escape("NV_ESC_RM_MAP_MEMORY").params
    val = spec.decode(bytes(spec.size))
    val = val.replace(params=val.params.replace(hClient=c.hclient, hDevice=v["hdevice"],
                                                hMemory=v["hmemory"], length=PAGE),
                      fd=c.gpu_fds[ctx.own_gpu])
    buf = bytearray(val.encode())
    e = raw_ioctl(c.ctl, iowr(0x4E, len(buf)), buf)
    outs.append(refused(ename(e)) if e else judge("status", spec.decode(bytes(buf)).params.status,
                                                  "RM_MAP_MEMORY of the victim's memory"))
    return combine(outs)


def a_client_collision(ctx: Ctx) -> Outcome:
    """Allocate a root client with the victim's client handle (take over its name)."""
    c = ctx.client()
    kind, code, h = rm_alloc(c, 0, 0x41, None, root=0, handle=ctx.victim["client"])
    return judge(kind, code, "root client with the victim's handle")


def a_guess_handles(ctx: Ctx) -> Outcome:
    """Sweep client handles near the victim's and the driver's numbering."""
    c = ctx.client()
    base = ctx.victim["client"]
    cands = set(range(base - 64, base + 64)) | {0xC1D00000 + i for i in range(0, 64)}
    cands |= {0xA55A0000 + i * 0x10 for i in range(64)}
    cands.discard(c.hclient)
    hits = []
    p = c.params(0x201).encode()
    seen: dict[str, int] = {}
    for h in sorted(cands):
        kind, code = rm_control(c, h, 0x201, p, hclient=h)
        name = code_name(kind, code)
        seen[name] = seen.get(name, 0) + 1
        if kind == "status" and code == nvs.NV_OK:
            hits.append(hex(h))
    if hits:
        return escaped(f"foreign client handles answered: {hits[:8]}")
    return refused("/".join(seen), f"{len(cands)} handles tried")


# ------------------------------------------------------------------------ refused escapes
def _refused_escape(ctx: Ctx, name: str, **fields) -> Outcome:
    c = ctx.client()
    cmd, buf, spec = escape_buf(c, name, **fields)
    e = raw_ioctl(c.ctl, cmd, buf)
    if e:
        return refused(ename(e))
    st = getattr(spec.decode(bytes(buf)), "status", None)
    if st not in (None, nvs.NV_OK):
        return refused(nvs.name(st), "ioctl returned 0 with a failure status")
    return escaped(f"{name} returned 0")


def a_dup_object(ctx):
    c = ctx.client()
    v = ctx.victim
    return _refused_escape(ctx, "NV_ESC_RM_DUP_OBJECT", hClient=c.hclient,
                           hParent=c.gpu["hdevice"], hObject=c.handle(),
                           hClientSrc=v["client"], hObjectSrc=v["hmemory"])


def a_share(ctx):
    """RM_SHARE is allowed on one's own objects (CUDA IPC): the attack sets the share policy
    of the victim's memory (to let everyone duplicate it). That the victim's own share
    (the victim shares its memory with everyone, escape/tenant.py) gives no other tenant a
    duplicate is the dup-object attack's."""
    v = ctx.victim
    return _refused_escape(ctx, "NV_ESC_RM_SHARE", hClient=v["client"], hObject=v["hmemory"],
                           sharePolicy={"target": 0, "accessMask": {"limbs": [1]},
                                        "type": 1, "action": 0})


def a_registry(ctx):
    c = ctx.client()
    key = ctypes.create_string_buffer(b"RmProfilingAdminOnly")
    return _refused_escape(ctx, "NV_ESC_RM_ACCESS_REGISTRY", hClient=c.hclient,
                           hObject=c.hclient, AccessType=2,  # write DWORD
                           pParmStr=ctypes.addressof(key), ParmStrLength=len(key.raw), Data=0)


def a_i2c(ctx):
    c = ctx.client()
    return _refused_escape(ctx, "NV_ESC_RM_I2C_ACCESS", hClient=c.hclient,
                           hDevice=c.gpu["hdevice"])


def a_sys_params(ctx):
    return _refused_escape(ctx, "NV_ESC_SYS_PARAMS", memblock_size=0x1000)


def a_numa_set(ctx):
    c = ctx.client()
    cmd, buf, _ = escape_buf(c, "NV_ESC_SET_NUMA_STATUS", status=1)
    e = raw_ioctl(c.gpu_fds[ctx.own_gpu], cmd, buf)
    return refused(ename(e)) if e else escaped("SET_NUMA_STATUS returned 0")


def a_xfer_cmd(ctx):
    """XFER_CMD wrapping RM_CONTROL with a wild pointer and size."""
    return _refused_escape(ctx, "NV_ESC_IOCTL_XFER_CMD", cmd=0x2A, size=0x7FFFFFFF,
                           ptr=0xDEADBEEF000)


def a_vid_heap_alloc(ctx):
    """VID_HEAP_CONTROL ALLOC_SIZE: the legacy allocator, past the class-based quota."""
    c = ctx.client()
    return _refused_escape(ctx, "NV_ESC_RM_VID_HEAP_CONTROL", hRoot=c.hclient,
                           hObjectParent=c.gpu["hdevice"], function=1)  # ALLOC_SIZE


def a_attach_fd(ctx):
    c = ctx.client()
    ids = ctypes.create_string_buffer(struct.pack("=I", ctx.victim["gpu_ids"][str(ctx.victim_gpu)]) * 1)
    buf = bytearray(ids.raw)
    e = raw_ioctl(c.ctl, iowr(212, len(buf)), buf)
    return refused(ename(e)) if e else escaped("ATTACH_GPUS_TO_FD with the victim's GPU id")


def a_unknown_escape(ctx):
    c = ctx.client()
    outs = []
    for nr, size in ((0x99, 16), (0x3F, 8), (0xF0, 64)):
        buf = bytearray(size)
        e = raw_ioctl(c.ctl, iowr(nr, size), buf)
        outs.append(refused(ename(e)) if e else escaped(f"unknown escape {nr:#x} returned 0"))
    return combine(outs)


# ------------------------------------------------------------------------ refused classes
def make_class_attack(cls: int):
    def attack(ctx: Ctx) -> Outcome:
        c = ctx.client()
        spec = c.abi.rm_class(cls)
        size = spec.size if spec and spec.size else 64
        params = bytes(size)
        parent = c.gpu["hsubdevice"] if cls in (0x83DE, 0x90CC, 0xB0CC, 0xB1CC, 0xB2CC) \
            else c.gpu["hdevice"] if cls in (0xC2, 0x3F, 0x42, 0xF8, 0xFD) else c.hclient
        if cls in (0xC2, 0x3F, 0x42) and size >= 120:
            params = c.new("NV_MEMORY_ALLOCATION_PARAMS", owner=c.hclient, size=2 * MiB,
                           alignment=2 * MiB).encode()
        kind, code, _ = rm_alloc(c, parent, cls, params)
        return judge(kind, code, f"RM_ALLOC class {cls:#x}")
    return attack


# ------------------------------------------------------------------------ refused controls
def make_control_attack(cmd: int, target: str = "subdevice"):
    def attack(ctx: Ctx) -> Outcome:
        c = ctx.client()
        spec = c.abi.control(cmd)
        size = spec.size if spec and spec.params else 0
        hobj = {"subdevice": c.gpu["hsubdevice"], "device": c.gpu["hdevice"],
                "client": c.hclient}[target]
        params = bytes(size) if size else None
        if cmd == 0x278 and spec and spec.params:  # MODIFY_DRAIN_STATE on its own GPU
            params = spec.params.decode(bytes(size)).replace(gpuId=c.gpu["gpu_id"],
                                                             newState=1).encode()
        kind, code = rm_control(c, hobj, cmd, params, size=size)
        return judge(kind, code, f"RM_CONTROL {cmd:#x}")
    return attack


def a_attach_foreign(ctx):
    """ATTACH_IDS / DETACH_IDS / GET_ID_INFO_V2 naming a GPU that is not the attacker's."""
    c = ctx.client()
    gid = ctx.victim["gpu_ids"][str(ctx.victim_gpu)]
    outs = []
    for cmd in (0x215, 0x216):
        p = c.params(cmd)
        ids = [gid] + [0xFFFFFFFF] * (len(p.gpuIds) - 1)
        outs.append(judge(*rm_control(c, c.hclient, cmd, p.replace(gpuIds=ids).encode()),
                          f"control {cmd:#x} with GPU id {gid:#x}"))
    outs.append(judge(*rm_control(c, c.hclient, 0x205,
                                  c.params(0x205, gpuId=gid).encode()), "GET_ID_INFO_V2"))
    # A device object is asked for by device *instance*, which the driver numbers at attach
    # time (not the minor: on a two-H200 host GPU minor 0 was instance 1). The attacker
    # cannot know the victim's, so it tries every instance but its own.
    own = c.control(c.hclient, 0x205, c.params(0x205, gpuId=c.gpu["gpu_id"])).deviceInstance
    for inst in range(8):
        if inst == own:
            continue
        outs.append(judge(*rm_alloc(c, c.hclient, 0x80, c.new("NV0080_ALLOC_PARAMETERS",
                                                              deviceId=inst).encode())[:2],
                          f"device object on device instance {inst} (own: {own})"))
    return combine(outs)


def a_gpu_id_fields(ctx):
    """Controls whose parameters name GPU ids in fields other than the one
    GET_PCI_INFO has (P2P_CAPS_MATRIX's groups, ASYNC_ATTACH_ID) with the victim's GPU."""
    c = ctx.client()
    gid = ctx.victim["gpu_ids"][str(ctx.victim_gpu)]
    own = c.gpu["gpu_id"]
    outs = []
    if c.abi.control(0x13A) is not None:
        pad = [0xFFFFFFFF] * 7
        p = c.params(0x13A, grpACount=1, grpBCount=1, gpuIdGrpA=[own] + pad,
                     gpuIdGrpB=[gid] + pad)
        outs.append(judge(*rm_control(c, c.hclient, 0x13A, p.encode()),
                          f"P2P_CAPS_MATRIX with GPU id {gid:#x}"))
    if c.abi.control(0x289) is not None:  # 580 and later
        outs.append(judge(*rm_control(c, c.hclient, 0x289, c.params(0x289, gpuId=gid).encode()),
                          f"ASYNC_ATTACH_ID {gid:#x}"))
    return combine(outs)


def a_no_layout_controls(ctx):
    """Controls allowed by a row but without a layout in the client's own ABI (a client that
    checked in as driver 535, which defines neither): GET_ACTIVE_DEVICE_IDS and
    ASYNC_ATTACH_ID, the latter naming the victim's GPU id. Nothing in their parameters
    could be checked, so they must not be relayed."""
    gid = ctx.victim["gpu_ids"][str(ctx.victim_gpu)]
    old = "535.309.01"
    # In a child: the broker decodes every later call of a process that checked in as
    # another driver with that driver's ABI, and the attacks after this one are the
    # parent's.
    def as_old_driver() -> bytes:
        from devbroker.tools.probe import Client

        c = Client(version=old)
        c.check_version()
        c.open_root()
        return json.dumps([rm_control(c, c.hclient, 0x289, struct.pack("<I", gid)),
                           rm_control(c, c.hclient, 0x288, bytes(4 + 4 * 32))]).encode()

    data, _ = in_child(as_old_driver)
    if not data:
        return Outcome("error", "", "the child checked in as driver 535 reported nothing")
    (k1, c1), (k2, c2) = json.loads(data)
    return combine([judge(k1, c1, f"ASYNC_ATTACH_ID {gid:#x} as driver {old}"),
                    judge(k2, c2, f"GET_ACTIVE_DEVICE_IDS as driver {old}")])


def a_client_fields(ctx):
    """Allocation parameters naming the victim's client (an OS event's
    hParentClient, a device's hTargetClient)."""
    c = ctx.client()
    victim = ctx.victim["client"]
    ev = c.new("NV0005_ALLOC_PARAMETERS", hParentClient=victim,
               hSrcResource=c.gpu["hsubdevice"], hClass=0x79, notifyIndex=0, data=c.ctl)
    dev = c.new("NV0080_ALLOC_PARAMETERS", deviceId=ctx.own_gpu, hTargetClient=victim)
    return combine([judge(*rm_alloc(c, c.gpu["hsubdevice"], 0x79, ev.encode())[:2],
                          "OS event with the victim's hParentClient"),
                    judge(*rm_alloc(c, c.hclient, 0x80, dev.encode())[:2],
                          "device with the victim's hTargetClient")])


def a_get_pids(ctx):
    """GET_PIDS on the shared GPU: the victim (holding memory there) must not be listed."""
    c = ctx.client()
    p = c.params(0x2080018D, idType=0, id=0x40)
    buf = ctypes.create_string_buffer(p.encode(), p.spec.size)
    v = c.new("NVOS54_PARAMETERS", hClient=c.hclient, hObject=c.gpu["hsubdevice"],
              cmd=0x2080018D, params=ctypes.addressof(buf), paramsSize=p.spec.size)
    ab = bytearray(v.encode())
    e = raw_ioctl(c.ctl, iowr(0x2A, len(ab)), ab)
    if e:
        return refused(ename(e))
    st = v.spec.decode(bytes(ab)).status
    if st != nvs.NV_OK:
        return refused(nvs.name(st), "GET_PIDS failed outright")
    out = p.spec.decode(buf.raw[: p.spec.size])
    pids = list(out.pidTbl)[: out.pidTblCount]
    foreign = [x for x in pids if x != os.getpid()]
    bad = {ctx.victim.get("host_pid"), ctx.victim.get("pid")} - {None, os.getpid()}
    if foreign or (bad & set(pids)):
        return escaped(f"GET_PIDS listed pids not the attacker's: {pids}")
    return refused("filtered", f"GET_PIDS answered NV_OK with only the caller's own pids "
                               f"{pids} (victim filtered out)")


def a_get_pid_info(ctx):
    c = ctx.client()
    outs = []
    for pid in {ctx.victim.get("host_pid"), ctx.victim.get("pid"), 1}:
        # Pids are read in the caller's own pid namespace: the victim's in-namespace pid
        # may name the attacker itself there (asking about oneself is allowed).
        if not pid or pid == os.getpid():
            continue
        p = c.params(0x2080018E)
        lst = list(p.pidInfoList)
        lst[0] = lst[0].replace(pid=pid, index=0)
        p = p.replace(pidInfoListCount=1, pidInfoList=lst)
        outs.append(judge(*rm_control(c, c.gpu["hsubdevice"], 0x2080018E, p.encode()),
                          f"GET_PID_INFO for pid {pid}"))
    return combine(outs)


# ------------------------------------------------------------------------ malformed args
def a_params_size(ctx):
    """paramsSize larger than the buffer, zero and huge (RM_CONTROL), huge (RM_ALLOC)."""
    c = ctx.client()
    p = c.params(0x201).encode()
    outs = []
    for size in (len(p) + 4096, 0, 0xFFFFFFFF, len(p) - 1):
        outs.append(judge(*rm_control(c, c.hclient, 0x201, p, size=size),
                          f"RM_CONTROL paramsSize={size:#x}"))
    dp = c.new("NV0080_ALLOC_PARAMETERS", deviceId=ctx.own_gpu).encode()
    for size in (0x7FFFFFFF, 0xFFFFFFFF, 64 << 20):
        kind, code, h = rm_alloc(c, c.hclient, 0x80, dp, size=size)
        outs.append(judge(kind, code, f"RM_ALLOC paramsSize={size:#x}"))
    return combine(outs)


def a_truncated(ctx):
    """Top-level arguments shorter (and longer) than the ABI says."""
    c = ctx.client()
    outs = []
    v = c.new("NVOS54_PARAMETERS", hClient=c.hclient, hObject=c.hclient, cmd=0x201)
    full = v.encode()
    for size in (16, 8, 31, 33, 64):
        buf = bytearray(full[:size].ljust(size, b"\0"))
        e = raw_ioctl(c.ctl, iowr(0x2A, size), buf)
        if e:
            outs.append(refused(ename(e)))
        else:
            outs.append(escaped(f"RM_CONTROL with a {size}-byte argument returned 0"))
    # RM_ALLOC in the NVOS21 (32-byte) form with a short nested buffer at a hole
    addr = page_before_hole()
    ctypes.memmove(addr + PAGE - 8, b"\0" * 8, 8)
    kind, code, _ = rm_alloc(c, c.hclient, 0x80, None, ptr=addr + PAGE - 8)
    outs.append(judge(kind, code, "RM_ALLOC with a params buffer running into a hole"))
    return combine(outs)


def a_unmapped_ptr(ctx):
    """Nested pointers into unmapped, NULL-page and kernel memory."""
    c = ctx.client()
    outs = []
    size = c.abi.control(0x201).size
    for ptr in (unmapped_address(), 0x10, 0xFFFF800000001000, 0xFFFFFFFFFFFFF000):
        outs.append(judge(*rm_control(c, c.hclient, 0x201, None, size=size, ptr=ptr),
                          f"RM_CONTROL params={ptr:#x}"))
        kind, code, _ = rm_alloc(c, c.hclient, 0x80, None, ptr=ptr)
        outs.append(judge(kind, code, f"RM_ALLOC pAllocParms={ptr:#x}"))
    # the top-level argument itself unmapped
    try:
        r = libc.ioctl(ctypes.c_int(c.ctl), ctypes.c_ulong(iowr(0x2A, 32)),
                       ctypes.c_void_p(unmapped_address()))
        outs.append(refused(ename(ctypes.get_errno())) if r != 0
                    else escaped("ioctl with an unmapped top-level argument returned 0"))
    except OSError as e:  # pragma: no cover
        outs.append(refused(ename(e.errno)))
    return combine(outs)


# ------------------------------------------------------------------------ UVM
UVM_INITIALIZE = 0x30000001
UVM_REGISTER_GPU = 37
UVM_REGISTER_GPU_VASPACE = 25


def _uvm_fd(c) -> int:
    fd = os.open("/dev/nvidia-uvm", os.O_RDWR | os.O_CLOEXEC)
    buf = bytearray(16)
    raw_ioctl(fd, UVM_INITIALIZE, buf)
    return fd


def a_uvm_foreign_client(ctx):
    c = ctx.client()
    fd = _uvm_fd(c)
    outs = []
    try:
        for cmd, name in ((UVM_REGISTER_GPU, "UVM_REGISTER_GPU"),
                          (UVM_REGISTER_GPU_VASPACE, "UVM_REGISTER_GPU_VASPACE")):
            spec = c.abi.uvm(cmd).params
            val = spec.decode(bytes(spec.size)).replace(rmCtrlFd=c.ctl,
                                                        hClient=ctx.victim["client"])
            buf = ctypes.create_string_buffer(val.encode(), spec.size)
            r = libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(cmd),
                           ctypes.c_void_p(ctypes.addressof(buf)))
            if r != 0:
                outs.append(refused(ename(ctypes.get_errno())))
                continue
            st = spec.decode(buf.raw[: spec.size]).rmStatus
            outs.append(judge("status", st, f"{name} with the victim's hClient"))
        # UVM argument pointer straddling a hole
        addr = page_before_hole()
        r = libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(UVM_REGISTER_GPU),
                       ctypes.c_void_p(addr + PAGE - 8))
        outs.append(refused(ename(ctypes.get_errno())) if r != 0 else
                    escaped("UVM_REGISTER_GPU with a truncated argument returned 0"))
    finally:
        os.close(fd)
    return combine(outs)


UVM_MM_INITIALIZE = 75
UVM_MAP_EXTERNAL_ALLOCATION = 33
UVM_CREATE_EXTERNAL_RANGE = 73
FERMI_VASPACE_A = 0x90F1


def _uvm_call(c, fd: int, cmd: int, **fields) -> tuple[str, int]:
    """One UVM ioctl with the ABI's layout: ("errno", e) or ("status", rmStatus)."""
    spec = c.abi.uvm(cmd).params
    buf = bytearray(spec.decode(bytes(spec.size)).replace(**fields).encode())
    e = raw_ioctl(fd, cmd, buf)
    return ("errno", e) if e else ("status", spec.decode(bytes(buf)).rmStatus)


def a_uvm_external_foreign(ctx):
    """UVM_MAP_EXTERNAL_ALLOCATION of the victim's device memory by (victim's client, its
    memory handle) — memory the victim shared with everyone, as CUDA IPC shares it — into a
    va space of the attacker's own. With real driver files this is a call the kernel runs
    alone (rules.kernel_commands: no broker decision, no audit record), so the driver's own
    check of the client against the caller is the whole boundary. The setup is CUDA's (the recorded H200 trace):
    UVM_INITIALIZE and MM_INITIALIZE, the GPU registered, an RM VA space (FERMI_VASPACE_A,
    CUDA's flags) registered, then an external range over 2 MiB of reserved address space.
    The same mapping of the attacker's OWN memory must succeed first: a refusal of a setup
    that cannot map anything proves nothing (an error, not a refusal)."""
    c = ctx.client()
    g = c.gpu
    uuid = bytes.fromhex(g["uuid"].removeprefix("GPU-").replace("-", ""))
    if len(uuid) != 16:
        return Outcome("error", "setup", f"GPU uuid {g['uuid']!r}")
    fds, steps = [], []

    def step(what, kind, code):
        steps.append(f"{what}: {code_name(kind, code)}")
        return kind == "status" and code == nvs.NV_OK

    span, addr = 6 * MiB, None
    try:
        ufd = os.open("/dev/nvidia-uvm", os.O_RDWR | os.O_CLOEXEC)
        fds.append(ufd)
        mfd = os.open("/dev/nvidia-uvm", os.O_RDWR | os.O_CLOEXEC)
        fds.append(mfd)
        ok = (step("UVM_INITIALIZE", *_uvm_call(c, ufd, UVM_INITIALIZE))
              and step("UVM_MM_INITIALIZE", *_uvm_call(c, mfd, UVM_MM_INITIALIZE,
                                                        uvmFd=ufd))
              and step("UVM_REGISTER_GPU", *_uvm_call(
                  c, ufd, UVM_REGISTER_GPU, gpu_uuid={"uuid": uuid},
                  numaNodeId=-1, rmCtrlFd=-1)))
        if ok:
            va = c.new("NV_VASPACE_ALLOCATION_PARAMETERS", index=0, flags=0x48,
                       vaSize=0x1FFFFFFFFFFF000, vaBase=4096)
            kind, code, hva = rm_alloc(c, g["hdevice"], FERMI_VASPACE_A, va.encode(),
                                       size=len(va.encode()))
            ok = step("FERMI_VASPACE_A", kind, code) and step(
                "UVM_REGISTER_GPU_VASPACE", *_uvm_call(
                    c, ufd, UVM_REGISTER_GPU_VASPACE, gpuUuid={"uuid": uuid},
                    rmCtrlFd=c.ctl, hClient=c.hclient, hVaSpace=hva))
        own = c.alloc_device_memory(g["hdevice"], TWO_MIB) if ok else 0
        if ok:
            raw = libc.mmap(None, span, 0, 0x22 | 0x4000, -1, 0)  # PROT_NONE, private anon
            if raw in (None, ctypes.c_void_p(-1).value):  # noreserve
                return Outcome("error", "setup", "mmap of the address range failed")
            addr = raw
        bases = []
        if ok:
            first = (addr + TWO_MIB - 1) & ~(TWO_MIB - 1)
            bases = [first, first + TWO_MIB]
        att = None
        if ok:
            spec = c.abi.uvm(UVM_MAP_EXTERNAL_ALLOCATION).params
            att = list(spec.decode(bytes(spec.size)).perGpuAttributes)
            att[0] = att[0].replace(gpuUuid={"uuid": uuid}, gpuMappingType=1)

        def map_at(base, client, memory, what):
            k, code = _uvm_call(c, ufd, UVM_CREATE_EXTERNAL_RANGE, base=base,
                                length=TWO_MIB)
            if not step(f"UVM_CREATE_EXTERNAL_RANGE ({what})", k, code):
                return None
            return _uvm_call(c, ufd, UVM_MAP_EXTERNAL_ALLOCATION, base=base,
                             length=TWO_MIB, offset=0, perGpuAttributes=att,
                             gpuAttributesCount=1, rmCtrlFd=c.ctl, hClient=client,
                             hMemory=memory)

        control = map_at(bases[0], c.hclient, own, "own memory") if ok else None
        if control is None or not step("UVM_MAP_EXTERNAL_ALLOCATION of its own memory",
                                       *control):
            return Outcome("error", "setup", "the mapping of the attacker's own memory "
                           "did not succeed, so a refusal would prove nothing: "
                           + "; ".join(steps))
        outs = []
        # a fresh range for each attempt (a failed mapping leaves its range behind)
        got = map_at(bases[1], ctx.victim["client"], ctx.victim["hmemory"],
                     "victim's client")
        outs.append(Outcome("error", "setup", "; ".join(steps)) if got is None else
                    judge(*got, "MAP_EXTERNAL_ALLOCATION (victim's client, its memory)"))
        return combine(outs)
    finally:
        if addr:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(span))
        for fd in fds:
            os.close(fd)


def a_wrong_node(ctx):
    """RM escapes on the UVM node, UVM commands on nvidiactl, a root client on a GPU node."""
    c = ctx.client()
    fd = _uvm_fd(c)
    outs = []
    try:
        outs.append(judge(*rm_control(c, c.hclient, 0x201, c.params(0x201).encode(), fd=fd),
                          "RM_CONTROL on nvidia-uvm"))
        buf = bytearray(16)
        e = raw_ioctl(c.ctl, UVM_INITIALIZE, buf)
        outs.append(refused(ename(e)) if e else escaped("UVM_INITIALIZE on nvidiactl returned 0"))
        kind, code, _ = rm_alloc(c, 0, 0x41, None, root=0, handle=0,
                                 fd=c.gpu_fds[ctx.own_gpu])
        outs.append(judge(kind, code, "root client on a GPU node"))
    finally:
        os.close(fd)
    return combine(outs)


def a_open_uvm_tools(ctx):
    try:
        fd = os.open("/dev/nvidia-uvm-tools", os.O_RDWR)
    except OSError as e:
        return refused(ename(e.errno))
    os.close(fd)
    return escaped("opened /dev/nvidia-uvm-tools (the profiling interface)")


# ------------------------------------------------------------------------ quota
def _alloc_mem(c, hdev: int, size: int) -> tuple[str, int, int]:
    p = c.new("NV_MEMORY_ALLOCATION_PARAMS", owner=c.hclient, type=0, flags=0x1C101,
              attr=0x18000000, size=size, alignment=2 * MiB)
    return rm_alloc(c, hdev, 0x40, p.encode())


def _used(c) -> int:
    return c.memory(c.gpu["hsubdevice"])["used"]


def a_quota_race(ctx):
    """Parallel allocations racing the limit: 8 threads × quota/4 at once."""
    c = ctx.client()
    chunk = ctx.quota // 4
    results: list[tuple] = []
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        results.append(_alloc_mem(c, c.gpu["hdevice"], chunk))

    ts = [threading.Thread(target=go) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ok = [r for r in results if r[0] == "status" and r[1] == nvs.NV_OK]
    used = _used(c)
    for r in ok:
        rm_free(c, c.gpu["hdevice"], r[2])
    if len(ok) * chunk > ctx.quota or used > ctx.quota:
        return escaped(f"{len(ok)} × {chunk >> 20} MiB granted ({used >> 20} MiB used) "
                       f"over a {ctx.quota >> 20} MiB quota")
    names = sorted({code_name(k, s) for k, s, _ in results if not (k == "status" and s == 0)})
    return refused("/".join(names) or "none", f"{len(ok)} of 8 granted, "
                                               f"{8 - len(ok)} refused")


def a_quota_small(ctx):
    """Many small (2 MiB) allocations: no more than the quota in total."""
    c = ctx.client()
    n = ctx.quota // (2 * MiB) + 8
    got = []
    refusals = set()
    for _ in range(n):
        k, s, h = _alloc_mem(c, c.gpu["hdevice"], 2 * MiB)
        if k == "status" and s == nvs.NV_OK:
            got.append(h)
        else:
            refusals.add(code_name(k, s))
    used = _used(c)
    for h in got:
        rm_free(c, c.gpu["hdevice"], h)
    if len(got) * 2 * MiB > ctx.quota or used > ctx.quota:
        return escaped(f"{len(got)} × 2 MiB granted over a {ctx.quota >> 20} MiB quota")
    return refused("/".join(sorted(refusals)), f"{len(got)} of {n} granted")


def a_quota_odd_sizes(ctx):
    """Sizes the accounting might get wrong: 0, 1 byte (rounded up by the driver), 2^64-1."""
    c = ctx.client()
    outs = []
    before = _used(c)
    held = []
    for size in (0, 1, (1 << 64) - 1, ctx.quota + 1):
        k, s, h = _alloc_mem(c, c.gpu["hdevice"], size)
        if k == "status" and s == nvs.NV_OK:
            mspec = c.abi.struct("NV_MEMORY_ALLOCATION_PARAMS")
            granted = mspec.decode(c.last_raw_params[: mspec.size]).size
            held.append(h)
            after = _used(c)
            if after - before < granted:
                outs.append(escaped(f"size {size:#x}: driver granted {granted} bytes, quota "
                                    f"charged {after - before}"))
            else:
                outs.append(refused("charged", f"size {size:#x} granted and charged "
                                               f"{after - before} bytes"))
            before = after
        else:
            outs.append(refused(code_name(k, s)))
    for h in held:
        rm_free(c, c.gpu["hdevice"], h)
    return combine(outs)


def a_quota_during_free(ctx):
    """An allocation while another is being freed: never both alive past the quota."""
    c = ctx.client()
    big = (ctx.quota * 3) // 4 // (2 * MiB) * (2 * MiB)
    outs = []
    k, s, a = _alloc_mem(c, c.gpu["hdevice"], big)
    if not (k == "status" and s == nvs.NV_OK):
        return Outcome("error", code_name(k, s), "first allocation failed")
    for i in range(10):
        res: dict = {}
        bar = threading.Barrier(2)

        def free_a():
            bar.wait()
            res["free"] = rm_free(c, c.gpu["hdevice"], a)

        def alloc_b():
            bar.wait()
            res["alloc"] = _alloc_mem(c, c.gpu["hdevice"], big)

        t1, t2 = threading.Thread(target=free_a), threading.Thread(target=alloc_b)
        t1.start(), t2.start()
        t1.join(), t2.join()
        freed = res["free"] == ("status", nvs.NV_OK)
        kb, sb, b = res["alloc"]
        got_b = kb == "status" and sb == nvs.NV_OK
        used = _used(c)
        if (got_b and not freed) or used > ctx.quota:
            return escaped(f"round {i}: both allocations alive ({used >> 20} MiB used, quota "
                           f"{ctx.quota >> 20} MiB)")
        outs.append(refused("ok" if got_b else code_name(kb, sb)))
        if not got_b:
            k, s, b = _alloc_mem(c, c.gpu["hdevice"], big)
        a = b
    rm_free(c, c.gpu["hdevice"], a)
    return combine(outs)


def a_rm_alloc_memory(ctx):
    """RM_ALLOC_MEMORY (NVOS02, on the GPU node) of device memory past the quota."""
    c = ctx.client()
    spec = c.abi.escape("NV_ESC_RM_ALLOC_MEMORY").params
    val = spec.decode(bytes(spec.size))
    size = ctx.quota * 4
    gfd = c.gpu_fds[ctx.own_gpu]
    outs = []
    for cls in (0x40, 0x3E):
        v = val.replace(params=val.params.replace(
            hRoot=c.hclient, hObjectParent=c.gpu["hdevice"], hObjectNew=c.handle(),
            hClass=cls, flags=0, pMemory=0, limit=size - 1), fd=c.ctl)
        buf = bytearray(v.encode())
        e = raw_ioctl(gfd, iowr(0x27, len(buf)), buf)
        if e:
            outs.append(refused(ename(e)))
            continue
        st = spec.decode(bytes(buf)).params.status
        outs.append(judge("status", st, f"RM_ALLOC_MEMORY class {cls:#x} of "
                                        f"{size >> 20} MiB"))
    return combine(outs)


def a_quota_alignment(ctx):
    """1 byte with a 135 GiB alignment (NV_OK on the driver, which charges the size rounded
    to its page, not the alignment), then the rest of the quota: the check and the charge
    must agree, and the tenant must still get its whole quota."""
    c = ctx.client()
    hdev = c.gpu["hdevice"]
    before = _used(c)
    p = c.new("NV_MEMORY_ALLOCATION_PARAMS", owner=c.hclient, type=0, flags=0x1C101,
              attr=0x18000000, size=1, alignment=135 << 30)
    k, st, h = rm_alloc(c, hdev, 0x40, p.encode())
    if not (k == "status" and st == nvs.NV_OK):
        return refused(code_name(k, st), "1 byte with a 135 GiB alignment refused")
    mspec = c.abi.struct("NV_MEMORY_ALLOCATION_PARAMS")
    granted = mspec.decode(c.last_raw_params[: mspec.size]).size
    charged = _used(c) - before
    held = [h]
    try:
        if granted > ctx.quota or charged > ctx.quota:
            return escaped(f"1 byte with a 135 GiB alignment granted {granted} bytes, charged "
                           f"{charged}, over a {ctx.quota >> 20} MiB quota")
        rest = (ctx.quota - _used(c)) // (2 * MiB) * (2 * MiB)
        if rest:
            k2, st2, h2 = _alloc_mem(c, hdev, rest)
            if not (k2 == "status" and st2 == nvs.NV_OK):
                return escaped(f"after 1 byte charged {charged} bytes, the remaining "
                               f"{rest >> 20} MiB of the quota were refused "
                               f"({code_name(k2, st2)})", code_name(k2, st2))
            held.append(h2)
        return refused("charged", f"1 byte granted {granted} bytes and charged {charged}; "
                                  f"the remaining {rest >> 20} MiB of the quota granted too")
    finally:
        for x in held:
            rm_free(c, hdev, x)


def a_quota_unwritable_params(ctx):
    """Allocations whose parameter block the broker can read but not write back (a read-only
    page): the driver has allocated by then, so the memory must be in the books although
    the call fails (were it booked only after a successful write-back, the memory the driver
    holds would be off the books)."""
    c = ctx.client()
    hdev = c.gpu["hdevice"]
    chunk = ctx.quota // 2 // (2 * MiB) * (2 * MiB)
    p = c.new("NV_MEMORY_ALLOCATION_PARAMS", owner=c.hclient, type=0, flags=0x1C101,
              attr=0x18000000, size=chunk, alignment=2 * MiB).encode()
    page = libc.mmap(None, PAGE, 3, 0x22, -1, 0)  # PROT_RW, MAP_PRIVATE|MAP_ANONYMOUS
    ctypes.memmove(page, p, len(p))
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mprotect(ctypes.c_void_p(page), PAGE, 1)  # PROT_READ: the broker's write-back fails
    handles, got = [], []
    try:
        for _ in range(4):
            h = c.handle()
            handles.append(h)
            k, st, _ = rm_alloc(c, hdev, 0x40, None, ptr=page, handle=h)
            got.append(code_name(k, st))
        failed_write = [g for g in got if g in ("EFAULT", "NV_OK")]
        if len(failed_write) * chunk > ctx.quota:
            return escaped(f"{len(failed_write)} × {chunk >> 20} MiB allocated with an "
                           f"unwritable parameter block ({got}) over a {ctx.quota >> 20} MiB "
                           "quota: the books lost them", "/".join(got))
        return refused("/".join(dict.fromkeys(got)), f"results {got}")
    finally:
        for h in handles:
            rm_free(c, hdev, h)
        libc.munmap(page, PAGE)


# ------------------------------------------------------------------------ broker stalls
MAP_FAILED = (1 << 64) - 1
SYS_userfaultfd = 323
UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
UFFD_API = 0xAA
UFFDIO_REGISTER_MODE_MISSING = 1
STALL_WATCHDOG = 20.0  # seconds: far beyond the broker's deadline on tenant memory (2 s)


def _watchdog(fn, seconds: float = STALL_WATCHDOG):
    """fn() on a thread: (True, result), or (False, None) when it has not returned in time
    (the broker stopped answering; the thread is left blocked)."""
    box: dict = {}

    def run():
        try:
            box["r"] = fn()
        except Exception as e:  # pragma: no cover - reported as the result
            box["r"] = ("errno", getattr(e, "errno", 0) or 0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return ("r" in box), box.get("r")


def _uvm_init_at(addr: int) -> tuple[str, int]:
    """UVM_INITIALIZE with its argument at addr (the broker reads it from the tenant)."""
    fd = os.open("/dev/nvidia-uvm", os.O_RDWR | os.O_CLOEXEC)
    try:
        r = libc.ioctl(ctypes.c_int(fd), ctypes.c_ulong(UVM_INITIALIZE), ctypes.c_void_p(addr))
        return ("errno", ctypes.get_errno()) if r != 0 else ("status", nvs.NV_OK)
    finally:
        os.close(fd)


def _stall_attempts(c, addr: int, where: str) -> list[Outcome]:
    """A nested RM_CONTROL parameter block and a UVM argument at addr, each under a
    watchdog; then an ordinary call, which must still be answered."""
    outs = []
    size = c.abi.control(0x201).size
    for what, fn in ((f"RM_CONTROL params in {where}",
                      lambda: rm_control(c, c.hclient, 0x201, None, size=size, ptr=addr)),
                     (f"UVM_INITIALIZE argument in {where}", lambda: _uvm_init_at(addr))):
        t0 = time.monotonic()
        done, res = _watchdog(fn)
        if not done:
            outs.append(escaped(f"{what}: no answer in {STALL_WATCHDOG:g} s (broker stalled)",
                                "hang"))
            return outs
        outs.append(judge(*res, f"{what} ({time.monotonic() - t0:.1f} s)"))
    done, _ = _watchdog(c.attached_ids)
    if not done:
        outs.append(escaped(f"after the {where} attempts an ordinary call got no answer in "
                            f"{STALL_WATCHDOG:g} s (broker stalled)", "hang"))
    return outs


def a_own_mount_ptr(ctx):
    """Nested pointers into pages mapped from the broker's own FUSE mount (the tenant's
    GPU node; and /proc/driver/nvidia/version, which was the broker's too until the sandbox
    began to copy that view into its own tmpfs: now an ordinary page, kept as a case),
    never touched: a fault on them is a FUSE READ to the broker itself (one the
    broker waited on itself would hang the whole broker)."""
    c = ctx.client()
    outs = []
    maps = []
    try:
        for path, oflags, mflags in ((f"/dev/nvidia{ctx.own_gpu}", os.O_RDWR, 0x01),  # SHARED
                                     ("/proc/driver/nvidia/version", os.O_RDONLY, 0x02)):
            try:
                fd = os.open(path, oflags | os.O_CLOEXEC)
            except OSError as e:
                return Outcome("error", ename(e.errno), f"open {path}")
            addr = libc.mmap(None, PAGE, 1, mflags, fd, 0)  # PROT_READ, not touched
            os.close(fd)
            if not addr or addr == MAP_FAILED:
                return Outcome("error", ename(ctypes.get_errno()), f"mmap {path}")
            maps.append(addr)
            outs += _stall_attempts(c, addr, f"an untouched page of {path}")
            if any(o.result == "escaped" for o in outs):
                break
    finally:
        for addr in maps:
            libc.munmap(addr, PAGE)
    return combine(outs)


def a_uffd_ptr(ctx):
    """A nested pointer into a userfaultfd range the tenant never serves: the broker's read
    waits for the tenant. Needs userfaultfd for kernel-mode faults (CAP_SYS_PTRACE or
    vm.unprivileged_userfaultfd=1): where the kernel refuses that, that is the refusal."""
    c = ctx.client()
    uffd = libc.syscall(ctypes.c_long(SYS_userfaultfd),
                        ctypes.c_long(os.O_CLOEXEC | os.O_NONBLOCK))
    if uffd < 0:
        e = ctypes.get_errno()
        return Outcome("refused", ename(e), f"userfaultfd refused to the tenant by the kernel "
                                            f"({ename(e)})", by_kernel=True)
    addr = 0
    try:
        api = bytearray(struct.pack("=QQQ", UFFD_API, 0, 0))
        fcntl.ioctl(uffd, UFFDIO_API, api, True)
        addr = libc.mmap(None, PAGE, 3, 0x22, -1, 0)  # PROT_RW, MAP_PRIVATE|MAP_ANONYMOUS
        reg = bytearray(struct.pack("=QQQQ", addr, PAGE, UFFDIO_REGISTER_MODE_MISSING, 0))
        fcntl.ioctl(uffd, UFFDIO_REGISTER, reg, True)
        outs = _stall_attempts(c, addr, "a userfaultfd page nobody serves")
    finally:
        os.close(uffd)  # wakes the faults still waiting: the broker's stalled threads return
        if addr:
            libc.munmap(addr, PAGE)
    return combine(outs)


# ------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Attack:
    id: str
    title: str
    category: str
    std: str  # the §5.3.1 item it tests
    expect: tuple[str, ...]  # acceptable refusals (errno names / NV_STATUS names)
    layer: str  # who should refuse: broker | sandbox | kernel | seccomp filter | front end
    audit: str | None  # regex searched in the audit record's what + reason; None: none
    fn: Callable[[Ctx], Outcome]
    victim: bool = False  # needs the victim's facts
    frontends: tuple[str, ...] = ("fuse", "seccomp", "kmod", "cuse")
    no_audit: str = ""  # why there is no audit record (when audit is None)
    # Per front end: {"seccomp": {"layer": ..., "audit": ..., "no_audit": ...}} where
    # another layer refuses the same attack there (or, in the guest, another function
    # performs it: "fn" is applied by the tenant runner too).
    overrides: dict = field(default_factory=dict, hash=False, compare=False)
    # Per front end the attack does not run on: why it does not apply (the table's N/A).
    na: dict = field(default_factory=dict, hash=False, compare=False)
    # The backends it applies to (the racing-thread attacks need the real driver's files).
    backends: tuple[str, ...] = ("emulated", "real")
    # Host GPUs it needs: 2 for the attacks aimed at a GPU only the victim has (with the real
    # backend on a one-GPU host the victim shares the attacker's only GPU: N/A there).
    gpus: int = 1

    def for_frontend(self, front_end: str) -> "Attack":
        import dataclasses

        o = self.overrides.get(front_end)
        return dataclasses.replace(self, **o) if o else self


_K = "the kernel refuses it before any broker code runs; the kernel writes no audit line"
_S = ("refused by the sandbox's mount/pid namespace view (the path does not exist there); "
      "path lookups leave no audit line")
GUEST = ("kmod", "cuse")


def _guest(**o) -> dict:
    """The same override for the module and CUSE (both run in the guest, tenants by uid)."""
    return {fe: o for fe in GUEST}


_MKNOD_GUEST = _guest(
    expect=("EPERM", "EACCES", "ENOENT", "EROFS"),
    no_audit=_K + " (guest: uid 1002 has no CAP_MKNOD, /dev is not writable for it, no "
                  "/dev/shm; a node made anyway would be the front end's own device, whose "
                  "opens the broker still maps by uid)")

ATTACKS: list[Attack] = [
    # sandbox / kernel layer
    Attack("real-nodes", "open real / other tenants' NVIDIA nodes by path", "sandbox", E,
           ("ENOENT", "EACCES"), "sandbox", None, a_open_real_nodes, True,
           ("fuse", *GUEST), _S,
           overrides=_guest(
               title="open the victim's GPU node /dev/nvidia1 and other NVIDIA/DRM nodes by "
                     "path", layer="broker (open)", audit=r"open gpu1\b",
               no_audit="")),
    Attack("mknod-ctl", "mknod c 195:255 (nvidiactl) in /tmp, /dev/shm, /dev", "sandbox", E,
           ("EPERM", "EROFS"), "kernel", None, a_mknod_ctl,
           no_audit=_K + " (sandbox: no CAP_MKNOD, /dev read-only; seccomp: filter EPERM)",
           overrides=_MKNOD_GUEST),
    Attack("mknod-gpu", "mknod c 195:0 (nvidia0)", "sandbox", E, ("EPERM", "EROFS"), "kernel",
           None, a_mknod_gpu0, no_audit=_K, overrides=_MKNOD_GUEST),
    Attack("mknod-uvm", "mknod of the nvidia-uvm major (238:0)", "sandbox", E,
           ("EPERM", "EROFS"), "kernel", None, a_mknod_uvm, no_audit=_K,
           overrides=_MKNOD_GUEST),
    Attack("proc-broker", "the broker's /proc/<pid>/{mem,environ,root,fd}, its /dev/fuse fd",
           "sandbox", E, ("ENOENT",), "sandbox", None, a_proc_broker, frontends=("fuse", *GUEST),
           no_audit=_S + " (fresh procfs of the tenant's pid namespace)",
           overrides=_guest(
               title="the broker's and the victim's /proc/<pid>/{mem,environ,root,cwd,fd}, "
                     "pidfd_getfd of their fds, process_vm_readv", fn=a_proc_other_uids,
               expect=("EACCES", "EPERM"), layer="kernel",
               no_audit="the kernel's ptrace access check refuses another uid without "
                        "CAP_SYS_PTRACE; no audit line (one pid namespace in the guest: the "
                        "processes are visible, not reachable)")),
    Attack("control-socket", "the broker's control socket and audit log in its run dir",
           "sandbox", E, ("ENOENT",), "sandbox", None, a_control_socket,
           frontends=("fuse", *GUEST), no_audit=_S + " (run dir covered by an empty tmpfs)",
           overrides=_guest(
               title="the broker's control socket and its audit log, by path",
               fn=a_control_socket_guest, expect=("EACCES",), layer="kernel (file modes)",
               no_audit="file modes: the control socket is 0600 (ControlServer), the audit "
                        "log's directory is not searchable by tenants here; no audit line "
                        "(AuditLog itself makes the file 0644: the run dir's mode protects it)"
               )),
    Attack("umount-node", "umount /dev/nvidiactl, /dev, /proc; remount /dev rw", "sandbox", E,
           ("EPERM",), "kernel", None, a_umount_node, frontends=("fuse", *GUEST),
           no_audit=_K + " (no CAP_SYS_ADMIN)",
           overrides=_guest(no_audit=_K + " (uid 1002: no CAP_SYS_ADMIN)")),
    Attack("userns-umount", "a user namespace, then umount the node / mknod on a new /dev",
           "sandbox", E, ("EINVAL", "EPERM", "EACCES", "EOVERFLOW"), "kernel", None,
           a_userns_umount,
           frontends=("fuse", *GUEST), no_audit=_K + " (locked mounts; mknod in a user ns)",
           overrides=_guest(no_audit=_K + " (no CAP_MKNOD from a user namespace; its mounts "
                                          "are nodev)")),
    Attack("userns-uid", "a user namespace mapping the victim's uid onto one's own, then open "
           "the victim's GPU node and count a new client's GPUs", "front end", E, ("EACCES",),
           "broker (open, real uid)", r"open gpu1\b", a_userns_uid, True, GUEST,
           na={"fuse": "FUSE tenants are told apart by their node paths in their own sandbox, "
                       "not by uid",
               "seccomp": "the seccomp supervisor is started for one tenant; uids play no part"}),
    Attack("open-by-handle", "open_by_handle_at (opens an inode past path checks)", "sandbox",
           E, ("EPERM",), "kernel", None, a_open_by_handle,
           no_audit=_K + " (no CAP_DAC_READ_SEARCH; seccomp: filter EPERM)"),
    Attack("io-uring", "io_uring (its OPENAT is not seen by seccomp)", "front end", E,
           ("ENOSYS",), "seccomp filter", None, a_io_uring, frontends=("seccomp",),
           no_audit="the seccomp filter answers ENOSYS in the kernel; no audit line",
           na={fe: "the nodes send every open to the broker whichever syscall "
                                "makes it (io_uring's OPENAT too); io_uring only matters as a "
                                "way around the seccomp filter" for fe in GUEST}),
    Attack("uvm-tools", "open /dev/nvidia-uvm-tools (profiling of other processes)",
           "broker", E, ("EACCES",), "broker", "nvidia-uvm-tools", a_open_uvm_tools),
    # fds and handles across tenants
    Attack("fd-pass", "victim's nvidiactl fd received over a Unix socket, used with its client",
           "cross-tenant", E, ("EACCES", "EPERM", "NV_ERR_INVALID_CLIENT", "ENOTTY"), "broker",
           r"\bfd\b|file|process|sandbox|namespace", a_fd_pass, True,
           overrides={"seccomp": {
               "layer": "seccomp front end", "audit": None, "expect": ("ENOTTY",),
               "no_audit": "the victim's placeholder is a memfd the attacker's supervisor does "
                           "not know: its ioctls are CONTINUEd to the kernel (ENOTTY) and never "
                           "reach the broker, so there is nothing to audit"}}),
    Attack("fd-pass-mmap", "victim's mapped nvidiactl (its page faulted in and written) "
           "received over a Unix socket and mapped", "cross-tenant", E, ("SIGBUS",),
           "front end (FUSE page cache)", "passed to another sandbox", a_fd_pass_mmap, True,
           frontends=("fuse", "seccomp"),
           na={"kmod": "the module maps a broker memfd per file", "cuse": "CUSE nodes have "
                                                                       "no mmap"},
           overrides={"seccomp": {
               "layer": "seccomp front end (what the mapped file is)", "expect": ("EACCES",),
               "audit": "a broker file that is not this tenant's"}}),
    Attack("fd-pass-register", "victim's ctl fd as REGISTER_FD.ctl_fd on the attacker's GPU fd",
           "cross-tenant", E, ("EBADF", "EINVAL"), "broker", "NV_ESC_REGISTER_FD",
           a_fd_pass_register, True),
    Attack("foreign-client", "the victim's client handle (control, free, alloc)",
           "cross-tenant", E, ("NV_ERR_INVALID_CLIENT",), "broker", "not this tenant's",
           a_foreign_client, True),
    Attack("foreign-object", "the victim's device/subdevice/memory handles in own client",
           "cross-tenant", E, ("NV_ERR_INVALID_OBJECT_HANDLE", "NV_ERR_INVALID_OBJECT_PARENT",
                               "EBADF"), "broker", "is not in client", a_foreign_object, True),
    Attack("client-collision", "allocate a root client with the victim's client handle",
           "cross-tenant", E, ("NV_ERR_INSERT_DUPLICATE_NAME",), "broker",
           "held by another tenant", a_client_collision, True),
    Attack("guess-handles", "sweep ~250 candidate client handles", "cross-tenant", E,
           ("NV_ERR_INVALID_CLIENT",), "broker", "not this tenant's", a_guess_handles, True),
    # RM_DUP_OBJECT is allowed inside a tenant: from another tenant's client the
    # broker answers as the driver answers an unknown client.
    Attack("dup-object", "RM_DUP_OBJECT from the victim's client", "cross-tenant", E,
           ("NV_ERR_INVALID_CLIENT",), "broker", "RM_DUP_OBJECT", a_dup_object, True),
    Attack("share", "RM_SHARE setting the share policy of the victim's memory",
           "cross-tenant", E, ("NV_ERR_INVALID_CLIENT",), "broker", "NV_ESC_RM_SHARE",
           a_share),
    Attack("attach-foreign", "ATTACH/DETACH_IDS, GET_ID_INFO_V2, device 0x80 on the victim's GPU",
           "cross-tenant", E, ("NV_ERR_INSUFFICIENT_PERMISSIONS", "NV_ERR_INVALID_ARGUMENT"),
           "broker", "not one of the tenant's", a_attach_foreign, True, gpus=2),
    Attack("gpu-id-fields", "P2P_CAPS_MATRIX / ASYNC_ATTACH_ID naming the victim's GPU id",
           "cross-tenant", E, ("NV_ERR_INVALID_ARGUMENT",), "broker",
           r"(P2P_CAPS_MATRIX|ASYNC_ATTACH_ID).*=0x[0-9a-f]+ is not one of the tenant's GPUs",
           a_gpu_id_fields, True, gpus=2),
    Attack("no-layout-controls", "allowed controls the client's ABI has no layout for "
           "(checked in as driver 535: ASYNC_ATTACH_ID with the victim's GPU id, "
           "GET_ACTIVE_DEVICE_IDS)", "cross-tenant", E, ("NV_ERR_NOT_SUPPORTED",), "broker",
           "defines no layout for it", a_no_layout_controls, True,
           frontends=("fuse", "seccomp"), backends=("emulated",),
           na={fe: "the guest's broker runs the same rule rows; the harness there checks in "
                   "as its own driver only" for fe in GUEST}),
    Attack("client-fields", "OS event hParentClient / device hTargetClient naming the "
           "victim's client", "cross-tenant", E, ("NV_ERR_INVALID_CLIENT",), "broker",
           "(hParentClient|hTargetClient)=0x[0-9a-f]+ is not a client of this tenant",
           a_client_fields, True),
    Attack("attach-gpus-to-fd", "NV_ESC_ATTACH_GPUS_TO_FD with the victim's GPU id",
           "cross-tenant", E, ("EPERM", "EINVAL"), "broker", "NV_ESC_ATTACH_GPUS_TO_FD", a_attach_fd,
           True, gpus=2),
    Attack("get-pids", "GET_PIDS on a shared GPU (victim holds memory there)", "cross-tenant",
           E, ("filtered",), "broker (rewrite)", None, a_get_pids, True,
           no_audit="not a refusal: the answer is rewritten to the caller's own processes "
                    "(rewrite.gpu_pids); rewrites are not audited"),
    Attack("get-pid-info", "GET_PID_INFO for the victim's pid", "cross-tenant", E,
           ("NV_ERR_INSUFFICIENT_PERMISSIONS",), "broker", "GET_PID_INFO", a_get_pid_info, True),
    Attack("uvm-foreign-client", "UVM_REGISTER_GPU(_VASPACE) naming the victim's client; "
           "truncated UVM argument", "cross-tenant", E,
           ("NV_ERR_INVALID_CLIENT", "EFAULT"), "broker", "not a client of this tenant",
           a_uvm_foreign_client, True),
    Attack("wrong-node", "RM escapes on nvidia-uvm, UVM on nvidiactl, root client on nvidia0",
           "malformed", F, ("EINVAL", "EPERM", "ENOTTY", "NV_ERR_INVALID_ARGUMENT"), "broker",
           "not valid on|unknown command|allocated on nvidiactl", a_wrong_node),
    # privileged escapes
    Attack("registry", "RM_ACCESS_REGISTRY (write a driver registry key)", "privileged", F,
           ("EPERM",), "broker", "NV_ESC_RM_ACCESS_REGISTRY", a_registry),
    Attack("i2c", "RM_I2C_ACCESS", "privileged", F, ("EPERM",), "broker",
           "NV_ESC_RM_I2C_ACCESS", a_i2c),
    Attack("sys-params", "SYS_PARAMS with a memblock size other than the host's", "privileged",
           F, ("EPERM",), "broker", "SYS_PARAMS", a_sys_params),
    Attack("numa-set", "SET_NUMA_STATUS (online/offline GPU memory)", "privileged", F,
           ("EPERM",), "broker", "NV_ESC_SET_NUMA_STATUS", a_numa_set),
    Attack("xfer-cmd", "XFER_CMD wrapping RM_CONTROL, wild pointer, size 0x7fffffff",
           "malformed", F, ("EPERM",), "broker", "NV_ESC_IOCTL_XFER_CMD", a_xfer_cmd),
    Attack("unknown-escape", "escapes the ABI tables do not know (0x99, 0x3f, 0xf0)",
           "malformed", F, ("EPERM", "EINVAL"), "broker", "unknown command", a_unknown_escape),
]

_CLASS_WHY = {0x83DE: "debugger", 0x90CC: "profiler", 0xB0CC: "profiler", 0xB1CC: "profiler",
              0xB2CC: "profiler", 0xC639: "MIG config capability",
              0xC640: "MIG monitor capability", 0x0F: "fabric manager capability",
              0xF1: "IMEX capability", 0xC2: "LOCAL_PHYSICAL video memory",
              0x3F: "privileged local memory", 0x42: "extended user memory (unaccounted)",
              0xFD: "multicast fabric memory"}
# (0xF8, NV_MEMORY_FABRIC, is allowed: an address range over the tenant's own
# memory, which the driver takes only from the caller's own client.)
for _cls, _why in _CLASS_WHY.items():
    ATTACKS.append(Attack(f"class-{_cls:04x}", f"RM_ALLOC class {_cls:#x} ({_why})",
                          "privileged class", F, ("NV_ERR_INSUFFICIENT_PERMISSIONS",), "broker",
                          rf"\({_cls:#x}\)", make_class_attack(_cls)))

_CONTROLS = [
    (0x20800134, "ECC: SET_ECC_CONFIGURATION"), (0x20800136, "ECC: RESET_ECC_ERROR_STATUS"),
    (0x20803403, "ECC configuration"), (0x208001A9, "reset: MARK_DEVICE_FOR_RESET"),
    (0x208001AC, "reset: MARK_DEVICE_FOR_DRAIN_AND_RESET"), (0x278, "drain: MODIFY_DRAIN_STATE"),
    (0x20800112, "power: GPU_SET_POWER"), (0x2080205B, "power: PERF_SET_POWERSTATE"),
    (0x2080206F, "power: RATED_TDP_SET_CONTROL"),
    # PERF_BOOST (0x2080200A) is not here: CUDA sends it at every context creation, so the
    # broker answers it NV_OK without the driver (the row's relay_if in broker/rules.py); the
    # attack tests/test_seccomp_exec.py checks that it never reaches the driver.
    (0x20800122, "registers: EXEC_REG_OPS"), (0x20800602, "I2C: WRITE_BUFFER"),
    (0x20800603, "I2C: READ_REG"), (0x20800604, "I2C: WRITE_REG"),
    (0x208F0703, "registers: BIF_CONFIG_REG_WRITE"), (0x20800174, "MIG: SET_PARTITIONS"),
    (0xC6370101, "MIG: EXEC_PARTITIONS_CREATE"), (0xC6370102, "MIG: EXEC_PARTITIONS_DELETE"),
]
for _cmd, _why in _CONTROLS:
    ATTACKS.append(Attack(f"ctrl-{_cmd:08x}", f"RM_CONTROL {_cmd:#x} ({_why})",
                          "privileged control", F, ("NV_ERR_INSUFFICIENT_PERMISSIONS",),
                          "broker", rf"\({_cmd:#x}\)",
                          make_control_attack(_cmd, "client" if _cmd < 0x10000 else
                                              "subdevice")))

ATTACKS += [
    # malformed arguments
    Attack("params-size", "paramsSize larger than the buffer, zero, huge, one short",
           "malformed", F, ("NV_ERR_INVALID_PARAM_STRUCT", "NV_ERR_INVALID_ARGUMENT", "EFAULT"),
           "broker", "paramsSize", a_params_size),
    Attack("truncated", "top-level argument shorter/longer than the ABI size; nested buffer "
           "running into a hole", "malformed", F, ("EINVAL", "EPERM", "EFAULT"), "broker",
           "NV_ESC_RM_CONTROL", a_truncated),
    Attack("unmapped-ptr", "nested pointers into unmapped, NULL-page and kernel addresses",
           "malformed", F, ("EFAULT", "NV_ERR_INVALID_ARGUMENT"), "broker",
           "memory access failed|argument unreadable", a_unmapped_ptr),
    # quota
    Attack("quota-race", "8 parallel allocations of quota/4 racing the limit", "quota", E,
           ("NV_ERR_NO_MEMORY",), "broker", "exceed the quota", a_quota_race),
    Attack("quota-small", "many 2 MiB allocations past the quota", "quota", E,
           ("NV_ERR_NO_MEMORY",), "broker", "exceed the quota", a_quota_small),
    Attack("quota-odd-sizes", "sizes 0, 1 byte, 2^64-1, quota+1", "quota", E,
           ("NV_ERR_NO_MEMORY", "NV_ERR_INVALID_ARGUMENT", "charged"), "broker",
           "exceed the quota", a_quota_odd_sizes),
    Attack("quota-during-free", "allocate 3/4 quota while the previous 3/4 is being freed",
           "quota", E, ("NV_ERR_NO_MEMORY", "ok"), "broker", None, a_quota_during_free,
           no_audit="a refusal here (if the free has not finished) is audited as a quota "
                    "denial, but the race may let every round succeed legitimately"),
    Attack("vid-heap-alloc", "VID_HEAP_CONTROL ALLOC_SIZE (legacy allocator)", "quota", E,
           ("EPERM",), "broker", "NV_ESC_RM_VID_HEAP_CONTROL", a_vid_heap_alloc),
    Attack("rm-alloc-memory", "RM_ALLOC_MEMORY of 4× the quota (classes 0x40, 0x3e)", "quota",
           E, ("NV_ERR_INSUFFICIENT_PERMISSIONS", "EPERM", "NV_ERR_NO_MEMORY"), "broker",
           "NV_ESC_RM_ALLOC_MEMORY", a_rm_alloc_memory),
    Attack("quota-alignment", "1 byte with a 135 GiB alignment, then the rest of the quota",
           "quota", E, ("charged",), "broker (quota) / driver", None, a_quota_alignment,
           no_audit="not a refusal: the driver grants it and charges the size rounded to its "
                    "page; the evidence is the charge (and the rest of the quota granted)"),
    Attack("quota-unwritable-params", "allocations of quota/2 whose parameter block cannot "
           "be written back (read-only page)", "quota", E, ("EFAULT", "NV_ERR_NO_MEMORY"),
           "broker", "exceed the quota", a_quota_unwritable_params),
    # availability: a tenant must not be able to stall the broker for everyone
    Attack("own-mount-ptr", "nested pointers into untouched pages mapped from the broker's "
           "own mount (own GPU node, /proc/driver/nvidia/version)", "availability", E,
           ("EFAULT",), "broker (memory gate, FUSE front end)",
           "broker's own nodes|did not complete within", a_own_mount_ptr,
           frontends=("fuse",),
           na={"seccomp": "the seccomp harness runs without the sandbox: the nodes are memfds "
                          "and no broker mount is in the tenant's view (the memory gate covers "
                          "one where a sandbox shows it)",
               **{fe: "no page the tenant can map faults into the broker: the module maps a "
                      "broker memfd (docs/kmod.md), CUSE nodes have no mmap (ENODEV)"
                  for fe in GUEST}}),
    Attack("uffd-ptr", "a nested pointer into a userfaultfd page nobody serves",
           "availability", E, ("EFAULT", "EPERM"), "broker (memory gate deadline)",
           "did not complete within", a_uffd_ptr,
           overrides={"fuse": {
               "layer": "kernel", "audit": None,
               "no_audit": "the sandbox gives no CAP_SYS_PTRACE, so the kernel refuses a "
                           "userfaultfd that traps the broker's accesses (EPERM); no audit "
                           "line. Where it is allowed, the broker's deadline refuses the call "
                           "(EFAULT, audited) as on seccomp"},
               **_guest(layer="kernel", audit=None,
                        no_audit="uid 1002 has no CAP_SYS_PTRACE, so the kernel refuses it a "
                                 "userfaultfd that traps the broker's accesses (EPERM); no "
                                 "audit line. Where it is allowed, the broker's deadline "
                                 "refuses the call (EFAULT, audited) as on seccomp")}),
]

# Racing-thread attacks on calls continued in the tenant (escape/races.py).
_RACE_NA = {"fuse": "continued calls exist only with driver files in the tenant (seccomp "
                    "front end, real backend)"}
_RACE_NO_AUDIT = ("a lost race leaves the decided call, which needs no record; a won "
                  "NVOS02 race is ended by the quota watch with a 'violation' record, judged "
                  "here by the process's death")
ATTACKS += [
    Attack("race-nvos02-class", "a racing thread rewrites a continued OS-descriptor "
           "allocation (NVOS02, 0x71) into 24 GiB of video memory (0x40)", "quota", E,
           ("NOT_WON", "KILLED"), "broker (quota watch: the driver's per-process accounting)",
           None, _races.a_race_nvos02_class, frontends=("seccomp",), no_audit=_RACE_NO_AUDIT,
           na=_RACE_NA, backends=("real",)),
    Attack("race-root-class", "a racing thread rewrites the continued root-client allocation "
           "on a fresh nvidiactl into another class", "cross-tenant", E,
           ("ROOT_CLIENT_ONLY",), "driver (no client on the file to allocate under)", None,
           _races.a_race_root_class, frontends=("seccomp",), no_audit=_RACE_NO_AUDIT,
           na=_RACE_NA, backends=("real",)),
    Attack("race-checked-gpu-id", "a racing thread flips GET_ID_INFO_V2's GPU id between "
           "the attacker's GPU and the victim's while the broker decides it", "cross-tenant",
           E, ("NOT_WON",), "broker (decides on its private copy, which the driver answers)",
           r"GET_ID_INFO_V2.*is not one of the tenant's GPUs", _races.a_race_checked_gpu_id,
           True, gpus=2),
    Attack("uvm-external-foreign", "UVM_MAP_EXTERNAL_ALLOCATION of the victim's shared "
           "device memory by its client and handle (a call the kernel runs alone)",
           "cross-tenant", E,
           ("NV_ERR_INVALID_CLIENT", "NV_ERR_INSUFFICIENT_PERMISSIONS",
            "NV_ERR_INVALID_OBJECT_HANDLE", "NV_ERR_OBJECT_NOT_FOUND", "NV_ERR_INVALID_OBJECT"),
           "driver (the client checked against the caller)", None, a_uvm_external_foreign,
           True, frontends=("seccomp",), backends=("real",),
           na={"fuse": "calls the kernel runs alone exist only with driver files in the "
                       "tenant (seccomp front end, real backend)"},
           no_audit="the broker does not see the call (rules.kernel_commands: the tenant's "
                    "filter lets the kernel run it): the driver's status is the evidence"),
    Attack("race-direct-open", "the real nvidiactl opened past the broker's path check "
           "(/proc/self/root/dev/nvidiactl), then an ioctl and an mmap of it", "front end", E,
           ("EPERM",), "front end (files the broker did not give out)", "did not give out",
           _races.a_race_direct_open, frontends=("seccomp",), na=_RACE_NA,
           backends=("real",)),
]

# Managed (nvidia-uvm) ranges charged against the quota (escape/managed.py).
from devbroker.escape import managed as _managed  # noqa: E402

_MANAGED_NA = {"fuse": "managed memory is offered through the seccomp front end only (a FUSE "
                       "node's mmap is the kernel's: the broker never sees its size)",
               **{fe: "managed memory is offered through the seccomp front end only: an "
                      "nvidia-uvm mapping of the module's node has no mapping context "
                      "(EINVAL), CUSE nodes have no mmap" for fe in GUEST}}
ATTACKS += [
    Attack("managed-pieces", "map managed (nvidia-uvm) ranges past the quota in many small "
           "pieces", "quota", E, ("ENOMEM",), "broker (managed ranges charged at map time)",
           "managed memory would exceed the quota", _managed.a_managed_pieces,
           frontends=("seccomp",), na=_MANAGED_NA),
    Attack("managed-remap-race", "unmap a managed range, then map one again from four "
           "racing threads (counted once for two ranges?)", "quota", E, ("ENOMEM",),
           "broker (a range in flight stays charged until its thread is past it)",
           "managed memory would exceed the quota", _managed.a_managed_remap_race,
           frontends=("seccomp",), na=_MANAGED_NA),
    Attack("managed-grow", "grow a charged managed range with mremap (in place, moved)",
           "quota", E, ("EFAULT", "COUNTED"),
           "kernel (the driver's VM_DONTEXPAND); the broker counts what the maps show",
           "managed memory would exceed the quota", _managed.a_managed_grow,
           frontends=("seccomp",), na=_MANAGED_NA),
]
BY_ID: dict[str, Attack] = {a.id: a for a in ATTACKS}
assert len(BY_ID) == len(ATTACKS), "duplicate attack ids"

# The request flood is driven by the host side (two tenants at once); described here so the
# table and the docs list it with the rest.
FLOOD = Attack("flood", "request flood by one tenant while another works", "availability", E,
               ("delayed",), "broker (rate limit)", None, lambda ctx: Outcome("error"),
               no_audit="rate limiting delays, it does not refuse: the evidence is "
                        "`devbroker status` (rate_limited) and the ordering, not an audit line")
