"""Inside the QEMU guest: the real broker core + emulated backend behind the kernel module's
nodes or CUSE nodes, and tenant programs run as ordinary uids against them.

    insmod kmod/devbroker.ko major=195 gpus=2        # or: modprobe cuse
    python -m devbroker.testing.guest_broker checks --frontend kmod --dir $DBRUN/kmod [--smi]

``checks`` starts ``serve`` (this module again, a separate process so that it can be
killed) and drives everything from the outside, printing one ``GUEST-RESULT {json}`` line
per check with what it observed; tests/test_guest_frontends.py on the host asserts on them.
Nothing here decides pass/fail except where a line says so.

Policy (two emulated H200s): alice = uid 1001 on GPU 0 with 16 GiB, bob = uid 1002 on
GPU 1 with 8 GiB; any other uid is refused at open. Tenants are mapped by uid
(frontends.kmod.tenant_by_uid) because the nodes are shared by every process of the guest.

Needs trio for ``serve`` (the guest venv of scripts/qemu/setup.sh); tenant programs run
under /usr/bin/python3 (stdlib only, fast to start over 9p), from the tenant tree (TREE).
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# What tenants (other uids) run and where: the copy run_in_guest made for them
# (devbroker.testing.tenant_tree), since the checkout may be out of their reach (a clone
# under /root); the checkout itself when started by hand without one.
TREE = Path(os.environ.get("DEVBROKER_TENANT_TREE") or REPO)
TENANT_PY = "/usr/bin/python3"
ALICE, BOB, NOBODY = 1001, 1002, 1003
UUID0 = "GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0001"
UUID1 = "GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0002"
GiB = 1 << 30
POLICY = f"""
[broker]
backend = "emulated"
driver_version = "580.159.04"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "{UUID0}"
pci_bus_id = "0000:00:06.0"
memory = "141GiB"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "{UUID1}"
pci_bus_id = "0000:00:07.0"
memory = "141GiB"

[tenant.alice]
gpus = [0]
memory_quota = "16GiB"
uids = [{ALICE}]

