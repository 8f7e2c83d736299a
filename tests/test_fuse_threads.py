"""The FUSE front end's reader threads, with real processes on a real mount.

Ioctls on node files are answered on the reader thread that read them, tenant memory touched
there directly (MemoryGate.direct, or the native loop's own accesses); a watchdog keeps the
gate's deadline. Each test runs with both reader loops (the native one and the Python one).
What must hold:

1. A tenant whose nested pointer leads into a userfaultfd page nobody serves gets EFAULT at
   the deadline, with an audit record naming it; meanwhile another tenant's ioctls are
   answered (the watchdog starts another reader); once the page is released, the stalled
   thread returns and the tenant's stall count goes back to 0.
2. Many processes of two tenants calling at once all get right answers (the caller cache,
   the fair queue and the hand-overs under load).
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest
import trio

from devbroker.backends.emulated import EmulatedBackend, EmulatedGpu
from devbroker.broker.audit import AuditLog
from devbroker.broker.core import Broker
from devbroker.broker.policy import load_policy_text
from devbroker.daemon import tenant_tree
from devbroker.frontends import fusenative
from devbroker.frontends.fuse import FuseFrontend

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="FUSE mounts need root")


@pytest.fixture(autouse=True, params=["native", "python"])
def reader_loop(request, monkeypatch):
    """Each test with both reader loops: the native one (frontends/fusenative.py, the
    default) and the Python one (DEVBROKER_FUSE_NATIVE=0, where no library can be built)."""
    monkeypatch.setenv("DEVBROKER_FUSE_NATIVE", "1" if request.param == "native" else "0")
    return request.param

POLICY = """
[broker]
backend = "emulated"
driver_version = "580.159.04"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "GPU-14141414-2222-3333-4444-555555555555"
pci_bus_id = "0000:00:06.0"
memory = "141GiB"

[tenant.alice]
gpus = [0]
memory_quota = "16GiB"
rate_limit = { requests_per_second = 1000000, burst = 1000000 }

[tenant.bob]
gpus = [0]
memory_quota = "8GiB"
rate_limit = { requests_per_second = 1000000, burst = 1000000 }
"""

# A tenant (run as root outside any sandbox: userfaultfd for kernel-mode faults needs
# CAP_SYS_PTRACE) whose FB_GET_INFO_V2 parameters are a userfaultfd page nobody serves.
from stallers import STALLER  # noqa: E402  (the program, shared with test_fastlane)


CALLER = r"""
import json, sys, time
from devbroker.tools.hotpath import FB_GET_INFO_V2, OneCall
c = OneCall(sys.argv[1], False)
n, want = int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None
spec = c.client.abi.control(FB_GET_INFO_V2).params
for _ in range(n):
    c.check()  # NV_OK
    total = spec.decode(c.params.raw[:spec.size]).fbInfoList[0].data  # TOTAL_RAM_SIZE, KiB
    if want is not None and total != want:
        raise SystemExit(f"total {total} KiB, want {want}")
