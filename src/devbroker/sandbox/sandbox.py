"""`devbroker exec`: run a command where the tenant's broker nodes are the only NVIDIA devices.

Process tree (host pids on the left)::

    caller ── exec_main(): forwards signals, waits, returns the status
      └─ helper      unshare(NEWNS|NEWPID); forwards signals, waits
           └─ init   pid 1 of the new pid namespace: builds /dev, /proc, /sys views,
                │    forwards signals, reaps every zombie, exits with the command's status
                └─ command   drops capabilities, sets no_new_privs, maybe uid/gid,
                             installs the stat shim's seccomp filter, execs

With the stat shim (on by default), the caller also runs a thread that answers the tenant's
stat-family system calls (devbroker.sandbox.statshim): the broker's node files are regular
FUSE files, and NVML refuses a /dev/nvidiactl that does not stat as char 195:255.

The helper exists because unshare(CLONE_NEWPID) only moves the caller's *children*, and the
caller (a CLI, a test, a broker) must not have its own namespaces changed. Mount work happens
in init because a fresh procfs belongs to the pid namespace of the process that mounts it.

See docs/sandbox.md for why each step is there and what this does not defend.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from devbroker.sandbox import brokers, linux, statshim
from devbroker.sandbox.seccompwire import FilterOptions, build_filter, build_stat_shim_filter
from devbroker.sandbox.linux import (
    MNT_DETACH, MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_RDONLY, MS_REC,
    MS_STRICTATIME,
)

# Which files of a tenant directory become device nodes, and under which name. The GPU node
# keeps the index it is named with: /dev/nvidia<N> is what NVML opens for the GPU whose
# minor number the broker reports as N.
TENANT_NODE_NAME = re.compile(r"^nvidia(ctl|[0-9]+|-uvm|-uvm-tools)$")

# The FUSE front end's file-system type in /proc/self/mountinfo ("fuse." + its subtype).
BROKER_FSTYPE = "fuse.devbroker"

# The character devices every container gets (runc's default set), major:minor.
SAFE_DEVICES = {
    "null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9),
    "tty": (5, 0),
}
DEV_SYMLINKS = {
    "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx",
}

# Kept when the command runs as root: Docker's default set minus mknod (a tenant must not
# create a real 195:* node), net_raw, setfcap, setpcap and sys_chroot. Everything else, in
# particular sys_admin (mount/umount, namespaces), sys_ptrace, sys_module, sys_rawio, is
# dropped from the bounding set so that no exec (setuid binary, file capability) regains it.
ROOT_CAPABILITIES = frozenset({
    "chown", "dac_override", "fowner", "fsetid", "kill", "setgid", "setuid",
    "net_bind_service", "audit_write",
})

# /proc entries a container runtime hides or freezes (runc/Docker defaults): kernel memory,
# keyrings and timers leak host state; sysctls, sysrq and IRQ affinity are writable by uid 0
# even without capabilities, and they act on the whole host.
PROC_MASKED_FILES = ("kcore", "keys", "timer_list", "timer_stats", "latency_stats",
                     "sched_debug")
PROC_MASKED_DIRS = ("acpi", "asound", "scsi")
PROC_READONLY = ("bus", "fs", "irq", "sys", "sysrq-trigger")

# Signals passed on to the command; the synchronous ones (SEGV, ...) and job-control stops
# are not: they are about the process that receives them.
FORWARDED_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM,
                     signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH, signal.SIGCONT,
                     signal.SIGALRM)
_WAITED_SIGNALS = frozenset(FORWARDED_SIGNALS) | {signal.SIGCHLD}
_SI_KERNEL = 0x80  # si_code of a signal the terminal sent to the whole foreground group

# Exit codes for failures of the sandbox itself (the conventions of docker run / env).
EXIT_SETUP_FAILED = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127


class SandboxError(Exception):
    """The sandbox could not be set up (bad arguments, not root, missing tenant dir)."""


# Binds may not land where the device view is built: they would replace it.
_NO_BIND_UNDER = ("/dev", "/proc", "/sys")


@dataclass(frozen=True)
class Bind:
    """A host path the command line binds into the tenant's view (`--bind SRC[:DST][:rw]`):
    read-only unless writable — the rest of the host file system is read-only anyway."""

    src: Path
    dst: Path
    writable: bool = False

    @classmethod
    def parse(cls, text: str) -> "Bind":
        """SRC, SRC:DST, SRC:ro|rw or SRC:DST:ro|rw (DST defaults to SRC)."""
        parts = text.split(":")
        mode = None
        if len(parts) > 1 and parts[-1] in ("ro", "rw"):
            mode = parts.pop()
        if len(parts) > 2 or not parts[0]:
            raise SandboxError(f"bad --bind {text!r} (SRC[:DST][:ro|rw], paths without ':')")
        src = Path(parts[0])
        dst = Path(parts[1]) if len(parts) == 2 and parts[1] else src
        return cls(src, dst, writable=(mode == "rw"))

    def text(self) -> str:
        return f"{self.src}:{self.dst}:{'rw' if self.writable else 'ro'}"


@dataclass(frozen=True)
class SandboxSpec:
    tenant_dir: Path
    argv: tuple[str, ...]
    uid: int | None = None  # None: stay uid 0 with ROOT_CAPABILITIES only
    gid: int | None = None  # None: the uid's (or 0)
    groups: tuple[int, ...] = ()  # supplementary groups once uid/gid are set
    cwd: str | None = None  # None: the caller's cwd
    env: Mapping[str, str] | None = None  # None: the caller's environment
    # Extra directories to cover with an empty read-only tmpfs (besides the FUSE mount that
    # holds tenant_dir, which is always covered so other tenants' directories are out of reach).
    hide: tuple[Path, ...] = ()
    readonly: tuple[Path, ...] = ()  # mount points to remount read-only (e.g. "/")
    capabilities: frozenset[str] = ROOT_CAPABILITIES
    driver_version: str | None = None  # for /sys/module/nvidia/version; else from proc view
    pass_fds: tuple[int, ...] = ()  # fds above 2 the command keeps (all others are closed)
    # Fake stat results for the node files (S_IFCHR 195:N, see statshim.py and docs).
    stat_shim: bool = True
    # "fuse": /dev/nvidia* are the broker's FUSE node files. "seccomp": /dev/nvidia* are
    # character nodes, and every open/ioctl/mmap of them stops at the broker through a
    # seccomp listener handed over on `seccomp_socket` for `tenant` (frontends/seccomp.py);
    # with the real backend the tenant then holds real driver files (what CUDA needs).
    frontend: str = "fuse"
    seccomp_socket: str | None = None
    tenant: str | None = None
    # seccomp front end: UVM command numbers the filter lets the kernel run without a
    # notification (the broker's answer to tenant.dir: rules.kernel_commands, real files only)
    kernel_ioctls: tuple[int, ...] = ()
    # The broker's control socket, where refusals the sandbox's own supervisor makes are
    # reported for the audit log (op tenant.refused; None: printed to stderr only)
    report_socket: str | None = None
    # Host paths made visible (read-only unless writable): the host file system is
    # otherwise read-only to the command, and /tmp is a tmpfs of its own.
    binds: tuple[Bind, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_dir", Path(self.tenant_dir))
        object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "hide", tuple(Path(p) for p in self.hide))
        object.__setattr__(self, "readonly", tuple(Path(p) for p in self.readonly))
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "pass_fds", tuple(self.pass_fds))
        object.__setattr__(self, "kernel_ioctls", tuple(int(c) for c in self.kernel_ioctls))
        object.__setattr__(self, "binds", tuple(b if isinstance(b, Bind) else Bind.parse(b)
                                                for b in self.binds))
        if self.frontend not in ("fuse", "seccomp"):
            raise SandboxError(f"unknown front end {self.frontend!r} (fuse, seccomp)")
        if self.frontend == "seccomp":
            if not (self.seccomp_socket and self.tenant):
                raise SandboxError("the seccomp front end needs the broker's socket and a tenant")
            # One filter per process tree may have a listener: the broker's, not the shim's;
            # the nodes are real character nodes, so stat needs no shim either.
            object.__setattr__(self, "stat_shim", False)


# ------------------------------------------------------------------------------ public API
# What subprocess takes for a child's stdin/stdout/stderr: a file, a descriptor, PIPE, ...
_File = IO[Any] | int | None

def exec_main(tenant_dir: Path, argv: Sequence[str], *, uid: int | None = None,
              gid: int | None = None, groups: Sequence[int] = (), cwd: str | None = None,
              env: Mapping[str, str] | None = None, hide: Sequence[Path] = (),
              readonly: Sequence[Path] = (), driver_version: str | None = None,
              stat_shim: bool = True, frontend: str = "fuse",
              seccomp_socket: str | None = None, tenant: str | None = None,
              binds: Sequence[Bind | str] = (), kernel_ioctls: Sequence[int] = (),
              report_socket: str | None = None) -> int:
    """What `devbroker exec` runs: the command's exit status (128+N if killed by signal N;
    125 if the sandbox failed, 126/127 if the command could not be executed).

    Runs in the calling process's main thread (it forwards the signals this process gets);
    from elsewhere use run_in_sandbox, which runs this in a child interpreter.
    """
    spec = SandboxSpec(tenant_dir=tenant_dir, argv=tuple(argv), uid=uid, gid=gid,
                       groups=tuple(groups), cwd=cwd, env=env, hide=tuple(hide),
                       readonly=tuple(readonly), driver_version=driver_version,
                       stat_shim=stat_shim, frontend=frontend, seccomp_socket=seccomp_socket,
                       tenant=tenant, kernel_ioctls=tuple(kernel_ioctls),
                       binds=tuple(b if isinstance(b, Bind) else Bind.parse(b) for b in binds),
                       report_socket=report_socket)
    return run_here(spec)


def run_in_sandbox(spec: SandboxSpec, *, stdin: _File = None, stdout: _File = None,
                   stderr: _File = None, timeout: float | None = None) -> int:
    """Run spec in a child interpreter (`python -m devbroker.sandbox`) and return the
    command's exit status. Safe from any thread and from async code; the calling process's
    namespaces and signal handling are untouched. stdin/stdout/stderr as for subprocess."""
    _preflight(spec)
    cmd = [sys.executable, "-m", "devbroker.sandbox", *spec_to_args(spec), "--", *spec.argv]
    proc = subprocess.run(cmd, stdin=stdin, stdout=stdout, stderr=stderr, timeout=timeout,
                          env=dict(spec.env) if spec.env is not None else None,
                          pass_fds=spec.pass_fds)
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def spec_to_args(spec: SandboxSpec) -> list[str]:
    """The `python -m devbroker.sandbox` options that reproduce spec (argv not included)."""
    args = ["--tenant-dir", str(spec.tenant_dir)]
    if spec.uid is not None:
        args += ["--uid", str(spec.uid)]
    if spec.gid is not None:
        args += ["--gid", str(spec.gid)]
    if spec.groups:
        args += ["--groups", ",".join(map(str, spec.groups))]
    if spec.cwd is not None:
        args += ["--cwd", spec.cwd]
    for p in spec.hide:
        args += ["--hide", str(p)]
    for p in spec.readonly:
        args += ["--readonly", str(p)]
    if spec.capabilities != ROOT_CAPABILITIES:
        args += ["--caps", ",".join(sorted(spec.capabilities))]
    if spec.driver_version:
        args += ["--driver-version", spec.driver_version]
    for fd in spec.pass_fds:
        args += ["--pass-fd", str(fd)]
    for b in spec.binds:
        args += ["--bind", b.text()]
    if not spec.stat_shim and spec.frontend == "fuse":
        args += ["--no-stat-shim"]
    if spec.report_socket:
        args += ["--report-socket", spec.report_socket]
    if spec.tenant and spec.frontend == "fuse":
        args += ["--tenant", spec.tenant]
    if spec.frontend == "seccomp":
        args += ["--frontend", "seccomp", "--seccomp-socket", str(spec.seccomp_socket),
                 "--tenant", str(spec.tenant)]
        if spec.kernel_ioctls:
            args += ["--kernel-ioctls", ",".join(str(c) for c in spec.kernel_ioctls)]
    return args


def run_here(spec: SandboxSpec) -> int:
    """exec_main's body: fork the helper and supervise it from this (main) thread."""
    _preflight(spec)
    if threading.current_thread() is not threading.main_thread():
        raise SandboxError("run_here/exec_main must run in the main thread; "
                           "use run_in_sandbox from other threads")
    spec = SandboxSpec(**{**spec.__dict__, "tenant_dir": spec.tenant_dir.resolve()})
    plan = _plan(spec)
    shim: _ListenerThread | None
    if spec.frontend == "seccomp":
        shim = _SeccompHandover(spec)
    else:
        shim = _ShimThread(spec, plan) if spec.stat_shim else None
    # Blocked before fork so that no signal is lost between fork and the wait loop; the
    # children inherit the mask and the command clears it just before exec. (The stat shim
    # thread, started afterwards, inherits it too: these signals reach only sigwaitinfo.)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED_SIGNALS)
    # With SIGCHLD ignored the kernel would reap our child itself and waitpid would fail.
    old_chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _helper_main(spec, plan, shim.child_fd if shim else None)  # never returns
        if shim:
            shim.start()  # after the fork: the children are forked from a one-thread process
        try:
            return _supervise(pid, reap_all=False)
        finally:
            if shim:
                shim.stop()
    finally:
        if shim:
            shim.close()
        signal.signal(signal.SIGCHLD, old_chld)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