[tenant.bob]
gpus = [1]
memory_quota = "8GiB"
uids = [{BOB}]
"""
UVM_INITIALIZE = 0x30000001
TIMEOUT = 60  # every wait below is bounded by this (seconds)


def control_path(frontend: str) -> Path:
    # Not in the run directory: 9p cannot hold a Unix socket. /tmp is the guest's tmpfs.
    return Path("/tmp") / f"devbroker-guest-{frontend}.sock"


# ------------------------------------------------------------------------------ serve
def serve(frontend: str, run: Path, policy_file: Path | None = None) -> int:
    import trio

    from devbroker.assemble import assemble, node_frontend
    from devbroker.broker import procview
    from devbroker.broker.audit import AuditLog
    from devbroker.broker.control import ControlServer
    from devbroker.broker.policy import load_policy_text

    text = policy_file.read_text() if policy_file else POLICY
    policy = load_policy_text(text, str(policy_file or "guest-policy"))
    built = assemble(policy, audit=AuditLog(run / "audit.jsonl"))
    broker, backend = built.broker, built.backend
    for name, t in broker.tenants.items():  # /proc/driver/nvidia as each tenant sees it
        for rel, data in procview.tenant_view(backend.gpus(), t.gpus, backend.version).items():
            p = run / "view" / name / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)

    async def main() -> None:
        fe = node_frontend(frontend, broker, **({"gpus": [0, 1]} if frontend == "cuse" else {}))
        control = ControlServer(control_path(frontend), {"status": lambda req: broker.snapshot()})
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with fe:
                async with trio.open_nursery() as nursery:
                    await nursery.start(control.serve)
                    (run / "ready").write_text(str(os.getpid()))
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        break

    trio.run(main)
    return 0


# ------------------------------------------------------------------------------ helpers
def emit(check: str, **data) -> None:
    print("GUEST-RESULT " + json.dumps({"check": check, **data}, default=str), flush=True)


class BrokerProc:
    def __init__(self, frontend: str, run: Path, policy_file: Path | None = None):
        self.frontend, self.run = frontend, run
        self.policy_file = policy_file  # None: POLICY above (devbroker.escape.guest has its own)

    def start(self) -> float:
        (self.run / "ready").unlink(missing_ok=True)
        t0 = time.monotonic()
        self.log = open(self.run / "broker.log", "a")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "devbroker.testing.guest_broker", "serve", "--frontend",
             self.frontend, "--dir", str(self.run)]
            + (["--policy", str(self.policy_file)] if self.policy_file else []),
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while not (self.run / "ready").exists():
            if self.p.poll() is not None or time.monotonic() - t0 > TIMEOUT:
                raise RuntimeError("broker did not start: " + self.tail())
            time.sleep(0.05)
        return time.monotonic() - t0

    def tail(self) -> str:
        try:
            return (self.run / "broker.log").read_text()[-3000:]
        except OSError:
            return ""

    def status(self) -> dict:
        from devbroker.broker.control import call

        return call(control_path(self.frontend), {"op": "status"}, timeout=TIMEOUT)

    def tenant(self, name: str) -> dict:
        return next(t for t in self.status()["tenants"] if t["name"] == name)

    def stop(self, sig=signal.SIGTERM) -> int | None:
        self.p.send_signal(sig)
        try:
            return self.p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()


def tenant_env() -> dict:
    return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(TREE / "src"),
            "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp", "LC_ALL": "C"}


def run_as(uid: int, argv: list[str], timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(argv, user=uid, group=uid, extra_groups=[], env=tenant_env(),
                          cwd=str(TREE), capture_output=True, text=True, timeout=timeout)


def drop_to(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def fork_as(uid: int, fn) -> tuple[int, int, int]:
    """Run fn(reply_fd, cmd_fd) in a child as uid. Returns (pid, read end, write end)."""
    r1, w1 = os.pipe()  # child -> parent
    r2, w2 = os.pipe()  # parent -> child
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r1)
            os.close(w2)
            drop_to(uid)
            fn(w1, r2)
        except BaseException as e:  # report, never return into the parent's code
            try:
                os.write(w1, (json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n").encode())
            except OSError:
                pass
            code = 1
        os._exit(code)
    os.close(w1)
    os.close(r2)
    return pid, r1, w2


def say(fd: int, **kw) -> None:
    os.write(fd, (json.dumps(kw) + "\n").encode())


def read_line(fd: int, timeout: float = TIMEOUT) -> dict:
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return {"error": "timeout"}
        chunk = os.read(fd, 4096)
        if not chunk:
            return {"error": "eof", "partial": buf.decode(errors="replace")}
        buf += chunk
    return json.loads(buf.splitlines()[0])


def reap(pid: int, timeout: float = TIMEOUT) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            return st
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def errno_of(fn) -> int:
    try:
        fn()
        return 0
    except OSError as e:
        return e.errno


def wait_for(pred, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def idle(b: BrokerProc) -> dict:
    """Per tenant: open files, clients and memory used (all zero when nothing is held)."""
    return {t["name"]: {"open_files": t["open_files"], "clients": t["clients"],
                        "used": sum(m["used"] for m in t["memory"].values())}
            for t in b.status()["tenants"]}


def client_session(c, alloc: int = 0) -> dict:
    """The NVML-style sequence on an open probe Client; optionally allocate and free."""
    c.check_version()
    c.open_root()
    ids = c.attached_ids()
    g = c.open_gpu(ids[0])
    g["memory"] = c.memory(g["hsubdevice"])
    if alloc:
        h = c.alloc_device_memory(g["hdevice"], alloc)
        g["used_after_alloc"] = c.memory(g["hsubdevice"])["used"]
        c.free(g["hdevice"], h)
    return {"ids": len(ids), "uuid": g["uuid"], "total": g["memory"]["total"],
            "used_after_alloc": g.get("used_after_alloc")}


# ------------------------------------------------------------------------------ checks
def check_nodes(frontend: str) -> None:
    out = {}
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm", "nvidia-uvm-tools"):
        try:
            st = os.stat(f"/dev/{name}")
            out[name] = {"chr": stat.S_ISCHR(st.st_mode), "mode": oct(st.st_mode & 0o777),
                         "rdev": f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"}
        except OSError as e:
            out[name] = {"errno": e.errno}
    emit("nodes", nodes=out)


def check_open() -> None:
    def try_open(path):
        def fn(w, r):
            e = errno_of(lambda: os.close(os.open(path, os.O_RDWR)))
            say(w, errno=e)
        return fn

    res = {}
    for label, uid, path in (("alice_ctl", ALICE, "/dev/nvidiactl"),
                             ("alice_gpu0", ALICE, "/dev/nvidia0"),
                             ("alice_gpu1", ALICE, "/dev/nvidia1"),
                             ("bob_gpu1", BOB, "/dev/nvidia1"),
                             ("nobody_ctl", NOBODY, "/dev/nvidiactl")):
        pid, r, w = fork_as(uid, try_open(path))
        res[label] = read_line(r).get("errno")
        os.close(r)
        os.close(w)
        reap(pid)
    emit("open", errno=res)


def check_probe(b: BrokerProc) -> None:
    for name, uid in (("alice", ALICE), ("bob", BOB)):
        p = run_as(uid, [TENANT_PY, "-m", "devbroker.tools.probe", "--json"])
        emit(f"probe_{name}", rc=p.returncode, report=_json(p.stdout), stderr=p.stderr[-2000:])


def check_quota(b: BrokerProc) -> None:
    p = run_as(ALICE, [TENANT_PY, "-m", "devbroker.tools.probe", "--json",
                       "--alloc", "10GiB", "--alloc", "10GiB"])
    emit("quota", rc=p.returncode, report=_json(p.stdout), stderr=p.stderr[-2000:],
         after=idle(b))


def check_refusals(b: BrokerProc) -> None:
    audit_path = b.run / "audit.jsonl"
    start = audit_path.stat().st_size if audit_path.exists() else 0
    p = run_as(ALICE, [TENANT_PY, str(TREE / "tests" / "tenant_prog.py"), "refusals"])
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    time.sleep(0.1)
    with open(audit_path) as f:
        f.seek(start)
        audit = [json.loads(x) for x in f.read().splitlines() if x.strip()]
    emit("refusals", rc=p.returncode, results=lines, stderr=p.stderr[-2000:],
         audit=[a for a in audit if a.get("event") == "deny"])


def check_uvm() -> None:
    def fn(w, r):
        import fcntl

        fd = os.open("/dev/nvidia-uvm", os.O_RDWR)
        buf = bytearray(16)  # UVM_INITIALIZE_PARAMS {u64 flags; u32 rmStatus; pad}
        ret = fcntl.ioctl(fd, UVM_INITIALIZE, buf, True)
        say(w, ret=ret, rmStatus=int.from_bytes(buf[8:12], "little"))
        os.close(fd)

    pid, r, w = fork_as(ALICE, fn)
    emit("uvm_raw", **read_line(r))
    os.close(r)
    os.close(w)
    reap(pid)


def check_kill(b: BrokerProc) -> None:
    """A tenant holding 1 GiB, SIGKILLed while it is making calls in a loop."""
    def fn(w, r):
        from devbroker.tools.probe import Client

        c = Client()
        c.check_version()
        c.open_root()
        g = c.open_gpu(c.attached_ids()[0])
        c.alloc_device_memory(g["hdevice"], GiB)
        say(w, ready=True)
        while True:  # the kill lands in (or between) these calls
            c.attached_ids()

    pid, r, w = fork_as(ALICE, fn)
    ready = read_line(r)
    before = idle(b)
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    st = reap(pid)
    exited = time.monotonic() - t0
    released = wait_for(lambda: idle(b)["alice"] == {"open_files": 0, "clients": 0, "used": 0})
    emit("tenant_kill", ready=ready, before=before, after=idle(b), released=released,
         killed=os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGKILL,
         exit_seconds=round(exited, 3))
    os.close(r)
    os.close(w)


def check_concurrent(b: BrokerProc, n: int = 16) -> None:
    def fn(w, r):
        from devbroker.tools.probe import Client

        c = Client()
        res = client_session(c, alloc=64 << 20)
        c.close()
        say(w, **res)

    kids = []
    for i in range(n):
        uid = ALICE if i % 2 == 0 else BOB
        pid, r, w = fork_as(uid, fn)
        kids.append((uid, pid, r, w))
    results = []
    for uid, pid, r, w in kids:
        res = read_line(r, timeout=2 * TIMEOUT)
        res["uid"] = uid
        results.append(res)
        os.close(r)
        os.close(w)
        reap(pid)
    settled = wait_for(lambda: all(v == {"open_files": 0, "clients": 0, "used": 0}
                                   for v in idle(b).values()))
    emit("concurrent", n=n, results=results, idle_after=settled, after=idle(b))


def smi_script(run: Path, tenant: str, uid: int, args: list[str]) -> str:
    """A mount namespace with the tenant's /proc/driver/nvidia and a /sys/module that says
    the driver is loaded (what the FUSE sandbox gives a tenant), then nvidia-smi as uid."""
    view = run / "view" / tenant
    q = " ".join(f"'{a}'" for a in args)
    return f"""
