"""Managed memory and pinned host memory checks for the H200 run (scripts/gpu/run-h200-uvm.sh).

    uvm_checks.py managed GIB        cupy.cuda.malloc_managed(GIB), filled and summed on the GPU
    uvm_checks.py mix MGIB DGIB      MGIB managed + DGIB cudaMalloc (filled), then 1 GiB more
                                     of each: what each step answered
    uvm_checks.py torch-managed SO N PyTorch through a CUDAPluggableAllocator whose malloc is
                                     cudaMallocManaged (SO): a small model trained N steps
    uvm_checks.py pinned GIB         cudaHostAlloc(GIB) and cudaHostRegister(GIB), then
                                     256 MiB pinned and a GPU copy through it (going on working)
    uvm_checks.py nvml-poll FILE     poll the device's used memory (NVML, host side) every
                                     10 ms until SIGTERM; FILE gets baseline / max / samples

Each check prints JSON lines; the last one is the result (`ok` and what was seen). Every CUDA
error is reported by the name CUDA gives it (cudaErrorMemoryAllocation, ...).
"""
from __future__ import annotations

import json
import signal
import sys
import time

GiB = 1 << 30
MiB = 1 << 20


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def cuda_error(e: BaseException) -> str:
    """The CUDA error's name as CuPy/PyTorch say it (cudaErrorMemoryAllocation, ...)."""
    text = str(e)
    for word in text.replace(":", " ").replace(",", " ").split():
        if word.startswith("cudaError") or word.startswith("CUDA_ERROR"):
            return word
    if "out of memory" in text.lower():
        return "out of memory: " + text[:120]
    return f"{type(e).__name__}: {text[:200]}"


