"""CUDA's legacy IPC (torch.multiprocessing's reductions: cudaIpcGetMemHandle, then RM_SHARE
and, in the other process, RM_DUP_OBJECT) between two processes on one GPU; run both inside
one `devbroker exec` they are one tenant's:
    python3 scripts/gpu/ipc_check.py           # the exporter; starts the importer itself
Prints one JSON line: {"ok": bool, "importer": ...}."""
from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys


def importer() -> None:
    import torch

    fn, args = pickle.loads(base64.b64decode(sys.stdin.readline()))
    try:
        t = fn(*args)
        got = bool(torch.equal(t.cpu(), torch.full((1024,), 7.0)))
    except Exception as e:  # noqa: BLE001
        got = f"{type(e).__name__}: {str(e)[:200]}"
    print(json.dumps({"importer": got}), flush=True)


def exporter() -> None:
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    t = torch.full((1024,), 7.0, device="cuda")
    box = base64.b64encode(pickle.dumps(reduce_tensor(t))).decode()
    r = subprocess.run([sys.executable, __file__, "importer"], input=box + "\n",
                       capture_output=True, text=True, timeout=120)
    line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    try:
        got = json.loads(line)["importer"]
    except (ValueError, KeyError):
        got = f"rc {r.returncode}: {r.stderr[-300:]}"
    print(json.dumps({"ok": got is True, "importer": got}), flush=True)


if __name__ == "__main__":
    importer() if sys.argv[1:] == ["importer"] else exporter()
