"""The audit log: one JSON line per refusal (and per notable event).

Reviewers grep this file, so every line is self-contained: who (tenant, pid), through which
node, what (escape / class / control by driver name and number), and why in words.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any


class AuditLog:
    def __init__(self, path: str | Path | None = None, *, stream: IO[str] | None = None):
        self.path = Path(path) if path else None
        self._stream = stream
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self.recent: list[dict[str, Any]] = []  # bounded tail for `devbroker status`

    def _out(self) -> IO[str] | None:
        if self._file is None and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The log names every tenant's refusals: readable by the operator only.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._file = os.fdopen(fd, "a", buffering=1)
        return self._file or self._stream

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, sort_keys=False, default=str)
        with self._lock:
            out = self._out()
            if out is not None:
                out.write(line + "\n")
                out.flush()
            self.recent.append(record)
            del self.recent[:-200]
        return record

    def deny(self, **fields: Any) -> dict[str, Any]:
        return self.write("deny", **fields)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def stderr_audit() -> AuditLog:
    return AuditLog(stream=sys.stderr)
