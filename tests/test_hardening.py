"""Hardening against hostile pointers and allocations, through real `devbroker exec` tenants (FUSE front end,
emulated backend), plus the memory gate's deadline on its own.

1. A tenant hands the broker nested pointers into pages it mapped from the broker's own FUSE
   mount and never touched. It used to hang the whole broker (the fault was a FUSE READ that
   only the hung thread could answer). Now the call fails with EFAULT, the audit log names
   the tenant, another tenant's NVML-style sequence completes and `devbroker status` answers.
2. 1 byte with a 135 GiB alignment is charged like the driver charges it (the size rounded to
   its page: 64 KiB), not 135 GiB, so the other tenant on that GPU still gets its quota.
"""
from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from devbroker.testing.policies import one_h200, tenant
import trio

from devbroker.abi import vidmem
from devbroker.broker.memgate import MemoryAccessRefused, MemoryGate
from tenant_io import lines, readline_json

HERE = Path(__file__).resolve().parent
PROBE = [sys.executable, "-m", "devbroker.tools.probe"]
TENANT = [sys.executable, str(HERE / "tenant_prog.py")]
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Both tenants on GPU 0: what one of them takes from the card is what the other can get.
POLICY = one_h200(tenant("alice", memory_quota="16GiB"), tenant("bob", memory_quota="256MiB"),
                  uuids=("GPU-13131313-2222-3333-4444-555555555555",))


@pytest.fixture
def broker(start_broker):
    b = start_broker(POLICY)
    b.frontend = "fuse"
    return b


