"""Who may hand a seccomp listener to the broker: decided at accept from the peer's kernel
credentials and pid namespace, before anything it sends is read.

A root tenant of one broker's sandbox (its own pid namespace, uid 0) that can name another
broker's RUN_DIR/oci-seccomp.sock used to hand over a listener of its own naming that
broker's tenant, and was then served as that tenant: the agent checked only the peer's uid,
and only after it had read and parsed the state. The same process from the broker's own pid
namespace (the host's container runtime) still hands over."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from devbroker.testing.policies import one_h200, tenant

POLICY = one_h200(tenant("alice", memory_quota="1GiB"), driver_version=None)

# Makes a seccomp listener in a child (the stat-family filter: the child only waits on a
# pipe) and hands it to the socket as a container runtime would, naming the tenant; or, with
# "junk", sends bytes that are not a state at all.
HAND_OVER = r'''
import json, os, socket, struct, sys
from devbroker.sandbox import seccompwire, statshim
from devbroker.oci.profile import encode_metadata
path, tenant, what = sys.argv[1], sys.argv[2], sys.argv[3]
a, b = socket.socketpair()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    a.close(); os.close(w)
    statshim.install_and_send(b.detach(), seccompwire.build_stat_shim_filter())
    os.read(r, 1)
    os._exit(0)
b.close(); os.close(r)
lfd, _ = statshim.recv_listener(a)
state = {"ociVersion": "1.0.2", "fds": ["seccompFd"], "pid": pid,
         "metadata": encode_metadata("seccomp", tenant),
         "state": {"ociVersion": "1.0.2", "id": "handed-" + what, "status": "creating",
                   "pid": pid, "bundle": "/"}}
data = json.dumps(state).encode() if what == "state" else b"{not json"
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
try:
    s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("=i", lfd))])
except OSError:
    pass  # refused at accept
s.settimeout(10)
try:
    s.recv(1)  # the broker closes when it is done with the connection
except OSError:
    pass
os.write(w, b"x")
os.waitpid(pid, 0)
print("sent")
'''


def _hand_over(broker, what: str, *, own_pidns: bool) -> None:
    cmd = [sys.executable, "-c", HAND_OVER, str(broker.run_dir / "oci-seccomp.sock"),
           "alice", what]
    if own_pidns:
        cmd = ["unshare", "--pid", "--fork", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "sent" in r.stdout, r.stderr


def _record_for(broker, container_or_none, deadline: float = 30.0) -> dict:
    """The broker's record of a hand-over: the container's (attached or refused), or with
    None the first container-refused record without a container."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        for a in broker.audit():
            if a["event"] in ("tenant-attached", "container-refused") and \
                    a.get("container") == container_or_none:
                return a
        time.sleep(0.05)
    raise AssertionError(f"no record for {container_or_none}: {broker.audit()[-5:]}")


@pytest.mark.root
def test_hand_over_from_another_pid_namespace_is_refused_unread(start_broker):
    broker = start_broker(POLICY)
    # A root process in a pid namespace of its own (what every tenant and container is):
    # refused at accept, its state never parsed (the junk is not reported as bad JSON).
    _hand_over(broker, "state", own_pidns=True)
    rec = _record_for(broker, None)
    assert rec["event"] == "container-refused"
    assert "pid namespace" in rec["reason"] and rec["uid"] == 0, rec
    _hand_over(broker, "junk", own_pidns=True)
    assert not [a for a in broker.audit() if "not JSON" in a.get("reason", "")]
    assert not [a for a in broker.audit() if a["event"] == "tenant-attached"]
    # The host's runtime (root, the broker's pid namespace) still hands over.
    _hand_over(broker, "state", own_pidns=False)
    rec = _record_for(broker, "handed-state")
    assert rec["event"] == "tenant-attached" and rec["tenant"] == "alice", rec
