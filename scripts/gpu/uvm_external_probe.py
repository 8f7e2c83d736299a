"""Does the driver let one process map another process's device memory into its own UVM va
space by naming the other's client and memory handle in UVM_MAP_EXTERNAL_ALLOCATION? (The
escape harness's uvm-external-foreign attack escaped on the H200 on 2026-12-02 with the
victim's memory shared RS_SHARE_TYPE_ALL; this asks the driver alone, natively, no broker.)

    python3 scripts/gpu/uvm_external_probe.py            # runs every case, one JSON line each
    python3 scripts/gpu/uvm_external_probe.py victim SHARE   (internal: the victim process)

Cases: the victim (root) allocates 64 MiB of device memory with the probe Client, shares it
with everyone (RM_SHARE, RS_SHARE_TYPE_ALL, as the harness's victim does), with one other
client of its own only (RS_SHARE_TYPE_CLIENT), or not at all, and waits; the attacker
(uid 65534, a separate process) sets up a va space as CUDA does and maps (victim client,
victim memory) with the harness's own attack function (devbroker.escape.attacks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys


SHARES = {"none": None, "all": 1, "client": 3}  # RS_SHARE_TYPE_ALL, RS_SHARE_TYPE_CLIENT


def victim(share: str) -> int:
    from devbroker.tools.probe import Client

    c = Client()
    c._next = 0xB1C70000
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    hmem = c.alloc_device_memory(g["hdevice"], 64 << 20)
    status = None
    if SHARES[share] is not None:
        # CLIENT: with one other client only (a second root client of the victim's own)
        target = 0
        if share == "client":
            other = Client()
            other._next = 0xB2C70000
            other.check_version()
            other.open_root()
            target = other.hclient
        p = c.new("NVOS57_PARAMETERS", hClient=c.hclient, hObject=hmem,
                  sharePolicy={"target": target, "accessMask": {"limbs": [1]},
                               "type": SHARES[share], "action": 0})
        status = c.escape(c.ctl, "NV_ESC_RM_SHARE", p).status
    print(json.dumps({"client": c.hclient, "hmemory": hmem, "share_status": status}),
          flush=True)
    sys.stdin.read()
    return 0


def attacker(facts: dict) -> dict:
    from devbroker.escape import attacks

    ctx = attacks.Ctx(frontend="native", victim=facts)
    return attacks.a_uvm_external_foreign(ctx).to_dict()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "victim":
        return victim(sys.argv[2])
    if len(sys.argv) > 1 and sys.argv[1] == "attacker":
        print(json.dumps(attacker(json.loads(sys.argv[2]))), flush=True)
        return 0
    me = os.path.abspath(__file__)
    for share in SHARES:
        v = subprocess.Popen([sys.executable, me, "victim", share],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            facts = json.loads(v.stdout.readline())
            ids = {"user": 65534, "group": 65534} if os.geteuid() == 0 else {}
            r = subprocess.run([sys.executable, me, "attacker", json.dumps(facts)],
                               capture_output=True, text=True, timeout=120, **ids)
            out = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-800:]
            print(json.dumps({"victim_shared": share, "victim": facts,
                              "attacker_uid": 65534 if ids else os.geteuid(),
                              "attack": out}), flush=True)
        finally:
            v.stdin.close()
            v.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
