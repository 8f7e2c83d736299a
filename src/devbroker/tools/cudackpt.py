"""One call of the NVIDIA driver's checkpoint API on another process, then exit.

    python -m devbroker.tools.cudackpt [--libcuda PATH] OP PID [--pairs OLD=NEW,...]
                                       [--timeout-ms N] [--no-init]
    OP: state | lock | checkpoint | restore | unlock | probe (PID not needed)

The real backend's checkpointer (backends/cudackpt.py) runs this program once per
operation and kills it at its deadline: a driver call can block for as long as the target
does not answer (a SIGSTOPped process never lets `lock` finish), and a call blocked inside
libcuda cannot be interrupted in-process. This module therefore imports nothing of
devbroker: it is a leaf program.

It loads libcuda (`--libcuda`, else $DEVBROKER_LIBCUDA, else libcuda.so.1) with ctypes and
prints one JSON line on stdout:
  {"ok": true, "op": ..., "pid": ..., "state": "locked", "ms": 12.3}
  {"ok": false, "op": ..., "pid": ..., "code": 800, "error": "CUDA_ERROR_NOT_PERMITTED", "ms": ...}
  {"ok": false, "op": ..., "error": "no-library" | "no-symbol" | "usage", "why": "..."}
Exit status: 0 done, 1 the driver returned an error, 2 bad arguments, 3 the library or its
checkpoint symbols are missing.

The argument structures are written here from NVIDIA's public documentation of cuda.h (the
CUDA Driver API reference, "CUDA Checkpointing" and the struct pages), not copied:
- CUcheckpointLockArgs: `unsigned int timeoutMs; unsigned int reserved0; cuuint64_t
  reserved1[7]` (64 bytes; timeoutMs 0 = wait forever; on timeout the process stays
  RUNNING);
- CUcheckpointCheckpointArgs, CUcheckpointUnlockArgs: `cuuint64_t reserved[8]` (64 bytes);
- CUcheckpointRestoreArgs: `CUcheckpointGpuPair *gpuPairs; unsigned int gpuPairsCount;`
  then reserved bytes up to 64 (CUDA 13.0's header: `char reserved[52 - sizeof(void*)];
  cuuint64_t reserved1`; 13.4's adds `unsigned int padding0; CUcheckpointCustomStorageInfo
  **customStorageInfo_out` in that space — zero means "restore from host memory", so one
  64-byte layout with the pointer at 0, the count at 8 and zeros after fits both);
- CUcheckpointGpuPair: `CUuuid oldUuid; CUuuid newUuid` (CUuuid: `char bytes[16]`);
- CUprocessState: RUNNING 0, LOCKED 1, CHECKPOINTED 2, FAILED 3 (13.4 adds CHECKPOINTING 4,
  RESTORING 5).
Every call takes `(int pid, Args *args)` and returns a CUresult; GetState takes
`(int pid, CUprocessState *state)`. The functions appeared in driver r570 (restore with GPU
pairs in r580, NVIDIA's cuda-checkpoint README and the 13.0 reference).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import time

DEFAULT_LIBRARY = "libcuda.so.1"
LIBRARY_ENV = "DEVBROKER_LIBCUDA"

SYMBOLS = {
    "state": "cuCheckpointProcessGetState",
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
}
OPS = tuple(SYMBOLS) + ("probe",)

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed",
          4: "checkpointing", 5: "restoring"}

# The CUresult values a checkpoint call can answer with (cuda.h's CUresult enum).
RESULTS = {
    0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY", 46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
    100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
    304: "CUDA_ERROR_OPERATING_SYSTEM", 400: "CUDA_ERROR_INVALID_HANDLE",
    401: "CUDA_ERROR_ILLEGAL_STATE", 500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY",
    719: "CUDA_ERROR_LAUNCH_FAILED", 800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED", 802: "CUDA_ERROR_SYSTEM_NOT_READY",
    803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 909: "CUDA_ERROR_TIMEOUT",
    999: "CUDA_ERROR_UNKNOWN",
}

EXIT_OK, EXIT_DRIVER, EXIT_USAGE, EXIT_LIBRARY = 0, 1, 2, 3


class LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class ReservedArgs(ctypes.Structure):  # CUcheckpointCheckpointArgs, CUcheckpointUnlockArgs
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("padding0", ctypes.c_uint), ("reserved", ctypes.c_uint64 * 6)]


assert ctypes.sizeof(LockArgs) == ctypes.sizeof(ReservedArgs) == 64
assert ctypes.sizeof(RestoreArgs) == 64 and ctypes.sizeof(GpuPair) == 32

UUID_RE = re.compile(r"^GPU-([0-9a-fA-F]{8})-([0-9a-fA-F]{4})-([0-9a-fA-F]{4})-"
                     r"([0-9a-fA-F]{4})-([0-9a-fA-F]{12})$")


def uuid_bytes(text: str) -> bytes:
    """The 16 bytes of a GPU UUID as the driver names it ("GPU-xxxxxxxx-xxxx-...")."""
    m = UUID_RE.match(text.strip())
    if not m:
        raise ValueError(f"not a GPU UUID: {text!r} (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-"
                         "xxxxxxxxxxxx)")
    return bytes.fromhex("".join(m.groups()))


def parse_pairs(text: str) -> list[tuple[bytes, bytes]]:
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        old, sep, new = item.partition("=")
        if not sep:
            raise ValueError(f"a GPU pair is OLD=NEW, not {item!r}")
        out.append((uuid_bytes(old), uuid_bytes(new)))
    return out


def result_name(code: int) -> str:
    return RESULTS.get(code, f"CUresult {code}")


class Driver:
    """libcuda's checkpoint entry points, or why they are not there."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)  # OSError when absent: the caller reports it
        self.missing = [s for s in SYMBOLS.values() if not hasattr(self.lib, s)]
        for name in SYMBOLS.values():
            if name not in self.missing:
                fn = getattr(self.lib, name)
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_int, ctypes.c_void_p]

    def version(self) -> int | None:
        """cuDriverGetVersion (no cuInit needed): e.g. 13000 for CUDA 13.0."""
        fn = getattr(self.lib, "cuDriverGetVersion", None)
        if fn is None:
            return None
        v = ctypes.c_int(0)
        return v.value if fn(ctypes.byref(v)) == 0 else None

    def init(self) -> int:
        fn = getattr(self.lib, "cuInit", None)
        return 0 if fn is None else int(fn(ctypes.c_uint(0)))

    def call(self, op: str, pid: int, *, timeout_ms: int = 0,
             pairs: list[tuple[bytes, bytes]] = ()) -> tuple[int, str | None]:
        """(CUresult, the state's name for `state`)."""
        fn = getattr(self.lib, SYMBOLS[op])
        if op == "state":
            st = ctypes.c_int(-1)
            rc = fn(pid, ctypes.byref(st))
            return rc, STATES.get(st.value, f"state {st.value}") if rc == 0 else None
        if op == "lock":
            args = LockArgs(timeoutMs=timeout_ms)
        elif op == "restore":
            args = RestoreArgs()
            if pairs:
                arr = (GpuPair * len(pairs))()
                for slot, (old, new) in zip(arr, pairs):
                    slot.oldUuid[:] = old
                    slot.newUuid[:] = new
                args.gpuPairs = ctypes.cast(arr, ctypes.POINTER(GpuPair))
                args.gpuPairsCount = len(pairs)
        else:
            args = ReservedArgs()
        return int(fn(pid, ctypes.byref(args))), None  # (`arr`, if any, lives until here)


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