print(json.dumps({"what": "done", "n": n, "t": time.monotonic()}), flush=True)
"""


def _env():
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.path.abspath(src) + os.pathsep + env.get("PYTHONPATH", "")
    return env


async def _with_mount(tmp_path, body, *, deadline: float = 2.0, lane_calls: bool = True):
    audit_path = tmp_path / "audit.log"
    emu = EmulatedBackend([EmulatedGpu(index=0, name="NVIDIA H200",
                                       uuid="GPU-14141414-2222-3333-4444-555555555555",
                                       pci_bus_id="0000:00:06.0", memory_bytes=141 << 30)],
                          version="580.159.04")
    broker = Broker(load_policy_text(POLICY, "test"), emu, AuditLog(audit_path))
    broker.memgate.deadline = deadline
    native = os.environ.get("DEVBROKER_FUSE_NATIVE") != "0"
    async with FuseFrontend(tmp_path / "nodes", broker) as fe:
        assert (fe._native is not None) == native, fusenative.describe()
        fe.set_tree(tenant_tree(broker))
        async with trio.open_nursery() as n:
            broker.set_spawner(n.start_soon)
            await body(broker, fe, tmp_path / "nodes")
            n.cancel_scope.cancel()
        # the loop under test answered the lane's calls (none answered natively otherwise)
        if lane_calls:
            assert (fe.native_lane_calls > 0) == native, fe.native_lane_calls
    if not audit_path.exists():  # nothing was audited
        return []
    return [json.loads(line) for line in audit_path.read_text().splitlines()]


def _line(p: subprocess.Popen) -> dict:
    line = p.stdout.readline()
    assert line, f"the tenant ended (rc {p.poll()})"
    return json.loads(line)


async def test_a_stalled_tenant_page_is_refused_at_the_deadline_and_stalls_nobody(tmp_path):
    result = {}

    async def body(broker, fe, nodes):
        staller = subprocess.Popen([sys.executable, "-c", STALLER, str(nodes / "alice")],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env=_env())
        try:
            calling = await trio.to_thread.run_sync(_line, staller)
            assert calling["what"] == "calling"
            # While alice's call waits on her page: bob is answered, many times.
            bob = await trio.to_thread.run_sync(lambda: subprocess.run(
                [sys.executable, "-c", CALLER, str(nodes / "bob"), "200"],
                capture_output=True, text=True, env=_env(), timeout=60))
            assert bob.returncode == 0, bob.stderr
            bob_done = json.loads(bob.stdout.strip().splitlines()[-1])
            answered = await trio.to_thread.run_sync(_line, staller)
            assert answered["what"] == "answered"
            result["alice_errno"] = answered["errno"]
            result["bob_before_alice"] = bob_done["t"] < answered["t"]
            result["stalled_while_held"] = broker.memgate.stalled.get("alice", 0)
            staller.stdin.write("go\n")
            staller.stdin.flush()
            assert (await trio.to_thread.run_sync(_line, staller))["what"] == "released"
            # The stalled thread comes back: the stall is no longer counted.
            for _ in range(200):
                if not broker.memgate.stalled.get("alice", 0):
                    break
                await trio.sleep(0.05)
            result["stalled_after"] = broker.memgate.stalled.get("alice", 0)
            # and alice is served again like anyone
            again = await trio.to_thread.run_sync(lambda: subprocess.run(
                [sys.executable, "-c", CALLER, str(nodes / "alice"), "5"],
                capture_output=True, text=True, env=_env(), timeout=60))
            result["alice_again"] = again.returncode
        finally:
            staller.kill()
            staller.wait()

    records = await _with_mount(tmp_path, body, deadline=3.0)
    assert result["alice_errno"] == 14  # EFAULT
    assert result["bob_before_alice"]
    assert result["stalled_while_held"] == 1
    assert result["stalled_after"] == 0
    assert result["alice_again"] == 0
    late = [r for r in records if r.get("event") == "deny" and r.get("tenant") == "alice"
            and "did not complete within" in r.get("reason", "")]
    assert late, records
    assert any(r.get("tenant") == "alice" and "returned after" in r.get("message", "")
               for r in records), records


DECLINED = r"""
import json, sys
from devbroker.tools.hotpath import OneCall
c = OneCall(sys.argv[1], False)
c.arg[4:8] = (0xDEAD).to_bytes(4, "little")  # hObject: no object of this tenant's
statuses = set()
for _ in range(int(sys.argv[2])):
    c.call()
    statuses.add(int.from_bytes(c.arg[28:32], "little"))
print(json.dumps({"statuses": sorted(statuses)}), flush=True)
"""


async def test_a_call_the_lane_declines_is_asked_once_and_decided_by_the_general_steps(
        tmp_path):
    """A control on an object the tenant does not have: the lane declines it (one
    admission asked per call, whichever loop reads it) and the general steps answer it with
    NV_ERR_INVALID_OBJECT_HANDLE (0x33), the driver's answer and the emulator's."""
    asked = []
    out = {}

    async def body(broker, fe, nodes):
        admit = fe._lane.admit

        def counting(session, caller, cmd, hdr, *a, **kw):
            if hdr[4:8] == (0xDEAD).to_bytes(4, "little"):
                asked.append(cmd)
            return admit(session, caller, cmd, hdr, *a, **kw)

        fe._lane.admit = counting
        r = await trio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-c", DECLINED, str(nodes / "alice"), "40"],
            capture_output=True, text=True, env=_env(), timeout=60))
        assert r.returncode == 0, r.stderr
        out.update(json.loads(r.stdout.strip().splitlines()[-1]))

    await _with_mount(tmp_path, body, lane_calls=False)
    assert out["statuses"] == [0x33]
    assert len(asked) == 40, len(asked)


async def test_many_processes_of_two_tenants_all_get_right_answers(tmp_path):
    """Six processes per tenant calling at once: every answer is NV_OK and shows the
    caller's own tenant's quota (16 GiB for alice, 8 GiB for bob), never the other's."""
    rcs = {}

    async def body(broker, fe, nodes):
        quota_kib = {"alice": 16 << 20, "bob": 8 << 20}
        procs = [(t, subprocess.Popen([sys.executable, "-c", CALLER, str(nodes / t), "150",
                                       str(quota_kib[t])],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=_env()))
                 for _ in range(6) for t in ("alice", "bob")]
        for i, (t, p) in enumerate(procs):
            out, err = await trio.to_thread.run_sync(p.communicate)
            rcs[(t, i)] = (p.returncode, err[-500:])

    await _with_mount(tmp_path, body)
    assert len(rcs) == 12
    assert all(rc == 0 for rc, _ in rcs.values()), rcs


