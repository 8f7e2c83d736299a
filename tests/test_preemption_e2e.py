"""Priority preemption through `devbroker run` with real tenant processes (`devbroker exec`,
both front ends: FUSE node files and seccomp notification) on an emulated 8 GiB H200: a high
tenant's allocation that does not fit checkpoints the low tenant, whose calls then wait until
it is restored when the high tenant exits; refusals keep the driver's out-of-memory answer;
the operator's preempt/resume; a live upgrade and a broker's death during a preemption."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devbroker.abi import status as nvs
from devbroker.testing.policies import h200s, tenant
from tenant_io import readline_json

pytestmark = pytest.mark.root

PROG = str(Path(__file__).with_name("preempt_prog.py"))
ENOMEM_STATUS = nvs.NV_ERR_NO_MEMORY


def policy(host_memory: str = "64GiB") -> str:
    return "\n".join([
        h200s(1, memory="8GiB"),
        f'[broker.preemption]\nenabled = true\nhost_memory = "{host_memory}"\nwait = 30\n'
        "lock_timeout = 5\n",
        tenant("low", memory_quota="8GiB", priority="low", preemptible=True),
        tenant("high", memory_quota="8GiB", priority="high"),
    ])


@pytest.fixture(params=["fuse", "seccomp"])
def start(start_broker, request):
    def go(text: str):
        b = start_broker(text)
        b.frontend = request.param
        return b
    return go


CLIENTS = {"low": "0xC1D00001", "high": "0xC1D00002"}


def spawn(b, name: str):
    p = b.exec_popen(name, sys.executable, PROG, CLIENTS[name], stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = readline_json(p)
    assert first["ready"] == [0, nvs.NV_OK, 0, nvs.NV_OK], first
    return p


def send(p, line: str) -> None:
    p.stdin.write(line + "\n")
    p.stdin.flush()


def ask(p, line: str) -> list:
    send(p, line)
    return readline_json(p)


def quit_(p) -> None:
    try:
        p.stdin.write("quit\n")
        p.stdin.close()
    except BrokenPipeError:
        pass
    assert p.wait(timeout=60) == 0, p.stderr.read()


def until(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not seen within {timeout} s: {what}")


def preemption(b) -> dict:
    return b.status()["preemption"]


def test_high_allocation_preempts_the_low_tenant_which_returns_when_it_exits(start):
    b = start(policy())
    low = spawn(b, "low")
    try:
        assert ask(low, "alloc 6144 0xC0") == [0, nvs.NV_OK]
        high = spawn(b, "high")
        try:
            # fits the high tenant's quota, not the GPU: answered after the low tenant left
            assert ask(high, "alloc 4096 0xC0") == [0, nvs.NV_OK]
            assert preemption(b)["tenants"]["low"]["state"] == "preempted"
            assert b.tenant("low")["preempted"] == "preempted"
            out = b.cli("status").stdout
            assert "PREEMPTED (preempted)" in out, out
            top = b.cli("top", "--once").stdout
            assert "PREEMPTED (preempted)" in next(x for x in top.splitlines()
                                                   if x.startswith("low ")), top
            # the preempted tenant's call waits (held by the broker), it does not fail
            send(low, "alloc 2 0xC1")
            until(lambda: preemption(b)["calls_held"].get("low"), "the low tenant's call held")
            assert b.tenant("low")["preempted"] == "preempted"
        finally:
            quit_(high)
        # its room is free again: restored, and the held call answered
        assert readline_json(low) == [0, nvs.NV_OK]
        assert b.tenant("low")["preempted"] is None
        assert b.tenant("low")["memory"]["0"]["used"] == (6144 << 20) + (2 << 20)
    finally:
        quit_(low)
    audit = b.audit()
    pre = [a for a in audit if a["event"] == "checkpoint"]
    assert [(a["tenant"], a["by"], a["bytes"]) for a in pre] == [("low", "high", 6144 << 20)]
    assert [a["tenant"] for a in audit if a["event"] == "restore"] == ["low"]
    assert not [a for a in audit if a["event"] == "error"]


def test_no_preemption_beyond_the_host_budget_gives_the_drivers_out_of_memory(start):
    b = start(policy(host_memory="4GiB"))
    low, high = spawn(b, "low"), None
    try:
        assert ask(low, "alloc 6144 0xC0") == [0, nvs.NV_OK]
        high = spawn(b, "high")
        assert ask(high, "alloc 4096 0xC0") == [0, ENOMEM_STATUS]
        assert preemption(b)["tenants"] == {}
        assert ask(low, "alloc 2 0xC1") == [0, nvs.NV_OK]  # never stopped
    finally:
        quit_(low)
        if high is not None:
            quit_(high)
    refused = [a for a in b.audit() if a["event"] == "checkpoint_refused"]
    assert refused and "exceed the host memory left for checkpoints" in refused[0]["reason"]
    assert refused[0]["tenant"] == "high"


def test_the_operator_preempts_and_resumes_by_hand(start):
    b = start(policy())
    low = spawn(b, "low")
    try:
        assert ask(low, "alloc 1024 0xC0") == [0, nvs.NV_OK]
        r = b.cli("preempt", "low")
        assert r.returncode == 0, r.stderr
        assert "tenant low preempted: 1 GiB of device memory of 1 process(es)" in r.stdout
        assert b.tenant("low")["preempted"] == "preempted"
        r = b.cli("preempt", "low")  # twice: refused with the reason
        assert r.returncode == 1 and "already preempted" in r.stderr
        assert b.cli("preempt", "nobody").returncode == 1
        # a control the lanes would answer themselves waits too (they decline it now)
        send(low, "control")
        until(lambda: preemption(b)["calls_held"].get("low"), "the low tenant's call held")
        r = b.cli("resume", "low")
        assert r.returncode == 0 and "tenant low resumed" in r.stdout, r.stderr
        assert readline_json(low) == [0, nvs.NV_OK]
        assert b.tenant("low")["preempted"] is None
        assert ask(low, "alloc 2 0xC1") == [0, nvs.NV_OK]
    finally:
        quit_(low)


def preempt_low(b):
    """The low tenant holding 6 GiB, preempted by the high tenant's 4 GiB."""
    low = spawn(b, "low")
    assert ask(low, "alloc 6144 0xC0") == [0, nvs.NV_OK]
    high = spawn(b, "high")
    assert ask(high, "alloc 4096 0xC0") == [0, nvs.NV_OK]
    assert preemption(b)["tenants"]["low"]["state"] == "preempted"
    return low, high