@dataclass(frozen=True)
class _Plan:
    """What the caller works out before forking, for init (the view) and the stat shim."""

    proc_devices: str | None  # the tenant's /proc/devices (None: leave the host's)
    uvm_major: int


def _plan(spec: SandboxSpec) -> _Plan:
    try:
        with open("/proc/devices") as f:
            text, uvm = statshim.proc_devices_view(f.read())
    except (OSError, ValueError) as e:
        _fail("/proc/devices (the tenant sees the host's)", e)
        return _Plan(None, 238)
    return _Plan(text, uvm)


class _ListenerThread:
    """A thread of the caller (outside the tenant's pid and mount namespaces) that gets the
    seccomp listener the command installs, over a socketpair, and does something with it
    (`_serve`). Started after the fork, stopped once the tenant is gone, joined before
    run_here returns. If it fails, the listener is closed and the tenant's notified calls
    get ENOSYS: fail closed."""

    NAME = "devbroker-listener"
    FAILURE = "seccomp listener thread failed"
    JOIN_TIMEOUT = 10.0

    def __init__(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Above 2 whatever the caller's stdio is, so the command's _close_fds keeps it apart.
        self.child_fd = fcntl.fcntl(child.fileno(), fcntl.F_DUPFD_CLOEXEC, 3)
        child.close()
        self._sock = parent
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.killable: bool | None = None

    def _serve(self, listener: int) -> None:
        raise NotImplementedError

    def start(self) -> None:
        os.close(self.child_fd)  # the command holds it now; EOF if it dies before sending
        self.child_fd = -1
        self._thread = threading.Thread(target=self._run, name=self.NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            got = statshim.recv_listener(self._sock, self._stop_r)
            if got is None:
                return  # the command failed before installing the filter
            listener, self.killable = got
            try:
                self._serve(listener)
            finally:
                os.close(listener)  # ours is closed; whoever else holds one carries on
        except BaseException as e:  # noqa: BLE001 - a thread must not die silently
            self.error = e
            _fail(self.FAILURE, e)

    def stop(self) -> None:
        """The tenant is gone (pid 1 of its namespace has exited, so every task has): end
        the thread."""
        if self._thread is None:
            return
        os.write(self._stop_w, b"x")
        self._thread.join(self.JOIN_TIMEOUT)
        if self._thread.is_alive():
            _fail(self.NAME, TimeoutError("its thread did not stop; left behind"))

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return  # stuck (reported by stop()); leave its fds alone
        for fd in (self.child_fd, self._stop_r, self._stop_w):
            if fd >= 0:
                os.close(fd)
        self.child_fd = self._stop_r = self._stop_w = -1
        self._sock.close()


class _ShimThread(_ListenerThread):
    """The stat shim's supervisor: answers the tenant's stat calls (it reads
    /proc/<host tid>/…) until no tenant task is left."""

    NAME = "devbroker-stat-shim"
    FAILURE = "stat shim failed; the tenant's stat calls now fail with ENOSYS"

    def __init__(self, spec: SandboxSpec, plan: _Plan):
        names = tenant_nodes(spec.tenant_dir)
        # Identities of the files that will be bound at /dev/<name>, taken now (a bind holds
        # the same inode). Fails early (SandboxError) when the kernel lacks user notification.
        self._spec = spec
        try:
            self.shim = statshim.StatShim(
                statshim.node_table(spec.tenant_dir, names, plan.uvm_major), names,
                on_refused_map=self._refused_map)
        except OSError as e:
            raise SandboxError(f"stat shim: {e} (use --no-stat-shim to run without it)") from e
        super().__init__()

    def _serve(self, listener: int) -> None:
        self.shim.serve(listener, self._stop_r)

    def _refused_map(self, tid: int, fd: int) -> None:
        """The shim refused a mapping of a broker placeholder (another tenant's node file,
        passed to this one): reported to the broker's audit log, else to stderr."""
        what, reason = f"mmap of fd {fd}", ("a broker file that is not this tenant's "
                                           "(another tenant's node placeholder, passed from "
                                           "another process)")
        path = self._spec.report_socket
        if path:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(5)
                with s:
                    s.connect(path)
                    s.sendall((json.dumps({"op": "tenant.refused",
                                           "tenant": self._spec.tenant or "?", "pid": tid,
                                           "what": what, "reason": reason}) + "\n").encode())
                    s.recv(4096)
                return
            except OSError:
                pass
        _fail("stat shim", OSError(errno.EACCES, f"{what} of pid {tid} refused: {reason}"))


class _SeccompHandover(_ListenerThread):
    """For the seccomp front end: hands the listener to the broker's seccomp socket with
    the tenant's name (SCM_RIGHTS); the broker serves it from then on."""

    NAME = "devbroker-seccomp-handover"
    FAILURE = "handing the seccomp listener to the broker; the tenant's NVIDIA calls now fail"
    JOIN_TIMEOUT = 15.0

    def __init__(self, spec: SandboxSpec):
        self._spec = spec
        super().__init__()

    def _serve(self, listener: int) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self._spec.seccomp_socket))
            s.sendmsg([json.dumps({"tenant": self._spec.tenant}).encode()],
                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("=i", listener))])
            line = s.makefile("rb").readline()  # one JSON line, as the control socket's
        if not line:
            raise SandboxError("the broker closed the seccomp hand-over without answering")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise SandboxError(f"the broker refused the tenant: "
                               f"{answer.get('error', 'no answer')}")


