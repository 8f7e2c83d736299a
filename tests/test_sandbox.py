"""The tenant sandbox, with real processes, namespaces and mounts (root only).

A tmp tenant directory of plain files stands in for the broker's FUSE nodes; a checker
program runs inside the sandbox and reports what it sees as JSON.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from devbroker.sandbox import SandboxSpec, exec_main, run_in_sandbox
from devbroker.sandbox.sandbox import spec_to_args

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, mounts)"),
]

VERSION_TEXT = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.309.01  Tue Oct  1 00:00:00 UTC 2025\n"
PARAMS_TEXT = "ModifyDeviceFiles: 0\nDeviceFileUID: 0\nDeviceFileGID: 0\nDeviceFileMode: 438\n"

EXPECTED_DEV = {
    "null", "zero", "full", "random", "urandom", "tty", "pts", "shm", "ptmx",
    "fd", "stdin", "stdout", "stderr",
    "nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools",
}

CHECKER = textwrap.dedent(r'''
    import ctypes, errno, json, os, stat, sys
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}
    def read(p):
        try:
            with open(p) as f:
                return f.read()
        except OSError as e:
            return "ERR:" + errno.errorcode[e.errno]
    def attempt(fn):
        try:
            fn()
            return "ok"
        except OSError as e:
            return errno.errorcode[e.errno]
    out["dev"] = sorted(os.listdir("/dev"))
    out["nvidiactl"] = read("/dev/nvidiactl")
    out["nvidia0"] = read("/dev/nvidia0")
    out["caps_exists"] = os.path.lexists("/dev/nvidia-caps")
    out["version"] = read("/proc/driver/nvidia/version")
    out["params"] = read("/proc/driver/nvidia/params")
    out["proc_driver"] = sorted(os.listdir("/proc/driver"))
    out["initstate"] = read("/sys/module/nvidia/initstate")
    out["sys_module"] = sorted(os.listdir("/sys/module"))
    out["mknod"] = attempt(lambda: os.mknod("/dev/shm/ctl", stat.S_IFCHR | 0o666, os.makedev(195, 255)))
    def umount():
        if libc.umount2(b"/dev/nvidiactl", 0) != 0:
            e = ctypes.get_errno(); raise OSError(e, os.strerror(e))
    out["umount"] = attempt(umount)
    def mount():
        if libc.mount(b"tmpfs", b"/mnt", b"tmpfs", 0, None) != 0:
            e = ctypes.get_errno(); raise OSError(e, os.strerror(e))
    out["mount"] = attempt(mount)
    out["write_dev"] = attempt(lambda: open("/dev/nvidia-caps", "w"))
    out["write_sys"] = attempt(lambda: open("/sys/module/nvidia/initstate", "w"))
    out["pid"] = os.getpid()
    out["ppid"] = os.getppid()
    out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    out["uid"] = os.getuid()
    try:
        out["hidden_root"] = os.listdir(sys.argv[1]) or "empty"
    except OSError as e:
        out["hidden_root"] = errno.errorcode[e.errno]
    status = dict(l.split(":\t", 1) for l in read("/proc/self/status").splitlines() if ":\t" in l)
    out["cap_eff"] = int(status["CapEff"], 16)
    out["cap_bnd"] = int(status["CapBnd"], 16)
    out["no_new_privs"] = status["NoNewPrivs"].strip()
    out["ro_sys"] = bool(os.statvfs("/sys").f_flag & os.ST_RDONLY)
    out["ro_proc_sys"] = bool(os.statvfs("/proc/sys").f_flag & os.ST_RDONLY)
    print(json.dumps(out))
''')


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    """<tmp>/mnt/{alice,bob}: the layout of the broker's mount, as plain files."""
    mnt = tmp_path / "mnt"
    alice = mnt / "alice"
    (alice / "proc" / "driver" / "nvidia").mkdir(parents=True)
    (alice / "nvidiactl").write_text("alice-ctl\n")
    (alice / "nvidia0").write_text("alice-gpu0\n")
    (alice / "nvidia-uvm").write_text("")
    (alice / "nvidia-uvm-tools").write_text("")
    # Not device nodes the tenant should get: a cap node, a dir, a stray file.
    (alice / "nvidia-cap1").write_text("")
    (alice / "nvidia-caps").mkdir()
    (alice / "README").write_text("")
    (alice / "proc" / "driver" / "nvidia" / "version").write_text(VERSION_TEXT)
    (alice / "proc" / "driver" / "nvidia" / "params").write_text(PARAMS_TEXT)
    bob = mnt / "bob"
    bob.mkdir()
    (bob / "nvidiactl").write_text("bob-ctl\n")
    (bob / "nvidia1").write_text("bob-gpu1\n")
    return mnt


