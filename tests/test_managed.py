"""Managed (nvidia-uvm) memory inside the quota and pinned host memory within its limit: a
real broker with the emulated backend, real tenant processes mapping managed ranges (as
libcuda does: MAP_FIXED, offset = address) and allocating device and system memory."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devbroker.testing.policies import tenant, two_h200

from tenant_io import lines

pytestmark = pytest.mark.root

GiB = 1 << 30
MiB = 1 << 20
HERE = Path(__file__).resolve().parent
PROG = [sys.executable, str(HERE / "managed_prog.py")]
POLICY = two_h200(tenant("m", gpus=[0], memory_quota="8GiB", pinned_host_memory="1GiB"),
                  driver_version=None)


@pytest.fixture
def seccomp_broker(start_broker):
    b = start_broker(POLICY)
    b.frontend = "seccomp"  # managed memory is the seccomp front end's (docs/security.md)
    return b


@pytest.fixture(params=["fuse", "seccomp"])
def broker(start_broker, request):
    b = start_broker(POLICY)
    b.frontend = request.param
    return b


def run(broker, *steps: str) -> list[dict]:
    r = broker.exec("m", *PROG, *steps)
    assert r.returncode == 0, r.stdout + r.stderr
    return list(lines(r.stdout))


def wait_for(pred, what: str, timeout: float = 30.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_managed_memory_within_the_quota_maps_and_beyond_it_is_out_of_memory(seccomp_broker):
    out = run(seccomp_broker, "map:6GiB", "used", "unmap:0", "map:12GiB", "used")
    assert out[0] == {"op": "map", "size": 6 * GiB, "errno": 0, "mapped": 6 * GiB}
    assert out[1]["used"] == 6 * GiB  # what NVML in the tenant shows
    assert out[3]["errno"] == errno.ENOMEM and out[3]["mapped"] == 0
    assert out[4]["used"] < 6 * GiB  # the unmapped range was given back on the next look
    deny = [a for a in seccomp_broker.audit() if a["event"] == "deny"]
    assert any("mmap nvidia-uvm 12884901888 bytes" in d["what"]
               and "managed memory would exceed the quota" in d["reason"] for d in deny)


def test_managed_and_device_memory_share_the_quota(seccomp_broker):
    out = run(seccomp_broker, "map:4GiB", "alloc:4GiB", "used", "alloc:1GiB", "map:1GiB")
    assert out[0]["errno"] == 0 and out[1]["status"] == "NV_OK"
    assert out[2]["used"] == 8 * GiB
    assert out[3]["status"] == "NV_ERR_NO_MEMORY"
    assert out[4]["errno"] == errno.ENOMEM


def test_unmapping_gives_the_charge_back_to_device_memory(seccomp_broker):
    out = run(seccomp_broker, "map:6GiB", "unmap:0", "alloc:6GiB", "used")
    assert out[0]["errno"] == 0 and out[1]["mapped"] == 0
    assert out[2]["status"] == "NV_OK", out
    assert out[3]["used"] == 6 * GiB


def test_process_exit_gives_the_charge_back(seccomp_broker):
    b = seccomp_broker
    p = b.exec_popen("m", *PROG, "map:6GiB", "hold", stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(p.stdout.readline())
        assert first["errno"] == 0
        assert json.loads(p.stdout.readline()) == {"op": "hold"}
        t = b.tenant("m")
        assert t["managed_memory"] == 6 * GiB and t["memory"]["0"]["used"] == 6 * GiB
        for pid in t["processes"]:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: b.tenant("m")["managed_memory"] == 0, "managed memory returned")
        assert b.tenant("m")["memory"]["0"]["used"] == 0
    finally:
        p.kill()
        p.wait()
    # and the whole quota is the next process's
    assert run(b, "map:8GiB")[0]["errno"] == 0


def test_pinned_host_memory_is_limited_and_freeing_gives_it_back(broker):
    out = run(broker, "pinned:768MiB", "pinned:512MiB", "free-pinned:0", "pinned:512MiB",
              "alloc:1GiB")
    assert [o["status"] for o in out] == ["NV_OK", "NV_ERR_NO_MEMORY", "NV_OK", "NV_OK",
                                          "NV_OK"]
    deny = [a for a in broker.audit() if a["event"] == "deny"]
    assert any("pinned_host_memory" in d["reason"] for d in deny), deny


def test_pinned_host_memory_shows_in_status(broker):
    p = broker.exec_popen("m", *PROG, "pinned:256MiB", "hold", stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(p.stdout.readline())["status"] == "NV_OK"
        json.loads(p.stdout.readline())
        assert broker.tenant("m")["pinned_host_memory"] == {"used": 256 * MiB,
                                                            "limit": 1 * GiB}
    finally:
        p.stdin.close()
        p.wait(timeout=60)


def test_security_doc_carries_the_refusal_answers():
    from devbroker.broker.refusal import answers_markdown

    doc = (HERE.parent / "docs" / "security.md").read_text()
    assert answers_markdown() in doc, "docs/security.md: paste refusal.answers_markdown()"


def test_common_refusals_answer_as_the_table_says(broker):
    """The answers of docs/security.md's table, against the emulated driver: device memory
    and pinned host memory beyond their limits, a managed range beyond the quota (seccomp),
    a refused escape, class and control."""
    from devbroker.abi import status as nvs
    from devbroker.broker.refusal import ANSWERS

    steps = ["alloc:12GiB", "pinned:2GiB"] + (["map:12GiB"] if broker.frontend == "seccomp"
                                              else [])
    got = run(broker, *steps)
    assert got[0]["status"] == ANSWERS["quota"].answer
    assert got[1]["status"] == ANSWERS["pinned"].answer
    # (and through the older allocator, whose status is inside its parameters)
    assert run(broker, "pinned-nvos02:2GiB")[0]["status"] == ANSWERS["pinned"].answer
    if broker.frontend == "seccomp":
        assert errno.errorcode[got[2]["errno"]] == ANSWERS["managed"].answer
    r = broker.exec("m", sys.executable, str(HERE / "tenant_prog.py"), "refusals")
    assert r.returncode == 0, r.stdout + r.stderr
    seen = {x["what"]: x for x in lines(r.stdout)}
    assert errno.errorcode[seen["registry"]["errno"]] == ANSWERS["escape"].answer
    assert nvs.name(seen["debugger"]["status"]) == ANSWERS["class"].answer
    assert nvs.name(seen["ecc"]["status"]) == ANSWERS["control"].answer


def test_pinned_host_memory_is_set_at_run_time(broker):
    """`devbroker tenant add|set --pinned-host-memory`: validated like the policy key and
    applied to the next allocation (what is pinned stays)."""
    r = broker.cli("tenant", "add", "r", "--gpus", "0", "--memory-quota", "8GiB",
                   "--pinned-host-memory", "256MiB")
    assert r.returncode == 0, r.stderr
    out = broker.exec("r", *PROG, "pinned:512MiB")
    assert lines(out.stdout)[-1]["status"] == "NV_ERR_NO_MEMORY", out.stdout + out.stderr
    bad = broker.cli("tenant", "set", "r", "--pinned-host-memory", "lots")
    assert bad.returncode != 0 and "pinned_host_memory" in bad.stderr, bad.stderr
    r = broker.cli("tenant", "set", "r", "--pinned-host-memory", "1GiB")
    assert r.returncode == 0, r.stderr
    assert broker.tenant("r")["pinned_host_memory"]["limit"] == 1 * GiB
    out = broker.exec("r", *PROG, "pinned:512MiB")
    assert lines(out.stdout)[-1]["status"] == "NV_OK", out.stdout + out.stderr


def test_nvml_in_the_tenant_follows_an_unmapped_range_without_another_call(seccomp_broker):
    """munmap is not a notification: the broker's periodic look (the alert monitor's, every
    second) reads the maps again, and the tenant's FB info shows the range gone."""
    out = run(seccomp_broker, "map:6GiB", "used", "unmap:0", "wait-used-below:1GiB")
    assert out[1]["used"] == 6 * GiB
    assert out[3]["used"] < 1 * GiB, out


def test_prefetch_and_advice_on_own_managed_ranges_work(seccomp_broker):
    """What cudaMemPrefetchAsync, cudaMemAdvise and cudaMallocManaged itself send on the
    tenant's own ranges is let through (rules.py's UVM rows) and answered as the driver
    answers a range of the caller's."""
    out = run(seccomp_broker, "map:1GiB", "advise:0")
    got = {k: v for k, v in out[1].items() if k != "op"}
    assert set(got) == {"UVM_SET_PREFERRED_LOCATION", "UVM_SET_ACCESSED_BY", "UVM_MIGRATE",
                        "UVM_UNSET_PREFERRED_LOCATION", "UVM_DISABLE_READ_DUPLICATION"}
    assert set(got.values()) == {"NV_OK"}, got
