"""Threshold alerts and the refusal counts behind them, observed through the audit log.

The broker core writes one audit record per refusal (broker/audit.py); :class:`AlertMonitor`
sees every one of them (an AuditLog observer, called before the log's own rate limit), sorts
it into a small fixed set of reasons (:func:`refusal_reason`, so that metric labels stay
bounded whatever a tenant does), and once a second compares three things with the
thresholds of the running policy (``[broker.alerts]``, docs/policy.md):

- ``quota``: a tenant's device memory on one GPU is at least ``quota_percent`` % of its quota;
- ``refusal_rate``: a tenant was refused at least ``refusals_per_minute`` times in the last 60 s;
- ``escape_attempts``: a tenant made at least ``escape_attempts`` escape attempts within
  ``escape_window`` seconds — refusals that only an attempt to reach another tenant or the
  host explains (reasons in :data:`ESCAPE_REASONS`), and quota-watch violations.

An alert that starts writes an ``alert`` audit record; one that ends writes
``alert-resolved``. The metrics endpoint shows each as ``devbroker_alert_active`` (0 or 1)
and counts starts in ``devbroker_alerts_raised_total`` (broker/metrics.py).
"""
from __future__ import annotations

import collections
import re
import threading
import time
from typing import Any, Callable

# (reason label, pattern on the refusal record's reason), first match wins. Every refusal
# the broker writes today matches one (tests/test_metrics.py checks the ones it provokes);
# anything new is "other" until it is added here.
_REASONS: tuple[tuple[str, re.Pattern], ...] = tuple((label, re.compile(p, re.I)) for label, p in (
    ("quota", r"exceed the quota|managed \(UVM\) memory beyond"),
    ("rate_limit", r"rate limit"),
    ("revoked", r"was revoked|removed from the running policy"),
    ("privileged", r"CAP_SYS_ADMIN"),
    ("cross_sandbox", r"fd passed between|file behind fd .* changed|did not give out"),
    ("foreign_object", r"not a client of this tenant|is not this tenant's|held by another tenant"
                       r"|not one of this tenant's|not one of the tenant's|not the tenant's"
                       r"|debugger only on the tenant's own|not pinned to this tenant"
                       r"|no such tenant"),
    ("not_allowed", r"not allowed for tenants|allowlist|needs capability|is not valid on"
                    r"|unknown (UVM )?command|profiling interface|MIG administration"
                    r"|not an NVIDIA node|host-global"),
    ("tenant_memory", r"tenant memory access failed|argument unreadable|cannot (read|write) "
                      r"tenant memory|memory gate|stalled"),
    ("bad_object", r"is not in client|already exists|needs a device parent|parent "),
    ("malformed", r"malformed|absurd|NULL|paramsSize|not a file descriptor|page size"
                  r"|not an OS event|needs its parameters|allocated on nvidiactl|SYS_PARAMS"
                  r"|cannot lend"),
))
REASONS = tuple(label for label, _ in _REASONS) + ("other",)

# Refusals that a well-behaved client never causes: naming another tenant's objects, files or
# GPUs, passing files between sandboxes, running calls with host privilege.
ESCAPE_REASONS = frozenset({"foreign_object", "cross_sandbox", "privileged"})

ALERTS = ("quota", "refusal_rate", "escape_attempts")


def refusal_reason(record: dict[str, Any]) -> str:
    """The reason label of a refusal record (one of REASONS)."""
    text = str(record.get("reason", ""))
    for label, pattern in _REASONS:
        if pattern.search(text):
            return label
    return "other"


class _MinuteCounter:
    """Events in the last 60 seconds, in one-second slots (bounded memory at any rate)."""

    def __init__(self) -> None:
        self.slots = [0] * 60
        self.stamps = [-1] * 60

    def add(self, now: float, n: int = 1) -> None:
        sec = int(now)
        i = sec % 60
        if self.stamps[i] != sec:
            self.stamps[i], self.slots[i] = sec, 0
        self.slots[i] += n

    def total(self, now: float) -> int:
        sec = int(now)
        return sum(n for n, s in zip(self.slots, self.stamps) if sec - 60 < s <= sec)


