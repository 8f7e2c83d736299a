"""The pynvml (nvidia-ml-py) client tests/test_nvidia_clients.py runs inside a tenant sandbox.

It loads Debian's libnvidia-ml.so.1 (535.309.01) and prints one JSON object: device count,
and per device index, name, UUID, PCI bus id, memory info and running compute processes.
NVML errors are reported per query (as the NVML error string), never raised, so that the
test can tell "not supported" from a crash.
"""
import json
import sys

import pynvml


def q(fn, *args):
    try:
        return fn(*args)
    except pynvml.NVMLError as e:
        return {"nvml_error": str(e)}


def main() -> int:
    out: dict = {}
    pynvml.nvmlInit()
    try:
        out["driver_version"] = q(pynvml.nvmlSystemGetDriverVersion)
        n = pynvml.nvmlDeviceGetCount()
        out["count"] = n
        out["devices"] = []
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            d = {"index": i, "name": q(pynvml.nvmlDeviceGetName, h),
                 "uuid": q(pynvml.nvmlDeviceGetUUID, h)}
            pci = q(pynvml.nvmlDeviceGetPciInfo, h)
            d["pci_bus_id"] = pci if isinstance(pci, dict) else pci.busId
            mem = q(pynvml.nvmlDeviceGetMemoryInfo, h)
            d["memory"] = mem if isinstance(mem, dict) else {
                "total": mem.total, "used": mem.used, "free": mem.free}
            procs = q(pynvml.nvmlDeviceGetComputeRunningProcesses, h)
            d["processes"] = procs if isinstance(procs, dict) else [
                {"pid": p.pid, "used": p.usedGpuMemory} for p in procs]
            out["devices"].append(d)
    finally:
        pynvml.nvmlShutdown()
    out["shutdown"] = True
    json.dump(out, sys.stdout, default=lambda b: b.decode() if isinstance(b, bytes) else str(b))
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
