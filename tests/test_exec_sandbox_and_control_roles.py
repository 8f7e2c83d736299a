"""What `devbroker exec` confines and the control socket's roles, with real brokers, real `devbroker exec` tenants
and real processes of other uids and pid namespaces.

Attacks by root tenants, each shown to fail:
- a root tenant writes a host file (it patched a broker source file the broker later
  imported): the host file system is read-only to every tenant, root or not;
- a root tenant reaches another broker's control socket and applies a policy: the socket is
  not in its view, and a caller outside the broker's pid namespace gets no role anyway;
- a root tenant appends forged lines to an audit log kept outside the run dir: the file is
  covered and read-only.
And what `devbroker exec` gives instead: a private /tmp, `--bind SRC[:DST][:rw]`, a non-root
default uid. The control socket's two roles are checked with processes of different uids.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from devbroker.testing.policies import one_h200, tenant

from tenant_io import lines

pytestmark = pytest.mark.root

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"

POLICY = one_h200(tenant("alice", memory_quota="1GiB"), driver_version=None)

# Runs inside the tenant: each attempt by name, its errno name or "ok" (and what it read).
ATTEMPTS = r'''
import errno, json, os, socket, sys
def attempt(what, fn):
    try:
        got = fn()
        print(json.dumps({"what": what, "result": "ok", "got": got}), flush=True)
    except OSError as e:
        print(json.dumps({"what": what, "result": errno.errorcode.get(e.errno, str(e.errno))}),
              flush=True)
def append(path, text):
    with open(path, "a") as f:
        f.write(text)
def read(path):
    with open(path) as f:
        return f.read()
def control(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(b'{"op": "policy.apply", "text": "", "name": "forged"}\n')
    return s.recv(65536).decode()
for arg in sys.argv[1:]:
    kind, _, path = arg.partition("=")
    if kind == "append":
        attempt(arg, lambda: append(path, "forged\n"))
    elif kind == "create":
        attempt(arg, lambda: append(path, "planted\n"))
    elif kind == "read":
        attempt(arg, lambda: read(path))
    elif kind == "control":
        attempt(arg, lambda: control(path))
    elif kind == "id":
        attempt(arg, lambda: [os.getuid(), os.getgid()])
    elif kind == "listdir":
        attempt(arg, lambda: sorted(os.listdir(path)))
    elif kind == "open":  # a device node, opened read-only: "ok" only if it opens
        attempt(arg, lambda: os.close(os.open(path, os.O_RDONLY)))
'''


def attempts(broker, *what: str, uid: int | None = 0, opts: tuple = (),
             python: str = sys.executable, cwd: str | None = None) -> dict[str, dict]:
    extra = (*opts, "--cwd", cwd) if cwd else opts
    r = broker.exec("alice", python, "-c", ATTEMPTS, *what, uid=uid, opts=extra)
    assert r.returncode == 0, r.stdout + r.stderr
    return {x["what"]: x for x in lines(r.stdout)}


@pytest.fixture
def host_dir():
    """A directory on the host outside /tmp (the tenant's /tmp is its own, which would make
    a file under the host's /tmp unreachable for a reason other than the one tested)."""
    d = Path(tempfile.mkdtemp(prefix="devbroker-test-", dir="/var/tmp"))
    d.chmod(0o755)
    yield d
    # (set up before start_broker where a broker runs in it: it is removed after the broker)
    subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)


def test_root_tenant_cannot_write_the_host_file_system(start_broker, host_dir):
    broker = start_broker(POLICY)
    source = REPO / "src" / "devbroker" / "broker" / "limits.py"
    before = source.read_bytes()
    mine = f"/tmp/devbroker-test-{os.getpid()}-{time.monotonic_ns()}"
    got = attempts(broker, f"append={source}",
                   f"create={REPO / 'src' / 'devbroker' / 'planted.py'}",
                   f"create={host_dir / 'planted'}", "create=/etc/devbroker-planted",
                   f"create={mine}")
    # The attack this guards against: a broker source file patched from inside a root
    # tenant.
    assert got[f"append={source}"]["result"] == "EROFS"
    assert got[f"create={REPO / 'src' / 'devbroker' / 'planted.py'}"]["result"] == "EROFS"
    assert got[f"create={host_dir / 'planted'}"]["result"] == "EROFS"
    assert got["create=/etc/devbroker-planted"]["result"] == "EROFS"
    assert source.read_bytes() == before
    assert not (REPO / "src" / "devbroker" / "planted.py").exists()
    assert not Path("/etc/devbroker-planted").exists()
    # /tmp is the tenant's own: writable there, and nothing of it reaches the host.
    assert got[f"create={mine}"]["result"] == "ok"
    assert not Path(mine).exists()


