"""A deterministic training loop holding GIB GiB of device memory, for preemption runs
(scripts/gpu/run-h200-preempt.sh).

    python3 ckpt_train.py --gib N --steps N --loss FILE [--step-sleep S] [--seed N]
                          [--managed MIB] [--ready FILE]

Fills N-1 one-GiB ballast tensors with a pattern (their checksum is checked at the end:
the content survived any checkpoint), trains a small MLP with a fixed seed on fixed data,
and appends "step loss" to FILE after every step (flushed: another process follows it).
The same seed gives the same losses bit for bit (deterministic algorithms; the ballast does
not enter the model), so a preempted run's curve can be compared with an unpreempted one.
--managed: also hold MIB MiB of CUDA managed memory (cupy), which the driver cannot
checkpoint. --ready: a file written once the memory is held (its content: the pid).
The last stdout line is a JSON summary, with the longest gap between two steps (the time the
process spent preempted).
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402

GiB = 1 << 30


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def checksum(chunks) -> int:
    return int(sum(int(torch.sum(c.view(torch.int32), dtype=torch.int64)) for c in chunks))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=2)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--loss", required=True)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--managed", type=int, default=0)
    ap.add_argument("--ready", default=None)
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    ballast = []
    for i in range(max(0, a.gib - 1)):
        c = torch.empty(GiB, dtype=torch.uint8, device="cuda")
        v = c.view(torch.int32)
        v.copy_(torch.arange(v.numel(), device="cuda", dtype=torch.int32).mul_(40503).add_(i))
        ballast.append(c)
    managed = None
    if a.managed:
        import cupy
        managed = cupy.cuda.malloc_managed(a.managed << 20)
        cupy.ndarray((a.managed << 20,), dtype=cupy.uint8, memptr=managed).fill(7)
        cupy.cuda.runtime.deviceSynchronize()
    first = checksum(ballast)
    torch.manual_seed(a.seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator(device="cuda").manual_seed(a.seed)
    data = [(torch.randn(256, 1024, device="cuda", generator=g),
             torch.randn(256, 1024, device="cuda", generator=g)) for _ in range(16)]
    torch.cuda.synchronize()
    out(holding=os.getpid(), gib=a.gib, reserved=torch.cuda.memory_reserved(),
        managed_mib=a.managed, fill_s=round(time.perf_counter() - t0, 3))
    if a.ready:
        with open(a.ready, "w") as f:
            f.write(str(os.getpid()))
    gap, gap_at, last = 0.0, 0, time.monotonic()
    t_train = time.monotonic()
    with open(a.loss, "w") as lf:
        for step in range(a.steps):
            x, y = data[step % len(data)]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            lf.write(f"{step} {loss.item():.9g}\n")
            lf.flush()
            now = time.monotonic()
            if now - last > gap:
                gap, gap_at = now - last, step
            last = now
            if a.step_sleep:
                time.sleep(a.step_sleep)
    ok = checksum(ballast) == first
    out(done=os.getpid(), steps=a.steps, ballast_ok=ok, train_s=round(time.monotonic() - t_train, 3),
        max_gap_s=round(gap, 3), max_gap_step=gap_at)


if __name__ == "__main__":
    main()
