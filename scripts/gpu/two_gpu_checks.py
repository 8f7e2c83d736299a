"""Checks for two GPUs on one host (issue 16), run inside a tenant (or natively).

    python3 two_gpu_checks.py view            # torch + pynvml + /proc view: GPUs by UUID, PCI
    python3 two_gpu_checks.py reach OTHER_UUID OTHER_PCI OTHER_MINOR
                                              # every route to a GPU that is not the tenant's
    python3 two_gpu_checks.py quota GIB       # on each visible GPU: GIB-1 ok, GIB+1 refused
    python3 two_gpu_checks.py ddp STEPS       # under torchrun: NCCL all-reduce, CUDA IPC

Each prints one JSON object on its last line.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time

GiB = 1 << 30


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def view() -> None:
    import pynvml as n
    import torch

    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append({"index": i, "name": p.name, "uuid": "GPU-" + str(p.uuid),
                     "pci_bus_id": f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:"
                                   f"{p.pci_device_id:02x}.0",
                     "total": total, "free": free})
    n.nvmlInit()
    nv = []
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        u = n.nvmlDeviceGetUUID(h)
        pci = n.nvmlDeviceGetPciInfo(h).busId
        m = n.nvmlDeviceGetMemoryInfo(h)
        nv.append({"uuid": u.decode() if isinstance(u, bytes) else u,
                   "pci_bus_id": pci.decode() if isinstance(pci, bytes) else pci,
                   "total": m.total})
    n.nvmlShutdown()
    out(torch=gpus, nvml=nv, nodes=sorted(glob.glob("/dev/nvidia[0-9]*")),
        proc_gpus=sorted(os.listdir("/proc/driver/nvidia/gpus"))
        if os.path.isdir("/proc/driver/nvidia/gpus") else None)


def reach(other_uuid: str, other_pci: str, other_minor: int) -> None:
    """Every way this harness knows to get at a GPU that is not the tenant's."""
    import errno
    import stat

    from devbroker.tools.probe import Client, NvError

    res: dict = {}
    node = f"/dev/nvidia{other_minor}"
    try:
        fd = os.open(node, os.O_RDWR)
        os.close(fd)
        res["open_node"] = "OPENED"
    except OSError as e:
        res["open_node"] = errno.errorcode.get(e.errno, str(e.errno))
    try:
        os.mknod("/tmp/nv-other", stat.S_IFCHR | 0o666, os.makedev(195, other_minor))
        try:
            fd = os.open("/tmp/nv-other", os.O_RDWR)
            os.close(fd)
            res["mknod_open"] = "OPENED"
        except OSError as e:
            res["mknod_open"] = "made, open " + errno.errorcode.get(e.errno, str(e.errno))
    except OSError as e:
        res["mknod_open"] = errno.errorcode.get(e.errno, str(e.errno))
    c = Client()
    c.check_version()
    c.open_root()
    ids = c.attached_ids()
    res["attached_ids"] = [hex(i) for i in ids]
    probed = c.control(c.hclient, 0x214, c.params(0x214))
    res["probed_ids"] = [hex(i) for i in probed.gpuIds if i != 0xFFFFFFFF]
    # The other GPU's id, as the driver numbers GPUs: domain<<16 | bus<<8 | device
    dom, bus, rest = other_pci.split(":")[-3:]
    other_id = (int(dom, 16) << 16) | (int(bus, 16) << 8) | int(rest.split(".")[0], 16)
    res["other_gpu_id"] = hex(other_id)
    for name, cmd, fields in (("id_info_v2", 0x205, {"gpuId": other_id}),
                              ("pci_info", 0x21B, {"gpuId": other_id})):
        try:
            c.control(c.hclient, cmd, c.params(cmd, **fields))
            res[name] = "ANSWERED"
        except NvError as e:
            res[name] = f"refused {e.status:#x}"
        except (OSError, KeyError, AttributeError) as e:
            res[name] = f"refused {e}"
    try:
        c.alloc(c.hclient, 0x80, c.new("NV0080_ALLOC_PARAMETERS", deviceId=other_minor))
        res["device_alloc"] = "ALLOCATED"
    except NvError as e:
        res["device_alloc"] = f"refused {e.status:#x}"
    except OSError as e:
        res["device_alloc"] = f"refused {e}"
    res["proc_view"] = sorted(os.listdir("/proc/driver/nvidia/gpus")) \
        if os.path.isdir("/proc/driver/nvidia/gpus") else None
    res["proc_other_visible"] = bool(res["proc_view"] and any(
        other_pci.lower() in p.lower() for p in res["proc_view"]))
    try:
        import pynvml as n
        n.nvmlInit()
        try:
            n.nvmlDeviceGetHandleByUUID(other_uuid)
            res["nvml_by_uuid"] = "FOUND"
        except n.NVMLError as e:
            res["nvml_by_uuid"] = f"refused {e}"
        try:
            n.nvmlDeviceGetHandleByPciBusId(other_pci)
            res["nvml_by_pci"] = "FOUND"
        except n.NVMLError as e:
            res["nvml_by_pci"] = f"refused {e}"
        n.nvmlShutdown()
    except Exception as e:  # noqa: BLE001
        res["nvml"] = f"error {e}"
    bad = [k for k, v in res.items() if isinstance(v, str) and v in ("OPENED", "ANSWERED",
                                                                        "ALLOCATED", "FOUND")]
    bad += ["probed_ids"] if other_id in [int(x, 16) for x in res["probed_ids"]] else []
    bad += ["attached_ids"] if other_id in ids else []
    bad += ["proc_view"] if res["proc_other_visible"] else []
    out(escaped=bad, **res)


