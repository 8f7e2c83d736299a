"""A PyTorch process holding GIB GiB of device memory with a known content, for checkpoint
runs (scripts/gpu/ckpt_native.py, run-h200-preempt.sh).

    python3 ckpt_holder.py GIB

Fills GIB one-GiB tensors with a pattern, prints {"holding": pid, "sum": ...} and then
answers commands on stdin, one JSON line each:
  check  the content's checksum again ("ok": equal to the first)
  work   a bf16 matmul (the GPU computes after a restore)
  exit
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


def checksum(chunks) -> int:
    return int(sum(int(torch.sum(c.view(torch.int32), dtype=torch.int64)) for c in chunks))


def main() -> None:
    gib = int(sys.argv[1])
    t0 = time.perf_counter()
    chunks = []
    for i in range(gib):
        c = torch.empty(GiB, dtype=torch.uint8, device="cuda")
        v = c.view(torch.int32)
        v.copy_(torch.arange(v.numel(), device="cuda", dtype=torch.int32).mul_(40503).add_(i))
        chunks.append(c)
    torch.cuda.synchronize()
    first = checksum(chunks)
    out(holding=os.getpid(), gib=gib, sum=first, fill_s=round(time.perf_counter() - t0, 3),
        reserved=torch.cuda.memory_reserved())
    for line in sys.stdin:
        cmd = line.strip()
        t = time.perf_counter()
        if cmd == "check":
            s = checksum(chunks)
            out(check=s, ok=s == first, s=round(time.perf_counter() - t, 3))
        elif cmd == "work":
            a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
            b = (a @ a).float().abs().mean().item()
            torch.cuda.synchronize()
            out(work=b > 0, s=round(time.perf_counter() - t, 3))
        elif cmd == "exit":
            break
    out(bye=os.getpid())


if __name__ == "__main__":
    main()