@pytest.mark.root
def test_pointer_into_the_brokers_own_mount_is_refused_and_stalls_nobody(broker):
    bob = broker.exec_popen("bob", *TENANT, "own-mount-ptr", stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        got = {}
        while True:
            rec = readline_json(bob)
            if rec["what"] == "done":
                break
            got[rec["what"]] = rec
        # Every attempt failed with an errno (EFAULT), none hung, none reached the driver.
        assert set(got) == {"control-gpu", "uvm-gpu", "control-version", "uvm-version"}
        for what, rec in got.items():
            assert not rec.get("hang"), f"{what}: the broker did not answer"
            assert rec.get("errno") == errno.EFAULT, (what, rec)

        # While bob still holds the mappings: the operator and another tenant are served.
        t0 = time.monotonic()
        r = broker.cli("status", timeout=20)
        assert r.returncode == 0, r.stderr
        assert "bob" in r.stdout
        assert time.monotonic() - t0 < 15
        r = broker.exec("alice", *PROBE, "--json", "--alloc", "1GiB", timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        alice = json.loads(r.stdout.strip().splitlines()[-1])
        assert alice["gpus"][0]["allocations"][0]["status"] == "NV_OK"
        assert alice["gpus"][0]["memory"]["total"] == 16 * GiB

        # bob itself keeps working too.
        bob.stdin.write("go\n")
        bob.stdin.flush()
        after = readline_json(bob)
        assert after == {"what": "after", "ids": 1}
    finally:
        bob.kill()
        bob.wait()

    denials = [a for a in broker.audit() if a["event"] == "deny" and a["tenant"] == "bob"]
    own = [d for d in denials if "broker's own nodes" in d["reason"]]
    # The GPU node's page is the broker's own mount: one record per attempt, each naming
    # the tenant. /proc/driver/nvidia is a copy in the sandbox's own tmpfs
    # (sandbox.mount_proc_driver_view), so its page is an ordinary read-only one: those two
    # attempts were answered EFAULT above (the results cannot be written into it) without
    # touching the broker's mount.
    assert len(own) == 2, denials
    assert {d["node"] for d in own} == {"nvidiactl", "nvidia-uvm"}
    assert all(d["pid"] for d in own)
    assert broker.tenant("bob")["memory_stalled"] == 0
    # And the broker still stops on SIGTERM (it used to sit in uninterruptible sleep).
    assert broker.stop(signal.SIGTERM) in (0, -signal.SIGTERM)


@pytest.mark.root
def test_huge_alignment_is_charged_the_size_and_the_other_tenant_keeps_its_quota(broker):
    bob = broker.exec_popen("bob", *TENANT, "hold-aligned", "1", "135GiB",
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        held = readline_json(bob)
        assert held["status"] == 0, held  # NV_OK, as the driver answers it
        # The driver's charge: the size rounded up to its page (64 KiB below 2 MiB), not
        # the alignment; the tenant's view and the broker's books say the same.
        assert held["granted"] == 64 * KiB
        assert held["memory"]["used"] == 64 * KiB
        assert broker.tenant("bob")["memory"]["0"]["used"] == 64 * KiB
        # alice, on the same GPU: 10 GiB inside her 16 GiB quota (with 135 GiB taken from
        # the 141 GiB card by bob's byte, the emulator refused this with NO_MEMORY).
        r = broker.exec("alice", *PROBE, "--json", "--alloc", "10GiB", timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        alice = json.loads(r.stdout.strip().splitlines()[-1])
        assert alice["gpus"][0]["allocations"] == [{"size": 10 * GiB, "status": "NV_OK"}]
        # bob's own remaining quota is usable as well: 254 MiB more is granted, 256 MiB not.
        r = broker.exec("bob", *PROBE, "--json", "--alloc", "254MiB", timeout=60)
        assert lines(r.stdout)[-1]["gpus"][0]["allocations"][0]["status"] == "NV_OK"
        r = broker.exec("bob", *PROBE, "--json", "--alloc", "256MiB", timeout=60)
        assert lines(r.stdout)[-1]["gpus"][0]["allocations"][0]["status"] == "NV_ERR_NO_MEMORY"
    finally:
        bob.stdin.close()
        bob.wait(timeout=30)


def test_vidmem_charges_the_size_rounded_to_the_drivers_page():
    """abi/vidmem.py: the rule the emulator charges and the broker checks the quota with."""
    cuda_attr = 0x18000000  # CUDA's attr: page size DEFAULT
    # The H200 measurement: 2 MiB with a 64 GiB alignment is 2 MiB.
    assert vidmem.charged_size(2 * MiB, cuda_attr) == 2 * MiB
    assert vidmem.alignment_usable(64 * GiB, vidmem.page_size(2 * MiB, cuda_attr))
    # Default page: 64 KiB below 2 MiB, 2 MiB from there; the alignment costs nothing.
    assert vidmem.charged_size(1, cuda_attr) == 64 * KiB
    assert vidmem.charged_size(2 * MiB + 1, cuda_attr) == 4 * MiB
    assert vidmem.charged_size(3 * MiB) == 4 * MiB
    # Pages asked for in attr (bits 24:23) and attr2 (huge: bits 21:20).
    assert vidmem.charged_size(1, 1 << 23) == 4 * KiB  # 4KB
    assert vidmem.charged_size(1, 2 << 23) == 64 * KiB  # BIG
    assert vidmem.charged_size(1, 3 << 23) == 2 * MiB  # HUGE (2 MiB by default)
    assert vidmem.charged_size(1, 3 << 23, 2 << 20) == 512 * MiB  # HUGE 512 MiB
    assert vidmem.charged_size(1, 3 << 23, 3 << 20) == 0  # 256 GiB pages: not offered
    assert vidmem.charged_size(0) == 0
    # An alignment the driver honours is a multiple or a divisor of the page.
    assert vidmem.alignment_usable(0, 64 * KiB)
    assert vidmem.alignment_usable(4 * KiB, 64 * KiB)
    assert vidmem.alignment_usable(135 * GiB, 64 * KiB)
    assert not vidmem.alignment_usable(3 * KiB, 64 * KiB)
    assert not vidmem.alignment_usable(96 * KiB, 64 * KiB)


# ------------------------------------------------------------------ the gate on its own
class _BlockingMemory:
    """TenantMemory whose reads wait for an event (a page nobody serves)."""

    def __init__(self):
        self.release = threading.Event()

    def read(self, addr: int, length: int) -> bytes:
        self.release.wait(30)
        return bytes(length)

    def write(self, addr: int, data: bytes) -> None:
        self.release.wait(30)


class _Audit:
    def __init__(self):
        self.records: list[dict] = []

    def write(self, event, **kw):
        self.records.append({"event": event, **kw})


def test_gate_deadline_stall_limit_and_accounting():
    audit = _Audit()
    gate = MemoryGate(audit, deadline=0.2, stall_limit=2)
    mem = _BlockingMemory()

    class Fast:
        def read(self, addr, length):
            return b"x" * length

    async def main():
        # A blocked read is refused at its deadline, with EFAULT; the thread is counted.
        for i in (1, 2):
            t0 = trio.current_time()
            with pytest.raises(MemoryAccessRefused) as e:
                await gate.read("mallory", mem, 0x1000, 8)
            assert e.value.errno == errno.EFAULT
            assert "did not complete within 0.2 s" in e.value.strerror
            assert trio.current_time() - t0 < 2
            assert gate.stalled["mallory"] == i
        # At the stall limit: refused at once, without a new thread.
        with pytest.raises(MemoryAccessRefused) as e:
            await gate.read("mallory", mem, 0x1000, 8)
        assert "stall limit" in e.value.strerror
        # Other tenants are not affected, and the trio thread was never blocked.
        assert await gate.read("alice", Fast(), 0, 4) == b"xxxx"
        # When the page is finally served, the threads return and are accounted for.
        mem.release.set()
        with trio.fail_after(10):
            while gate.stalled.get("mallory"):
                await trio.sleep(0.01)
        assert await gate.read("mallory", Fast(), 0, 2) == b"xx"

    trio.run(main)
    assert gate.timeouts["mallory"] == 2
    returned = [r for r in audit.records if "returned after" in r.get("message", "")]
    assert len(returned) == 2 and all(r["tenant"] == "mallory" for r in returned)