# ------------------------------------------------------------------------------ processes
def _preflight(spec: SandboxSpec) -> None:
    if not spec.argv:
        raise SandboxError("no command given")
    if not spec.tenant_dir.is_dir():
        raise SandboxError(f"tenant directory {spec.tenant_dir} does not exist")
    if os.geteuid() != 0:
        raise SandboxError("devbroker exec needs root (mount and pid namespaces, mounts)")
    unknown = spec.capabilities - linux.CAPABILITY_NUMBERS.keys()
    if unknown:
        raise SandboxError(f"unknown capabilities: {', '.join(sorted(unknown))}")
    for b in spec.binds:
        if not b.src.is_absolute() or not b.dst.is_absolute():
            raise SandboxError(f"--bind {b.text()}: SRC and DST must be absolute paths")
        if not os.path.lexists(b.src):
            raise SandboxError(f"--bind {b.text()}: {b.src} does not exist")
        dst = os.path.normpath(b.dst)
        if dst == "/" or any(dst == d or dst.startswith(d + "/") for d in _NO_BIND_UNDER):
            raise SandboxError(f"--bind {b.text()}: not onto / or under /dev, /proc, /sys "
                               "(the tenant's device view is built there)")


def _supervise(child: int, *, reap_all: bool) -> int:
    """Wait for child, forwarding signals to it; with reap_all (pid 1) reap every zombie.

    A signal the terminal sent (si_code SI_KERNEL) reached the whole foreground process
    group, the command included: forwarding it too would deliver it twice.
    """
    while True:
        info = signal.sigwaitinfo(_WAITED_SIGNALS)
        if info.si_signo == signal.SIGCHLD:
            status = _reap(child, reap_all)
            if status is not None:
                return status
        elif info.si_code != _SI_KERNEL:
            try:
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass


