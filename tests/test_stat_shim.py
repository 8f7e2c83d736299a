"""The sandbox's stat shim: /dev/nvidia* (FUSE regular files) stat() as NVIDIA char devices.

Three layers:

* sans-IO: the filter (``build_stat_shim_filter``, ``FilterOptions.notify_stat``) through the
  cBPF interpreter, the struct stat/statx patching, call decoding and planning, the
  /proc/devices view;
* the supervisor (``StatShim``) answering a real filtered process, outside any sandbox (root:
  it reads /proc/<pid>/mem); what the tenant sees when the supervisor is gone (ENOSYS);
* the sandbox (``run_in_sandbox``) with plain files standing in for the nodes, and
  ``devbroker exec`` on a real broker: opens/ioctls still reach the broker, and NVIDIA's
  nvidia-smi gets past "GPU access blocked by the operating system".
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from devbroker.sandbox import seccompwire as w
from devbroker.sandbox import statshim as ss

X86_64 = sys.platform == "linux" and os.uname().machine == "x86_64"
is_root = os.geteuid() == 0
needs_root = pytest.mark.skipif(not is_root, reason="needs root (reads other processes' memory)")
needs_x86 = pytest.mark.skipif(not X86_64, reason="x86_64 Linux only")

NOTIF = w.SECCOMP_RET_USER_NOTIF
ALLOW = w.SECCOMP_RET_ALLOW
SYSTEM_PYTHON = "/usr/bin/python3"
NVIDIA_SMI = shutil.which("nvidia-smi")


# ------------------------------------------------------------------------------ sans-IO
def test_stat_shim_filter_sends_only_the_stat_family():
    prog = w.build_stat_shim_filter()
    for name in w.STAT_SYSCALLS:
        assert w.run_filter(prog, w.syscall_data(name, 0, 0)) == NOTIF, name
    for name in ("open", "openat", "ioctl", "mmap", "read", "close", "mknod", "io_uring_setup"):
        assert w.run_filter(prog, w.syscall_data(name, 0, 0)) == ALLOW, name
    # access/faccessat(2) need no faking: only the permission bits count, and they are real
    for nr in (21, 269, 439):
        assert w.run_filter(prog, w.syscall_data(nr)) == ALLOW
    # i386 and x32 calls are not a bypass of anything: allowed (their stat is not faked)
    assert w.run_filter(prog, w.syscall_data("stat", arch=w.AUDIT_ARCH_I386)) == ALLOW
    assert w.run_filter(prog, w.syscall_data(w.X32_SYSCALL_BIT | 4)) == ALLOW


def test_front_end_filter_option():
    base = w.build_filter()
    assert len(base) // 8 == 39  # unchanged by default
    prog = w.build_filter(w.FilterOptions(notify_stat=True))
    for name in w.STAT_SYSCALLS:
        assert w.run_filter(base, w.syscall_data(name)) == ALLOW
        assert w.run_filter(prog, w.syscall_data(name)) == NOTIF
    assert w.run_filter(prog, w.syscall_data("mknod", 0, stat.S_IFCHR)) == \
        w.SECCOMP_RET_ERRNO | errno.EPERM


def test_makedev_matches_glibc():
    for major, minor in ((195, 255), (195, 0), (238, 1), (4095, 1 << 19), (1 << 12, 300)):
        dev = w.makedev(major, minor)
        assert dev == os.makedev(major, minor)
        assert (w.dev_major(dev), w.dev_minor(dev)) == (major, minor)


def test_fake_stat_and_statx_keep_everything_but_type_and_rdev():
    raw = bytearray(os.urandom(w.STAT_SIZE))
    raw[24:28] = (stat.S_IFREG | 0o640).to_bytes(4, "little")
    out = w.fake_chr_stat(bytes(raw), 195, 255)
    f = w.decode_stat(out)
    assert stat.S_ISCHR(f.mode) and stat.S_IMODE(f.mode) == 0o640
    assert (f.rdev_major, f.rdev_minor) == (195, 255)
    diff = [i for i in range(w.STAT_SIZE) if out[i] != raw[i]]
    assert set(diff) <= set(range(24, 28)) | set(range(40, 48))

    rawx = bytearray(os.urandom(w.STATX_SIZE))
    rawx[28:30] = (stat.S_IFREG | 0o666).to_bytes(2, "little")
    outx = w.fake_chr_statx(bytes(rawx), 238, 1)
    fx = w.decode_statx(outx)
    assert stat.S_ISCHR(fx.mode) and stat.S_IMODE(fx.mode) == 0o666
    assert (fx.rdev_major, fx.rdev_minor) == (238, 1)
    diff = [i for i in range(w.STATX_SIZE) if outx[i] != rawx[i]]
    assert set(diff) <= set(range(28, 30)) | set(range(128, 136))
    with pytest.raises(w.WireError):
        w.fake_chr_stat(b"\0" * 100, 1, 1)


def test_parse_stat_calls():
    AT = w.AT_FDCWD
    c = ss.parse_stat_call(w.syscall_data("stat", 0x1000, 0x2000))
    assert c == ss.StatCall(False, AT, 0x1000, 0, 0x2000)
    assert ss.parse_stat_call(w.syscall_data("lstat", 1, 2)).follow is False
    c = ss.parse_stat_call(w.syscall_data("fstat", 7, 0x2000))
    assert (c.path_ptr, c.dirfd, c.buf) == (None, 7, 0x2000)
    c = ss.parse_stat_call(w.syscall_data("newfstatat", AT, 0x10, 0x20, w.AT_EMPTY_PATH))
    assert (c.dirfd, c.path_ptr, c.buf, c.flags, c.statx) == (AT, 0x10, 0x20, w.AT_EMPTY_PATH, False)
    c = ss.parse_stat_call(w.syscall_data("statx", 5, 0x10, w.AT_SYMLINK_NOFOLLOW, 0x7FF, 0x30))
    assert (c.dirfd, c.path_ptr, c.buf, c.mask, c.statx, c.follow) == (5, 0x10, 0x30, 0x7FF, True, False)
    assert c.size == w.STATX_SIZE
    assert ss.parse_stat_call(w.syscall_data("openat", 0, 0)) is None
    assert ss.parse_stat_call(w.syscall_data("stat", 1, 2, arch=w.AUDIT_ARCH_I386)) is None


def test_plan():
    names = frozenset({"nvidiactl", "nvidia0", "nvidia-uvm"})
    st = ss.StatCall(False, w.AT_FDCWD, 0x10, 0, 0x20)
    assert isinstance(ss.plan(st, b"/etc/hostname", names), ss.Continue)
    assert ss.plan(st, b"/dev/nvidiactl", names) == ss.PathTarget(w.AT_FDCWD, b"/dev/nvidiactl", True)
    assert ss.plan(st, b"nvidia0", names) == ss.PathTarget(w.AT_FDCWD, b"nvidia0", True)
    assert isinstance(ss.plan(st, b"/dev/nvidiactl/", names), ss.Continue)  # ENOTDIR: kernel's
    assert isinstance(ss.plan(st, b"/dev/nvidia1", names), ss.Continue)  # not this tenant's
    assert isinstance(ss.plan(st, b"", names), ss.Continue)  # ENOENT: kernel's
    assert isinstance(ss.plan(st, b"/dev/\xff", names), ss.Continue)
    empty = ss.StatCall(False, 4, 0x10, w.AT_EMPTY_PATH, 0x20)
    assert ss.plan(empty, b"", names) == ss.FdTarget(4)
    null = ss.StatCall(True, 4, 0, w.AT_EMPTY_PATH, 0x20)
    assert ss.plan(null, None, names) == ss.FdTarget(4)  # statx(fd, NULL, AT_EMPTY_PATH)
    assert isinstance(ss.plan(ss.StatCall(True, 4, 0, 0, 0x20), None, names), ss.Continue)
    assert ss.plan(ss.StatCall(False, 3, None, w.AT_EMPTY_PATH, 0x20), None, names) == ss.FdTarget(3)
    nofollow = ss.StatCall(False, w.AT_FDCWD, 0x10, w.AT_SYMLINK_NOFOLLOW, 0x20)
    assert ss.plan(nofollow, b"/dev/nvidia0", names).follow is False


def test_tenant_path():
    assert ss.tenant_path(b"/dev/nvidiactl", None, b"/") == b"/dev/nvidiactl"
    assert ss.tenant_path(b"nvidiactl", b"/dev", b"/") == b"/dev/nvidiactl"
    assert ss.tenant_path(b"../dev/nvidia0", b"/", b"/") == b"/../dev/nvidia0"
    assert ss.tenant_path(b"x", b"pipe:[123]", b"/") is None
    assert ss.tenant_path(b"x", None, b"/") is None
    # a chrooted tenant: the supervisor reads paths from the namespace root
    assert ss.tenant_path(b"nvidiactl", b"/srv/root/dev", b"/srv/root") == b"/dev/nvidiactl"
    assert ss.tenant_path(b"a", b"/srv/root", b"/srv/root") == b"/a"
    assert ss.tenant_path(b"a", b"/elsewhere", b"/srv/root") is None


def test_node_numbers():
    assert ss.node_numbers("nvidiactl", 238) == (195, 255)
    assert ss.node_numbers("nvidia0", 238) == (195, 0)
    assert ss.node_numbers("nvidia17", 238) == (195, 17)
    assert ss.node_numbers("nvidia-uvm", 238) == (238, 0)
    assert ss.node_numbers("nvidia-uvm-tools", 511) == (511, 1)
    assert ss.node_numbers("nvidia255", 238) is None
    assert ss.node_numbers("nvidia-modeset", 238) is None


HOST_DEVICES = """Character devices:
  1 mem
  5 /dev/tty