set -e
mount -t tmpfs -o mode=755 tmpfs /proc/driver
mkdir /proc/driver/nvidia
cp -r {view}/. /proc/driver/nvidia/
mount -t tmpfs -o mode=755 tmpfs /sys/module
mkdir /sys/module/nvidia /sys/module/nvidia_uvm
echo live > /sys/module/nvidia/initstate
echo live > /sys/module/nvidia_uvm/initstate
echo 580.159.04 > /sys/module/nvidia/version
exec setpriv --reuid={uid} --regid={uid} --clear-groups nvidia-smi {q}
"""


def check_smi(b: BrokerProc, frontend: str) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        emit("smi", skipped="nvidia-smi is not installed on the host")
        return
    for tenant, uid in (("alice", ALICE), ("bob", BOB)):
        for label, args in (("csv", ["--query-gpu=index,name,uuid,memory.total,memory.used",
                                     "--format=csv"]), ("list", ["-L"])):
            t0 = time.monotonic()
            try:
                p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                    smi_script(b.run, tenant, uid, args)], capture_output=True,
                                   text=True, timeout=2 * TIMEOUT, env=tenant_env(), cwd=TREE)
                rc, out, err = p.returncode, p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                rc, out, err = None, str(e.stdout or ""), "timeout"
            emit(f"smi_{label}_{tenant}", rc=rc, stdout=out[-4000:], stderr=err[-2000:],
                 seconds=round(time.monotonic() - t0, 2))


def check_broker_death(b: BrokerProc, frontend: str) -> None:
    """Tenant has the nodes open; the broker is SIGKILLed; its next call must fail at once."""
    def fn(w, r):
        from devbroker.tools.probe import Client

        c = Client()
        c.check_version()
        c.open_root()
        say(w, ready=True)
        os.read(r, 1)  # the broker is dead now
        t0 = time.monotonic()
        e = errno_of(lambda: c.attached_ids())
        e_open = errno_of(lambda: os.close(os.open("/dev/nvidiactl", os.O_RDWR)))
        say(w, call_errno=e, call_seconds=round(time.monotonic() - t0, 3), open_errno=e_open)
        os.read(r, 1)  # the broker was restarted
        e2 = errno_of(lambda: c.attached_ids())
        say(w, old_file_after_restart_errno=e2)

    pid, r, w = fork_as(ALICE, fn)
    ready = read_line(r)
    rc = b.stop(signal.SIGKILL)
    os.write(w, b"x")
    after = read_line(r)
    restart_seconds = b.start()
    os.write(w, b"x")
    after_restart = read_line(r)
    reap(pid)
    os.close(r)
    os.close(w)
    emit("broker_death", ready=ready, broker_rc=rc, **after, **after_restart)
    p = run_as(ALICE, [TENANT_PY, "-m", "devbroker.tools.probe", "--json"])
    emit("broker_restart", rc=p.returncode, report=_json(p.stdout), stderr=p.stderr[-2000:],
         restart_seconds=round(restart_seconds, 2))


def _json(text: str):
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def checks(frontend: str, run: Path, smi: bool) -> int:
    run.mkdir(parents=True, exist_ok=True)
    b = BrokerProc(frontend, run)
    try:
        emit("broker_start", seconds=round(b.start(), 2))
    except RuntimeError as e:
        emit("broker_start", error=str(e))
        return 1
    steps = [("nodes", lambda: check_nodes(frontend)), ("open", check_open),
             ("probe", lambda: check_probe(b)), ("quota", lambda: check_quota(b)),
             ("refusals", lambda: check_refusals(b)), ("uvm", check_uvm),
             ("kill", lambda: check_kill(b)), ("concurrent", lambda: check_concurrent(b))]
    if smi:
        steps.append(("smi", lambda: check_smi(b, frontend)))
    steps.append(("broker_death", lambda: check_broker_death(b, frontend)))
    for name, fn in steps:
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # one broken step must not hide the others' results
            import traceback

            emit(name, crashed=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
        print(f"step {name}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    emit("broker_stop", rc=b.stop(), log=b.tail()[-1500:])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serve", "checks"])
    ap.add_argument("--frontend", choices=["kmod", "cuse"], required=True)
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--smi", action="store_true")
    ap.add_argument("--policy", type=Path, help="serve: this policy file instead of POLICY")
    a = ap.parse_args(argv)
    if a.mode == "serve":
        return serve(a.frontend, a.dir, a.policy)
    return checks(a.frontend, a.dir, a.smi)


if __name__ == "__main__":
    sys.exit(main())
