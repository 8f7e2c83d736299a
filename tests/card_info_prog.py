"""A tenant program of tests/test_real_lane.py's answer-fact test, against a stand-in driver
that answers every call the broker makes with 0 and leaves the argument as sent
(nvok_standin.py): NV_ESC_CARD_INFO many times on its nvidiactl, each time with the same
table — entry 0 a GPU of the tenant's (minor 0) with BAR addresses, entry 1 another GPU
(minor 1) — so that what comes back is the broker's rewrite of it (the real driver clears
the table and fills it itself: nv.c nvidia_read_card_info); then once on a second nvidiactl
the tenant opens. Prints one JSON line: the distinct answers."""
from __future__ import annotations

import fcntl
import json
import os
import sys

from rm_escape import ABI as abi

REPEAT = int(sys.argv[1]) if len(sys.argv) > 1 else 20
entry = abi.struct("nv_ioctl_card_info_t")
mine = entry.decode(bytes(entry.size)).replace(valid=1, minor_number=0, reg_address=0x1234000,
                                               fb_address=0x5678000, fb_size=1 << 30)
other = entry.decode(bytes(entry.size)).replace(valid=1, minor_number=1, reg_address=0x9999000)
table = mine.encode() + other.encode() + bytes(entry.size * 30)
cmd = abi.escape_cmd("NV_ESC_CARD_INFO", len(table))


def card_info(fd: int) -> list:
    buf = bytearray(table)
    try:
        fcntl.ioctl(fd, cmd, buf, True)
        err = 0
    except OSError as e:
        err = e.errno
    first, second = entry.decode(bytes(buf[:entry.size])), entry.decode(
        bytes(buf[entry.size:2 * entry.size]))
    return [err, first.valid, first.minor_number, first.reg_address, first.fb_address,
            first.fb_size, bytes(buf[entry.size:]) == bytes(len(buf) - entry.size)]


ctl = os.open("/dev/nvidiactl", os.O_RDWR)
seen = []
for _ in range(REPEAT):
    r = card_info(ctl)
    if r not in seen:
        seen.append(r)
ctl2 = os.open("/dev/nvidiactl", os.O_RDWR)
print(json.dumps({"answers": seen, "second_file": card_info(ctl2)}), flush=True)
