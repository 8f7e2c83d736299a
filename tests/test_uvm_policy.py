"""Taking UVM away from a running seccomp tenant with real driver files.

Its filter lets the kernel run the UVM rows with `in_kernel` unasked (rules.kernel_commands),
and a running process's filter cannot be changed: a policy that took `uvm` away used to be
applied, and those calls kept reaching the driver. Now such a policy is refused while the
tenant holds nvidia-uvm files (the running policy stays in force, with the reason), and is
applied once they are closed. Real broker, real backend on stand-in driver nodes
(test_real_lane._on_stand_in_nodes), the tenant through `devbroker exec --frontend seccomp`."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, mounts)")

HERE = Path(__file__).resolve().parent
NO_UVM = ('[broker]\nbackend = "real"\n\n[tenant.t0]\ngpus = [0]\nmemory_quota = "2GiB"\n'
          'capabilities = ["nvml", "compute"]\n')


def test_uvm_is_not_taken_from_a_tenant_holding_uvm_files(tmp_path):
    from test_real_lane import _on_stand_in_nodes

    seen = {}

    def during(broker, line):
        assert line["uvm"] >= 0
        r = broker.control({"op": "policy.apply", "text": NO_UVM, "name": "no-uvm"})
        seen["held"] = r

    def after(broker):  # the tenant has closed its file and exited
        seen["audit"] = [a for a in broker.audit() if a["event"] == "policy-refused"]
        # (the broker hears of the last close through the file's inotify watch: asked
        # again until it has, or for a minute)
        deadline = time.monotonic() + 60
        while True:
            seen["closed"] = broker.control({"op": "policy.apply", "text": NO_UVM,
                                             "name": "no-uvm"})
            if seen["closed"]["ok"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)

    out, _ = _on_stand_in_nodes(tmp_path, "uvmpolicy", {}, "seccomp",
                                [sys.executable, str(HERE / "uvm_hold_prog.py")],
                                during=during, inspect=after)
    assert out == {"closed": True}
    held = seen["held"]
    assert not held["ok"] and "open nvidia-uvm file" in held["error"], held
    assert "the running policy stays in force" in held["error"]
    assert [a["source"] for a in seen["audit"]][:1] == ["no-uvm"]
    assert seen["closed"]["ok"], seen["closed"]


def test_a_runtime_tenant_keeps_uvm_while_it_holds_files_and_its_removal_ends_them(tmp_path):
    """The same for a tenant made at run time (`devbroker tenant set` is refused while its
    process holds a uvm file); `devbroker tenant rm` is not: it ends the tenant's processes
    itself, and with them what their filters let the kernel run."""
    import json
    import subprocess

    from test_real_lane import _on_stand_in_nodes

    seen = {}

    def during(broker, line):
        # (the stand-in GPU reports no memory: a quota of none)
        r = broker.cli("tenant", "add", "u1", "--gpus", "0", "--memory-quota", "0")
        assert r.returncode == 0, r.stderr
        held = broker.exec_popen("u1", sys.executable, str(HERE / "uvm_hold_prog.py"),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            assert json.loads(held.stdout.readline())["uvm"] >= 0
            seen["set"] = broker.cli("tenant", "set", "u1", "--capability", "nvml",
                                     "--capability", "compute")
            seen["rm"] = broker.cli("tenant", "rm", "u1", "--grace", "0")
            seen["held_rc"] = held.wait(timeout=60)
        finally:
            if held.poll() is None:
                held.kill()
                held.wait()

    _on_stand_in_nodes(tmp_path, "uvmruntime", {}, "seccomp",
                       [sys.executable, str(HERE / "uvm_hold_prog.py")], during=during)
    assert seen["set"].returncode != 0 and "open nvidia-uvm file" in seen["set"].stderr, \
        seen["set"].stdout + seen["set"].stderr
    assert seen["rm"].returncode == 0, seen["rm"].stderr
    assert seen["held_rc"] != 0  # ended by the removal
