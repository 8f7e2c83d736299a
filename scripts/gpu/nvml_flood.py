"""NVML queries in a loop, for scripts/gpu/run-h200-nvml-load.sh (issue 51 item 12).

    python3 nvml_flood.py flood SECONDS START_AT [TAG]   # one process's query loop
    python3 nvml_flood.py verdict ALONE.json LOADED.json FLOOD1.json ... AUDIT.log TENANT

`flood` waits for START_AT (a wall-clock epoch shared with the trainer), then loops on what a
monitoring agent asks — utilization (nvmlDeviceGetUtilizationRates, whose fallback sent the
unpublished 0x2080a097 under load), memory, the running processes — as fast as the broker
answers (the tenant's rate limit paces it), and prints one JSON object: queries made, errors
by NVML error name (none expected), the utilization values seen.

`verdict` prints one JSON object: the trainer's throughput next to the flood against alone
(within 1 % is the issue's bar), the flood's queries and errors, and the tenant's refusals
in the audit log (none expected: load may delay a call, never refuse it).
"""
from __future__ import annotations

import json
import sys
import time


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def flood(seconds: str, start_at: str, tag: str = "") -> None:
    import pynvml as nv

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    now = time.time()
    if now < float(start_at):
        time.sleep(float(start_at) - now)
    end = time.time() + float(seconds)
    queries, errors, util = 0, {}, []
    while time.time() < end:
        for q in (lambda: nv.nvmlDeviceGetUtilizationRates(h),
                  lambda: nv.nvmlDeviceGetMemoryInfo(h),
                  lambda: nv.nvmlDeviceGetComputeRunningProcesses(h)):
            try:
                r = q()
                if hasattr(r, "gpu") and len(util) < 10000:
                    util.append(r.gpu)
            except nv.NVMLError as e:
                name = type(e).__name__
                errors[name] = errors.get(name, 0) + 1
            queries += 1
    nv.nvmlShutdown()
    out(what="nvml-flood", tag=tag, queries=queries, errors=errors,
        util_max=max(util) if util else None, util_samples=len(util))


def _last_json(path: str) -> dict:
    try:
        lines = [ln for ln in open(path).read().splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {}
    except OSError:
        return {}


def _rate(r: dict) -> float:
    """Matmuls per second over the bins, the first second left out (warm-up)."""
    bins, bin_s = r.get("bins") or [], r.get("bin_s", 0.25)
    skip = int(1.0 / bin_s)
    kept = bins[skip:-1] or bins
    return sum(kept) / (len(kept) * bin_s) if kept else 0.0


def verdict(alone: str, loaded: str, *rest: str) -> None:
    *floods, audit, tenant = rest
    a, b = _rate(_last_json(alone)), _rate(_last_json(loaded))
    fl = [_last_json(f) for f in floods]
    refusals = []
    try:
        for line in open(audit):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("tenant") == tenant and r.get("event") in ("deny", "error"):
                refusals.append(f"{r.get('event')}: {r.get('what')}: {r.get('reason')}"[:300])
    except OSError as e:
        refusals.append(f"no audit log: {e}")
    errors = {}
    for f in fl:
        for k, v in (f.get("errors") or {}).items():
            errors[k] = errors.get(k, 0) + v
    slowdown = (1 - b / a) if a else None
    out(ok=bool(a and b and slowdown is not None and slowdown <= 0.01 and not errors
                and not refusals and all(f.get("queries") for f in fl)),
        trainer_alone_mm_s=round(a, 2), trainer_loaded_mm_s=round(b, 2),
        slowdown_pct=round(slowdown * 100, 2) if slowdown is not None else None,
        flood_queries=[f.get("queries") for f in fl], flood_errors=errors,
        refusals=len(refusals), refusal_examples=refusals[:5])


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"flood": flood, "verdict": verdict}[cmd](*args)