136 pts
238 other
245 hidraw

Block devices:
  7 loop
259 blkext
"""


def test_proc_devices_view():
    text, uvm = ss.proc_devices_view(HOST_DEVICES)
    assert uvm == 254  # 238 taken: the highest free dynamic major
    chars = text.split("\n\n")[0].splitlines()
    assert chars[0] == "Character devices:"
    assert "195 nvidia-frontend" in chars and "254 nvidia-uvm" in chars
    majors = [int(ln.split()[0]) for ln in chars[1:]]
    assert majors == sorted(majors)
    assert text.endswith("Block devices:\n  7 loop\n259 blkext\n")
    # free 238 is preferred (as on the H200 machine)
    assert ss.proc_devices_view(HOST_DEVICES.replace("238 other", "239 other"))[1] == 238
    # a host with the driver keeps its own lines and major
    host = HOST_DEVICES.replace("238 other", "195 nvidia\n235 nvidia-uvm\n238 other")
    text, uvm = ss.proc_devices_view(host)
    assert uvm == 235
    assert "nvidia-frontend" not in text and text.count("nvidia-uvm") == 1


# ------------------------------------------------------------------------------ supervisor
# A process that puts itself under the stat shim filter and sends the listener back.
FILTERED = textwrap.dedent(r'''
    import ctypes, json, os, stat, sys, threading
    from devbroker.sandbox import statshim
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(38, 1, 0, 0, 0)  # no_new_privs
    statshim.install_and_send(int(sys.argv[1]))
    def info(p, fn=os.stat):
        try:
            st = fn(p)
        except OSError as e:
            return errno_name(e.errno)
        kind = "chr" if stat.S_ISCHR(st.st_mode) else "reg" if stat.S_ISREG(st.st_mode) else \
            "lnk" if stat.S_ISLNK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "other"
        return [kind, os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode)]
    def errno_name(n):
        import errno
        return errno.errorcode[n]
    exec(sys.argv[2])
''')


def run_filtered(code: str, shim: ss.StatShim | None, *, timeout: float = 60) -> tuple[dict, subprocess.CompletedProcess]:
    """Run FILTERED + code; serve it with shim (None: close the listener at once)."""
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", FILTERED, str(child.fileno()), code],
                            pass_fds=[child.fileno()], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child.close()
    stop_r, stop_w = os.pipe()
    thread = None
    try:
        got = ss.recv_listener(parent)
        assert got is not None, proc.communicate(timeout=timeout)
        listener, killable = got
        assert killable  # Linux >= 5.19
        if shim is None:
            os.close(listener)
        else:
            def serve():
                try:
                    shim.serve(listener, stop_r)
                finally:
                    os.close(listener)
            thread = threading.Thread(target=serve, daemon=True)
            thread.start()
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.write(stop_w, b"x")
        if thread:
            thread.join(10)
            assert not thread.is_alive()
        for fd in (stop_r, stop_w):
            os.close(fd)
        parent.close()
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), r


@pytest.fixture
def nodes(tmp_path: Path):
    """Plain files standing in for the nodes, and a shim that knows them."""
    d = tmp_path / "alice"
    d.mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia-uvm"):
        (d / name).write_text(name + "\n")
        os.chmod(d / name, 0o666)
    (tmp_path / "nvidia3").write_text("not a node\n")  # named like one, but not bound
    os.symlink(d / "nvidiactl", tmp_path / "nvidiactl")  # a symlink named like a node
    names = ["nvidiactl", "nvidia0", "nvidia-uvm"]
    return d, (lambda: ss.StatShim(ss.node_table(d, names, 238), names))


@needs_root
@needs_x86
def test_supervisor_fakes_nodes_and_continues_the_rest(nodes, tmp_path):
    d, make = nodes
    shim = make()
    code = textwrap.dedent(f'''
        d, t = {str(d)!r}, {str(tmp_path)!r}
        out = {{}}
        out["ctl"] = info(d + "/nvidiactl")
        out["gpu"] = info(d + "/nvidia0")
        out["uvm"] = info(d + "/nvidia-uvm")
        out["lstat"] = info(d + "/nvidiactl", os.lstat)
        out["other"] = info(t + "/nvidia3")
        out["link"] = info(t + "/nvidiactl")
        out["link_l"] = info(t + "/nvidiactl", os.lstat)
        out["hostname"] = info("/etc/hostname")
        out["missing"] = info(d + "/nvidia9")
        os.chdir(d)
        out["rel"] = info("nvidiactl")
        dfd = os.open(d, os.O_RDONLY)
        out["dirfd"] = info("nvidia0", lambda p: os.stat(p, dir_fd=dfd))
        fd = os.open(d + "/nvidiactl", os.O_RDONLY)
        out["fstat"] = info(fd, os.fstat)
        out["read"] = os.read(fd, 100).decode()
        # threads and a forked child are under the same filter
        res = []
        def worker():
            res.append(all(info(d + "/nvidia0")[0] == "chr" and info("/etc/hostname")[0] != "chr"
                           for _ in range(50)))
        ts = [threading.Thread(target=worker) for _ in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        out["threads"] = res
        pid = os.fork()
        if pid == 0:
            os._exit(0 if info(d + "/nvidiactl")[0] == "chr" else 1)
        out["child"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(json.dumps(out))
    ''')
    seen, _ = run_filtered(code, shim)
    assert seen["ctl"] == ["chr", 195, 255, 0o666]
    assert seen["gpu"] == ["chr", 195, 0, 0o666]
    assert seen["uvm"] == ["chr", 238, 0, 0o666]
    assert seen["lstat"] == ["chr", 195, 255, 0o666]
    assert seen["other"][0] == "reg"  # named like a node, but not one: real answer
    assert seen["link"] == ["chr", 195, 255, 0o666]  # stat follows the symlink to the node
    assert seen["link_l"][0] == "lnk"  # lstat does not
    host = os.stat("/etc/hostname")
    assert seen["hostname"] == ["reg", 0, 0, stat.S_IMODE(host.st_mode)]
    assert seen["missing"] == "ENOENT"
    assert seen["rel"] == ["chr", 195, 255, 0o666]
    assert seen["dirfd"] == ["chr", 195, 0, 0o666]
    assert seen["fstat"] == ["chr", 195, 255, 0o666]
    assert seen["read"] == "nvidiactl\n"  # the file behind it is untouched
    assert seen["threads"] == [True] * 4 and seen["child"] == 0
    assert shim.stats.errors == 0
    assert shim.stats.faked == 8 + 4 * 50 + 1  # ctl gpu uvm lstat link rel dirfd fstat
    assert shim.stats.continued > 0


@needs_root
@needs_x86
def test_without_a_supervisor_stat_fails_with_enosys(nodes):
    # What a tenant sees if the shim dies: the kernel answers ENOSYS to every notified call
    # once the listener is closed; everything else keeps working.
    code = textwrap.dedent('''
        out = {"stat": info("/etc/hostname"), "fstat": info(0, os.fstat)}
        fd = os.open("/etc/hostname", os.O_RDONLY)
        out["read"] = len(os.read(fd, 10)) > 0
        print(json.dumps(out))
    ''')
    seen, _ = run_filtered(code, None)
    assert seen == {"stat": "ENOSYS", "fstat": "ENOSYS", "read": True}


# ------------------------------------------------------------------------------ sandbox
CHECKER = textwrap.dedent(r'''
    import ctypes, json, os, stat, subprocess, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def info(st):
        kind = "chr" if stat.S_ISCHR(st.st_mode) else "reg" if stat.S_ISREG(st.st_mode) else \
            "lnk" if stat.S_ISLNK(st.st_mode) else "other"
        return [kind, os.major(st.st_rdev), os.minor(st.st_rdev)]
    def statx(dirfd, path, flags):
        buf = ctypes.create_string_buffer(256)
        r = libc.syscall(332, dirfd, path, flags, 0x7ff, buf)
        if r != 0:
            return "errno %d" % ctypes.get_errno()
        mode = int.from_bytes(buf.raw[28:30], "little")
        kind = "chr" if stat.S_ISCHR(mode) else "reg" if stat.S_ISREG(mode) else "other"
        return [kind, int.from_bytes(buf.raw[128:132], "little"),
                int.from_bytes(buf.raw[132:136], "little")]
    out = {}
    for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
              "/etc/hostname", "/dev/null"):
        out["stat " + p] = info(os.stat(p))
        out["lstat " + p] = info(os.lstat(p))
    fd = os.open("/dev/nvidiactl", os.O_RDONLY)
    out["fstat"] = info(os.fstat(fd))
    out["read"] = os.read(fd, 64).decode()
    out["statx"] = statx(-100, b"/dev/nvidia0", 0)
    out["statx_fd"] = statx(fd, b"", 0x1000)
    os.chdir("/dev")
    out["relative"] = info(os.stat("nvidia0"))
    os.symlink("/dev/nvidiactl", "/dev/shm/nvidiactl")
    out["symlink"] = info(os.stat("/dev/shm/nvidiactl"))
    out["symlink_l"] = info(os.lstat("/dev/shm/nvidiactl"))
    r = subprocess.run(["stat", "-c", "%F %t %T", "/dev/nvidiactl", "/dev/nvidia0"],
                       capture_output=True, text=True)
    out["coreutils"] = r.stdout.splitlines()
    out["devices"] = [l.split() for l in open("/proc/devices").read().split("\n\n")[0].splitlines()[1:]]
    print(json.dumps(out))
''')

VERSION_TEXT = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.309.01  Tue Oct  1 00:00:00 UTC 2025\n"


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    mnt = tmp_path / "mnt"
    alice = mnt / "alice"
    (alice / "proc" / "driver" / "nvidia").mkdir(parents=True)
    for name in ("nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"):
        (alice / name).write_text(f"alice-{name}\n")
        os.chmod(alice / name, 0o666)
    (alice / "proc" / "driver" / "nvidia" / "version").write_text(VERSION_TEXT)
    return mnt


def sandboxed(tenant_dir: Path, argv: list[str], **kw) -> subprocess.CompletedProcess:
    from devbroker.sandbox import SandboxSpec
    from devbroker.sandbox.sandbox import spec_to_args

    from devbroker.testing.tenant_binds import paths

    kw.setdefault("binds", tuple(paths()))  # a checkout under /tmp: the tenant's is its own
    spec = SandboxSpec(tenant_dir=tenant_dir, argv=tuple(argv), **kw)
    return subprocess.run([sys.executable, "-m", "devbroker.sandbox", *spec_to_args(spec),
                           "--", *argv], capture_output=True, text=True, timeout=120)


def check(tenants: Path, python: str = sys.executable, **kw) -> dict:
    r = sandboxed(tenants / "alice", [python, "-c", CHECKER], hide=(tenants,), **kw)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.root
@needs_root
@needs_x86
def test_sandbox_nodes_stat_as_nvidia_char_devices(tenants: Path):
    seen = check(tenants)
    uvm = next(int(maj) for maj, name in seen["devices"] if name == "nvidia-uvm")
    assert ["195", "nvidia-frontend"] in seen["devices"]
    for fn in ("stat", "lstat"):
        assert seen[f"{fn} /dev/nvidiactl"] == ["chr", 195, 255]
        assert seen[f"{fn} /dev/nvidia0"] == ["chr", 195, 0]
        assert seen[f"{fn} /dev/nvidia-uvm"] == ["chr", uvm, 0]
        assert seen[f"{fn} /dev/nvidia-uvm-tools"] == ["chr", uvm, 1]
        assert seen[f"{fn} /etc/hostname"] == ["reg", 0, 0]  # untouched
        assert seen[f"{fn} /dev/null"] == ["chr", 1, 3]  # a real device stays itself
    assert seen["fstat"] == ["chr", 195, 255]
    assert seen["read"] == "alice-nvidiactl\n"  # the open reached the (stand-in) node file
    assert seen["statx"] == ["chr", 195, 0]
    assert seen["statx_fd"] == ["chr", 195, 255]
    assert seen["relative"] == ["chr", 195, 0]
    assert seen["symlink"] == ["chr", 195, 255]
    assert seen["symlink_l"] == ["lnk", 0, 0]
    assert seen["coreutils"] == ["character special file c3 ff", "character special file c3 0"]


@pytest.mark.root
@needs_root
@needs_x86
def test_sandbox_stat_shim_for_a_non_root_tenant(tenants: Path, tenant_tree: Path):
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} is needed to run the checker as uid 65534")
    # cwd: the caller's (the checkout) may be out of uid 65534's reach (a clone under /root)
    seen = check(tenants, python=SYSTEM_PYTHON, uid=65534, gid=65534, cwd=str(tenant_tree))
    assert seen["stat /dev/nvidiactl"] == ["chr", 195, 255]
    assert seen["fstat"] == ["chr", 195, 255]
    assert seen["stat /etc/hostname"] == ["reg", 0, 0]


@pytest.mark.root
@needs_root
@needs_x86
def test_sandbox_without_stat_shim(tenants: Path):
    r = sandboxed(tenants / "alice", ["stat", "-c", "%F", "/dev/nvidiactl"], stat_shim=False)
    assert (r.returncode, r.stdout) == (0, "regular file\n"), r.stderr
    # the CLI flag is passed through to the sandbox entry point
    from devbroker.sandbox.__main__ import parse_args

    assert parse_args(["--tenant-dir", "/x", "--no-stat-shim", "--", "true"]).stat_shim is False
    assert parse_args(["--tenant-dir", "/x", "--", "true"]).stat_shim is True


# ------------------------------------------------------------------------------ broker
IOCTL_PROG = textwrap.dedent(r'''
    import json, os, stat
    from devbroker.tools.probe import Client
    st = os.stat("/dev/nvidiactl")
    c = Client()
    fst = os.fstat(c.ctl)
    out = {"stat": [stat.S_ISCHR(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev)],
           "fstat": [stat.S_ISCHR(fst.st_mode), os.minor(fst.st_rdev)],
           "version_reply": c.check_version()}
    c.open_root()
    out["gpus"] = len(c.attached_ids())
    print(json.dumps(out))
''')


@pytest.mark.root
@needs_x86
def test_broker_nodes_still_open_and_ioctls_reach_the_broker(start_broker):
    broker = start_broker()  # built-in policy: alice has GPU 0
    before = broker.tenant("alice")["requests"]
    r = broker.exec("alice", sys.executable, "-c", IOCTL_PROG)
    assert r.returncode == 0, r.stderr + broker.output()
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["stat"] == [True, 195, 255]
    assert seen["fstat"] == [True, 255]
    assert seen["version_reply"] == 1  # answered by the broker (a plain file gives ENOTTY)
    assert seen["gpus"] == 1
    assert broker.tenant("alice")["requests"] > before


@pytest.mark.root
@needs_x86
@pytest.mark.skipif(NVIDIA_SMI is None, reason="nvidia-smi is not installed "
                    "(scripts/install-nvidia-clients.sh installs Debian's 535 client)")
def test_nvidia_smi_gets_past_the_device_check(start_broker):
    broker = start_broker()
    r = broker.exec("alice", NVIDIA_SMI, "-L", timeout=120)
    assert "blocked by the operating system" not in r.stdout + r.stderr
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("GPU 0: NVIDIA H200 (UUID: GPU-"), r.stdout
    # the same without the shim is what NVML 535 refuses
    off = broker.cli("exec", "--tenant", "alice", "--no-stat-shim", "--", NVIDIA_SMI, "-L",
                     timeout=120)
    assert off.returncode == 17 and "blocked by the operating system" in off.stdout + off.stderr
