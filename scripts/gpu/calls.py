"""Per-call broker time from a broker's metrics endpoint (the GPU probes' helper).

    calls.py snap URL FILE          save the endpoint's call-duration sums and counts
    calls.py diff BEFORE AFTER N    what was spent between two snapshots, per call, top 30,
                                    divided into N sequences (runs of the measured program)
    calls.py kinds DIR NATIVE DEV VERSION
                                    systime.so's per-kind NVIDIA ioctl times (SYSTIME_KINDS)
                                    of the files DIR/NATIVE*.jsonl against DIR/DEV*.jsonl:
                                    per call kind, calls and ms per run on each side and the
                                    difference, largest difference first (the tenant's view:
                                    what the broker adds to each kind of call)
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


def _kinds(paths: list[str]) -> tuple[dict[str, list[float]], int]:
    """Sum of the measured program's per-kind rows over these files (in each file, the
    process with the most NVIDIA ioctls), and how many programs were summed."""
    out: dict[str, list[float]] = {}
    n = 0
    for path in paths:
        recs = [json.loads(line) for line in open(path) if line.strip()]
        recs = [r for r in recs if r.get("kinds")]
        if not recs:
            continue
        r = max(recs, key=lambda r: r["ioctl_nvidia"][0])
        n += 1
        for key, count, ms in r["kinds"]:
            row = out.setdefault(key, [0.0, 0.0])
            row[0] += count
            row[1] += ms
        for key in _TOTALS:  # the process's other system calls, one row each (not ioctls)
            row = out.setdefault("=" + key, [0.0, 0.0])
            row[0] += r.get(key, [0, 0])[0]
            row[1] += r.get(key, [0, 0])[1]
    return out, n


# systime.c's totals besides the NVIDIA ioctls (rows "=name" of the kinds table)
_TOTALS = ("open_nvidia", "open_other", "ioctl_other", "mmap_nvidia", "mmap_other", "close")


def _kind_name(key: str, abi) -> str:
    if key.startswith("="):
        return key[1:] + " (all such system calls)"
    if abi is None:
        return key
    if key.startswith("U"):
        op = abi.uvm(int(key[1:], 16))
        return op.name if op is not None else key
    nr, _, sub = key[1:].partition("/")
    op = abi.escape(int(nr, 16))
    name = op.name if op is not None else key
    if sub:
        x = int(sub, 16)
        name += " " + (abi.control_name(x) if name == "NV_ESC_RM_CONTROL" else abi.class_name(x))
    return name


def kinds(folder: str, native: str, dev: str, version: str) -> None:
    import glob
    import os
    try:
        from devbroker.abi import registry
        abi = registry.get(version)
    except Exception as e:  # noqa: BLE001 - names are a convenience
        print(f"(no ABI tables for {version}: {e}; raw keys)")
        abi = None
    nat, nn = _kinds(sorted(glob.glob(os.path.join(folder, native + "*.jsonl"))))
    got, nd = _kinds(sorted(glob.glob(os.path.join(folder, dev + "*.jsonl"))))
    if not nn or not nd:
        print(f"no per-kind records ({native}: {nn}, {dev}: {nd}): SYSTIME_KINDS unset?")
        return
    rows = []
    for key in set(nat) | set(got):
        a, b = nat.get(key, [0, 0]), got.get(key, [0, 0])
        rows.append((b[1] / nd - a[1] / nn, key, a[0] / nn, a[1] / nn, b[0] / nd, b[1] / nd))
    rows.sort(reverse=True)
    tn = sum(r[3] for r in rows if not r[1].startswith("="))
    td = sum(r[5] for r in rows if not r[1].startswith("="))
    print(f"per run ({nn} native, {nd} devbroker): NVIDIA ioctls {tn:.1f} ms native, "
          f"{td:.1f} ms devbroker, +{td - tn:.1f} ms")
    print("  extra ms   native: calls     ms   devbroker: calls     ms   us/call extra  kind")
    for extra, key, ca, ma, cb, mb in rows:
        per = (mb / cb - ma / ca) * 1e3 if ca and cb else float("nan")
        print(f"{extra:9.2f}   {ca:13.1f} {ma:7.2f}   {cb:16.1f} {mb:7.2f}   {per:13.1f}  "
              f"{_kind_name(key, abi)}")


if __name__ == "__main__":
    if sys.argv[1] == "snap":
        snap(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "kinds":
        kinds(*sys.argv[2:6])
    else:
        diff(sys.argv[2], sys.argv[3], int(sys.argv[4]))
