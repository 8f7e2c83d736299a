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
        self.over_share = False  # (some of them left out for the tenant's share of the file)
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
    """One JSON line per event, bounded three ways:

    * every record that names a tenant is paced per tenant and kind of record (`deny`,
      `rewrite`, `notice`, ...: `deny_rate` per second, up to `deny_burst`): a tenant that
      makes refused or rewritten calls in a loop cannot fill the disk, and its noise of one
      kind cannot hide its records of another. What was left out is summarised in a
      `suppressed` record (the kind, the count, one example), written when that tenant's
      next record of the kind gets through, at rotation or at close;
    * each tenant may fill at most `tenant_share` of the current file (half of it by
      default), so one tenant alone never makes the file rotate: the records of the others
      (refusals, escapes) are never pushed out of the retained files by one tenant's noise.
      Over its share, its records are summarised the same way until the file rotates;
    * the file is rotated at `max_bytes` (audit.log → audit.log.1 …, `keep` old files).

    Records without a tenant (the broker's own: start, policy, upgrade) are not paced."""

    def __init__(self, path: str | Path | None = None, *, stream: IO[str] | None = None,
                 deny_rate: float = 50.0, deny_burst: float = 500.0,
                 max_bytes: int = 64 << 20, keep: int = 3, clock=time.monotonic,
                 tenant_share: float = 0.5):
        self.path = Path(path) if path else None
        self._stream = stream
        self._file: IO[str] | None = None
        self._size = 0
        self._lock = threading.Lock()
        self.recent: list[dict[str, Any]] = []  # bounded tail for `devbroker status`
        self.deny_rate, self.deny_burst = deny_rate, deny_burst
        self.max_bytes, self.keep = max_bytes, keep
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self.tenant_share = tenant_share
        self._tenant_bytes: dict[str, int] = {}  # bytes each tenant wrote to the current file
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
        self._tenant_bytes.clear()

    def _line(self, record: dict[str, Any]) -> str:
        return json.dumps(record, sort_keys=False, default=str) + "\n"

    def _emit(self, record: dict[str, Any], line: str | None = None) -> None:
        line = line or self._line(record)
        out = self._out()
        if out is not None:
            if (self._file is not None and self.path is not None and self.max_bytes
                    and self._size and self._size + len(line) > self.max_bytes):
                self._rotate()
                self._summarise_all()  # (into the fresh file: what each left out before)
                out = self._out()
            out.write(line)
            out.flush()
            self._size += len(line)
            tenant = record.get("tenant")
            if tenant is not None:
                key = str(tenant)
                self._tenant_bytes[key] = self._tenant_bytes.get(key, 0) + len(line)
        self.recent.append(record)
        del self.recent[:-200]

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": round(time.time(), 6), "event": event, **fields}
        for observe in self.observers:
            observe(record)
        with self._lock:
            if record.get("tenant") is None or event == "suppressed":
                self._emit(record)
                return record
            line = self._line(record)
            if self._admit(record, len(line)):
                self._emit(record, line)
        return record

    def _over_share(self, tenant: str, size: int) -> bool:
        """Whether this record would take the tenant past its share of the current file
        (only for a file that rotates: a stream keeps everything)."""
        if self.path is None or not self.max_bytes or self.tenant_share <= 0:
            return False
        used = self._tenant_bytes.get(tenant, 0)
        return used + size > self.max_bytes * self.tenant_share

    def _admit(self, record: dict[str, Any], size: int) -> bool:
        tenant, event = str(record.get("tenant")), str(record.get("event"))
        now = self._clock()
        b = self._buckets.get((tenant, event))
        if b is None:
            b = self._buckets[(tenant, event)] = _Bucket(self.deny_rate, self.deny_burst, now)
        # (a summary line may come first: ~300 bytes are kept free for it)
        over = self._over_share(tenant, size + (512 if b.suppressed else 0))
        if over or (self.deny_rate > 0 and not b.take(now)):
            if not b.suppressed:
                b.since = time.time()
            b.suppressed += 1
            b.over_share = over or b.over_share
            self.suppressed_total += 1
            b.example = {k: record.get(k) for k in ("pid", "node", "what", "reason")}
            return False
        self._summarise(tenant, event, b)
        return True

    def _summarise(self, tenant: str, event: str, b: _Bucket) -> None:
        if b.suppressed:
            why = (f"its share of the audit file ({self.tenant_share:.0%} of "
                   f"{self.max_bytes} bytes) was used up"
                   if b.over_share else
                   f"over the tenant's audit rate ({self.deny_rate:g}/s, burst "
                   f"{self.deny_burst:g} per kind)")
            self._emit({"ts": round(time.time(), 6), "event": "suppressed", "tenant": tenant,
                        "kind": event, "count": b.suppressed, "since": round(b.since, 6),
                        "reason": f"{b.suppressed} more '{event}' records like this left "
                                  f"out: {why}",
                        "example": b.example})
            b.suppressed = 0
            b.over_share = False

    def _summarise_all(self) -> None:
        for (tenant, event), b in list(self._buckets.items()):
            self._summarise(tenant, event, b)

    def deny(self, **fields: Any) -> dict[str, Any]:
        return self.write("deny", **fields)

    def close(self) -> None:
        with self._lock:
            self._summarise_all()
            if self._file is not None:
                self._file.close()
                self._file = None


def stderr_audit() -> AuditLog:
    return AuditLog(stream=sys.stderr)