def test_a_live_upgrade_carries_a_preemption(start):
    """A preempted tenant is handed over as it is and restored by the successor; while the
    broker holds one of its calls, an upgrade is refused with the reason (only this broker
    can answer that call) and nothing changes."""
    b = start(policy())
    low, high = preempt_low(b)
    successor = None
    try:
        r = b.cli("upgrade", "--json", timeout=200)
        assert r.returncode == 0, r.stderr + b.output()
        successor = json.loads(r.stdout)["pid"]
        assert b.proc.wait(timeout=30) == 0
        assert b.status()["pid"] == successor
        assert preemption(b)["tenants"]["low"]["state"] == "preempted"
        send(low, "alloc 2 0xC1")
        until(lambda: preemption(b)["calls_held"].get("low"), "the low tenant's call held")
        r = b.cli("upgrade", "--json", timeout=200)
        assert r.returncode != 0
        assert "tenant low is preempted and 1 of its calls wait in this broker" in r.stderr
        assert b.status()["pid"] == successor
        quit_(high)
        assert readline_json(low) == [0, nvs.NV_OK]  # restored by the successor
        assert b.tenant("low")["preempted"] is None
        quit_(low)
        assert [a["tenant"] for a in b.audit() if a["event"] == "restore"] == ["low"]
    finally:
        if successor is not None:
            try:
                os.kill(successor, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in (low, high):
            if p.poll() is None:
                p.kill()


def test_a_broker_that_dies_during_a_preemption_leaves_no_tenant_waiting(start):
    """The preempted tenant's held call fails when the broker is gone (its nodes or its
    listener with it), as any call does then: the process is not left waiting forever."""
    b = start(policy())
    low, high = preempt_low(b)
    try:
        send(low, "alloc 2 0xC1")
        until(lambda: preemption(b)["calls_held"].get("low"), "the low tenant's call held")
        b.proc.kill()
        b.proc.wait(timeout=30)
        err, _status = readline_json(low)
        assert err != 0  # ENOTCONN (FUSE) or ENOSYS (no listener): failed, not hung
    finally:
        for p in (low, high):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def test_devbroker_migrate_moves_a_tenant_to_another_of_its_gpus(start):
    b = start("\n".join([
        h200s(2, memory="8GiB"), "[broker.preemption]\nenabled = true\n",
        tenant("low", gpus=[0, 1], memory_quota="8GiB")]))
    low = spawn(b, "low")
    try:
        assert ask(low, "alloc 1024 0xC0") == [0, nvs.NV_OK]
        r = b.cli("migrate", "low", "--gpu", "2")
        assert r.returncode == 1 and "GPU 2 is not one of tenant low's GPUs" in r.stderr
        r = b.cli("migrate", "low", "--gpu", "1")
        assert r.returncode == 0 and "tenant low moved to GPU 1" in r.stdout, r.stderr
        mem = b.tenant("low")["memory"]
        assert (mem["0"]["used"], mem["1"]["used"]) == (0, 1 << 30)
        # its device is GPU 1's now: the next allocation lands there
        assert ask(low, "alloc 2 0xC1") == [0, nvs.NV_OK]
        assert b.tenant("low")["memory"]["1"]["used"] == (1 << 30) + (2 << 20)
    finally:
        quit_(low)
    assert [(a["from_gpu"], a["gpu"]) for a in b.audit() if a["event"] == "migrate"] == [(0, 1)]
