#!/usr/bin/env python3
"""Benchmark (not a test): decode + lookup time per ioctl over the torch trace.

For every ioctl record: decode_ioctl() on the argument, nested() (the control / class /
xfer lookup) and, where the trace holds it, decode_nested() plus one field read.  Reports
p50/p90/p99 in microseconds by kind.  Usage: .venv/bin/python scripts/bench_abi.py [TRACE]
"""
from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from devbroker.abi import nvtrace, registry
from devbroker.abi.traceview import TraceDecoder

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "tests" / "data" / "h200-580.159.04-torch.nvtrace"


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else str(DEFAULT)
    abi = registry.get("580.159.04")
    recs = [r for r in nvtrace.read_file(path) if r.type == nvtrace.RecordType.IOCTL]
    dec = TraceDecoder(abi)
    work = []
    for r in recs:
        node = dec.node_for(r)
        name = abi.decode_ioctl(node, r.cmd, r.in_, window=True).name
        work.append((name, node, r))
    # Each record is timed as a batch of REP calls (per-call mean), which removes timer
    # overhead; percentiles are then taken over records, best of ROUNDS rounds (this machine
    # is shared, so the minimum is the least disturbed measurement).
    REP, ROUNDS = 50, 5

    def lookup(node, r):
        call = abi.decode_ioctl(node, r.cmd, r.in_, window=True)
        abi.nested(call)
        return call

    def full(node, r):
        call = abi.decode_ioctl(node, r.cmd, r.in_, window=True)
        ref = abi.nested(call)
        if ref is not None and ref.spec is not None and r.xin:
            v = abi.decode_nested(call, r.xin, ref)
            getattr(v, v.spec.fields[0].name)
        return call

    for label, fn in (("decode_ioctl + nested() lookup", lookup),
                      ("... + decode_nested() + one field read", full)):
        times = defaultdict(list)
        for name, node, r in work:
            best = None
            for _ in range(ROUNDS):
                t0 = time.perf_counter_ns()
                for _ in range(REP):
                    fn(node, r)
                dt = (time.perf_counter_ns() - t0) / REP
                best = dt if best is None or dt < best else best
            times[name if not name.startswith("UVM") else "UVM_*"].append(best)
        print(f"\n{label}")
        print(f"{'kind':36s} {'n':>5s} {'p50 us':>7s} {'p90 us':>7s} {'p99 us':>7s}")
        for k, v in sorted(times.items(), key=lambda kv: -len(kv[1])):
            v.sort()
            q = lambda p: v[min(len(v) - 1, int(p * len(v)))] / 1000
            print(f"{k:36s} {len(v):5d} {q(0.5):7.2f} {q(0.9):7.2f} {q(0.99):7.2f}")
        allv = sorted(x for v in times.values() for x in v)
        print(f"{'all ioctls':36s} {len(allv):5d} {statistics.median(allv) / 1000:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
