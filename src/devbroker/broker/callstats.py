"""Per-call counters and latency histograms, taken at the boundary the front ends call.

The broker core is not instrumented: :class:`InstrumentedBroker` wraps the one interface every
front end calls (open / ioctl / map_read / release, broker/interface.py) and records, per call,
who (tenant), what (the escape by its driver name, and for RM_CONTROL / RM_ALLOC the control or
class by name, all from the ABI tables) and how it ended (``ok``, ``refused`` by the broker,
``error`` with an errno, ``continued`` in the tenant), and how long the broker took.

The hot path pays for plain dict updates only: counters are ints in a dict keyed by a label
tuple and a histogram is a list of per-bucket counts found with bisect. Nothing here touches
prometheus_client; the exposition (broker/metrics.py) turns these numbers into metric families
at scrape time. A call is ``refused`` when the broker wrote a refusal record for it: the audit
log tells the recorder through :meth:`CallStats.note_refusal`, which marks the call being
recorded in the same trio task (a context variable: calls of other tasks interleave at every
await). Label values come from the ABI's own name tables, so their number is bounded whatever
a tenant sends: an unknown command is ``UNKNOWN``, never its number.
"""
from __future__ import annotations

import bisect
import contextvars
import threading
import time
from typing import Any

from devbroker.abi import ioc_nr, ioc_type, registry
from devbroker.abi.driver import NV_IOCTL_MAGIC
from devbroker.abi.nodes import NodeKind
from devbroker.broker.effects import around_each_step

# Latency bucket bounds in seconds: from the tens of µs the hot path aims at to the tens of
# ms a driver allocation can take (BRIEF §2: RM_ALLOC p50 301 µs, max 51 ms).
BUCKETS = (10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
           50e-3, 100e-3, 250e-3, 1.0)
_BOUNDS_NS = tuple(int(b * 1e9) for b in BUCKETS)

_NODE_NAMES = {NodeKind.CTL: "nvidiactl", NodeKind.GPU: "nvidia-gpu", NodeKind.UVM: "nvidia-uvm",
               NodeKind.UVM_TOOLS: "nvidia-uvm-tools", NodeKind.CAP: "nvidia-cap",
               NodeKind.OTHER: "other"}

# The call being recorded in this task: a one-element list the refusal hook sets to True.
_current: contextvars.ContextVar[list | None] = contextvars.ContextVar("devbroker_call",
                                                                      default=None)


_UVM_NODES = frozenset({NodeKind.UVM, NodeKind.UVM_TOOLS})
_PLAIN, _CONTROL, _ALLOC = 0, 1, 2
_CACHE_MAX = 4096  # (node, cmd) pairs remembered; a tenant can make up any number of cmds


class _Names:
    """Escape, control, class and UVM names of every driver version the ABI tables know
    (names are the same across versions where both have them)."""

    def __init__(self) -> None:
        self.escapes: dict[int, str] = {}
        self.controls: dict[int, str] = {}
        self.classes: dict[int, str] = {}
        self.uvm: dict[int, str] = {}
        for version in registry.versions():
            names = registry.op_names(version)  # (no layouts built: a broker's start)
            for table, into in ((names["escapes"], self.escapes),
                                (names["controls"], self.controls),
                                (names["classes"], self.classes), (names["uvm"], self.uvm)):
                for key, name in table.items():
                    into.setdefault(key, name)
        by_name = {v: k for k, v in self.escapes.items()}
        self._sub = {by_name.get("NV_ESC_RM_CONTROL", -1): _CONTROL,
                     by_name.get("NV_ESC_RM_ALLOC", -1): _ALLOC}
        self._cache: dict[tuple, tuple[str, int]] = {}

    def _escape(self, node: NodeKind, cmd: int) -> tuple[str, int]:
        if node in _UVM_NODES:
            return self.uvm.get(cmd, "UNKNOWN"), _PLAIN
        if ioc_type(cmd) != NV_IOCTL_MAGIC:  # once per (node, cmd): the answer is cached
            return "UNKNOWN", _PLAIN
        nr = ioc_nr(cmd)
        return self.escapes.get(nr, "UNKNOWN"), self._sub.get(nr, _PLAIN)

    def ioctl(self, node: NodeKind, cmd: int, arg: bytes | None) -> tuple[str, str]:
        """(escape, command) label values of one ioctl."""
        hit = self._cache.get((node, cmd))
        if hit is None:
            hit = self._escape(node, cmd)
            if len(self._cache) < _CACHE_MAX:
                self._cache[(node, cmd)] = hit
        name, sub = hit
        # NVOS54 (RM_CONTROL) has cmd at offset 8; NVOS21/NVOS64 (RM_ALLOC) hClass at 12.
        if sub and arg is not None and len(arg) >= 16:
            if sub == _CONTROL:
                return name, self.controls.get(int.from_bytes(arg[8:12], "little"), "UNKNOWN")
            return name, self.classes.get(int.from_bytes(arg[12:16], "little"), "UNKNOWN")
        return name, ""


