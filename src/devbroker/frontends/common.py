"""What every front end does the same way: the broker's private "which session is
this file?" ioctl, the errnos a kernel reply may carry, and handing work from a front end's
own threads to the trio loop. Front ends are thin adapters over their wire codecs
(fusewire, kmodwire, seccompwire) and the one broker interface; what they share lives here.
"""
from __future__ import annotations

import ctypes
import errno
import logging
from typing import Any, Callable

import trio

from devbroker.broker import laneexec

log = logging.getLogger("devbroker.frontends")

# The private "which session is this file?" ioctl the broker issues on a tenant's file it
# duplicated with pidfd_getfd (FUSE, CUSE and the module's nodes alike): _IOR(0xDB, 1, u64).
# Type 0xDB is not NVIDIA's 'F', so the module forwards it without argument bytes; only
# requests from the broker's own process get an answer, from anyone else it is an unknown
# command the broker refuses.
WHOAMI_IOCTL = (2 << 30) | (8 << 16) | (0xDB << 8) | 1


def sanitize_errno(e: int) -> int:
    """An errno a FUSE/CUSE reply may carry: the kernel takes -1..-511; anything else (a
    broker bug, a status mistaken for an errno) becomes EIO instead of a bad reply."""
    return e if 0 < e < 512 else errno.EIO


def to_trio(token: trio.lowlevel.TrioToken, fn: Callable[..., Any], *args: Any) -> bool:
    """Run fn(*args) on the trio loop from a front end's reader or listener thread; False
    once the loop has finished (the caller answers the request itself then). Guarded: an
    exception escaping a run_sync_soon callback ends the whole trio run (TrioInternalError:
    the broker, every tenant's, exits), so one is logged instead — callers that must answer
    something then do it themselves (FuseFrontend._take_handed, SeccompSupervisor
    ._start_or_fail)."""
    try:
        token.run_sync_soon(_guarded, fn, args)
        return True
    except trio.RunFinishedError:
        return False


def start_task(nursery: trio.Nursery, fn: Callable[..., Any], *args: Any) -> bool:
    """(Trio thread.) nursery.start_soon(fn, *args); False when the nursery is closed to new
    tasks (its front end stopping), where start_soon raises — the caller answers then."""
    try:
        nursery.start_soon(fn, *args)
        return True
    except RuntimeError:  # "Nursery is closed to new arrivals"
        return False


def _guarded(fn: Callable[..., Any], args: tuple) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("front end: work handed to the trio thread failed")


# A front end's "not for the control lane: decide it the general way" (the lane's
# executor's own answer, broker/laneexec.py).
GENERAL = laneexec.GENERAL


def control_lane_of(broker: Any) -> tuple[Any, frozenset[int]]:
    """The broker's control lane (broker/fastlane.py) and the ioctl numbers it takes, for a
    front end to test before anything else; (None, empty) for a broker without one, or when
    DEVBROKER_CONTROL_LANE=0 (benchmarks compare both ways)."""
    import os

    from devbroker.abi import registry

    lane = getattr(broker, "control_lane", None)
    if lane is None or os.environ.get("DEVBROKER_CONTROL_LANE", "1") == "0":
        return None, frozenset()
    return lane, lane.ioctl_cmds(registry.get(v) for v in registry.versions())


_PR_SET_NAME = 15
_libc_prctl = ctypes.CDLL(None, use_errno=True).prctl


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (≤ 15 bytes) where the kernel shows it (/proc/<pid>/
    task/<tid>/comm, top -H, ps -L): Python's thread names stay inside the interpreter.
    Best effort."""
    _libc_prctl(ctypes.c_int(_PR_SET_NAME), ctypes.c_char_p(name.encode()[:15]),
                ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