def managed(gib: float) -> None:
    import cupy

    n = int(gib * GiB)
    t0 = time.monotonic()
    try:
        mp = cupy.cuda.malloc_managed(n)
    except Exception as e:  # noqa: BLE001 - the error is the result
        out(check="managed", gib=gib, ok=False, error=cuda_error(e), at="malloc_managed")
        return
    try:
        a = cupy.ndarray((n // 4,), dtype=cupy.float32, memptr=mp)
        a.fill(1.0)
        s = float(a.sum(dtype=cupy.float64))
        cupy.cuda.Device().synchronize()
    except Exception as e:  # noqa: BLE001
        out(check="managed", gib=gib, ok=False, error=cuda_error(e), at="fill/sum")
        return
    out(check="managed", gib=gib, ok=s == n // 4, sum=s, seconds=round(time.monotonic() - t0, 2))


def mix(mgib: float, dgib: float) -> None:
    import cupy

    steps, held = [], []

    def attempt(what: str, gib: float, fn) -> bool:
        try:
            held.append(fn(int(gib * GiB)))
            steps.append({"what": what, "gib": gib, "ok": True})
            return True
        except Exception as e:  # noqa: BLE001
            steps.append({"what": what, "gib": gib, "ok": False, "error": cuda_error(e)})
            return False

    def dev(n):
        m = cupy.cuda.runtime.malloc(n)
        cupy.cuda.runtime.memset(m, 1, n)
        return m

    def man(n):
        mp = cupy.cuda.malloc_managed(n)
        cupy.ndarray((n,), dtype=cupy.uint8, memptr=mp).fill(1)  # resident on the GPU
        return mp

    free0, total = cupy.cuda.runtime.memGetInfo()
    first = attempt("managed", mgib, man) and attempt("cudaMalloc", dgib, dev)
    # What is left of the quota after the context and the two (the tenant's own view)
    free1, _ = cupy.cuda.runtime.memGetInfo()
    more_dev = attempt("cudaMalloc", 1, dev)
    more_man = attempt("managed", 1, man)
    cupy.cuda.Device().synchronize()
    out(check="mix", steps=steps, total=total, free_at_start=free0, free_after=free1,
        ok=first and not more_dev and not more_man)


ALLOCATOR_C = r"""
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <sys/types.h>
void *managed_malloc(ssize_t size, int device, void *stream) {
    void *p = NULL;
    if (cudaMallocManaged(&p, (size_t)size, cudaMemAttachGlobal) != cudaSuccess) return NULL;
    return p;
}
void managed_free(void *p, ssize_t size, int device, void *stream) { cudaFree(p); }
int pointer_kind(void *p) {  /* cudaMemoryTypeManaged (3) for a managed pointer */
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) return -1;
    return (int)a.type;
}
"""


def torch_managed(so: str, steps: int) -> None:
    import torch

    alloc = torch.cuda.memory.CUDAPluggableAllocator(so, "managed_malloc", "managed_free")
    torch.cuda.memory.change_current_allocator(alloc)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(512, 1024, device="cuda")
    y = torch.randint(0, 10, (512,), device="cuda")
    losses = []
    t0 = time.monotonic()
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if i in (0, steps - 1):
            losses.append(float(loss))
    torch.cuda.synchronize()
    # a tensor's memory really is managed: CUDA says so of its pointer
    import ctypes

    lib = ctypes.CDLL(so)
    lib.pointer_kind.argtypes = [ctypes.c_void_p]
    kind = lib.pointer_kind(ctypes.c_void_p(x.data_ptr()))  # 3: cudaMemoryTypeManaged
    out(check="torch-managed", steps=steps, losses=losses, pointer_type=kind,
        seconds=round(time.monotonic() - t0, 2),
        ok=len(losses) == 2 and losses[1] < losses[0] and kind == 3)


def pinned(gib: float) -> None:
    import cupy
    import numpy

    rt = cupy.cuda.runtime
    res = {}
    try:
        p = rt.hostAlloc(int(gib * GiB), 0)
        res["hostAlloc"] = "ok"
        rt.freeHost(p)
    except Exception as e:  # noqa: BLE001
        res["hostAlloc"] = cuda_error(e)
    buf = numpy.ones(int(gib * GiB) // 8, dtype=numpy.float64)
    try:
        rt.hostRegister(buf.ctypes.data, buf.nbytes, 0)
        res["hostRegister"] = "ok"
        rt.hostUnregister(buf.ctypes.data)
    except Exception as e:  # noqa: BLE001
        res["hostRegister"] = cuda_error(e)
    del buf
    # and it goes on working: a smaller pinned buffer, a copy to the GPU and back
    try:
        n = 256 * MiB
        p = rt.hostAlloc(n, 0)
        d = cupy.arange(n, dtype=cupy.uint8)
        rt.memcpy(p, d.data.ptr, n, rt.memcpyDeviceToHost)
        back = cupy.empty(n, dtype=cupy.uint8)
        rt.memcpy(back.data.ptr, p, n, rt.memcpyHostToDevice)
        res["after"] = "ok" if bool((back == d).all()) else "data differs"
        rt.freeHost(p)
    except Exception as e:  # noqa: BLE001
        res["after"] = cuda_error(e)
    out(check="pinned", gib=gib, **res,
        ok=res["hostAlloc"] == "cudaErrorMemoryAllocation" and res["after"] == "ok")


def nvml_poll(path: str) -> None:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    base = pynvml.nvmlDeviceGetMemoryInfo(h).used
    peak, n, stop = base, 0, []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    while not stop:
        used = pynvml.nvmlDeviceGetMemoryInfo(h).used
        peak = max(peak, used)
        n += 1
        time.sleep(0.01)
    with open(path, "w") as f:
        json.dump({"baseline": base, "max_used": peak, "max_above_baseline": peak - base,
                   "samples": n}, f)


def main(argv: list[str]) -> None:
    cmd, args = argv[0], argv[1:]
    if cmd == "managed":
        managed(float(args[0]))
    elif cmd == "mix":
        mix(float(args[0]), float(args[1]))
    elif cmd == "torch-managed":
        torch_managed(args[0], int(args[1]))
    elif cmd == "pinned":
        pinned(float(args[0]))
    elif cmd == "nvml-poll":
        nvml_poll(args[0])
    elif cmd == "allocator-source":
        sys.stdout.write(ALLOCATOR_C)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
