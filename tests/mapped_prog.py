"""A tenant program of tests/test_real_lane.py's mapping-facts test, on stand-in driver
nodes (nvidiactl and nvidia-uvm are /dev/null's device, whose mappings fail ENODEV;
nvidia0 is /dev/zero's, which maps): each of them mapped five times, and five times each a
regular file and a memfd. Prints one JSON line: each file's answers, deduplicated."""
from __future__ import annotations

import json
import mmap
import os
import sys

out: dict = {}


def maps(fd: int) -> list:
    seen: list = []
    size = os.fstat(fd).st_size or 4096  # (a regular file: no more than it holds)
    for _ in range(5):
        try:
            m = mmap.mmap(fd, min(size, 4096), mmap.MAP_SHARED, mmap.PROT_READ)
            got = ["ok", m[:4].hex()]
            m.close()
        except OSError as e:
            got = ["errno", e.errno]
        if got not in seen:
            seen.append(got)
    return seen


for name in ("nvidiactl", "nvidia0", "nvidia-uvm"):
    fd = os.open(f"/dev/{name}", os.O_RDWR)
    out[name] = maps(fd)
with open(sys.argv[0], "rb") as f:
    head = f.read(4).hex()
    out["regular"] = maps(f.fileno())
    out["regular-head"] = head
mfd = os.memfd_create("mapped-prog")
os.write(mfd, b"\x01\x02\x03\x04" + bytes(4092))
out["memfd"] = maps(mfd)
print(json.dumps(out), flush=True)
