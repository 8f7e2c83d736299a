"""The real backend's checkpoint executor: libcuda's cuCheckpointProcess* calls, each in a
short-lived helper process (devbroker.tools.cudackpt) that is killed at its deadline.

Why a process per operation and not a thread: a checkpoint call blocks inside libcuda until
the target answers, and a target that cannot answer (SIGSTOPped, wedged in the driver)
would keep the call, and the thread, forever; Python cannot cancel a foreign call. A child
process can be killed. Loading libcuda into the broker would also make the broker a CUDA
client of its own, which the real backend's design avoids (docs/real-backend.md). The cost
is one interpreter start per operation (~0.1 s), small beside the seconds a checkpoint of
tens of GiB takes (docs/preemption-driver.md).

The helper prints one JSON line; this module turns a failure into a CheckpointError whose
text is one line a user can act on.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from devbroker.backends.checkpoint import CheckpointError, GpuPair

HELPER = "devbroker.tools.cudackpt"
# src/ (the tree this package was imported from): the helper is started with it on its
# path, whatever the broker's working directory.
SRC = str(Path(__file__).resolve().parents[2])
PROBE_TIMEOUT_S = 15.0

# What to do about each driver answer, after "<op> of process <pid> failed: NAME (code): ".
HINTS = {
    "CUDA_ERROR_NOT_PERMITTED": "the driver refused it (the caller needs rights over the "
                                "process; a tenant whose own driver calls are refused "
                                "cannot be checkpointed either)",
    "CUDA_ERROR_NOT_SUPPORTED": "the process uses what the driver cannot checkpoint "
                                "(managed/UVM memory, CUDA IPC) or the driver lacks it",
    "CUDA_ERROR_NOT_INITIALIZED": "the process has no CUDA state the driver knows of",
    "CUDA_ERROR_ILLEGAL_STATE": "the process is not in the state this step needs (lock: "
                                "running, checkpoint: locked, restore: checkpointed, "
                                "unlock: locked)",
    "CUDA_ERROR_INVALID_VALUE": "no such process, or arguments the driver refuses",
    "CUDA_ERROR_TIMEOUT": "the process did not reach a point where it can be locked in time; "
                          "it is left running",
    "CUDA_ERROR_OUT_OF_MEMORY": "the GPU lacks the room to take the process back; reserve "
                                "its memory before restoring (on the H200 a second restore "
                                "after this one failed too: the process stays checkpointed)",
    "CUDA_ERROR_OPERATING_SYSTEM": "the driver could not restore it (seen on a restore after "
                                   "one refused for lack of memory: the process stays "
                                   "checkpointed)",
    "CUDA_ERROR_INVALID_DEVICE": "a GPU pair names a GPU the driver does not have",
}


# What a missed deadline most likely means, by operation (docs/preemption-driver.md).
DEADLINE_HINTS = {
    "lock": "a stopped or hung process never answers the driver: is it SIGSTOPped?",
    "checkpoint": "the copy runs at ~1.8 GiB/s on an H200: is the deadline long enough for "
                  "the process's memory?",
    "restore": "the copy runs at ~6 GiB/s on an H200: is the deadline long enough for the "
               "process's memory?",
}


class CudaCheckpointer:
    """backends/checkpoint.Checkpointer over libcuda, one helper process per call.

    `library`: the libcuda to load (None: the helper's default, $DEVBROKER_LIBCUDA, else
    libcuda.so.1). `supported` and `why` come from a probe (a helper that loads the library
    and looks for the five symbols), run once: at the first read, or earlier by
    `probe_soon` (the real backend's start)."""

    def __init__(self, library: str | None = None, python: str = sys.executable):
        self.library = library
        self.python = python
        self._probe: tuple[bool, str] | None = None
        self._probe_lock = threading.Lock()

    # -- whether the driver has the API

    @property
    def supported(self) -> bool:
        return self._probed()[0]

    @property
    def why(self) -> str:
        return self._probed()[1]

    def probe_soon(self) -> None:
        """Probe on a thread of its own now, so that the first read of `supported` (which
        would otherwise run the probe and wait for it) finds the answer ready."""
        if self._probe is None:
            threading.Thread(target=self._probed, name="dvb-ckpt-probe", daemon=True).start()

    def _probed(self) -> tuple[bool, str]:
        with self._probe_lock:
            if self._probe is None:
                try:
                    rec = self.call("probe", None, PROBE_TIMEOUT_S)
                    self._probe = (True, f"{rec.get('library')}: CUDA driver API "
                                         f"{rec.get('version')}")
                except CheckpointError as e:
                    self._probe = (False, str(e))
            return self._probe

    # -- the operations (backends/checkpoint.Checkpointer)

    def state(self, pid: int, timeout_s: float) -> str:
        return self.call("state", pid, timeout_s)["state"]

    def lock(self, pid: int, timeout_s: float) -> None:
        # The driver's own lock timeout ends the wait cleanly (the process stays running)
        # before the kill at the deadline would; the margin is the helper's start.
        margin = min(1.0, timeout_s / 4)
        self.call("lock", pid, timeout_s,
                  "--timeout-ms", str(max(1, int((timeout_s - margin) * 1000))))

    def checkpoint(self, pid: int, timeout_s: float) -> None:
        self.call("checkpoint", pid, timeout_s)

    def restore(self, pid: int, pairs: tuple[GpuPair, ...], timeout_s: float) -> None:
        extra = ("--pairs", ",".join(f"{p.old_uuid}={p.new_uuid}" for p in pairs)) if pairs else ()
        self.call("restore", pid, timeout_s, *extra)

    def unlock(self, pid: int, timeout_s: float) -> None:
        self.call("unlock", pid, timeout_s)

    # -- the helper

    def command(self, op: str, pid: int | None, *extra: str) -> list[str]:
        cmd = [self.python, "-m", HELPER, op]
        if pid is not None:
            cmd.append(str(pid))
        cmd += list(extra)
        if self.library:
            cmd += ["--libcuda", self.library]
        return cmd

    def call(self, op: str, pid: int | None, timeout_s: float, *extra: str) -> dict:
        """Run the helper for `op` and return its record (with "ms": the driver call's own
        time); a CheckpointError for anything but success."""
        what = f"{op} of process {pid}" if pid is not None else "the checkpoint API probe"
        env = dict(os.environ)
        env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            proc = subprocess.Popen(self.command(op, pid, *extra), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        except OSError as e:
            raise CheckpointError(f"{what}: cannot start the helper {self.python}: {e}") from None
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise CheckpointError(f"{what} did not finish within {timeout_s:g} s; the helper "
                                  f"was killed ({DEADLINE_HINTS.get(op, DEADLINE_HINTS['lock'])})"
                                  ) from None
        rec = last_json(out)
        if rec is None:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise CheckpointError(f"{what}: the helper exited {proc.returncode}: {tail[0]}")
        if rec.get("ok"):
            return rec
        raise CheckpointError(describe_failure(what, rec))


def last_json(out: bytes) -> dict | None:
    for line in reversed(out.decode(errors="replace").strip().splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            return rec
    return None


def describe_failure(what: str, rec: dict) -> str:
    """One line from the helper's failure record."""
    error = rec.get("error")
    if error in ("no-library", "no-symbol", "usage"):
        return f"{what}: {rec.get('why')}"
    hint = HINTS.get(error)
    line = f"{what} failed: {error} ({rec.get('code')})"
    return f"{line}: {hint}" if hint else line
