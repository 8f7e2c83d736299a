"""Why NV0000_CTRL_CMD_GPU_GET_PROBED_IDS (and NV01_DEVICE_0) cost the broker ~300-500 µs
where a native NVML process sees ~8 µs (nvml_probe.sh, `kinds-nvml.txt`): the same control
timed in one plain process, (a) as it starts (root, every capability), (b) after this
thread dropped every capability (as the broker's driver calls run: tenantfile.NoCapsExecutor),
(c) the same with 3,000 more open files in the process (the broker holds pidfds and
duplicates; the driver scans the caller's fd table for some checks: nv_is_gpu_accessible),
(d) with a file of the GPU held open. GET_ATTACHED_IDS (laned too, ~115 µs over native
through devbroker) beside it for comparison. Prints one JSON line per case: p50/p90 µs of
300 calls each.

    python3 scripts/gpu/probed_probe.py
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from devbroker.backends.tenantfile import drop_thread_capabilities
from devbroker.tools.probe import Client

PROBED, ATTACHED = 0x214, 0x201


def timed(c: Client, cmd: int, n: int = 300) -> dict:
    p = c.params(cmd)
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        c.control(c.hclient, cmd, p)
        out.append((time.perf_counter_ns() - t) / 1e3)
    out.sort()
    return {"p50_us": round(statistics.median(out), 1), "p90_us": round(out[int(n * 0.9)], 1)}


def case(what: str, c: Client) -> None:
    print(json.dumps({"what": what, "probed": timed(c, PROBED), "attached": timed(c, ATTACHED),
                      "fds": len(os.listdir("/proc/self/fd"))}), flush=True)


def main() -> int:
    c = Client()
    c.check_version()
    c.open_root()
    case("a root, all capabilities", c)
    gpu = os.open("/dev/nvidia0", os.O_RDWR)
    case("d GPU file held", c)
    os.close(gpu)
    extra = [os.open("/dev/null", os.O_RDONLY) for _ in range(3000)]
    case("c 3000 more files", c)
    for fd in extra:
        os.close(fd)
    import threading

    def dropped() -> None:
        drop_thread_capabilities()
        case("b this thread without capabilities", c)
        extra = [os.open("/dev/null", os.O_RDONLY) for _ in range(3000)]
        case("b+c without capabilities, 3000 more files", c)
        for fd in extra:
            os.close(fd)

    t = threading.Thread(target=dropped)
    t.start()
    t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