VERDICTS = ("ok", "refused", "error", "continued")
_OK, _REFUSED, _ERROR, _CONTINUED = range(4)
_NB = len(_BOUNDS_NS) + 1  # buckets, the last one above every bound
_HIST = len(VERDICTS)  # where the buckets start in a row
_SUM = _HIST + _NB  # where the sum of nanoseconds is


class CallStats:
    """What InstrumentedBroker records; read at scrape time (broker/metrics.py).

    One row per (tenant, op, call, command): calls per verdict, latency bucket counts (not
    cumulative), the sum of nanoseconds. A call costs one dict lookup and three list
    increments."""

    def __init__(self, clock=time.perf_counter_ns):
        self.names = _Names()
        self.clock = clock
        self.rows: dict[tuple[str, str, str, str], list[int]] = {}
        # Seccomp listener threads record their tenants' calls concurrently with the trio
        # thread (broker/effects.py): the row updates are one lock's.
        self._lock = threading.Lock()

    def note_refusal(self, record: dict[str, Any]) -> None:
        """AuditLog observer: a refusal record marks the call of the task that wrote it."""
        if record.get("event") == "deny":
            cell = _current.get()
            if cell is not None:
                cell[0] = True

    def _record(self, key: tuple[str, str, str, str], verdict: int, ns: int) -> None:
        bucket = _HIST + bisect.bisect_left(_BOUNDS_NS, ns)
        with self._lock:
            row = self.rows.get(key)
            if row is None:
                row = self.rows[key] = [0] * (_SUM + 1)
            row[verdict] += 1
            row[bucket] += 1
            row[_SUM] += ns

    def record_rows(self, key: tuple[str, str, str, str], ok: int, err: int, sum_ns: int,
                    buckets, continued: int = 0) -> None:
        """Many calls of one kind at once: ok, err and continued of them by verdict, their
        latency already counted per bucket (`buckets`: one count per bucket, in BUCKETS'
        order and then the one above them all) and summed."""
        if len(buckets) != _NB:
            raise ValueError(f"{len(buckets)} latency buckets, expected {_NB}")
        with self._lock:
            row = self.rows.get(key)
            if row is None:
                row = self.rows[key] = [0] * (_SUM + 1)
            row[_OK] += ok
            row[_ERROR] += err
            row[_CONTINUED] += continued
            for i, n in enumerate(buckets):
                row[_HIST + i] += n
            row[_SUM] += sum_ns

    @property
    def calls(self) -> dict[tuple[str, str, str, str, str], int]:
        """(tenant, op, call, command, verdict) -> calls, for the verdicts seen."""
        out = {}
        with self._lock:
            rows = [(k, list(r)) for k, r in self.rows.items()]
        for key, row in rows:
            for i, verdict in enumerate(VERDICTS):
                if row[i]:
                    out[key + (verdict,)] = row[i]
        return out

    def histograms(self) -> dict[tuple[str, str, str], tuple[list[tuple[str, int]], float]]:
        """Cumulative buckets (le, count) and the sum in seconds per (op, call, command):
        the tenants' rows added up (latency is labelled by kind only, to keep series few)."""
        merged: dict[tuple[str, str, str], list[int]] = {}
        with self._lock:
            rows = [(k, list(r)) for k, r in self.rows.items()]
        for key, row in rows:
            m = merged.setdefault(key[1:], [0] * (_NB + 1))
            for i in range(_NB + 1):
                m[i] += row[_HIST + i]
        out = {}
        for key, m in merged.items():
            acc, buckets = 0, []
            for bound, n in zip(BUCKETS, m):
                acc += n
                buckets.append((repr(bound), acc))
            acc += m[_NB - 1]
            buckets.append(("+Inf", acc))
            out[key] = (buckets, m[_NB] / 1e9)
        return out

    def export_state(self) -> dict[str, Any]:
        """For a successor broker (live upgrade): the rows, as JSON-able lists."""
        with self._lock:
            return {"buckets": list(BUCKETS),
                    "rows": [[*k, list(row)] for k, row in self.rows.items()]}

    def import_state(self, state: dict[str, Any]) -> None:
        if list(state.get("buckets", [])) != list(BUCKETS):
            return  # other buckets: start afresh (Prometheus takes it as a counter reset)
        for tenant, op, call, command, row in state.get("rows", []):
            if len(row) == _SUM + 1:
                self.rows[(tenant, op, call, command)] = [int(x) for x in row]


