"""Tenant workloads and the analysis for scripts/gpu/compute_shares.sh (issue 15).

    python3 compute_workload.py matmul SECONDS START_AT [TAG]   # continuous bf16 matmuls
    python3 compute_workload.py latency SECONDS START_AT [TAG]  # small kernels + synchronize
    python3 compute_workload.py ratio A.json B.json [FROM TO]   # A's throughput / B's
    python3 compute_workload.py settle A.json B.json AT TARGET  # ratio before/after AT
    python3 compute_workload.py pct LAT.json BASE.json          # p50 vs a baseline

Workloads warm up (CUDA context, first matmul), wait for START_AT (a wall-clock epoch shared
by the tenants of one measurement, so their windows coincide), run for SECONDS and print one
JSON object: throughput in 250 ms bins from START_AT (matmul) or step-time percentiles
(latency). The analysis reads those objects and prints one JSON object.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

N = 8192  # bf16 matmul size: ~1.1 TFLOP each, ~1.6 ms on an H200 alone
BATCH = int(os.environ.get("MATMUL_BATCH", 4))  # matmuls between synchronizations
BIN_S = 0.25


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _wait(start_at: float) -> float:
    """Sleep until start_at; returns the epoch the measurement starts (later if late)."""
    now = time.time()
    if now < start_at:
        time.sleep(start_at - now)
        return start_at
    return now


def matmul(seconds: str, start_at: str, tag: str = "") -> None:
    import torch

    secs, at = float(seconds), float(start_at)
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    ready = time.time()
    t0 = _wait(at)
    bins = [0] * (int(secs / BIN_S) + 1)
    end = t0 + secs
    while True:
        for _ in range(BATCH):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        now = time.time()
        if now >= end:
            break
        bins[int((now - t0) / BIN_S)] += BATCH
    total = sum(bins)
    out(what="matmul", ok=True, tag=tag, pid=os.getpid(), start=t0, seconds=secs,
        late_s=round(max(0.0, ready - at), 3), bin_s=BIN_S, bins=bins, matmuls=total,
        tflops=round(total * 2 * N ** 3 / secs / 1e12, 1))


def latency(seconds: str, start_at: str, tag: str = "") -> None:
    import torch

    secs, at = float(seconds), float(start_at)
    x = torch.zeros(1024, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    ready = time.time()
    t0 = _wait(at)
    end = t0 + secs
    steps: list[float] = []
    while time.time() < end:
        s = time.perf_counter()
        for _ in range(4):
            x.add_(1)
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - s)
    steps.sort()

    def pct(q: float) -> float:
        return round(steps[min(len(steps) - 1, int(q * len(steps)))] * 1e6, 1)

    out(what="latency", ok=bool(steps), tag=tag, pid=os.getpid(), start=t0, seconds=secs,
        late_s=round(max(0.0, ready - at), 3), steps=len(steps), p50_us=pct(0.5),
        p90_us=pct(0.9), p99_us=pct(0.99), mean_us=round(statistics.fmean(steps) * 1e6, 1))


# --------------------------------------------------------------------------- analysis
def _load(path: str) -> dict:
    lines = [ln for ln in open(path).read().splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(json.dumps({"ok": False, "error": f"no result in {path}"}))
    return json.loads(lines[-1])


def _rate(r: dict, t_from: float, t_to: float) -> float:
    """Matmuls per second in the bins wholly inside [t_from, t_to] (epoch seconds)."""
    n = secs = 0.0
    for i, count in enumerate(r["bins"]):
        lo = r["start"] + i * r["bin_s"]
        if lo >= t_from and lo + r["bin_s"] <= t_to:
            n += count
            secs += r["bin_s"]
    return n / secs if secs else 0.0


def _window(a: dict, b: dict, skip: float = 1.0) -> tuple[float, float]:
    lo = max(a["start"], b["start"]) + skip
    hi = min(a["start"] + a["seconds"], b["start"] + b["seconds"]) - skip
    return lo, hi


def ratio(a_path: str, b_path: str, t_from: str = "", t_to: str = "") -> None:
    a, b = _load(a_path), _load(b_path)
    lo, hi = _window(a, b)
    if t_from:
        lo, hi = max(lo, float(t_from)), min(hi, float(t_to))
    ra, rb = _rate(a, lo, hi), _rate(b, lo, hi)
    tf = 2 * N ** 3 / 1e12
    out(ok=rb > 0, window_s=round(hi - lo, 2), a_tflops=round(ra * tf, 1),
        b_tflops=round(rb * tf, 1), sum_tflops=round((ra + rb) * tf, 1),
        ratio=round(ra / rb, 3) if rb else None, late_s=[a.get("late_s"), b.get("late_s")])


def settle(a_path: str, b_path: str, at: str, target: str) -> None:
    """Ratio before and after a policy change applied at `at`, and how long after it the
    ratio over a sliding 0.5 s window first came within ±10 % of `target` and stayed there
    for the next second."""
    a, b = _load(a_path), _load(b_path)
    lo, hi = _window(a, b, skip=0.5)
    t_at, want = float(at), float(target)
    before = _rate(a, lo, t_at - 0.25) / max(_rate(b, lo, t_at - 0.25), 1e-9)
    after = _rate(a, t_at + 1.0, hi) / max(_rate(b, t_at + 1.0, hi), 1e-9)
    settled = None
    t = t_at
    while t + 1.5 <= hi:
        ok = all(abs(_rate(a, s, s + 0.5) / max(_rate(b, s, s + 0.5), 1e-9) - want)
                 <= 0.1 * want for s in (t, t + 0.5, t + 1.0))
        if ok:
            settled = round(t - t_at + 0.5, 2)  # the end of the first good window
            break
        t += BIN_S
    series = []
    s = lo
    while s + 0.5 <= hi:
        rb_ = _rate(b, s, s + 0.5)
        series.append(round(_rate(a, s, s + 0.5) / rb_, 2) if rb_ else None)
        s += 0.5
    out(ok=True, ratio_before=round(before, 3), ratio_after=round(after, 3), target=want,
        settled_within_s=settled, ratio_every_half_second_from_start=series)


def pct(lat_path: str, base_path: str) -> None:
    lat, base = _load(lat_path), _load(base_path)
    out(ok=True, p50_us=lat["p50_us"], alone_p50_us=base["p50_us"],
        p50_vs_alone=round(lat["p50_us"] / base["p50_us"], 3), p99_us=lat["p99_us"],
        alone_p99_us=base["p99_us"], steps=lat["steps"])


COMMANDS = {"matmul": matmul, "latency": latency, "ratio": ratio, "settle": settle, "pct": pct}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    COMMANDS[sys.argv[1]](*sys.argv[2:])