def _reap(child: int, reap_all: bool) -> int | None:
    status = None
    while True:
        try:
            pid, wstatus = os.waitpid(-1 if reap_all else child, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(wstatus)
            status = code if code >= 0 else 128 - code
            if not reap_all:
                break
    return status


def _fail(step: str, exc: BaseException) -> None:
    try:
        os.write(2, f"devbroker exec: {step}: {exc}\n".encode())
    except OSError:
        pass


def _helper_main(spec: SandboxSpec, plan: _Plan, shim_fd: int | None) -> None:
    code = EXIT_SETUP_FAILED
    try:
        # If the caller dies, so does the helper, and with it (pid 1 gone) the namespace.
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWPID)
        # Nothing mounted from here on may propagate back to the host (or in from it).
        linux.mount(None, "/", None, MS_REC | MS_PRIVATE)
        pid = os.fork()
        if pid == 0:
            _init_main(spec, plan, shim_fd)  # never returns
        if shim_fd is not None:
            os.close(shim_fd)  # only the command sends on it
        code = _supervise(pid, reap_all=False)
    except BaseException as e:  # noqa: BLE001 - a forked child must never unwind into the caller
        _fail("namespaces", e)
    finally:
        os._exit(code)


def _init_main(spec: SandboxSpec, plan: _Plan, shim_fd: int | None) -> None:
    code = EXIT_SETUP_FAILED
    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        build_view(spec, proc_devices=plan.proc_devices)
        pid = os.fork()
        if pid == 0:
            _command_main(spec, shim_fd)  # never returns
        if shim_fd is not None:
            os.close(shim_fd)  # only the command sends on it
        code = _supervise(pid, reap_all=True)
    except BaseException as e:  # noqa: BLE001
        _fail("setting up the tenant view", e)
    finally:
        os._exit(code)


