"""Record mode: every call the broker relays to its backend, in the nvtrace format.

`devbroker run --record FILE` writes what the *backend* was asked and answered: calls the
broker refused never reach the backend and so never appear (a recording of a session is the
proof that the driver did not see them). Records follow docs/nvtrace.md:

- an OPEN record the first time a session is seen (path /dev/<node>, ret = session id; the
  session id stands in for the fd number everywhere in the file),
- one IOCTL record per backend call: `in`/`out` the top-level argument as sent to and
  returned by the backend, `xin`/`xout` the nested buffer, `ret`/`err` the result,
  followed by a DURATION record (the backend call's wall time, when the caller gave it),
- CLOSE and MMAP records when the broker reports them (open/close/map_read hooks below).

Each record is written and flushed at once, so a killed broker leaves a readable file.
"""
from __future__ import annotations

import os
import struct
import threading
import time
from typing import Any

from devbroker.abi.nodes import NodeKind
from devbroker.abi.nvtrace import Record, RecordType, Writer


def _node_path(session: Any) -> str:
    name = getattr(session, "node_name", None)
    if name is None:
        node, minor = session.node, session.minor
        name = f"nvidia{minor}" if node is NodeKind.GPU else {
            NodeKind.CTL: "nvidiactl", NodeKind.UVM: "nvidia-uvm"}.get(node, "nvidia-other")
    return f"/dev/{name}"


class Recorder:
    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._fh = open(self.path, "ab", buffering=0)
        self._w = Writer(self._fh)
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        self.count = 0

    def _write(self, rec: Record) -> None:
        with self._lock:
            self._w.write(rec)
            self.count += 1

    def _ids(self, session: Any) -> tuple[int, int]:
        c = session.caller
        return int(getattr(c, "pid", 0)), int(getattr(c, "tid", 0) or getattr(c, "pid", 0))

    def open(self, session: Any) -> None:
        if session.id in self._seen:
            return
        self._seen.add(session.id)
        pid, tid = self._ids(session)
        kind = int(session.node) if int(session.node) <= 4 else 4
        self._write(Record(RecordType.OPEN, fd=-1, cmd=kind, ret=session.id, pid=pid, tid=tid,
                           ts_ns=time.monotonic_ns(),
                           in_=_node_path(session).encode() + b"\0"))

    def close(self, session: Any) -> None:
        if session.id not in self._seen:
            return
        pid, tid = self._ids(session)
        self._write(Record(RecordType.CLOSE, fd=session.id, pid=pid, tid=tid,
                           ts_ns=time.monotonic_ns()))

    def map_read(self, session: Any, offset: int, length: int, ok: bool = True) -> None:
        self.open(session)
        pid, tid = self._ids(session)
        self._write(Record(RecordType.MMAP, fd=session.id, cmd=0x1, ret=0 if ok else -1,
                           pid=pid, tid=tid, ts_ns=time.monotonic_ns(),
                           in_=struct.pack("<QQQ", length, 0x1, offset)))

    def ioctl(self, session: Any, call: Any, nested: bytes | None, result: Any,
              duration_ns: int | None = None) -> None:
        self.open(session)
        pid, tid = self._ids(session)
        now = time.monotonic_ns()
        err = int(getattr(result, "errno", 0) or 0)
        ret = -1 if err else int(getattr(result, "result", 0) or 0)
        self._write(Record(RecordType.IOCTL, fd=session.id, cmd=call.cmd, ret=ret, err=err,
                           pid=pid, tid=tid, ts_ns=now, arg=0, in_=call.encode(),
                           out=bytes(result.arg or b""), xin=bytes(nested or b""),
                           xout=bytes(result.nested or b"") if nested is not None else b""))
        if duration_ns is not None:
            self._write(Record(RecordType.DURATION, fd=session.id, cmd=call.cmd, pid=pid,
                               tid=tid, ts_ns=now, arg=duration_ns))

    def close_file(self) -> None:
        with self._lock:
            self._fh.close()
