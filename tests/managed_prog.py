"""A tenant that maps managed (nvidia-uvm) ranges, allocates device and pinned host memory
and reports each step as one JSON line. Run inside `devbroker exec`.

    managed_prog.py STEP...   STEP: map:SIZE  unmap:N  alloc:SIZE  pinned:SIZE
                                    pinned-nvos02:SIZE  free-pinned:N  advise:N  used
                                    wait-used-below:SIZE  hold

`map` maps a managed range as libcuda does (MAP_FIXED, offset = address, in a reservation of
its own); `unmap:N` unmaps the N-th range mapped; `alloc` is device memory (class 0x40);
`pinned` is system memory (class 0x3e, as cudaHostAlloc allocates it); `used` is the memory
the tenant's FB info shows; `hold` says so and waits for a line on stdin.
"""
from __future__ import annotations

import errno
import fcntl
import json
import sys
import time

from devbroker.abi import status as nvs
from devbroker.escape.managed import ManagedSpace
from devbroker.tools.probe import Client, NvError, parse_size

NV01_MEMORY_SYSTEM = 0x3E


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def main(steps: list[str]) -> None:
    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    space = ManagedSpace(64 << 30)
    ranges: list[tuple[int, int]] = []
    pinned: list[int] = []
    next_off = 0
    for step in steps:
        op, _, arg = step.partition(":")
        if op == "map":
            size = parse_size(arg)
            err = space.map(next_off, size)
            if not err:
                ranges.append((next_off, size))
            next_off += size
            out(op=op, size=size, errno=err, mapped=space.mapped())
        elif op == "unmap":
            off, size = ranges[int(arg)]
            space.unmap(off, size)
            out(op=op, size=size, mapped=space.mapped())
        elif op in ("alloc", "pinned"):
            size = parse_size(arg)
            try:
                if op == "alloc":
                    c.alloc_device_memory(g["hdevice"], size)
                else:
                    p = c.new("NV_MEMORY_ALLOCATION_PARAMS", owner=c.hclient, type=0,
                              flags=0xC001, attr=0x2A800000, attr2=9, format=6, size=size,
                              alignment=4096)
                    pinned.append(c.alloc(g["hdevice"], NV01_MEMORY_SYSTEM, p))
                out(op=op, size=size, status="NV_OK")
            except NvError as e:
                out(op=op, size=size, status=nvs.name(e.status))
        elif op == "pinned-nvos02":  # system memory through NV_ESC_RM_ALLOC_MEMORY
            size = parse_size(arg)
            v = c.new("nv_ioctl_nvos02_parameters_with_fd", fd=-1, params={
                "hRoot": c.hclient, "hObjectParent": g["hdevice"], "hObjectNew": c.handle(),
                "hClass": NV01_MEMORY_SYSTEM, "flags": 0xC001, "limit": size - 1})
            got = c.escape(c.ctl, "NV_ESC_RM_ALLOC_MEMORY", v)
            out(op=op, size=size, status=nvs.name(got.params.status))
        elif op == "advise":  # prefetch and advice on the N-th range (UVM_MIGRATE, ...)
            off, size = ranges[int(arg)]
            got = {}
            for name, fields in (("UVM_SET_PREFERRED_LOCATION", {"requestedBase": off,
                                                                 "length": size}),
                                 ("UVM_SET_ACCESSED_BY", {"requestedBase": off,
                                                          "length": size}),
                                 ("UVM_MIGRATE", {"base": off, "length": size}),
                                 ("UVM_UNSET_PREFERRED_LOCATION", {"requestedBase": off,
                                                                   "length": size}),
                                 ("UVM_DISABLE_READ_DUPLICATION", {"requestedBase": off,
                                                                   "length": size})):
                cmd = next(n for n, o in c.abi.uvm_cmds.items() if o.name == name)
                spec = c.abi.uvm(cmd).params
                fields = {k: (space.base + v if k in ("requestedBase", "base") else v)
                          for k, v in fields.items() if k in spec.by_name}
                buf = bytearray(spec.decode(bytes(spec.size)).replace(**fields).encode())
                try:
                    fcntl.ioctl(space.fd, cmd, buf, True)
                    got[name] = nvs.name(spec.decode(bytes(buf)).rmStatus)
                except OSError as e:
                    got[name] = errno.errorcode.get(e.errno, str(e.errno))
            out(op=op, **got)
        elif op == "free-pinned":
            out(op=op, status=nvs.name(c.free(g["hdevice"], pinned[int(arg)])))
        elif op == "used":
            out(op=op, **c.memory(g["hsubdevice"]))
        elif op == "wait-used-below":  # (the broker's next look gives an unmapped range back)
            limit, deadline = parse_size(arg), time.monotonic() + 30
            while ((m := c.memory(g["hsubdevice"]))["used"] >= limit
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            out(op=op, **m)
        elif op == "hold":
            out(op=op)
            sys.stdin.readline()
        else:
            raise SystemExit(f"unknown step {step!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