def sandbox_cmd(tenant_dir: Path, argv: list[str], **kw) -> list[str]:
    from devbroker.testing.tenant_binds import paths

    kw.setdefault("binds", tuple(paths()))  # a checkout under /tmp: the tenant's is its own
    spec = SandboxSpec(tenant_dir=tenant_dir, argv=tuple(argv), **kw)
    return [sys.executable, "-m", "devbroker.sandbox", *spec_to_args(spec), "--", *argv]


def run(tenant_dir: Path, argv: list[str], *, input: str | None = None, **kw):
    return subprocess.run(sandbox_cmd(tenant_dir, argv, **kw), input=input,
                          capture_output=True, text=True, timeout=60)


# For the non-root runs: the venv's interpreter may live under /root, out of reach of uid 65534.
SYSTEM_PYTHON = "/usr/bin/python3"


def check(tenants: Path, *, python: str = sys.executable, **kw) -> dict:
    r = run(tenants / "alice", [python, "-c", CHECKER, str(tenants)],
            hide=(tenants,), **kw)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_view_of_dev_proc_sys(tenants: Path):
    seen = check(tenants)
    assert set(seen["dev"]) == EXPECTED_DEV  # no real nodes, no caps, nothing else
    assert seen["nvidiactl"] == "alice-ctl\n"
    assert seen["nvidia0"] == "alice-gpu0\n"
    assert not seen["caps_exists"]
    assert seen["version"] == VERSION_TEXT
    assert seen["params"] == PARAMS_TEXT
    assert seen["proc_driver"] == ["nvidia"]  # the host's other driver entries are covered
    assert seen["initstate"] == "live\n"
    assert seen["sys_module"] == ["nvidia", "nvidia_uvm"]
    # The broker mount's root (and so bob's directory) is covered inside; here it lies
    # under the host's /tmp, which the tenant does not see at all (its /tmp is its own).
    assert seen["hidden_root"] in ("empty", "ENOENT")


def test_tenant_cannot_undo_the_view(tenants: Path):
    seen = check(tenants)
    assert seen["mknod"] == "EPERM"
    assert seen["umount"] == "EPERM"
    assert seen["mount"] == "EPERM"
    assert seen["write_dev"] == "EROFS"
    assert seen["write_sys"] == "EROFS"
    assert seen["ro_sys"] and seen["ro_proc_sys"]
    assert seen["no_new_privs"] == "1"
    for cap in (21, 27, 19, 16, 17):  # sys_admin, mknod, sys_ptrace, sys_module, sys_rawio
        assert not seen["cap_eff"] & (1 << cap)
        assert not seen["cap_bnd"] & (1 << cap)


def test_own_pid_namespace(tenants: Path):
    seen = check(tenants)
    # pid 1 is the sandbox's init, the command is its child; no host process is visible.
    assert seen["ppid"] == 1
    assert seen["pid"] == 2
    assert seen["pids"] == [1, 2]


def test_runs_as_given_uid_without_capabilities(tenants: Path, tenant_tree: Path):
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} is needed to run the checker as uid 65534")
    # cwd: the caller's (the checkout) may be out of uid 65534's reach (a clone under /root)
    seen = check(tenants, python=SYSTEM_PYTHON, uid=65534, gid=65534, cwd=str(tenant_tree))
    assert seen["uid"] == 65534
    assert seen["cap_eff"] == 0 and seen["cap_bnd"] == 0
    assert seen["nvidiactl"] == "alice-ctl\n"  # the plain files are 0644: still readable
    assert seen["mknod"] == "EPERM"
    assert seen["hidden_root"] in ("empty", "EACCES", "ENOENT")  # under the host's /tmp


def test_other_tenant_sees_its_own_nodes(tenants: Path):
    r = run(tenants / "bob", ["sh", "-c", "ls /dev | grep nvidia; cat /dev/nvidiactl"],
            hide=(tenants,))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["nvidia1", "nvidiactl", "bob-ctl"]


