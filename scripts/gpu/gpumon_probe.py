"""An H200 experiment for issue 15 (no broker): can an unprivileged client see which process
keeps the GPU busy, and how often? Polls NV2080_CTRL_CMD_PERF_GET_GPUMON_PERFMON_UTIL_SAMPLES_V2
(NON_PRIVILEGED; NVML's nvmlDeviceGetProcessUtilization) on its own subdevice every 0.1 s while
a matmul loop and then a latency loop (scripts/gpu/compute_workload.py) run, and prints what
the samples say: their spacing, and per process the samples naming it and its mean GR
utilisation. A work-conserving preemption (compute.py) would need such a signal.

    python3 scripts/gpu/gpumon_probe.py [SECONDS]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from devbroker.tools.probe import Client, NvError

CMD = 0x20802096
TYPE_PERFMON_UTIL = 2
WL = [sys.executable, os.path.join(os.path.dirname(__file__), "compute_workload.py")]


def main(seconds: float = 16.0) -> int:
    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    spec = c.abi.control(CMD).params
    buf = spec.by_name["samples"].size
    t0 = time.time()
    mm = subprocess.Popen(WL + ["matmul", "5", f"{t0 + 6:.3f}", "matmul"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    lat = subprocess.Popen(WL + ["latency", "3", f"{t0 + 12:.3f}", "latency"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    print(json.dumps({"what": "pids", "matmul": mm.pid, "latency": lat.pid,
                      "matmul_window": [t0 + 6, t0 + 11], "latency_window": [t0 + 12, t0 + 15]}),
          flush=True)
    tracker, last_ts, rows, errors = 0, 0, [], {}
    calls = []
    end = t0 + seconds
    while time.time() < end:
        p = spec.decode(bytes(spec.size)).replace(type=TYPE_PERFMON_UTIL, bufSize=buf,
                                                  tracker=tracker)
        s = time.perf_counter()
        try:
            out = c.control(g["hsubdevice"], CMD, p)
        except NvError as e:
            errors[str(e)] = errors.get(str(e), 0) + 1
            time.sleep(0.1)
            continue
        calls.append(time.perf_counter() - s)
        tracker = int(out.tracker)
        for smp in out.samples:
            ts = int(smp.base.timeStamp)
            if ts > last_ts:
                rows.append((ts, int(smp.gr.util), int(smp.gr.procId), int(smp.fb.util),
                             int(smp.fb.procId)))
        if rows:
            last_ts = max(r[0] for r in rows)
        time.sleep(0.1)
    mm.wait()
    lat.wait()
    rows.sort()
    gaps = [(b[0] - a[0]) / 1e6 for a, b in zip(rows, rows[1:])]
    by_pid: dict[int, list[int]] = {}
    for _ts, util, pid, _fbu, _fbp in rows:
        by_pid.setdefault(pid, []).append(util)
    print(json.dumps({
        "what": "summary", "errors": errors, "samples": len(rows),
        "control_ms_p50": round(statistics.median(calls) * 1e3, 3) if calls else None,
        "sample_gap_ms_p50": round(statistics.median(gaps), 3) if gaps else None,
        "per_pid": {str(pid): {"samples": len(u), "gr_util_mean_pct": round(statistics.fmean(u) / 100, 2)}
                    for pid, u in by_pid.items()},
        "first_rows": rows[:3], "last_rows": rows[-3:]}), flush=True)
    # the timeline in 0.5 s bins: which pid the samples name, mean GR util
    start = rows[0][0] if rows else 0
    bins: dict[int, list] = {}
    for ts, util, pid, *_ in rows:
        bins.setdefault(int((ts - start) / 5e8), []).append((pid, util))
    for k in sorted(bins):
        v = bins[k]
        print(json.dumps({"what": "bin", "t_s": k * 0.5, "n": len(v),
                          "pids": sorted({p for p, _u in v}),
                          "gr_util_pct": round(statistics.fmean(u for _p, u in v) / 100, 2)}))
    for pr, tag in ((mm, "matmul"), (lat, "latency")):
        line = [x for x in (pr.stdout.read() or "").splitlines() if x.startswith("{")]
        print(json.dumps({"what": tag, "result": json.loads(line[-1]) if line else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*(float(a) for a in sys.argv[1:])))
