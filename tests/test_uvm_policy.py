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