def _verdict(cell: list, errno_: int, continued: bool = False) -> int:
    if cell[0]:
        return _REFUSED
    if continued:
        return _CONTINUED
    return _ERROR if errno_ else _OK


def _observed(steps, done):
    """The broker's steps (broker/effects.py), unchanged, and `done(reply)` called at the
    end. The refusal marker is set while the broker's own code runs — on whichever thread
    resumes the steps (a seccomp listener's, or the trio thread after a hand-over) — by the
    broker's own step wrapper (Broker.ioctl_steps(req, around=...)), or by a wrapper of
    ours for a broker without one."""
    reply = yield from steps
    done(reply)
    return reply


class _Marking:
    """The refusal marker of one call set for a stretch of the broker's code."""

    __slots__ = ("cell", "token")

    def __init__(self, cell: list):
        self.cell = cell

    def __enter__(self) -> None:
        self.token = _current.set(self.cell)

    def __exit__(self, *exc) -> None:
        _current.reset(self.token)



class InstrumentedBroker:
    """The broker as the front ends see it, with every call counted and timed.

    The async calls (FUSE, CUSE, kmod) and the synchronous ones a seccomp listener thread
    makes (open_now, ioctl_steps, map_check_now) are wrapped; every other attribute
    (memgate, poll, sessions, ...) is the wrapped broker's, so a front end cannot tell the
    difference."""

    def __init__(self, broker: Any, stats: CallStats):
        self._broker = broker
        self._stats = stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self._broker, name)

    def _key(self, s: Any, op: str) -> tuple[str, str, str, str]:
        """The row of a call on session `s` (None: a session the broker does not know)."""
        if s is None:
            return ("", op, "UNKNOWN", "")
        return (s.tenant.name, op, _NODE_NAMES.get(s.node, "other"), "")

    def _ioctl_key(self, s: Any, req: Any) -> tuple[str, ...]:
        if s is None:
            return ("", "ioctl", "UNKNOWN", "")
        return (s.tenant.name, "ioctl", *self._stats.names.ioctl(s.node, req.cmd, req.arg))

    async def open(self, req):
        stats, cell = self._stats, [False]
        t0 = stats.clock()
        with _Marking(cell):
            rep = await self._broker.open(req)
        stats._record((req.tenant, "open", _NODE_NAMES.get(req.node, "other"), ""),
                      _verdict(cell, rep.errno), stats.clock() - t0)
        return rep

    async def ioctl(self, req):
        stats, cell = self._stats, [False]
        s = self._broker.sessions.get(req.session)
        t0 = stats.clock()
        with _Marking(cell):
            rep = await self._broker.ioctl(req)
        ns = stats.clock() - t0
        stats._record(self._ioctl_key(s, req), _verdict(cell, rep.errno, rep.run_in_caller), ns)
        return rep

    def open_now(self, req):
        stats, cell = self._stats, [False]
        t0 = stats.clock()
        with _Marking(cell):
            rep = self._broker.open_now(req)
        stats._record((req.tenant, "open", _NODE_NAMES.get(req.node, "other"), ""),
                      _verdict(cell, rep.errno), stats.clock() - t0)
        return rep

    def ioctl_steps(self, req):
        stats, cell = self._stats, [False]
        key = self._ioctl_key(self._broker.sessions.get(req.session), req)
        t0 = stats.clock()

        def done(rep):
            stats._record(key, _verdict(cell, rep.errno, rep.run_in_caller),
                          stats.clock() - t0)
        try:
            steps = self._broker.ioctl_steps(req, around=lambda: _Marking(cell))
        except TypeError:  # a broker whose steps take no wrapper
            steps = around_each_step(self._broker.ioctl_steps(req), lambda: _Marking(cell))
        return _observed(steps, done)

    @property
    def continue_lane(self):
        """The broker's continue lane (fastlane.py), its calls counted as continued."""
        lane = getattr(self._broker, "continue_lane", None)
        return None if lane is None else _CountedContinue(lane, self._stats)

    @property
    def control_lane(self):
        """The broker's control lane (fastlane.py), its calls counted like ioctl_steps'."""
        lane = getattr(self._broker, "control_lane", None)
        return None if lane is None else _CountedLane(lane, self._stats)

    def map_check_now(self, req):
        stats, cell = self._stats, [False]
        s = self._broker.sessions.get(req.session)
        t0 = stats.clock()
        with _Marking(cell):
            rep = self._broker.map_check_now(req)
        stats._record(self._key(s, "mmap"), _verdict(cell, rep.errno), stats.clock() - t0)
        return rep

    async def map_check(self, req):
        return self.map_check_now(req)

    async def map_read(self, req):
        stats, cell = self._stats, [False]
        s = self._broker.sessions.get(req.session)
        t0 = stats.clock()
        with _Marking(cell):
            rep = await self._broker.map_read(req)
        stats._record(self._key(s, "map_read"), _verdict(cell, rep.errno), stats.clock() - t0)
        return rep

    async def release(self, req):
        stats = self._stats
        s = self._broker.sessions.get(req.session)
        t0 = stats.clock()
        await self._broker.release(req)
        stats._record(self._key(s, "release"), _OK, stats.clock() - t0)