class AlertMonitor:
    """Refusal counts by tenant and reason, and the three threshold alerts (module doc)."""

    EVERY = 1.0  # seconds between evaluations
    MAX_REMEMBERED = 10_000  # escape-attempt times kept per tenant

    def __init__(self, audit, clock: Callable[[], float] = time.monotonic):
        self.audit = audit
        self.clock = clock
        self._lock = threading.Lock()  # refusals may be written from worker threads
        self.refusals: dict[tuple[str, str], int] = {}  # (tenant, reason) -> count
        self.escape_attempts: dict[str, int] = {}  # tenant -> count
        self._per_minute: dict[str, _MinuteCounter] = {}
        self._escapes: dict[str, collections.deque] = {}
        # (alert, tenant, gpu) -> {"value": ..., "threshold": ...} while it holds
        self.active: dict[tuple[str, str, str], dict[str, Any]] = {}
        # every (alert, tenant, gpu) evaluated last time -> 0/1, for the gauge
        self.state: dict[tuple[str, str, str], int] = {}
        self.raised: dict[tuple[str, str], int] = {}  # (alert, tenant) -> times it started

    # ---------------------------------------------------------------- audit observer
    def observe(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if event not in ("deny", "violation"):
            return
        tenant = str(record.get("tenant"))
        reason = refusal_reason(record) if event == "deny" else "violation"
        now = self.clock()
        with self._lock:
            if event == "deny":
                key = (tenant, reason)
                self.refusals[key] = self.refusals.get(key, 0) + 1
                m = self._per_minute.get(tenant)
                if m is None:
                    m = self._per_minute[tenant] = _MinuteCounter()
                m.add(now)
            if reason in ESCAPE_REASONS or event == "violation":
                self.escape_attempts[tenant] = self.escape_attempts.get(tenant, 0) + 1
                d = self._escapes.get(tenant)
                if d is None:
                    d = self._escapes[tenant] = collections.deque(maxlen=self.MAX_REMEMBERED)
                d.append(now)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, broker) -> None:
        """Compare the broker's state with the running policy's thresholds (trio thread)."""
        cfg = broker.policy.broker.alerts
        now = self.clock()
        # Managed ranges are given back only when the broker looks at the processes' maps
        # (broker/managed.py): a look now, so that the quota alert, and NVML in the tenant,
        # follow an unmapped range within one evaluation.
        refresh = getattr(broker, "refresh_managed", None)
        if refresh is not None:
            refresh()
        seen: dict[tuple[str, str, str], dict[str, Any] | None] = {}
        for t in list(broker.tenants.values()):
            name = t.name
            if cfg.quota_percent > 0:
                used = t.used()
                for g in t.gpus:
                    quota = t.quota(g)
                    n = used.get(g, 0)
                    pct = 100.0 * n / quota if quota else 0.0
                    seen[("quota", name, str(g))] = (
                        {"value": round(pct, 2), "threshold": cfg.quota_percent,
                         "message": f"tenant {name} uses {n} of its {quota} bytes on GPU {g} "
                                    f"({pct:.1f} %, threshold {cfg.quota_percent:g} %)"}
                        if quota and pct >= cfg.quota_percent else None)
            with self._lock:
                m = self._per_minute.get(name)
                per_minute = m.total(now) if m else 0
                d = self._escapes.get(name)
                while d and d[0] <= now - cfg.escape_window:
                    d.popleft()
                escapes = len(d) if d else 0
            if cfg.refusals_per_minute > 0:
                seen[("refusal_rate", name, "")] = (
                    {"value": per_minute, "threshold": cfg.refusals_per_minute,
                     "message": f"tenant {name} was refused {per_minute} times in the last "
                                f"minute (threshold {cfg.refusals_per_minute})"}
                    if per_minute >= cfg.refusals_per_minute else None)
            if cfg.escape_attempts > 0:
                seen[("escape_attempts", name, "")] = (
                    {"value": escapes, "threshold": cfg.escape_attempts,
                     "message": f"tenant {name} made {escapes} escape attempts in the last "
                                f"{cfg.escape_window} s (threshold {cfg.escape_attempts})"}
                    if escapes >= cfg.escape_attempts else None)
        for key, firing in seen.items():
            alert, tenant, gpu = key
            if firing is not None and key not in self.active:
                self.active[key] = firing
                self.raised[(alert, tenant)] = self.raised.get((alert, tenant), 0) + 1
                self.audit.write("alert", alert=alert, tenant=tenant,
                                 **({"gpu": int(gpu)} if gpu else {}), **firing)
            elif firing is None and key in self.active:
                del self.active[key]
                self.audit.write("alert-resolved", alert=alert, tenant=tenant,
                                 **({"gpu": int(gpu)} if gpu else {}))
            elif firing is not None:
                self.active[key] = firing
        for key in [k for k in self.active if k not in seen]:  # tenant or threshold gone
            alert, tenant, gpu = key
            del self.active[key]
            self.audit.write("alert-resolved", alert=alert, tenant=tenant,
                             **({"gpu": int(gpu)} if gpu else {}),
                             message="no longer evaluated (tenant removed or alert turned off)")
        self.state = {k: int(v is not None) for k, v in seen.items()}

    async def run(self, broker) -> None:
        import trio

        while True:
            self.evaluate(broker)
            await trio.sleep(self.EVERY)

    # ---------------------------------------------------------------- live upgrade
    def export_state(self) -> dict[str, Any]:
        """What a successor broker needs to go on counting (broker/handover.py). Times are
        made relative to now: the successor's monotonic clock is the same (one host)."""
        now = self.clock()
        with self._lock:
            return {
                "refusals": [[t, r, n] for (t, r), n in self.refusals.items()],
                "escape_attempts": dict(self.escape_attempts),
                "raised": [[a, t, n] for (a, t), n in self.raised.items()],
                "active": [[a, t, g, v] for (a, t, g), v in self.active.items()],
                "per_minute": {t: [[s, n] for n, s in zip(m.slots, m.stamps) if s >= 0]
                               for t, m in self._per_minute.items()},
                "escapes": {t: [round(x - now, 6) for x in d] for t, d in self._escapes.items()},
            }

    def import_state(self, state: dict[str, Any]) -> None:
        now = self.clock()
        with self._lock:
            self.refusals = {(t, r): int(n) for t, r, n in state.get("refusals", [])}
            self.escape_attempts = {t: int(n) for t, n in state.get("escape_attempts", {}).items()}
            self.raised = {(a, t): int(n) for a, t, n in state.get("raised", [])}
            self.active = {(a, t, g): v for a, t, g, v in state.get("active", [])}
            for t, slots in state.get("per_minute", {}).items():
                m = self._per_minute[t] = _MinuteCounter()
                for s, n in slots:
                    m.stamps[int(s) % 60], m.slots[int(s) % 60] = int(s), int(n)
            for t, ages in state.get("escapes", {}).items():
                self._escapes[t] = collections.deque((now + a for a in ages),
                                                     maxlen=self.MAX_REMEMBERED)