def _command_main(spec: SandboxSpec, shim_fd: int | None = None) -> None:
    code = EXIT_SETUP_FAILED
    step = "dropping privileges"
    try:
        drop_privileges(spec)
        step = "changing directory"
        where = spec.cwd or _caller_cwd()
        try:
            os.chdir(where)
        except (PermissionError, FileNotFoundError) as e:
            if spec.cwd is None:
                # The caller's directory is not the command's to enter (a 0700 home and the
                # default uid, or under the host's /tmp, which the tenant does not see):
                # start in / and say why in one line, rather than fail a command that never
                # asked for a directory.
                os.write(2, f"devbroker exec: running in /: {_why_not_cwd(where, e)}\n"
                         .encode())
                os.chdir("/")
            elif isinstance(e, PermissionError):
                raise CommandNotRun(f"--cwd {where}: the command runs as uid {os.getuid()}, "
                                    "which may not enter it; choose another --cwd or --uid",
                                    EXIT_SETUP_FAILED) from None
            else:
                raise CommandNotRun(f"--cwd {where}: not in the command's view (the host's "
                                    "files, a /tmp of its own, the --bind targets); --bind "
                                    "it or choose another --cwd", EXIT_SETUP_FAILED) from None
        step = "exec"
        # Python ignores SIGPIPE and SIGXFSZ, and ignored dispositions survive exec.
        for sig in (*_WAITED_SIGNALS, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        _close_fds(keep=spec.pass_fds + ((shim_fd,) if shim_fd is not None else ()))
        env = _writable_home(dict(spec.env) if spec.env is not None else dict(os.environ))
        if shim_fd is not None:
            step = "installing the stat shim"
            # Last, after no_new_privs: from here every stat of this process and of all its
            # descendants goes to the caller's shim thread. Nothing between the install and
            # the send stats a file (the send hands the listener to that thread).
            if spec.frontend == "seccomp":
                step = "installing the seccomp front end's filter"
                statshim.install_and_send(shim_fd, build_filter(FilterOptions(
                    kernel_ioctls=spec.kernel_ioctls)))
            else:
                # File mappings too: a seccomp tenant's placeholder that reached this
                # tenant is refused there (statshim.StatShim._mmap).
                statshim.install_and_send(shim_fd, build_stat_shim_filter(notify_mmap=True))
            step = "exec"
        _exec_command(list(spec.argv), env)
    except CommandNotRun as e:
        code = e.code
        os.write(2, f"devbroker exec: {e}\n".encode())
    except FileNotFoundError as e:
        code = EXIT_NOT_FOUND if step == "exec" else EXIT_SETUP_FAILED
        _fail(step, e)
    except PermissionError as e:
        code = EXIT_NOT_EXECUTABLE if step == "exec" else EXIT_SETUP_FAILED
        _fail(step, e)
    except BaseException as e:  # noqa: BLE001
        _fail(step, e)
    finally:
        os._exit(code)


class CommandNotRun(Exception):
    """The command could not be started: the message for the user and the exit status a
    shell gives (127 not found, 126 found but not executable)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _exec_command(argv: list[str], env: dict[str, str]) -> None:
    """execvpe as a shell searches PATH: a PATH directory the command's uid may not search
    (root's /root/.cargo/bin, seen by nobody) does not hold the program for it, so a name
    found nowhere is "not found" (127) — os.execvpe would report that directory's EACCES as
    "permission denied" (126). A name found but not executable is 126. Never returns."""
    name = argv[0]
    if "/" in name:
        candidates = [name]
    else:
        candidates = [os.path.join(d or ".", name)
                      for d in env.get("PATH", os.defpath).split(os.pathsep)]
    refused: OSError | None = None
    for path in candidates:
        try:
            os.execve(path, argv, env)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            try:
                os.stat(path)
            except OSError:
                continue  # a directory on the way is closed to this uid: not here for it
            refused = refused or e
    who = f"uid {os.getuid()}"
    if refused is not None:
        hint = ("; check its mode, or choose the uid with --uid"
                if refused.errno == errno.EACCES else "")
        raise CommandNotRun(f"{refused.filename or name}: {refused.strerror} (as {who}){hint}",
                            EXIT_NOT_EXECUTABLE)
    if "/" in name:
        raise CommandNotRun(f"{name}: not found in the command's view (the host's files as "
                            f"{who} sees them, a /tmp of its own); --bind the directory that "
                            "holds it", EXIT_NOT_FOUND)
    raise CommandNotRun(f"{name}: command not found (searched PATH as {who}); give its "
                        "full path", EXIT_NOT_FOUND)


def _why_not_cwd(where: str, e: OSError) -> str:
    """One line: why the command cannot start in the caller's directory, and what to pass."""
    if where == "/tmp" or where.startswith("/tmp/"):
        return (f"the current directory {where} is under the host's /tmp, which the command "
                f"does not see (its /tmp is its own); --bind {where} keeps it, --cwd DIR "
                "chooses another")
    if isinstance(e, PermissionError):
        return (f"uid {os.getuid()} may not enter the current directory {where}; --uid UID "
                "or --cwd DIR chooses")
    return f"the current directory {where} is not in the command's view; --cwd DIR chooses"


def _caller_cwd() -> str:
    try:
        return os.getcwd()
    except OSError:
        return "/"


def _close_fds(keep: Sequence[int]) -> None:
    # Whatever the caller had open (a broker's /dev/fuse fd, a control socket) must not
    # reach the tenant. Python opens fds close-on-exec, but a caller's C library may not.
    lo = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 65536)


# ------------------------------------------------------------------------------ the view
def tenant_nodes(tenant_dir: Path) -> list[str]:
    """The node files of a tenant directory that become /dev entries (sorted)."""
    return sorted(n for n in os.listdir(tenant_dir)
                  if TENANT_NODE_NAME.match(n) and not (tenant_dir / n).is_dir())


def build_view(spec: SandboxSpec, *, proc_devices: str | None = None) -> None:
    """In the new mount namespace: the host file system read-only, /dev, /proc, /sys views,
    hide what must be hidden, a private /tmp, then the command line's binds.
    ``proc_devices``: the text the tenant's /proc/devices shows (None: the host's)."""
    os.umask(0o022)
    tenant = spec.tenant_dir
    # Every mount the tenant inherits from the host, at once (else a root tenant could
    # write a broker source file and have the broker import it). Mounts made below are new and
    # writable where they must be (/dev/shm, /dev/pts, /tmp, the node binds).
    # And nodev: no device node anywhere in the host's tree opens as a device for the tenant
    # (a broker's spare driver nodes, a node left in some directory); its own /dev is a new
    # mount, and the node binds below clear it where they are real devices (CUSE/kmod).
    linux.mount_setattr("/", set_=linux.MOUNT_ATTR_RDONLY | linux.MOUNT_ATTR_NODEV,
                        recursive=True)
    # Found before /proc is replaced and before anything is stacked on top of it.
    fuse_root = fuse_mount_containing(tenant)
    # Every devbroker mount on the host (other broker instances too), not only this one,
    # and the run directory above each (its control socket, seccomp socket, audit log).
    broker_mounts = [mp for mp, _root, fstype in linux.mountinfo()
                     if fstype == BROKER_FSTYPE and mp != "/"]
    run_dirs = [os.path.dirname(mp) for mp in broker_mounts if os.path.dirname(mp) != "/"]
    # And every broker's run dir and audit log the host tells of, whatever its front end
    # (a seccomp-only broker mounts nothing): sandbox/brokers.py.
    run_dirs += brokers.paths_to_hide()
    _build_dev(tenant, char_nodes=_char_nodes(spec, proc_devices))
    _build_proc(tenant, proc_devices)
    _build_sys(tenant, spec.driver_version or _driver_version_from(tenant))
    # The nodes are already bound (a bind holds the file, not its path), so the directory
    # they came from can now be covered: the tenant cannot walk to its siblings.
    covered: set[str] = set()
    hidden: list[str | Path] = [*spec.hide, *run_dirs, *([fuse_root] if fuse_root else []),
                                *broker_mounts]
    for path in hidden:
        if str(path) in covered:
            continue
        covered.add(str(path))
        if os.path.isdir(path):
            _cover(Path(path))
        elif os.path.isfile(path):
            _cover_file(Path(path))
    for path in spec.readonly:
        linux.remount_bind(path, MS_RDONLY)
    # Taken after the covers (a bind of a directory above a run dir shows the cover) and
    # before the private /tmp (a source under the host's /tmp stays reachable).
    trees = [(b, _clone_bind(b)) for b in spec.binds]
    _private_tmp()
    for b, fd in trees:
        try:
            _attach_bind(b, fd)
        finally:
            os.close(fd)


PRIVATE_HOME = "/tmp/home"


def _writable_home(env: dict[str, str]) -> dict[str, str]:
    """The command's environment with a HOME it can write: the host's file system is
    read-only in the tenant's view, so a HOME there (root's /root, a user's home not bound
    rw) would fail every program that keeps a cache in it (CuPy's kernel cache, pip, torch's
    compile caches). Such a HOME becomes PRIVATE_HOME in the tenant's own /tmp (made here, as
    the command's uid); a HOME the command can write (bound with --bind DIR:DIR:rw) stays."""
    home = env.get("HOME")
    if home and os.access(home, os.W_OK):
        return env
    os.makedirs(PRIVATE_HOME, mode=0o700, exist_ok=True)
    return {**env, "HOME": PRIVATE_HOME}


def _private_tmp() -> None:
    """A tmpfs of the tenant's own on /tmp: writable scratch space that no other tenant and
    nothing on the host shares (sockets two tenants could meet on, files they could pass).
    Its size is the kernel's default (half the RAM); nothing limits host memory here."""
    if os.path.isdir("/tmp"):
        linux.mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")


def _clone_bind(b: Bind) -> int:
    """A detached copy of the bind's source tree, read-only unless writable (then only its
    top mount is made writable: mounts under it, covers included, stay read-only)."""
    try:
        fd = linux.open_tree_clone(b.src, recursive=True)
    except FileNotFoundError:
        raise OSError(errno.ENOENT, f"--bind {b.text()}: {b.src} is not in the tenant's view "
                      "(the broker's run directories stay hidden)") from None
    try:
        if b.writable:
            linux.mount_setattr("", dirfd=fd, clear=linux.MOUNT_ATTR_RDONLY)
        linux.mount_setattr("", dirfd=fd, set_=linux.MOUNT_ATTR_NOSUID | linux.MOUNT_ATTR_NODEV)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _attach_bind(b: Bind, fd: int) -> None:
    dst = str(b.dst)
    if not os.path.lexists(dst):
        try:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(dst, 0o755)
            else:
                os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
                os.close(os.open(dst, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
        except OSError as e:
            raise OSError(e.errno, f"--bind {b.text()}: cannot make {dst} ({e.strerror}); the "
                          "host file system is read-only: bind onto an existing path or "
                          "under /tmp") from None
    linux.move_mount(fd, dst)


def fuse_mount_containing(path: Path) -> str | None:
    """Mount point of the FUSE file system that holds path, if it is on one."""
    best = None
    p = str(path)
    for mp, _root, fstype in linux.mountinfo():
        if (p == mp or p.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) >= len(best[0])):
            best = (mp, fstype)
    if best and best[0] != "/" and best[1].startswith("fuse"):
        return best[0]
    return None


def _tty_gid() -> int | None:
    try:
        with open("/etc/group") as f:
            for line in f:
                parts = line.split(":")
                if parts[0] == "tty":
                    return int(parts[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _char_nodes(spec: SandboxSpec, proc_devices: str | None) -> dict[str, int] | None:
    """For the seccomp front end: the tenant's nodes as character devices (name -> rdev).
    Opens of them are answered by the broker; the numbers are what stat shows (NVML insists
    on 195:255 for nvidiactl) and what a real driver file has."""
    if spec.frontend != "seccomp":
        return None
    uvm = 238
    for line in (proc_devices or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == "nvidia-uvm" and parts[0].isdigit():
            uvm = int(parts[0])
    out = {}
    for name in tenant_nodes(spec.tenant_dir):
        if name == "nvidiactl":
            out[name] = os.makedev(195, 255)
        elif name == "nvidia-uvm":
            out[name] = os.makedev(uvm, 0)
        elif name[len("nvidia"):].isdigit():
            out[name] = os.makedev(195, int(name[len("nvidia"):]))
    return out


def _build_dev(tenant: Path, char_nodes: dict[str, int] | None = None) -> None:
    linux.mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC | MS_STRICTATIME,
                "mode=0755,size=65536k")
    for name, (major, minor) in SAFE_DEVICES.items():
        path = f"/dev/{name}"
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        os.chmod(path, 0o666)
    for name, target in DEV_SYMLINKS.items():
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/pts", 0o755)
    # A new devpts instance: the tenant's ptys are its own, the host's are not visible.
    tty = _tty_gid()
    linux.mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                "newinstance,ptmxmode=0666,mode=0620" + (f",gid={tty}" if tty is not None else ""))
    os.mkdir("/dev/shm", 0o1777)
    linux.mount("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                "mode=1777,size=65536k")
    for name, rdev in (char_nodes or {}).items():
        os.mknod(f"/dev/{name}", stat.S_IFCHR | 0o666, rdev)
        os.chmod(f"/dev/{name}", 0o666)
    for name in ([] if char_nodes is not None else tenant_nodes(tenant)):
        target = f"/dev/{name}"
        # A bind target must exist and be a non-directory like its source.
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o666))
        linux.mount(str(tenant / name), target, None, MS_BIND)
        # Writable (the copy of the host's mount is read-only, and the nodes are opened
        # O_RDWR); nodev off on these binds alone: with the CUSE/kmod front ends these are
        # real devices.
        linux.mount_setattr(target, clear=linux.MOUNT_ATTR_RDONLY | linux.MOUNT_ATTR_NODEV,
                            set_=linux.MOUNT_ATTR_NOSUID | linux.MOUNT_ATTR_NOEXEC)
    # Read-only: the tenant cannot plant its own nvidia* files, /dev/nvidia-caps, symlinks.
    linux.remount_bind("/dev", MS_RDONLY)


def _build_proc(tenant: Path, proc_devices: str | None = None) -> None:
    # Detach the host's procfs (with its submounts) instead of stacking on it: nothing of
    # it stays reachable, and /proc/<pid> now lists only this pid namespace.
    linux.umount2("/proc", MNT_DETACH)
    linux.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount_proc_driver_view("/proc", tenant, proc_devices)
    for name in PROC_MASKED_FILES:
        if os.path.isfile(f"/proc/{name}"):
            linux.mount("/dev/null", f"/proc/{name}", None, MS_BIND)
    for name in PROC_MASKED_DIRS:
        if os.path.isdir(f"/proc/{name}"):
            _cover(Path(f"/proc/{name}"))
    for name in PROC_READONLY:
        path = f"/proc/{name}"
        if os.path.exists(path):
            linux.mount(path, path, None, MS_BIND | MS_REC)
            linux.remount_bind(path, MS_RDONLY)


def mount_proc_driver_view(proc: str, tenant: Path, proc_devices: str | None = None) -> None:
    """On the procfs at ``proc``: ``driver`` becomes a read-only tmpfs holding only
    ``nvidia/``, a copy of the tenant's ``proc/driver/nvidia`` as it is now; ``devices``
    (with ``proc_devices``) a read-only bind of that text. Shared with the OCI hook
    (devbroker.oci.hook), which passes the container's procfs as a /proc/self/fd path.

    A copy, not a bind of the broker's view: NVML opens and reads these files ~15 times per
    nvmlInit (`params` ten times), and each open+read+close of a file the broker serves
    costs FUSE round trips (~1 ms on the development machine, against ~20 µs for a file
    here). The files say what the driver is and which GPUs the tenant has; a
    policy change that takes a GPU away takes effect for every call at once (the broker
    refuses them) and in this view for processes started after it."""
    # procfs refuses mkdir, and /proc/driver is global (it shows the host's driver whatever
    # the pid namespace): cover it with a tmpfs that holds only the tenant's view.
    linux.mount("tmpfs", f"{proc}/driver", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                "mode=0755,size=1m")
    view = tenant / "proc" / "driver" / "nvidia"
    if view.is_dir():
        _copy_view(view, Path(f"{proc}/driver/nvidia"))
    else:
        os.mkdir(f"{proc}/driver/nvidia", 0o555)
    if proc_devices is not None:
        # /proc/devices with the NVIDIA majors NVML looks up (nvidia-uvm's must match what the
        # stat shim reports for /dev/nvidia-uvm). Written into the /proc/driver tmpfs while it
        # is still writable, bound, and unlinked: the bind keeps the inode, nothing shows.
        tmp = f"{proc}/driver/.devices"
        with open(tmp, "w") as f:
            f.write(proc_devices)
        os.chmod(tmp, 0o444)
        linux.mount(tmp, f"{proc}/devices", None, MS_BIND)
        linux.remount_bind(f"{proc}/devices", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.unlink(tmp)
    linux.remount_bind(f"{proc}/driver", MS_RDONLY)


def _copy_view(src: Path, dst: Path, depth: int = 0) -> None:
    """src's directories and regular files into dst (directories 0555, files 0444); links
    and other kinds are left out (the broker's view has none)."""
    if depth > 16:
        raise OSError(errno.ELOOP, f"{src}: the view is deeper than 16 levels")
    os.mkdir(dst, 0o755)
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            _copy_view(Path(entry.path), dst / entry.name, depth + 1)
        elif entry.is_file(follow_symlinks=False):
            data = Path(entry.path).read_bytes()
            fd = os.open(dst / entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
    os.chmod(dst, 0o555)


def _driver_version_from(tenant: Path) -> str | None:
    try:
        text = (tenant / "proc" / "driver" / "nvidia" / "version").read_text()
    except OSError:
        return None
    m = re.search(r"Kernel Module(?: for \S+)?\s+([0-9]+\.[0-9]+(?:\.[0-9]+)?)", text)
    return m.group(1) if m else None


def _build_sys(tenant: Path, driver_version: str | None) -> None:
    mount_sys_module_view("/sys/module", tenant, driver_version)
    if os.path.isdir("/sys/firmware"):
        _cover(Path("/sys/firmware"))  # ACPI tables, EFI variables
    # sysfs attributes are root-owned: uid 0 writes many of them (PCI remove/reset/rescan,
    # cgroup files) without any capability. Every mount under /sys becomes read-only.
    mounts = [mp for mp, _root, _fs in linux.mountinfo() if mp == "/sys" or mp.startswith("/sys/")]
    for mp in sorted(set(mounts), key=len):
        try:
            linux.remount_bind(mp, MS_RDONLY)
        except OSError:
            # A mount hidden under a later one (e.g. the host's /sys/module/* submounts
            # under our tmpfs) can no longer be reached by path; it is unreachable for the
            # tenant too.
            if os.path.ismount(mp):
                raise


def mount_sys_module_view(module_dir: str, tenant: Path, driver_version: str | None) -> None:
    """A read-only tmpfs on ``module_dir`` (a sysfs ``module`` directory) with only the
    NVIDIA modules: ``nvidia/{initstate,version}``, ``nvidia_uvm/initstate`` (or binds of
    the tenant's ``sys/module/<m>`` where the broker provides them). Shared with the OCI hook.

    NVML checks access("/sys/module/nvidia/initstate") first: without it, it decides there
    is no driver and scans PCI config space for NVIDIA devices instead. sysfs refuses mkdir,
    hence the tmpfs (which also stops the host's module parameters from leaking in)."""
    linux.mount("tmpfs", module_dir, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                "mode=0755,size=64k")
    for module in ("nvidia", "nvidia_uvm"):
        target = f"{module_dir}/{module}"
        os.mkdir(target, 0o755)
        given = tenant / "sys" / "module" / module
        if given.is_dir():
            linux.mount(str(given), target, None, MS_BIND | MS_REC)
            continue
        Path(target, "initstate").write_text("live\n")
        if module == "nvidia" and driver_version:
            Path(target, "version").write_text(driver_version + "\n")
    linux.remount_bind(module_dir, MS_RDONLY)


def _cover(path: Path) -> None:
    """Hide a directory under an empty read-only tmpfs."""
    linux.mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                "mode=0555,size=4k")


def _cover_file(path: Path) -> None:
    """Hide a file (an audit log outside the run dir) under an empty read-only one. The empty
    file is made in the tenant's /dev/shm, bound, and unlinked there: nothing shows."""
    tmp = "/dev/shm/.devbroker-cover"
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o444))
    try:
        linux.mount(tmp, path, None, MS_BIND)
        linux.remount_bind(path, MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    finally:
        os.unlink(tmp)


# ------------------------------------------------------------------------------ privileges
def drop_privileges(spec: SandboxSpec) -> None:
    """Bounding set, ambient set, uid/gid, effective/permitted set, no_new_privs — in the
    order that each step still has the capability it needs (PR_CAPBSET_DROP needs setpcap,
    setgroups/setgid/setuid need setgid/setuid)."""
    as_root = spec.uid in (None, 0)
    keep = {linux.CAPABILITY_NUMBERS[n] for n in spec.capabilities} if as_root else set()
    # The bounding set limits what any later exec can gain: root's implicit full file
    # capabilities, setuid-root binaries, file capabilities.
    for cap in range(linux.last_cap() + 1):
        if cap not in keep:
            linux.prctl(linux.PR_CAPBSET_DROP, cap)
    linux.prctl(linux.PR_CAP_AMBIENT, linux.PR_CAP_AMBIENT_CLEAR_ALL)
    if spec.uid is not None or spec.gid is not None:
        uid = 0 if spec.uid is None else spec.uid
        gid = spec.gid if spec.gid is not None else _primary_gid(uid)
        # Root's supplementary groups (0, disk, ...) would otherwise survive setuid.
        os.setgroups(list(spec.groups))
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # clears permitted/effective for a non-zero uid
    mask = sum(1 << c for c in keep)
    linux.capset(effective=mask, permitted=mask, inheritable=0)
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)


def _primary_gid(uid: int) -> int:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_gid
    except (KeyError, ImportError):
        return uid