class _CountedLane:
    """A control lane whose calls are recorded as the general path's are: one row per
    (tenant, ioctl, escape, control), verdict ok or error, time from admission to answer
    (kept on the admitted call itself: a call sent the general way after admission is
    counted there; one whose books a front end writes after the answer, to the booking)."""

    __slots__ = ("_lane", "_stats")

    def __init__(self, lane: Any, stats: CallStats):
        self._lane, self._stats = lane, stats

    def ioctl_cmds(self, versions) -> frozenset[int]:
        return self._lane.ioctl_cmds(versions)

    def admit(self, session_id: int, caller: Any, ioctl_cmd: int, hdr: bytes,
              max_params: int | None = None, run_hooks: bool = False):
        t0 = self._stats.clock()
        adm = self._lane.admit(session_id, caller, ioctl_cmd, hdr, max_params, run_hooks)
        if adm is not None:
            s = adm.session
            adm.mark = (t0, (s.tenant.name, "ioctl",
                             *self._stats.names.ioctl(s.node, ioctl_cmd, hdr)))
        return adm

    def check(self, adm, params: bytearray, embedded_ok: bool = False) -> bool:
        return self._lane.check(adm, params, embedded_ok)

    def fd_target(self, adm, session_id: int | None) -> bool:
        return self._lane.fd_target(adm, session_id)

    def sent_back(self, adm) -> None:
        self._lane.sent_back(adm)

    def unknown_client(self, session_id: int, ioctl_cmd: int, hdr: bytes) -> int | None:
        return self._lane.unknown_client(session_id, ioctl_cmd, hdr)

    def release(self, adm) -> None:
        self._lane.release(adm)

    def table_patch(self, adm):
        return self._lane.table_patch(adm)

    def id_flag(self, adm):
        return self._lane.id_flag(adm)

    def id_list_check(self, adm):
        return self._lane.id_list_check(adm)

    def settleable_escape(self, adm) -> bool:
        return self._lane.settleable_escape(adm)

    def needs_finish(self, adm, patched: bool = False) -> bool:
        return self._lane.needs_finish(adm, patched)

    def book(self, adm) -> None:
        self._lane.book(adm)

    def books_only(self, adm) -> bool:
        return self._lane.books_only(adm)

    def book_settled(self, session_id: int, hdr_out: bytes, ioctl_cmd: int):
        return self._lane.book_settled(session_id, hdr_out, ioctl_cmd)

    def settleable(self, adm) -> bool:
        return self._lane.settleable(adm)

    def settled_calls(self, tenant, key, ok: int, err: int, sum_ns: int, buckets) -> None:
        """Settled calls' rows (a front end counted them by latency bucket itself)."""
        self._lane.settled_calls(tenant, key, ok, err, sum_ns, buckets)
        if key is not None:
            self._stats.record_rows(key, ok, err, sum_ns, buckets)

    def answered(self, adm, err: int, end_ns: int) -> None:
        """The row of a call answered without finish (the verdict and the end time the
        front end kept for it)."""
        self._lane.answered(adm, err, end_ns)
        if adm.mark is not None:
            t0, key = adm.mark
            self._stats._record(key, _ERROR if err else _OK, max(0, end_ns - t0))

    def finish(self, adm, hdr: bytes, params_in: bytes, ret: int, err: int, hdr_out: bytes,
               params_out: bytearray) -> bytes:
        out = self._lane.finish(adm, hdr, params_in, ret, err, hdr_out, params_out)
        if err or not self._lane.runs_hook(adm):  # (else its row ends with run_after)
            self._done(adm, _ERROR if err else _OK)
        return out

    def runs_hook(self, adm) -> bool:
        return self._lane.runs_hook(adm)

    def run_after(self, adm, hdr_out: bytes, params_in: bytes, req: Any, perform) -> bool:
        """The after-hook the front end runs before the answer: in the call's row's time."""
        try:
            return self._lane.run_after(adm, hdr_out, params_in, req, perform)
        finally:
            self._done(adm, _OK)

    def _done(self, adm, verdict: int) -> None:
        if adm.mark is not None:
            t0, key = adm.mark
            self._stats._record(key, verdict, self._stats.clock() - t0)


