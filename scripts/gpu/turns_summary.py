"""Issue 12's launch-bound and matmul targets from native and tenant processes that took
turns on the GPU (cuda_checks.py turns; lib.sh turns_pair records turnsN_native/_dev).

    python3 turns_summary.py RESULTS.json

The first SKIP units of each kind in each process are left out: the GPU's clocks settle
after the other kind of work. Prints one line per measure (what targets.txt gets)."""
from __future__ import annotations

import json
import statistics
import sys

SKIP = 3


def main() -> None:
    d = json.load(open(sys.argv[1]))
    tn, td, mn, md, pairs = [], [], [], [], 0
    for i in range(1, 10):
        n, v = d.get(f"turns{i}_native"), d.get(f"turns{i}_dev")
        if not (isinstance(n, dict) and isinstance(v, dict) and n.get("tiny_s") and v.get("tiny_s")):
            continue
        pairs += 1
        tn += n["tiny_s"][SKIP:]
        td += v["tiny_s"][SKIP:]
        mn += n["mm_tflops"][SKIP:]
        md += v["mm_tflops"][SKIP:]
    if not (tn and td and mn and md):
        print("taking turns: no pair of results (see turnsN-*.txt in the bundle)")
        return
    mt, dt = statistics.median(tn), statistics.median(td)
    print(f"taking turns ({pairs} pairs), 2,000 tiny kernels: {len(tn)} passes each, median "
          f"native {mt * 1e3:.2f} ms, devbroker {dt * 1e3:.2f} ms: {dt / mt:.3f}x "
          f"(target <= 1.02)")
    s = 1 - statistics.mean(md) / statistics.mean(mn)
    print(f"taking turns ({pairs} pairs), bf16 matmul: {len(mn)} batches each, mean native "
          f"{statistics.mean(mn):.1f}, devbroker {statistics.mean(md):.1f} TFLOP/s: "
          f"S = {100 * s:.2f} % (target <= 0.5 %)")


if __name__ == "__main__":
    main()
