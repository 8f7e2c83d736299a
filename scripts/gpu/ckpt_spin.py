"""A process that holds GiB of device memory and then runs one kernel that spins for SPIN
seconds (run-h200-preempt.sh part f): a checkpoint's lock waits for the process's work, so
a preemption of this process must give up at its lock timeout, not wait for the kernel.

    python3 ckpt_spin.py --gib 64 --spin 40 --ready FILE
Prints one JSON line when the kernel has finished."""
from __future__ import annotations

import argparse
import json
import time

import cupy

SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns, unsigned long long *out) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    *out = t - t0;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=2)
    ap.add_argument("--spin", type=float, default=30.0)
    ap.add_argument("--ready", required=True)
    a = ap.parse_args()
    held = cupy.ones(a.gib << 30, dtype=cupy.uint8)
    out = cupy.zeros(1, dtype=cupy.uint64)
    kernel = cupy.RawKernel(SPIN, "spin")
    kernel((1,), (1,), (cupy.uint64(int(a.spin * 1e9)), out))  # compiled and run once...
    cupy.cuda.Device().synchronize()
    t0 = time.monotonic()
    kernel((1,), (1,), (cupy.uint64(int(a.spin * 1e9)), out))  # ...and now spins
    with open(a.ready, "w") as f:
        f.write("spinning\n")
    cupy.cuda.Device().synchronize()
    print(json.dumps({"spun_s": round(time.monotonic() - t0, 3),
                      "held_ok": bool(int(held[-1]) == 1), "gib": a.gib}), flush=True)


if __name__ == "__main__":
    main()