async def test_a_request_handed_over_as_the_front_end_closes_is_answered_eio(tmp_path):
    """A reader thread hands a request to the trio thread just as the front end's nursery
    closes (seen in CI: a tenant holding pages of the broker's own mount met the broker's
    SIGTERM). The request is answered EIO and the trio run goes on: a run_sync_soon callback
    that raised ended the whole run before (TrioInternalError, the broker exiting 1)."""
    from devbroker.frontends import fusewire as w

    emu = EmulatedBackend([EmulatedGpu(index=0, name="NVIDIA H200",
                                       uuid="GPU-14141414-2222-3333-4444-555555555555",
                                       pci_bus_id="0000:00:06.0", memory_bytes=141 << 30)],
                          version="580.159.04")
    broker = Broker(load_policy_text(POLICY, "test"), emu, AuditLog(tmp_path / "audit.log"))
    fe = FuseFrontend(tmp_path / "unmounted", broker)
    sent: list[bytes] = []
    fe._send = sent.append  # (no /dev/fuse: the reply is what would be written)
    async with trio.open_nursery() as nursery:
        pass
    fe._nursery = nursery  # closed to new tasks now
    opened = w.Open(w.InHeader(40, 14, 77, 5, 0, 0, 1234), flags=os.O_RDWR)
    token = trio.lowlevel.current_trio_token()
    with fe._tlock:
        fe._handed += 1
    # as a reader thread hands requests over: from another thread, through run_sync_soon
    await trio.to_thread.run_sync(
        lambda: token.run_sync_soon(fe._take_handed, fe._dispatch_request, opened))
    await trio.sleep(0.05)
    assert sent == [w.encode_error(77, errno.EIO)]
    assert fe._handed == 0 and fe._inflight == 0 and fe._idle.is_set()


async def test_work_a_thread_hands_to_trio_cannot_end_the_run(tmp_path, caplog):
    """Front ends hand work from their threads to the trio loop (common.to_trio), and the
    broker starts background tasks from listener threads (Broker._start_soon): an exception
    in such a callback used to end the whole trio run — every tenant's broker. Now it is
    logged and the run goes on: a callback that raises, a task offered to a nursery that
    has closed (the broker stopping) and one offered while it is open."""
    import logging

    from devbroker.frontends.common import to_trio

    token = trio.lowlevel.current_trio_token()

    def boom():
        raise ValueError("a bug in handed-over work")

    with caplog.at_level(logging.ERROR, logger="devbroker.frontends"):
        assert await trio.to_thread.run_sync(lambda: to_trio(token, boom))
        await trio.sleep(0.05)
    assert "a bug in handed-over work" in caplog.text

    emu = EmulatedBackend([EmulatedGpu(index=0, name="NVIDIA H200",
                                       uuid="GPU-14141414-2222-3333-4444-555555555555",
                                       pci_bus_id="0000:00:06.0", memory_bytes=141 << 30)],
                          version="580.159.04")
    broker = Broker(load_policy_text(POLICY, "test"), emu, AuditLog(tmp_path / "audit.log"))
    ran = []

    async def job():
        ran.append(1)

    async with trio.open_nursery() as nursery:
        broker.set_spawner(nursery.start_soon)
        await trio.to_thread.run_sync(broker._start_soon, job)
        await trio.sleep(0.05)
    assert ran == [1]
    # the nursery has closed: the next offer is dropped with a warning, the run goes on
    await trio.to_thread.run_sync(broker._start_soon, job)
    await trio.sleep(0.05)
    assert ran == [1]


def test_extra_reader_threads_coming_back_together_leave_one_to_read():
    """As the seccomp listener threads (test_seccomp_frontend.py): extra FUSE reader threads
    the watchdog started while every reader was held up come back together; each asks
    `_surplus` before any has counted itself out, and exactly the surplus retires."""
    import threading

    fe = FuseFrontend.__new__(FuseFrontend)
    fe.threads, fe._serving, fe._tlock, fe._spare_until = 1, {}, threading.Lock(), 0.0
    for live, leave in ((2, 1), (3, 2), (1, 0)):
        fe._live, fe._leaving = live, 0
        said = []
        for _ in range(live):
            t = threading.Thread(target=lambda: said.append(fe._surplus()))
            t.start()
            t.join()
        assert said.count(True) == leave, (live, said)
        assert fe._live - fe._leaving == fe.threads