def quota(gib: float) -> None:
    import torch

    res = []
    for i in range(torch.cuda.device_count()):
        with torch.cuda.device(i):
            free, total = torch.cuda.mem_get_info(i)
            r = {"index": i, "total": total}
            try:
                a = torch.empty(int((gib - 1.5) * GiB), dtype=torch.uint8, device=f"cuda:{i}")
                a.fill_(1)
                torch.cuda.synchronize(i)
                r["below"] = "ok"
                del a
            except Exception as e:  # noqa: BLE001
                r["below"] = f"{type(e).__name__}"
            torch.cuda.empty_cache()
            try:
                b = torch.empty(int((gib + 1) * GiB), dtype=torch.uint8, device=f"cuda:{i}")
                r["above"] = "ALLOCATED"
                del b
            except torch.cuda.OutOfMemoryError:
                r["above"] = "OutOfMemoryError"
            torch.cuda.empty_cache()
            x = torch.ones(8, device=f"cuda:{i}")
            r["after"] = bool(x.sum().item() == 8)
            res.append(r)
    out(ok=all(r["below"] == "ok" and r["above"] == "OutOfMemoryError" and r["after"]
               for r in res) and len(res) > 0, gpus=res)


def ddp(steps: int) -> None:
    """Two processes (torchrun), one per GPU: NCCL all-reduce, a copy across the GPUs, a
    CUDA IPC handle of a tensor passed from rank 0 to rank 1 (torch.multiprocessing's
    reductions), and the per-GPU quota (TENANT_QUOTA_GIB) with NCCL's buffers held."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    t0 = time.perf_counter()
    x = torch.ones(1 << 20, device="cuda") * (rank + 1)
    for _ in range(steps):
        y = x.clone()
        dist.all_reduce(y)
    torch.cuda.synchronize()
    expect = float(sum(range(1, world + 1)))
    ok = bool(torch.allclose(y, torch.full_like(y, expect)))
    elapsed = time.perf_counter() - t0
    # Device-to-device copy across GPUs inside the tenant (peer access through the driver).
    z = torch.arange(1024, device="cuda", dtype=torch.float32)
    other = (rank + 1) % world
    try:
        zz = z.to(f"cuda:{other}")
        p2p = bool(torch.equal(zz.cpu(), z.cpu()))
    except Exception as e:  # noqa: BLE001
        p2p = f"{type(e).__name__}: {str(e)[:120]}"
    # CUDA IPC (legacy handles, as torch.multiprocessing passes tensors): rank 0's tensor
    # opened in rank 1's process.
    from torch.multiprocessing.reductions import reduce_tensor
    box = [reduce_tensor(torch.full((1024,), 7.0, device="cuda")) if rank == 0 else None]
    keep = box[0]
    dist.broadcast_object_list(box, src=0)
    ipc: object = "sender"
    if rank != 0:
        try:
            fn, args = box[0]
            t = fn(*args)
            ipc = bool(torch.equal(t.cpu(), torch.full((1024,), 7.0)))
            del t
        except Exception as e:  # noqa: BLE001
            ipc = f"{type(e).__name__}: {str(e)[:160]}"
    dist.barrier()
    del keep
    # The tenant's per-GPU quota while NCCL holds its buffers: one allocation beyond it
    # fails cleanly, and the process goes on allocating after it.
    quota = int(float(os.environ.get("TENANT_QUOTA_GIB", "8")) * (1 << 30))
    try:
        big = torch.empty(quota + (1 << 30), dtype=torch.uint8, device="cuda")
        over = "allocated (quota not enforced)"
        del big
    except torch.cuda.OutOfMemoryError:
        over = "OutOfMemoryError"
    except Exception as e:  # noqa: BLE001
        over = f"{type(e).__name__}: {str(e)[:120]}"
    try:
        small = torch.ones(1 << 28, dtype=torch.uint8, device="cuda")
        after = int(small.sum().item()) == 1 << 28
        del small
    except Exception as e:  # noqa: BLE001
        after = f"{type(e).__name__}: {str(e)[:120]}"
    dist.barrier()
    dist.destroy_process_group()
    out(rank=rank, world=world, steps=steps, allreduce_ok=ok, seconds=round(elapsed, 3),
        cross_gpu_copy=p2p, cuda_ipc=ipc, beyond_quota=over, alloc_after=after,
        device_count=torch.cuda.device_count())


def main() -> None:
    what = sys.argv[1]
    if what == "view":
        view()
    elif what == "reach":
        reach(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif what == "quota":
        quota(float(sys.argv[2]))
    elif what == "ddp":
        ddp(int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown check {what}")


if __name__ == "__main__":
    main()