def test_tmp_is_private_to_each_tenant(start_broker, host_dir):
    broker = start_broker(POLICY)
    from devbroker.testing.tenant_binds import paths

    marker = Path(tempfile.mkstemp(prefix="host-only-", dir="/tmp")[1])
    # Only what the tests bind in (a checkout under the host's /tmp) may show there, and the
    # private HOME (the test's HOME, root's, is read-only in the tenant's view).
    bound = sorted({p.split("/")[2] for p in paths()} | {"home"})
    try:
        got = attempts(broker, "listdir=/tmp", "create=/tmp/first")
        assert got["listdir=/tmp"]["got"] == bound  # nothing else of the host's /tmp
        assert marker.name not in got["listdir=/tmp"]["got"]
        # A second tenant process does not find the first one's file either.
        again = attempts(broker, "listdir=/tmp")
        assert again["listdir=/tmp"]["got"] == bound
        assert not Path("/tmp/first").exists()
    finally:
        marker.unlink()


def test_home_is_writable_private_unless_bound_rw(start_broker, host_dir):
    """The host's HOME is read-only in the tenant's view: programs that cache under it
    (CuPy failed so on the H200) get a private HOME in the tenant's /tmp; a HOME bound rw
    stays the command's HOME."""
    broker = start_broker(POLICY)
    script = 'echo "$HOME"; touch "$HOME/.cache-probe" && echo wrote'
    r = broker.exec("alice", "sh", "-c", script, env={**os.environ, "HOME": str(host_dir)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["/tmp/home", "wrote"], r.stdout
    assert not (host_dir / ".cache-probe").exists()
    (host_dir / "home").mkdir()
    (host_dir / "home").chmod(0o777)
    r = broker.exec("alice", "sh", "-c", script, env={**os.environ, "HOME": f"{host_dir}/home"},
                    opts=("--bind", f"{host_dir}/home:{host_dir}/home:rw"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"{host_dir}/home", "wrote"], r.stdout
    assert (host_dir / "home" / ".cache-probe").exists()


def test_binds_read_only_unless_rw(start_broker, host_dir):
    broker = start_broker(POLICY)
    (host_dir / "ro").mkdir()
    (host_dir / "ro" / "data").write_text("host data\n")
    (host_dir / "rw").mkdir()
    (host_dir / "rw").chmod(0o777)
    # Targets: under the tenant's /tmp (made there), an existing host directory (/mnt), or
    # the source's own path (no DST).
    got = attempts(broker, "read=/tmp/data/data", "append=/tmp/data/data",
                   "create=/mnt/result", f"read={host_dir}/ro/data", f"append={host_dir}/ro/data",
                   opts=("--bind", f"{host_dir}/ro:/tmp/data", "--bind", f"{host_dir}/rw:/mnt:rw",
                         "--bind", f"{host_dir}/ro"))
    assert got["read=/tmp/data/data"] == {"what": "read=/tmp/data/data", "result": "ok",
                                          "got": "host data\n"}
    assert got["append=/tmp/data/data"]["result"] == "EROFS"
    assert got[f"read={host_dir}/ro/data"]["result"] == "ok"
    assert got[f"append={host_dir}/ro/data"]["result"] == "EROFS"
    assert got["create=/mnt/result"]["result"] == "ok"
    assert (host_dir / "rw" / "result").read_text() == "planted\n"
    assert (host_dir / "ro" / "data").read_text() == "host data\n"
    # A bind target that cannot be made on the read-only host is refused, saying why.
    r = broker.exec("alice", "true", opts=("--bind", f"{host_dir}/ro:/no/such/dir"))
    assert r.returncode == 125 and "read-only" in r.stderr, r.stderr
    r = broker.exec("alice", "true", opts=("--bind", f"{host_dir}/ro:/dev/x"))
    assert r.returncode == 125 and "under /dev" in r.stderr, r.stderr


def test_other_brokers_sockets_and_an_outside_audit_log_are_out_of_reach(start_broker,
                                                                           host_dir):
    audit_dir = host_dir / "log"
    audit = audit_dir / "audit.jsonl"
    mine = start_broker(POLICY, extra=["--audit", str(audit)])
    other = start_broker(POLICY)
    sock = other.run_dir / "control.sock"
    got = attempts(mine, f"control={sock}", f"append={audit}", f"read={audit}",
                   f"control={mine.run_dir / 'control.sock'}",
                   f"control={mine.run_dir / 'seccomp.sock'}")
    assert got[f"control={sock}"]["result"] == "ENOENT"  # the other broker's run dir: covered
    assert got[f"control={mine.run_dir / 'control.sock'}"]["result"] == "ENOENT"
    assert got[f"control={mine.run_dir / 'seccomp.sock'}"]["result"] == "ENOENT"
    assert got[f"append={audit}"]["result"] == "EROFS"
    # Its whole directory is covered: the rotated files beside it too (sandbox/brokers.py)
    assert got[f"read={audit}"]["result"] == "ENOENT"
    records = [json.loads(x) for x in audit.read_text().splitlines()]
    assert records and not any("forged" in json.dumps(r) for r in records)
    # Bound in writable on purpose, the log itself still is not.
    got = attempts(mine, f"append={audit}", opts=("--bind", f"{audit_dir}:{audit_dir}:rw"))
    assert got[f"append={audit}"]["result"] == "EROFS"
    assert other.tenant("alice")["name"] == "alice"  # the other broker is untouched


def test_default_uid_is_not_root(start_broker, tenant_tree):
    broker = start_broker(POLICY)
    cwd = str(tenant_tree)  # where uid 65534 may go
    got = attempts(broker, "id", uid=None, python=SYSTEM_PYTHON, cwd=cwd)
    assert got["id"]["got"] == [65534, 65534]
    env = {**os.environ, "SUDO_UID": "1234", "SUDO_GID": "2345"}
    r = broker.cli("exec", "--tenant", "alice", "--cwd", cwd, "--", SYSTEM_PYTHON, "-c",
                   ATTEMPTS, "id", env=env)
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout)[0]["got"] == [1234, 2345]
    # Not able to enter the caller's directory (the checkout may be under a 0700 home):
    # it starts in / and says why in one line.
    r = broker.cli("exec", "--tenant", "alice", "--", SYSTEM_PYTHON, "-c",
                   "import os; print(os.getcwd())", cwd="/root")
    assert r.returncode == 0 and r.stdout == "/\n", r.stdout + r.stderr
    if os.stat("/root").st_mode & 0o001 == 0:  # /root closed to others, as Debian makes it
        assert r.stderr == ("devbroker exec: running in /: uid 65534 may not enter the "
                            "current directory /root; --uid UID or --cwd DIR chooses\n")


# ------------------------------------------------------------------ the control socket
CLIENT = r'''
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(json.dumps({"connect": e.strerror})); sys.exit(0)
for op in sys.argv[2:]:
    s2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s2.connect(sys.argv[1])
    # An empty policy: an admin gets it refused for what it is, others for who they are.
    req = {"op": op, "text": "", "name": "empty"} if op == "policy.apply" else {"op": op}
    try:
        s2.sendall((json.dumps(req) + "\n").encode())
    except OSError:
        pass  # a caller without a role is answered and closed at accept, unread
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s2.recv(65536)
        if not chunk:
            break
        buf += chunk
    r = json.loads(buf)
    print(json.dumps({"op": op, "ok": r["ok"], "error": r.get("error", "")}), flush=True)
'''

ROLES = POLICY + """
[control]
readonly_uids = [1001]
admin_uids = [1002]
"""


def ask(sock: Path, *ops: str, uid: int = 0, pidns: bool = False) -> dict[str, dict]:
    cmd = [SYSTEM_PYTHON, "-c", CLIENT, str(sock), *ops]
    if pidns:
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, user=uid,
                       cwd="/")
    assert r.returncode == 0, r.stderr
    out = [json.loads(x) for x in r.stdout.splitlines()]
    return {x.get("op", "connect"): x for x in out}


def test_control_socket_roles_by_credentials(host_dir, start_broker):
    # In a directory other uids may pass through (pytest's tmp is root's alone).
    broker = start_broker(ROLES, run_dir=host_dir / "run")
    sock = broker.run_dir / "control.sock"
    # Others may reach the socket now (each caller is checked), but nothing else of the run
    # dir: the FUSE mount's root is root's alone.
    assert (sock.stat().st_mode & 0o777, broker.run_dir.stat().st_mode & 0o777) == (0o666,
                                                                                    0o711)
    root = ask(sock, "status", "policy.apply")
    assert root["status"]["ok"]
    # root is admin: the (empty) policy is parsed and refused for what it is, not for who
    assert not root["policy.apply"]["ok"] and "policy refused" in root["policy.apply"]["error"]
    tenant_ops = ("tenant.add", "tenant.set", "tenant.rm", "tenant.list")
    reader = ask(sock, "status", "policy.show", "policy.apply", "tenant.dir", *tenant_ops,
                 uid=1001)
    assert reader["status"]["ok"] and reader["policy.show"]["ok"]
    for op in ("policy.apply", "tenant.dir", *tenant_ops):
        assert reader[op]["error"] == f"permission denied: role read may not {op}"
    admin = ask(sock, "status", "policy.apply", uid=1002)
    assert admin["status"]["ok"] and "policy refused" in admin["policy.apply"]["error"]
    nobody = ask(sock, "status", uid=1003)
    assert nobody["status"]["error"] == "permission denied: uid 1003 has no control role"
    # Root of another pid namespace (a tenant's, a container's) gets no role at all.
    tenant_root = ask(sock, "status", "policy.apply", pidns=True)
    assert tenant_root["status"]["error"] == ("permission denied: not in the broker's pid "
                                              "namespace")
    assert tenant_root["policy.apply"]["error"] == tenant_root["status"]["error"]
    refused = [a for a in broker.audit() if a["event"] == "control-refused"]
    # Callers without a role are refused at accept, before their request is read.
    assert {(a["uid"], a["op"]) for a in refused} == {
        (1001, "policy.apply"), (1001, "tenant.dir"), (1003, "connect"), (0, "connect"),
        *((1001, op) for op in tenant_ops)}
    # The nodes stay root's: a reader cannot walk into the mount to a tenant's node.
    r = subprocess.run([SYSTEM_PYTHON, "-c", "import os,sys; os.open(sys.argv[1], os.O_RDWR)",
                        str(broker.run_dir / "nodes" / "alice" / "nvidiactl")],
                       capture_output=True, text=True, user=1001, cwd="/")
    assert "PermissionError" in r.stderr, r.stderr


def test_default_control_socket_is_roots_alone(host_dir, start_broker):
    broker = start_broker(POLICY, run_dir=host_dir / "run")
    sock = broker.run_dir / "control.sock"
    assert (sock.stat().st_mode & 0o777, broker.run_dir.stat().st_mode & 0o777) == (0o600,
                                                                                    0o700)
    assert ask(sock, "status", uid=1001) == {"connect": {"connect": "Permission denied"}}
    assert ask(sock, "status")["status"]["ok"]


# Opens connections as one uid and reports what the broker did with each.
HOLDER = r'''
import json, socket, sys
path, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def reply(s):
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf.decode()
held = []
for i in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    if mode == "hold":  # a request never finished: the connection stays open
        s.sendall(b"{")
        held.append(s)
        continue
    try:  # 8 KiB of request without a newline, then nothing more to send
        s.sendall(b" " * 8192)
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    print(json.dumps({"i": i, "reply": reply(s)}), flush=True)
if mode == "hold":
    print(json.dumps({"held": len(held)}), flush=True)
    sys.stdin.read()  # until the test says so
'''


def test_control_socket_bounds_callers_before_reading(host_dir, start_broker):
    broker = start_broker(ROLES, run_dir=host_dir / "run")
    sock = str(broker.run_dir / "control.sock")

    def flood(uid: int, n: int) -> list[str]:
        r = subprocess.run([SYSTEM_PYTHON, "-c", HOLDER, sock, "send", str(n)],
                           capture_output=True, text=True, timeout=120, user=uid, cwd="/")
        assert r.returncode == 0, r.stderr
        return [json.loads(x)["reply"] for x in r.stdout.splitlines()]

    # A uid without a role is answered and closed at accept: none of its bytes are read
    # (they used to be buffered up to 1 MiB per connection, for 10 s each).
    for got in flood(1003, 20):
        assert json.loads(got) == {"ok": False,
                                   "error": "permission denied: uid 1003 has no control role"}
    # A reader's request line is capped small (policy texts are an admin's).
    for got in flood(1001, 2):
        assert json.loads(got) == {"ok": False, "error": "request too large"}
    # A reader holding connections open gets MAX_PER_UID of them served; the rest are closed
    # at accept, and the operator is still answered.
    from devbroker.broker.control import MAX_PER_UID

    holder = subprocess.Popen([SYSTEM_PYTHON, "-c", HOLDER, sock, "hold", str(MAX_PER_UID + 4)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              user=1001, cwd="/")
    try:
        assert json.loads(holder.stdout.readline()) == {"held": MAX_PER_UID + 4}
        assert broker.status()["ok"]
        assert ask(sock, "status", uid=1002)["status"]["ok"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    refused = [a for a in broker.audit() if a["event"] == "control-refused"]
    assert {a["op"] for a in refused if a["uid"] == 1003} == {"connect"}
    # paced: at most REFUSALS_PER_UID records a second for one uid, the rest counted
    assert len([a for a in refused if a["uid"] == 1003]) < 20
    assert [a for a in refused if a["uid"] == 1001
            and a["reason"].startswith("too many connections open for uid 1001")]


def test_every_brokers_files_are_hidden_whatever_its_front_end(start_broker, host_dir):
    """A root tenant of one broker reads nothing of another broker that has no FUSE mount
    (--frontend seccomp: its run dir used to stay in the tenant's view), nor any rotated
    file of its own broker's audit log, and no device node in the host's tree opens for it
    (a real backend's spare driver nodes sat on a tmpfs without nodev)."""
    other = start_broker(POLICY, run_dir=host_dir / "other", extra=["--frontend", "seccomp"])
    logs = host_dir / "logs"
    mine = start_broker(POLICY, run_dir=host_dir / "mine", extra=["--audit",
                                                                  str(logs / "audit.jsonl")])
    rotated = logs / "audit.jsonl.1"  # what a rotation leaves beside the live file
    rotated.write_text('{"event": "deny", "tenant": "bob", "secret": "OTHER-TENANTS"}\n')
    rotated.chmod(0o600)
    node = host_dir / "node"  # a character device node in the host's tree (here /dev/null's)
    os.mknod(node, 0o600 | 0o020000, os.makedev(1, 3))
    got = attempts(mine, f"listdir={other.run_dir}", f"read={other.run_dir / 'audit.log'}",
                   f"control={other.run_dir / 'control.sock'}", f"read={rotated}",
                   f"read={logs / 'audit.jsonl'}", f"open={node}")
    assert got[f"listdir={other.run_dir}"] == {"what": f"listdir={other.run_dir}",
                                               "result": "ok", "got": []}
    assert got[f"read={other.run_dir / 'audit.log'}"]["result"] == "ENOENT"
    assert got[f"control={other.run_dir / 'control.sock'}"]["result"] == "ENOENT"
    assert got[f"read={rotated}"]["result"] == "ENOENT"
    assert got[f"read={logs / 'audit.jsonl'}"]["result"] == "ENOENT"
    assert got[f"open={node}"]["result"] == "EACCES"
    # The brokers wrote down where they are, for every sandbox; gone when they stop.
    from devbroker.sandbox import brokers

    hidden = brokers.paths_to_hide()
    assert str(other.run_dir.resolve()) in hidden and str(logs.resolve()) in hidden
    other.stop()
    assert str(other.run_dir.resolve()) not in brokers.paths_to_hide()


# Maps, in a FUSE tenant, a memfd named as the seccomp front end names its placeholders
# (what another tenant's placeholder passed over a socket is) and one of its own.
MAP_MEMFDS = r'''
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_long
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
out = {}
for name in ("devbroker:nvidiactl", "scratch"):
    fd = os.memfd_create(name)
    os.pwrite(fd, b"PAGE-OF-" + name.encode(), 0)
    os.ftruncate(fd, 4096)
    r = libc.mmap(None, 4096, 3, 1, fd, 0)  # PROT_RW, MAP_SHARED
    out[name] = ctypes.get_errno() if r == -1 else ctypes.string_at(r, 8 + len(name)).decode()
out["pid"] = os.getpid()
print(json.dumps(out))
'''


def test_a_fuse_tenant_cannot_map_a_seccomp_tenants_placeholder(start_broker):
    """A seccomp tenant's node file is a memfd placeholder; passed to a FUSE tenant (fds
    cross any socket both reach), the FUSE front end never sees its mapping. The FUSE
    sandbox's stat shim now gets file mappings too and refuses a placeholder EACCES, with
    the record in the broker's audit log; a memfd of the tenant's own maps as before."""
    broker = start_broker(POLICY)
    r = broker.exec("alice", sys.executable, "-c", MAP_MEMFDS)
    assert r.returncode == 0, r.stdout + r.stderr
    got = lines(r.stdout)[-1]
    assert got["devbroker:nvidiactl"] == errno.EACCES, got
    assert got["scratch"] == "PAGE-OF-scratch"
    denials = [a for a in broker.audit() if a["event"] == "deny" and a.get("by") == "sandbox"]
    assert [d["tenant"] for d in denials] == ["alice"], denials
    assert denials[0]["what"].startswith("mmap of fd ")
    assert "another tenant's node placeholder" in denials[0]["reason"]
