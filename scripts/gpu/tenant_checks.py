"""Checks run *inside* a tenant sandbox (or natively, for the baseline) on the H200.

    python3 tenant_checks.py nvml            # pynvml: init, count, name, UUID, memory, processes
    python3 tenant_checks.py dangerous       # privileged/dangerous calls; prints how each was refused
    python3 tenant_checks.py bench-nvml N    # NVML init sequence N times: p50/p90 (µs)
    python3 tenant_checks.py bench-control N [GAP_US]
                                             # one RM_CONTROL (FB_GET_INFO_V2) N times: p50/p90 (µs);
                                             # GAP_US: sleep that long between calls (a CUDA
                                             # init's pace: the CPUs go idle between calls)
    python3 tenant_checks.py dup-handle      # RM_ALLOC of a subdevice with a handle the client holds

Each prints one JSON object on stdout.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import statistics
import sys
import time


def nvml() -> dict:
    import pynvml as n

    out: dict = {"pid_in_ns": os.getpid()}
    try:
        n.nvmlInit()
    except n.NVMLError as e:
        return {"init": f"error: {e}"}
    out["init"] = "ok"
    out["driver"] = _s(n.nvmlSystemGetDriverVersion())
    cnt = n.nvmlDeviceGetCount()
    out["count"] = cnt
    out["gpus"] = []
    for i in range(cnt):
        h = n.nvmlDeviceGetHandleByIndex(i)
        g: dict = {"index": i}
        for key, fn in (("name", n.nvmlDeviceGetName), ("uuid", n.nvmlDeviceGetUUID)):
            try:
                g[key] = _s(fn(h))
            except n.NVMLError as e:
                g[key] = f"error: {e}"
        try:
            m = n.nvmlDeviceGetMemoryInfo(h)
            g["memory"] = {"total": m.total, "used": m.used, "free": m.free}
        except n.NVMLError as e:
            g["memory"] = f"error: {e}"
        for key, fn in (("compute_procs", n.nvmlDeviceGetComputeRunningProcesses),
                        ("graphics_procs", n.nvmlDeviceGetGraphicsRunningProcesses)):
            try:
                g[key] = [{"pid": p.pid, "used": p.usedGpuMemory} for p in fn(h)]
            except n.NVMLError as e:
                g[key] = f"error: {e}"
        out["gpus"].append(g)
    n.nvmlShutdown()
    return out


def _s(x):
    return x.decode() if isinstance(x, bytes) else x


def dangerous() -> dict:
    """Each privileged or dangerous operation of the issue, sent the way a client would."""
    from devbroker.abi import iowr
    from devbroker.tools.probe import Client, NvError

    out = {}
    c = Client()
    c.check_version()
    c.open_root()
    ids = c.attached_ids()
    g = c.open_gpu(ids[0]) if ids else None

    def rec(name, fn):
        try:
            r = fn()
            out[name] = {"result": "accepted", "detail": str(r)}
        except NvError as e:
            from devbroker.abi import status as nvs
            out[name] = {"result": "refused", "status": nvs.name(e.status)}
        except OSError as e:
            out[name] = {"result": "refused", "errno": e.errno, "strerror": e.strerror}

    if g:
        hsub = g["hsubdevice"]
        rec("ECC SET_ECC_CONFIGURATION 0x20800134",
            lambda: c.control(hsub, 0x20800134, c.params(0x20800134)))
        rec("ECC RESET_ECC_ERROR_STATUS 0x20800136",
            lambda: c.control(hsub, 0x20800136, c.params(0x20800136)))
        rec("debugger class GT200_DEBUGGER 0x83de",
            lambda: c.alloc(hsub, 0x83DE, c.new("NV83DE_ALLOC_PARAMETERS")))

    def registry_access():
        v = c.new("NVOS38_PARAMETERS" if "NVOS38_PARAMETERS" in c.abi.structs else
                  c.abi.escape("NV_ESC_RM_ACCESS_REGISTRY").params.name,
                  hClient=c.hclient, hObject=c.hclient)
        return c.escape(c.ctl, "NV_ESC_RM_ACCESS_REGISTRY", v)

    rec("RM_ACCESS_REGISTRY escape 0x4d", registry_access)

    def sys_params():
        v = c.new(c.abi.escape("NV_ESC_SYS_PARAMS").params.name, memblock_size=1 << 20)
        return c.escape(c.ctl, "NV_ESC_SYS_PARAMS", v).memblock_size

    rec("SYS_PARAMS memblock_size=1MiB", sys_params)
    c.close()
    return out


def _stats(ts: list[float]) -> dict:
    ts = sorted(ts)
    return {"n": len(ts), "p50_us": round(statistics.median(ts) * 1e6, 1),
            "p90_us": round(ts[int(len(ts) * 0.9) - 1] * 1e6, 1),
            "min_us": round(ts[0] * 1e6, 1), "mean_us": round(statistics.fmean(ts) * 1e6, 1)}


def bench_nvml(n: int) -> dict:
    import pynvml as nv

    ts = []
    for i in range(n + 2):
        t0 = time.perf_counter()
        nv.nvmlInit()
        h = nv.nvmlDeviceGetHandleByIndex(0)
        nv.nvmlDeviceGetMemoryInfo(h)
        nv.nvmlShutdown()
        if i >= 2:  # two warm-up rounds (library load, first GPU open)
            ts.append(time.perf_counter() - t0)
    return {"what": "nvmlInit + GetHandleByIndex(0) + GetMemoryInfo + nvmlShutdown",
            **_stats(ts)}


def bench_control(n: int, gap_us: int = 0) -> dict:
    from devbroker.tools.probe import Client

    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    p = c.params(0x20801303)
    entries = list(p.fbInfoList)
    entries[0] = entries[0].replace(index=0x08)
    p = p.replace(fbInfoListSize=1, fbInfoList=entries)
    ts = []
    for i in range(n + 10):
        if gap_us:
            time.sleep(gap_us / 1e6)
        t0 = time.perf_counter()
        c.control(g["hsubdevice"], 0x20801303, p)
        if i >= 10:
            ts.append(time.perf_counter() - t0)
    c.close()
    return {"what": "RM_CONTROL NV2080_CTRL_CMD_FB_GET_INFO_V2 (1 entry)", "gap_us": gap_us,
            **_stats(ts)}


def dup_handle() -> dict:
    """The driver's answer to an allocation naming a handle its client already holds: a
    subdevice under the device open_gpu made, first with the subdevice's own handle, then
    with the device's (through devbroker with settled allocations, the loop admits both and
    the driver must refuse them — NV_ERR_INSERT_DUPLICATE_NAME, the general path's answer);
    then frees of the device's subdevice and the device, which must find them as before."""
    from devbroker.tools.probe import Client, NvError

    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    out: dict = {}
    for what, handle in (("dup_subdevice", g["hsubdevice"]), ("dup_device", g["hdevice"])):
        try:
            c.alloc(g["hdevice"], 0x2080, c.new("NV2080_ALLOC_PARAMETERS", subDeviceId=0),
                    handle=handle)
            out[what] = 0
        except NvError as e:
            out[what] = e.status
    out["name_after"] = c.control(g["hsubdevice"], 0x20800110,
                                  c.params(0x20800110)).gpuNameString.raw[:12].hex()
    out["free_subdevice"] = c.free(g["hdevice"], g["hsubdevice"])
    out["free_device"] = c.free(c.hclient, g["hdevice"])
    c.close()
    return out


def main(argv: list[str]) -> int:
    what = argv[0]
    n = int(argv[1]) if len(argv) > 1 else 20
    fn = {"nvml": nvml, "dangerous": dangerous, "dup-handle": dup_handle}.get(what)
    if fn is not None:
        res = fn()
    elif what == "bench-nvml":
        res = bench_nvml(n)
    elif what == "bench-control":
        res = bench_control(n, int(argv[2]) if len(argv) > 2 else 0)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
