"""Moving one process's GPU state to host memory and back: what the broker asks of a
backend's checkpoint executor (docs/preemption.md).

The broker decides who is checkpointed and when (broker/preemption.py); an executor only
carries the order out. The emulated backend's models the driver (backends/emulated.py); the
real backend's calls libcuda's cuCheckpointProcess* in a short-lived helper process
(backends/cudackpt.py). Every method blocks: the broker runs them on worker threads with
its own deadlines, and an implementation must itself never block longer than `timeout_s`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# What `Checkpointer.state` answers (the driver's CUprocessState, by name).
RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"
STATES = (RUNNING, LOCKED, CHECKPOINTED, FAILED)


class CheckpointError(Exception):
    """One line a user can act on, e.g. 'process 1234 did not answer the lock within 10 s'."""


@dataclass(frozen=True)
class GpuPair:
    """For a restore onto another GPU: the GPU the state was taken from and the one it goes
    to, as the driver names them ("GPU-…")."""
    old_uuid: str
    new_uuid: str


class Checkpointer(Protocol):
    """Moves one process's GPU state to host memory and back. Blocking calls: the broker runs
    them on worker threads with its own deadlines; an implementation must itself never block
    longer than `timeout_s` (kill its helper process, etc.)."""

    supported: bool  # False: the driver has no checkpoint API; why in `why`
    why: str
    # Optional (absent: False): the broker must hold a locked or checkpointed process's
    # driver calls itself until it runs again. The emulated driver's model sets it; libcuda
    # blocks a locked process's work inside the process, so the real executor leaves it out.
    holds_calls: bool

    def state(self, pid: int, timeout_s: float) -> str:
        """"running" | "locked" | "checkpointed" | "failed"."""
        ...

    def lock(self, pid: int, timeout_s: float) -> None: ...

    def checkpoint(self, pid: int, timeout_s: float) -> None: ...

    def restore(self, pid: int, pairs: tuple[GpuPair, ...], timeout_s: float) -> None: ...

    def unlock(self, pid: int, timeout_s: float) -> None: ...


class NotSupported:
    """The checkpointer of a backend whose driver has no checkpoint API: every operation is
    refused with the reason, so the broker's refusal names it."""

    supported = False
    holds_calls = False

    def __init__(self, why: str = "this backend's driver has no checkpoint API"):
        self.why = why

    def _refuse(self, pid: int, *_args) -> None:
        raise CheckpointError(f"cannot checkpoint process {pid}: {self.why}")

    def state(self, pid: int, timeout_s: float) -> str:
        self._refuse(pid)
        return FAILED  # (not reached)

    def lock(self, pid: int, timeout_s: float) -> None:
        self._refuse(pid)

    def checkpoint(self, pid: int, timeout_s: float) -> None:
        self._refuse(pid)

    def restore(self, pid: int, pairs: tuple[GpuPair, ...], timeout_s: float) -> None:
        self._refuse(pid)

    def unlock(self, pid: int, timeout_s: float) -> None:
        self._refuse(pid)


NOT_SUPPORTED = NotSupported()