def test_exit_status_propagates(tenants: Path):
    assert run(tenants / "alice", ["sh", "-c", "exit 7"]).returncode == 7
    assert run(tenants / "alice", ["true"]).returncode == 0
    # Killed by a signal: the shell convention 128+N.
    assert run(tenants / "alice", ["sh", "-c", "kill -KILL $$"]).returncode == 128 + 9
    assert run(tenants / "alice", ["/nonexistent/program"]).returncode == 127


def test_stdio_passes_through(tenants: Path):
    r = run(tenants / "alice", ["sh", "-c", "cat; echo err >&2"], input="hello\n")
    assert (r.returncode, r.stdout, r.stderr) == (0, "hello\n", "err\n")


def test_signals_are_forwarded(tenants: Path):
    script = 'trap "echo got-term; exit 42" TERM; echo ready; while :; do sleep 0.05; done'
    p = subprocess.Popen(sandbox_cmd(tenants / "alice", ["sh", "-c", script]),
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "ready\n"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 42
        assert p.stdout.read() == "got-term\n"
    finally:
        p.kill()
        p.wait()


def test_init_reaps_orphans(tenants: Path):
    # A grandchild orphaned inside the namespace is re-parented to the sandbox's pid 1;
    # if pid 1 did not reap it, it would stay a zombie ("Z") while the command runs on.
    script = textwrap.dedent('''
        import os, time
        if os.fork() == 0:
            if os.fork() == 0:
                time.sleep(0.2)
                os._exit(0)
            os._exit(0)
        os.wait()
        time.sleep(1.0)
        states = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                with open(f"/proc/{p}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        print("".join(sorted(states)))
    ''')
    r = run(tenants / "alice", [sys.executable, "-c", script])
    assert r.returncode == 0, r.stderr
    assert "Z" not in r.stdout
    assert r.stdout.strip() in ("RS", "SR", "RR", "SS")  # pid 1 and the command only


def test_exec_main_in_process(tenants: Path, capfd):
    # What `devbroker exec` calls: forks here, returns the status, leaves us as we were.
    mask_before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    ns_before = os.readlink("/proc/self/ns/mnt"), os.readlink("/proc/self/ns/pid_for_children")
    status = exec_main(tenants / "alice", ["sh", "-c", "cat /dev/nvidiactl; exit 3"],
                       hide=[tenants])
    assert status == 3
    assert capfd.readouterr().out == "alice-ctl\n"
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == mask_before
    assert (os.readlink("/proc/self/ns/mnt"),
            os.readlink("/proc/self/ns/pid_for_children")) == ns_before


def test_run_in_sandbox(tenants: Path):
    spec = SandboxSpec(tenant_dir=tenants / "alice", argv=("sh", "-c", "test -e /dev/nvidia0 && exit 5"))
    assert run_in_sandbox(spec, stdout=subprocess.DEVNULL) == 5


def test_what_hides_a_brokers_files(tmp_path):
    """sandbox/brokers.py: a registered broker's run dir; its audit log's directory when the
    directory holds only the log and its rotated files (covered across rotations), else the
    files themselves (a cover over a home or a project would take them from the tenant);
    nothing for a log inside the run dir (covered with it); entries of brokers gone are
    dropped at the next registration."""
    from devbroker.sandbox import brokers

    reg, run = tmp_path / "registry", tmp_path / "run"
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "audit.jsonl").write_text("")
    (tmp_path / "logs" / "audit.jsonl.1").write_text("")
    (tmp_path / "home" / "project").mkdir(parents=True)
    (tmp_path / "home" / "audit.jsonl").write_text("")
    (tmp_path / "home" / "audit.jsonl.2").write_text("")

    def hidden(audit) -> list[str]:
        for old in reg.glob("*.json"):
            old.unlink()
        brokers.register(run, audit, registry=reg)
        return [p for p in brokers.paths_to_hide(reg) if p.startswith(str(tmp_path))]

    assert hidden(tmp_path / "logs" / "audit.jsonl") == [str(run), str(tmp_path / "logs")]
    assert hidden(tmp_path / "home" / "audit.jsonl") == [
        str(run), str(tmp_path / "home" / "audit.jsonl"), str(tmp_path / "home" / "audit.jsonl.2")]
    assert hidden(run / "audit.log") == [str(run)]
    assert brokers.audit_dir_is_shared("/var/log/audit.jsonl")
    (reg / "999999999.json").write_text('{"run_dir": "/nowhere"}')  # a broker long gone
    brokers.register(run, None, registry=reg)
    assert not (reg / "999999999.json").exists()
