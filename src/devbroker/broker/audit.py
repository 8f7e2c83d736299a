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
from typing import IO, Any, Callable


class _Bucket:
    """Refusal records one tenant may still write: `rate` per second, up to `burst`."""

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst, self.tokens, self.at = rate, burst, burst, now
        self.suppressed = 0
        self.since = 0.0
        self.example: dict[str, Any] = {}

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


class AuditLog:
    """One JSON line per event, bounded two ways (issue 13 item 8): refusal records are
    rate-limited per tenant (a tenant that makes refused calls in a loop cannot fill the
    disk; what was left out is summarised in a `suppressed` record with the count and one
    example, written when that tenant's next refusal gets through or at close), and the file
    is rotated at `max_bytes` (audit.log → audit.log.1 …, `keep` old files)."""

    def __init__(self, path: str | Path | None = None, *, stream: IO[str] | None = None,
                 deny_rate: float = 50.0, deny_burst: float = 500.0,
                 max_bytes: int = 64 << 20, keep: int = 3, clock=time.monotonic):
        self.path = Path(path) if path else None
        self._stream = stream
        self._file: IO[str] | None = None
        self._size = 0
        self._lock = threading.Lock()
        self.recent: list[dict[str, Any]] = []  # bounded tail for `devbroker status`
        self.deny_rate, self.deny_burst = deny_rate, deny_burst
        self.max_bytes, self.keep = max_bytes, keep
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self.suppressed_total = 0
        # Called with every record, before the rate limit decides whether it is written:
        # metrics and alerts (broker/callstats.py, broker/alerts.py) count every refusal, also
        # those the file leaves out. Called on the writer's thread; must be quick and not
        # raise.
        self.observers: list[Callable[[dict[str, Any]], None]] = []

    def _out(self) -> IO[str] | None:
        if self._file is None and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The log names every tenant's refusals: readable by the operator only.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._size = os.fstat(fd).st_size
            self._file = os.fdopen(fd, "a", buffering=1)
        return self._file or self._stream

    def _rotate(self) -> None:
        """audit.log.N-1 → audit.log.N …, audit.log → audit.log.1; the oldest beyond `keep`
        is dropped. The next write opens a fresh file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for i in range(self.keep, 0, -1):
            src = self.path if i == 1 else self.path.with_name(f"{self.path.name}.{i - 1}")
            try:
                os.replace(src, self.path.with_name(f"{self.path.name}.{i}"))
            except FileNotFoundError:
                pass
        self._size = 0

    def _emit(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=False, default=str) + "\n"
        out = self._out()
        if out is not None:
            if (self._file is not None and self.path is not None and self.max_bytes
                    and self._size and self._size + len(line) > self.max_bytes):
                self._rotate()
                out = self._out()
            out.write(line)
            out.flush()
            self._size += len(line)
        self.recent.append(record)
        del self.recent[:-200]

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": round(time.time(), 6), "event": event, **fields}
        for observe in self.observers:
            observe(record)
        with self._lock:
            if event == "deny" and self.deny_rate > 0 and not self._admit(record):
                return record
            self._emit(record)
        return record

    def _admit(self, record: dict[str, Any]) -> bool:
        key = str(record.get("tenant"))
        now = self._clock()
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(self.deny_rate, self.deny_burst, now)
        if not b.take(now):
            if not b.suppressed:
                b.since = time.time()
            b.suppressed += 1
            self.suppressed_total += 1
            b.example = {k: record.get(k) for k in ("pid", "node", "what", "reason")}
            return False
        self._summarise(key, b)
        return True

    def _summarise(self, tenant: str, b: _Bucket) -> None:
        if b.suppressed:
            self._emit({"ts": round(time.time(), 6), "event": "suppressed", "tenant": tenant,
                        "count": b.suppressed, "since": round(b.since, 6),
                        "reason": "refusal records over the tenant's audit rate "
                                  f"({self.deny_rate:g}/s, burst {self.deny_burst:g})",
                        "example": b.example})
            b.suppressed = 0

    def deny(self, **fields: Any) -> dict[str, Any]:
        return self.write("deny", **fields)

    def close(self) -> None:
        with self._lock:
            for tenant, b in self._buckets.items():
                self._summarise(tenant, b)
            if self._file is not None:
                self._file.close()
                self._file = None


def stderr_audit() -> AuditLog:
    return AuditLog(stream=sys.stderr)