class Usage(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one JSON line and exit 2, like every other failure here
        raise Usage(message)


def parse(argv: list[str]) -> argparse.Namespace:
    p = Parser(prog="python -m devbroker.tools.cudackpt", add_help=True,
               description="One call of libcuda's checkpoint API on process PID.")
    p.add_argument("op", choices=OPS)
    p.add_argument("pid", nargs="?", type=int)
    p.add_argument("--pairs", default="", help="restore: OLD=NEW GPU UUID pairs, comma-separated")
    p.add_argument("--timeout-ms", type=int, default=0,
                   help="lock: the driver's own lock timeout (0: none)")
    p.add_argument("--libcuda", default=None,
                   help=f"the library to load (default ${LIBRARY_ENV}, else {DEFAULT_LIBRARY})")
    p.add_argument("--no-init", action="store_true",
                   help="restore: skip cuInit (the driver wants it, or persistence mode, "
                        "before a restore)")
    a = p.parse_args(argv)
    if a.op != "probe" and (a.pid is None or a.pid <= 0):
        raise Usage(f"{a.op} needs a process id > 0")
    if not 0 <= a.timeout_ms <= 0xFFFFFFFF:
        raise Usage("--timeout-ms must fit an unsigned int")
    if a.pairs and a.op != "restore":
        raise Usage("--pairs is for restore only")
    try:
        a.pair_list = parse_pairs(a.pairs)
    except ValueError as e:
        raise Usage(str(e)) from None
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse(sys.argv[1:] if argv is None else argv)
    except Usage as e:
        emit({"ok": False, "error": "usage", "why": str(e)})
        return EXIT_USAGE
    path = a.libcuda or os.environ.get(LIBRARY_ENV) or DEFAULT_LIBRARY
    base = {"op": a.op, "pid": a.pid, "library": path}
    try:
        drv = Driver(path)
    except OSError as e:
        emit({**base, "ok": False, "error": "no-library",
              "why": f"cannot load {path}: {e}"})
        return EXIT_LIBRARY
    if drv.missing:
        emit({**base, "ok": False, "error": "no-symbol", "missing": drv.missing,
              "version": drv.version(),
              "why": f"{path} lacks {', '.join(drv.missing)} (the driver's checkpoint API "
                     "needs driver r570 or later)"})
        return EXIT_LIBRARY
    if a.op == "probe":
        emit({**base, "ok": True, "version": drv.version()})
        return EXIT_OK
    extra = {}
    if a.op == "restore" and not a.no_init:
        t0 = time.monotonic()
        extra["init"] = result_name(drv.init())
        extra["init_ms"] = round((time.monotonic() - t0) * 1e3, 1)
    t0 = time.monotonic()
    rc, state = drv.call(a.op, a.pid, timeout_ms=a.timeout_ms, pairs=a.pair_list)
    ms = round((time.monotonic() - t0) * 1e3, 1)
    if rc != 0:
        emit({**base, **extra, "ok": False, "code": rc, "error": result_name(rc), "ms": ms})
        return EXIT_DRIVER
    emit({**base, **extra, "ok": True, "ms": ms, **({"state": state} if state else {})})
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
