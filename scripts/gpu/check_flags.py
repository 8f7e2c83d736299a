#!/usr/bin/env python3
"""On a machine with the NVIDIA driver: do the driver's answers to an unprivileged caller
agree with the flags in devbroker's ABI tables (issue 19)? Not run in CI (needs a GPU).

    sudo .venv/bin/python scripts/gpu/check_flags.py [--per-class 12] > flags.json

It drops to uid/gid 65534 with no capabilities first (the driver's privilege is
CAP_SYS_ADMIN of the caller), opens /dev/nvidiactl, makes a root client, a device and a
subdevice of GPU 0, and sends read-only controls ("_GET_" in the name) with zeroed
parameters of the tables' size:

- a sample the tables say the driver reserves (PRIVILEGED, KERNEL_PRIVILEGED, INTERNAL, and
  numbers in LEGACY_PRIVILEGED categories): the driver must answer
  NV_ERR_INSUFFICIENT_PERMISSIONS (NV_ERR_NOT_SUPPORTED for INTERNAL) before it runs them;
- a sample of NON_PRIVILEGED ones: the driver must not answer INSUFFICIENT_PERMISSIONS.

Only getters are sent, and the reserved ones are refused by the driver before they run if
the tables are right. Prints one JSON object: every control sent, what the tables predicted,
what the driver answered, and the disagreements (the list the issue asks to investigate).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "src"))

from devbroker.abi import registry  # noqa: E402
from devbroker.abi import status as nvs  # noqa: E402
from devbroker.tools.probe import Client, NvError, driver_version  # noqa: E402

CLASSES = (0x0000, 0x0080, 0x2080)


def drop_privileges() -> None:
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_NO_NEW_PRIVS = 38
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    with open("/proc/self/status") as f:
        eff = [l for l in f if l.startswith("CapEff")][0].split()[1]
    if int(eff, 16):
        raise SystemExit(f"still holding capabilities ({eff}): refusing to probe")


def sample(abi, want, n):
    out = []
    for cmd in sorted(abi.controls):
        op = abi.control_op(cmd)
        if cmd >> 16 not in CLASSES or "_GET_" not in op.name:
            continue
        ref = op.driver_refusal()
        got = ref[0] if ref else ("NON_PRIVILEGED" if op.driver_flags and
                                  "NON_PRIVILEGED" in op.driver_flags else None)
        if got == want:
            out.append(cmd)
    step = max(1, len(out) // n)
    return out[::step][:n]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-class", type=int, default=12)
    args = ap.parse_args()
    drop_privileges()
    version = driver_version("unknown")
    abi = registry.get(registry.require_supported(version, "NVIDIA driver"))
    c = Client(version)
    c.open_root()
    gpu = c.open_gpu(c.attached_ids()[0])
    objects = {0x0000: c.hclient, 0x0080: gpu["hdevice"], 0x2080: gpu["hsubdevice"]}
    plan = {k: sample(abi, k, args.per_class) for k in (
        "RMCTRL_FLAGS_PRIVILEGED", "RMCTRL_FLAGS_KERNEL_PRIVILEGED", "RMCTRL_FLAGS_INTERNAL",
        "NON_PRIVILEGED")}
    plan["RM_GSS_LEGACY_MASK_PRIVILEGED"] = [0x2080C501, 0x2080D001, 0x2080E001]
    rows, disagree = [], []
    for expect, cmds in plan.items():
        for cmd in cmds:
            op = abi.control_op(cmd)
            params = op.params.zero() if op.params is not None else \
                abi.struct("NvU32").zero()
            try:
                c.control(objects[cmd >> 16], cmd, params)
                status = nvs.NV_OK
            except NvError as e:
                status = e.status
            if expect == "NON_PRIVILEGED":
                ok = status != nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
            elif expect == "RMCTRL_FLAGS_INTERNAL":
                ok = status == nvs.NV_ERR_NOT_SUPPORTED
            else:
                ok = status == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
            row = {"cmd": f"{cmd:#010x}", "name": op.name, "tables": expect,
                   "driver": nvs.name(status), "agree": ok}
            rows.append(row)
            if not ok:
                disagree.append(row)
    print(json.dumps({"driver": version, "tag": abi.tag, "uid": os.getuid(), "sent": len(rows),
                      "disagree": disagree, "rows": rows}, indent=1))
    return 1 if disagree else 0


if __name__ == "__main__":
    sys.exit(main())
