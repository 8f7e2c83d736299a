"""One RM escape from a tenant program (tests/settled_prog.py, tests/continued_prog.py):
the layout's fields as given, every other byte zero, the ioctl made on the fd."""
from __future__ import annotations

import errno
import fcntl

from devbroker.abi import registry

ABI = registry.get("580.159.04")


def escape(fd: int, name: str, spec_name: str, **fields) -> tuple[int, object]:
    """(errno, or 0; the argument as the call left it, decoded)."""
    spec = ABI.struct(spec_name)
    buf = bytearray(spec.decode(bytes(spec.size)).replace(**fields).encode())
    try:
        fcntl.ioctl(fd, ABI.escape_cmd(name, len(buf)), buf, True)
        err = 0
    except OSError as e:
        err = e.errno or errno.EIO
    return err, spec.decode(bytes(buf))
