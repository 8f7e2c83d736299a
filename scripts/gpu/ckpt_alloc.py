"""The high-priority side of a preemption run (scripts/gpu/run-h200-preempt.sh): initialise
CUDA, then time one allocation of GIB GiB (the request-to-answer time, which includes any
preemption the broker does to make room), hold it HOLD seconds, exit.

    python3 ckpt_alloc.py GIB [HOLD]

Prints {"ready": pid} after CUDA init and, last, {"alloc_s": ..., "ok": ...}.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

GiB = 1 << 30


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def main() -> None:
    gib = int(sys.argv[1])
    hold = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    out(ready=os.getpid(), free=torch.cuda.mem_get_info()[0])
    t0 = time.perf_counter()
    try:
        x = torch.empty(gib * GiB, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        ok, err = True, None
    except Exception as e:  # OutOfMemoryError: the fallback when nobody could be preempted
        x, ok, err = None, False, str(e).splitlines()[0][:300]
    dt = time.perf_counter() - t0
    if ok:
        time.sleep(hold)
    del x
    out(alloc_s=round(dt, 3), ok=ok, error=err, gib=gib, held_s=hold if ok else 0)


if __name__ == "__main__":
    main()
