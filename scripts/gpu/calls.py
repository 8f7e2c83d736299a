"""Per-call broker time from a broker's metrics endpoint (the GPU probes' helper).

    calls.py snap URL FILE          save the endpoint's call-duration sums and counts
    calls.py diff BEFORE AFTER N    what was spent between two snapshots, per call, top 30,
                                    divided into N sequences (runs of the measured program)
"""
from __future__ import annotations

import json
import re
import sys
import urllib.request

ROW = re.compile(r'devbroker_call_duration_seconds_(sum|count)\{(.*)\} (\S+)')


def snap(url: str, path: str) -> None:
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        m = ROW.match(line)
        if m:
            (sums if m.group(1) == "sum" else counts)[m.group(2)] = float(m.group(3))
    json.dump({"sums": sums, "counts": counts}, open(path, "w"))


def diff(before: str, after: str, n: int) -> None:
    a, b = json.load(open(before)), json.load(open(after))
    rows = []
    for k, s in b["sums"].items():
        ds = s - a["sums"].get(k, 0.0)
        dc = b["counts"].get(k, 0.0) - a["counts"].get(k, 0.0)
        if dc > 0:
            rows.append((ds, dc, k))
    rows.sort(reverse=True)
    tot = sum(r[0] for r in rows)
    print(f"all calls: {tot * 1e3:.1f} ms over {n} runs ({tot * 1e3 / n:.2f} ms per run)")
    for s, c, k in rows[:30]:
        print(f"{s * 1e3 / n:8.3f} ms/run {c / n:7.1f} calls/run {s / c * 1e6:8.1f} us/call  {k}")


if __name__ == "__main__":
    if sys.argv[1] == "snap":
        snap(sys.argv[2], sys.argv[3])
    else:
        diff(sys.argv[2], sys.argv[3], int(sys.argv[4]))
