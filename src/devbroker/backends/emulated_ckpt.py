"""The emulated driver's checkpoint API (backends/checkpoint.py Checkpointer), modelled on
libcuda's cuCheckpointProcess*: a process is locked, its device memory checkpointed to host
memory (it leaves the GPU: the emulated free heap rises by exactly the bytes the process
holds there), restored (back at the same handles, or CheckpointError when the GPU lacks the
room) and unlocked. RM handles stay valid throughout; the objects never leave the books.

The real driver blocks a locked process's GPU work inside libcuda. The emulator has no
libcuda in the tenant, so `holds_calls` asks the broker to hold the process's driver calls
until it runs again (broker/preemption.py).
"""
from __future__ import annotations

from devbroker.backends.checkpoint import (
    CHECKPOINTED, LOCKED, RUNNING, CheckpointError, GpuPair,
)


class EmulatedCheckpointer:
    supported = True
    why = "the emulated driver models the checkpoint API"
    holds_calls = True  # (module docstring)

    def __init__(self, backend) -> None:
        self.backend = backend
        # pid -> LOCKED | CHECKPOINTED (a running process is not listed). The backend's
        # memory accounting reads it: a checkpointed process's objects hold no device memory.
        self.states: dict[int, str] = {}

    def away(self, pid: int) -> bool:
        """Whether pid's device memory is in host memory (EmulatedBackend._index asks)."""
        return self.states.get(pid) == CHECKPOINTED

    def _holds_state(self, pid: int) -> bool:
        return any(c.tgid == pid for c in self.backend.clients.values())

    def _need(self, pid: int) -> dict[int, int]:
        return {gpu: held[pid] for gpu, held in self.backend._held.items() if held.get(pid)}

    def _expect(self, pid: int, want: str, what: str) -> None:
        got = self.states.get(pid, RUNNING)
        if got != want:
            raise CheckpointError(f"cannot {what} process {pid}: it is {got}, not {want}")

    # -- Checkpointer
    def state(self, pid: int, timeout_s: float) -> str:
        with self.backend._calls:
            return self.states.get(pid, RUNNING)

    def lock(self, pid: int, timeout_s: float) -> None:
        with self.backend._calls:
            self._expect(pid, RUNNING, "lock")
            if not self._holds_state(pid):
                # (libcuda answers a process without a CUDA context with an error too)
                raise CheckpointError(f"process {pid} holds no GPU state")
            self.states[pid] = LOCKED

    def checkpoint(self, pid: int, timeout_s: float) -> None:
        b = self.backend
        with b._calls:
            self._expect(pid, LOCKED, "checkpoint")
            for gpu, n in self._need(pid).items():
                b.used[gpu] -= n
            self.states[pid] = CHECKPOINTED

    def restore(self, pid: int, pairs: tuple[GpuPair, ...], timeout_s: float) -> None:
        """Back onto the GPUs it was taken from, or onto others (`pairs`: as the driver, a
        GPU not listed stays where it was). The objects move with it: a device object of
        the old GPU is the new GPU's from now on, as the driver's restored context is."""
        b = self.backend
        with b._calls:
            self._expect(pid, CHECKPOINTED, "restore")
            by_uuid = {g.uuid.lower(): g.index for g in b.gpus()}
            moves = {}
            for p in pairs:
                old, new = by_uuid.get(p.old_uuid.lower()), by_uuid.get(p.new_uuid.lower())
                if old is None or new is None:
                    raise CheckpointError(f"cannot restore process {pid}: no GPU "
                                          f"{p.old_uuid if old is None else p.new_uuid}")
                moves[old] = new
            need: dict[int, int] = {}
            for gpu, n in self._need(pid).items():
                need[moves.get(gpu, gpu)] = need.get(moves.get(gpu, gpu), 0) + n
            for gpu, n in need.items():
                total = b.gpus()[gpu].memory_bytes
                if b.used[gpu] + n > total:
                    raise CheckpointError(
                        f"cannot restore process {pid}: GPU {gpu} has "
                        f"{total - b.used[gpu]} bytes free, the process needs {n}")
            if any(old != new for old, new in moves.items()):
                for c in [c for c in b.clients.values() if c.tgid == pid]:
                    for obj in c.objects.values():
                        if obj.gpu in moves:
                            b._unindex(c, obj)  # (away: only the indexes, not `used`)
                            obj.gpu = moves[obj.gpu]
                            b._index(c, obj)
            for gpu, n in need.items():
                b.used[gpu] += n
            self.states[pid] = LOCKED

    def unlock(self, pid: int, timeout_s: float) -> None:
        with self.backend._calls:
            self._expect(pid, LOCKED, "unlock")
            del self.states[pid]

    def forget_exited(self, live: set[int]) -> None:
        """A checkpointed process that exited left nothing to restore: its clients are
        gone, and with them what it held (the books never counted it on the GPU)."""
        with self.backend._calls:
            for pid in [p for p in self.states if p not in live and not self._holds_state(p)]:
                del self.states[pid]
