"""What the broker reads about a caller from /proc (pid namespaces and their numbering)."""
from __future__ import annotations

import os


def pid_namespace(pid: int) -> str | None:
    """The pid namespace of a process ("pid:[4026531836]"), or None if it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def pid_in_own_namespace(pid: int) -> int:
    """The innermost pid of a process (NSpid's last field), as the process itself sees it."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except OSError:
        pass
    return pid