class _CountedContinue:
    """A continue lane whose admitted calls are recorded as the general path's continued
    ones are (verdict "continued")."""

    __slots__ = ("_lane", "_stats")

    def __init__(self, lane: Any, stats: CallStats):
        self._lane, self._stats = lane, stats

    def candidate(self, node: Any, cmd: int) -> bool:
        return self._lane.candidate(node, cmd)

    def arg_size(self, session_id: int, cmd: int) -> int | None:
        return self._lane.arg_size(session_id, cmd)

    def settle_fields(self, session_id: int, cmd: int):
        return self._lane.settle_fields(session_id, cmd)

    def row_key(self, session_id: int, cmd: int, arg: bytes):
        s = self._lane.broker.sessions.get(session_id)
        return None if s is None else (s.tenant.name, "ioctl",
                                       *self._stats.names.ioctl(s.node, cmd, arg))

    def map_key(self, session_id: int):
        s = self._lane.broker.sessions.get(session_id)
        return None if s is None else (s.tenant.name, "mmap", _NODE_NAMES.get(s.node, "other"),
                                       "")

    def settled_maps(self, tenant, key, count: int, sum_ns: int, buckets) -> None:
        """Mappings the front end let through by a mapping fact: map_check_now's rows."""
        self._lane.settled_maps(tenant, key, count, sum_ns, buckets)
        if key is not None:
            self._stats.record_rows(key, count, 0, sum_ns, buckets)

    def settled_answers(self, tenant, key, count: int, sum_ns: int, buckets) -> None:
        """Answer facts' rows (the front end counted them by latency bucket)."""
        self._lane.settled_answers(tenant, key, count, sum_ns, buckets)
        if key is not None:
            self._stats.record_rows(key, count, 0, sum_ns, buckets)

    def settled_calls(self, tenant, key, count: int, sum_ns: int, buckets) -> None:
        """Settled continuations' rows (the front end counted them by latency bucket)."""
        self._lane.settled_calls(tenant, key, count, sum_ns, buckets)
        if key is not None:
            self._stats.record_rows(key, 0, 0, sum_ns, buckets, continued=count)

    def root_alloc(self, session_id: int, caller: Any, ioctl_cmd: int, hdr: bytes) -> bool:
        t0 = self._stats.clock()
        ok = self._lane.root_alloc(session_id, caller, ioctl_cmd, hdr)
        if ok:
            s = self._lane.broker.sessions.get(session_id)
            if s is not None:
                self._stats._record((s.tenant.name, "ioctl", *self._stats.names.ioctl(
                    s.node, ioctl_cmd, hdr)), _CONTINUED, self._stats.clock() - t0)
        return ok

    def admit(self, session_id: int, caller: Any, cmd: int, arg: bytes,
              resolve_fd: Any = None) -> bool:
        t0 = self._stats.clock()
        ok = self._lane.admit(session_id, caller, cmd, arg, resolve_fd)
        if ok:
            s = self._lane.broker.sessions.get(session_id)
            if s is not None:
                self._stats._record((s.tenant.name, "ioctl", *self._stats.names.ioctl(
                    s.node, cmd, arg)), _CONTINUED, self._stats.clock() - t0)
        return ok
