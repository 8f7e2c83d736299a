"""The quota watch (broker/quotawatch.py): processes that made a continued call a racing
thread could turn into device memory are watched for their life; memory the driver accounts
to a tenant's processes beyond its quota ends them.

Real processes (children that sleep), real pidfds, real SIGKILL, a real trio run on real
time. The one stand-in is the driver's per-process accounting (GET_PID_INFO), which needs
the NVIDIA driver: `Accounting` answers what the test says each process holds, on the worker
thread the watch reads it from. On the H200 the real read runs in every CUDA tenant
(docs/hardware.md).
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest
import trio

from devbroker.broker import quotawatch
from devbroker.broker.audit import AuditLog
from devbroker.broker.procinfo import pid_namespace
from devbroker.broker.quotawatch import QuotaWatch

GiB = 1 << 30


class Accounting:
    """What the driver would account to each process (tgid -> GPU -> bytes)."""

    def __init__(self):
        self.held: dict[int, dict[int, int]] = {}
        self.reads: list[list[int]] = []
        self.threads: set[str] = set()
        self.delay = 0.0

    def __call__(self, tgids: list[int]) -> dict[int, dict[int, int]]:
        self.reads.append(list(tgids))
        self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        return {t: dict(self.held.get(t, {})) for t in tgids}


class Tenant:
    """What a look needs of the broker's TenantState: name, quota per GPU, the processes
    holding its files, its books."""

    def __init__(self, name: str, quota: int, tgids=(), books: int = 0):
        self.name, self._quota, self.files_held_by = name, quota, set(tgids)
        self.books = books
        self.opened_in: dict[int, str | None] = {}

    def quota(self, gpu: int) -> int:
        return self._quota

    def openers(self) -> dict[int, str | None]:
        """As TenantState.openers: pid -> the pid namespace its file was opened in (here
        the process's own, unless the test recorded another in `opened_in`)."""
        return {p: self.opened_in.get(p, pid_namespace(p)) for p in self.files_held_by}

    def used(self) -> dict[int, int]:
        return {0: self.books}


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def killed(p: subprocess.Popen, within: float) -> bool:
    try:
        return p.wait(within) == -signal.SIGKILL
    except subprocess.TimeoutExpired:
        return False


def watch_for(seconds: float, setup):
    """Run a QuotaWatch in a trio run for `seconds`; setup(qw) runs inside it (it may
    return an async function run alongside). Returns (qw, audit records)."""
    audit = AuditLog()
    box = {}

    async def main():
        async with trio.open_nursery() as n:
            def start_soon(fn):
                n.start_soon(fn)
                return True
            qw = QuotaWatch(box["read"], lambda: box["tenants"], audit, start_soon)
            box["qw"] = qw
            extra = setup(qw)
            if extra is not None:
                n.start_soon(extra)
            await trio.sleep(seconds)
            n.cancel_scope.cancel()
    return box, main, audit


def run_watch(read, tenants, seconds, setup):
    box, main, audit = watch_for(seconds, setup)
    box["read"], box["tenants"] = read, tenants
    trio.run(main)
    qw = box["qw"]
    qw.close()
    return qw, [r for r in audit.recent]


@pytest.fixture
def procs():
    made = []

    def make():
        p = sleeper()
        made.append(p)
        return p
    yield make
    for p in made:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_watched_process_beyond_the_quota_is_killed_at_the_first_look(procs):
    a = procs()
    acc = Accounting()
    acc.held[a.pid] = {0: 2 * GiB}
    t0 = time.monotonic()
    qw, recs = run_watch(acc, {"t": Tenant("t", GiB, [a.pid])}, 0.6,
                         lambda qw: qw.watch(a.pid, "t"))
    assert killed(a, 1), "the process holding 2 GiB against a 1 GiB quota was not killed"
    v = [r for r in recs if r["event"] == "violation"]
    assert len(v) == 1 and v[0]["tenant"] == "t" and str(a.pid) in v[0]["reason"], recs
    assert qw.killed == 1
    # The first look comes FIRST_S after the call, not a period later.
    assert acc.reads and acc.reads[0] == [a.pid]
    assert time.monotonic() - t0 < 5


def test_memory_the_driver_accounts_later_is_still_found(procs):
    """The kernel's re-read of a continued call can come long after the decision (its
    argument's page faulting to a handler the tenant serves when it likes). The looks go on
    while the process lives: memory that appears 1.5 s later — after the 50 ms and 1 s looks
    of the watch this replaced — is found."""
    a = procs()
    acc = Accounting()

    async def later():
        await trio.sleep(1.5)
        acc.held[a.pid] = {0: 3 * GiB}

    qw, recs = run_watch(acc, {"t": Tenant("t", GiB, [a.pid])}, 3.2,
                         lambda qw: (qw.watch(a.pid, "t"), later)[1])
    assert killed(a, 1), f"not killed; reads {len(acc.reads)}, records {recs}"
    assert len(acc.reads) >= 3  # the first look, then one every PERIOD_S


def test_memory_split_over_a_tenants_processes_counts_as_one(procs):
    """The quota is the tenant's: two processes holding 0.6 GiB each of a 1 GiB quota are
    over it together, the one not watched (it holds the tenant's files) included."""
    a, b, other = procs(), procs(), procs()
    acc = Accounting()
    acc.held = {a.pid: {0: 600 << 20}, b.pid: {0: 600 << 20}, other.pid: {0: 900 << 20}}
    tenants = {"t": Tenant("t", GiB, [a.pid, b.pid]), "u": Tenant("u", GiB, [other.pid])}
    qw, recs = run_watch(acc, tenants, 0.6,
                         lambda qw: (qw.watch(a.pid, "t"), qw.watch(other.pid, "u"))[1])
    assert killed(a, 1) and killed(b, 1)
    assert other.poll() is None, "tenant u within its own quota was killed"
    v = [r for r in recs if r["event"] == "violation"]
    assert len(v) == 1 and v[0]["tenant"] == "t"
    assert sorted(acc.reads[0]) == sorted([a.pid, b.pid, other.pid])  # one read for all


def test_within_the_quota_nothing_happens_and_exited_processes_are_forgotten(procs):
    a = procs()
    acc = Accounting()
    acc.held[a.pid] = {0: GiB // 2}
    tenants = {"t": Tenant("t", GiB, [a.pid])}

    async def end_it():
        await trio.sleep(0.3)
        assert a.poll() is None  # alive and within the quota after the first look
        a.terminate()
        a.wait()
        tenants["t"].files_held_by.clear()

    qw, recs = run_watch(acc, tenants, 2.5, lambda qw: (qw.watch(a.pid, "t"), end_it)[1])
    assert a.returncode == -signal.SIGTERM  # ours, not the watch's
    assert not [r for r in recs if r["event"] == "violation"]
    assert qw.watching() == [] and not qw._running, "the look task outlived the last process"
    n = len(acc.reads)
    assert 1 <= n <= 3  # stopped reading once nothing was left to watch


def test_the_read_runs_off_the_trio_thread_and_does_not_hold_it_up(procs):
    a = procs()
    acc = Accounting()
    acc.delay = 0.4  # a slow driver read
    ticks = []

    async def ticker():
        for _ in range(50):
            ticks.append(time.monotonic())
            await trio.sleep(0.01)

    qw, _ = run_watch(acc, {"t": Tenant("t", GiB, [a.pid])}, 0.7,
                      lambda qw: (qw.watch(a.pid, "t"), ticker)[1])
    assert acc.reads and threading.main_thread().name not in acc.threads
    gaps = [y - x for x, y in zip(ticks, ticks[1:])]
    assert max(gaps) < 0.2, f"the trio thread was held up {max(gaps):.3f} s"


def test_a_watch_from_another_thread_brings_the_look_forward(procs):
    """Decisions run on listener threads: a watch from one pulls a look that was a period
    away in to FIRST_S."""
    a, b = procs(), procs()
    acc = Accounting()
    tenants = {"t": Tenant("t", GiB, [a.pid, b.pid])}
    seen = {}

    async def from_a_thread():
        await trio.sleep(0.3)  # past a's first look: the next is a period away
        acc.held[b.pid] = {0: 2 * GiB}
        seen["t"] = time.monotonic()
        await trio.to_thread.run_sync(qw_box["qw"].watch, b.pid, "t")

    qw_box = {}

    def setup(qw):
        qw_box["qw"] = qw
        qw.watch(a.pid, "t")
        return from_a_thread

    qw, recs = run_watch(acc, tenants, 0.55, setup)
    assert killed(b, 0.2), "the look after the second watch did not come within 0.25 s"
    assert quotawatch.PERIOD_S[0] > 0.25  # so the look was the early one


def test_processes_watched_before_the_trio_run_are_looked_at_once_it_starts(procs):
    """A live upgrade's successor watches its tenants' processes before its trio run
    exists; resume() starts the looks then."""
    a = procs()
    acc = Accounting()
    acc.held[a.pid] = {0: 2 * GiB}
    audit = AuditLog()
    qw = QuotaWatch(acc, lambda: {"t": Tenant("t", GiB, [a.pid])}, audit, lambda fn: False)
    qw.watch(a.pid, "t")
    assert qw.watching() == [a.pid] and not qw._running

    async def main():
        async with trio.open_nursery() as n:
            def start_soon(fn):
                n.start_soon(fn)
                return True
            qw.start_soon = start_soon
            qw.resume()
            await trio.sleep(0.5)
            n.cancel_scope.cancel()
    trio.run(main)
    qw.close()
    assert killed(a, 1)


def test_a_pid_that_is_gone_is_not_watched(procs):
    a = procs()
    a.kill()
    a.wait()
    qw = QuotaWatch(Accounting(), dict, AuditLog(), lambda fn: True)
    qw.watch(a.pid, "t")  # pidfd_open fails: nothing to watch, nothing to kill later
    assert qw.watching() == []


def test_the_accounting_reads_parameter_block_is_the_codecs():
    """VidmemMonitor builds GET_PID_INFO's 200-entry block with struct (no codec work on
    the interpreter lock); the bytes must be what the ABI codec encodes, and the answer
    read as the codec decodes it."""
    from devbroker.abi import registry
    from devbroker.abi import status as nvs
    from devbroker.backends.real import VidmemMonitor

    abi = registry.get("580.159.04")
    spec = abi.control(0x2080018E).params
    tgids = [101, 202, 303]

    class Driver:  # answers as the driver would, through the codec
        abi = registry.get("580.159.04")
        sent = None

        def control_raw(self, obj, cmd, params):
            assert (obj, cmd) == (0xCAFE, 0x2080018E)
            self.sent = params
            v = spec.decode(params)
            out = []
            for k, e in enumerate(v.pidInfoList):
                if k < v.pidInfoListCount:
                    raw = bytearray(len(e.data.raw) if hasattr(e.data, "raw")
                                    else len(e.data.encode()))
                    raw[0:16] = ((e.pid << 20).to_bytes(8, "little")
                                 + (7).to_bytes(8, "little"))
                    e = e.replace(result=nvs.NV_OK if e.pid != 202 else 0x3E,
                                  data=e.data.spec.decode(bytes(raw))
                                  if hasattr(e.data, "spec") else bytes(raw))
                out.append(e)
            return spec.encode(v.replace(pidInfoList=out)) if hasattr(spec, "encode") \
                else v.replace(pidInfoList=out).encode()

    mon = VidmemMonitor.__new__(VidmemMonitor)
    mon.rm, mon._layout = Driver(), None
    got = mon._read(0xCAFE, tgids)
    want = spec.decode(bytes(spec.size))
    entries = list(want.pidInfoList)
    for j, t in enumerate(tgids):
        entries[j] = entries[j].replace(pid=t, index=0)
    assert mon.rm.sent == want.replace(pidInfoListCount=3, pidInfoList=entries).encode()
    assert got == [(101 << 20) + 7, 0, (303 << 20) + 7]  # 202: not NV_OK -> 0


def test_a_quota_lowered_under_what_the_books_hold_is_not_a_violation(procs):
    """A policy change may lower a tenant's quota under what it already holds (kept until
    freed). The driver's accounting then matches the books, above the new quota: the bound
    is the books there, not the quota. Memory beyond the books is still found."""
    a, b = procs(), procs()
    acc = Accounting()
    acc.held = {a.pid: {0: 3 * GiB}, b.pid: {0: 5 * GiB}}
    tenants = {"t": Tenant("t", GiB, [a.pid], books=3 * GiB),  # quota lowered to 1 GiB
               "u": Tenant("u", GiB, [b.pid], books=3 * GiB)}  # 2 GiB past its books
    qw, recs = run_watch(acc, tenants, 0.6,
                         lambda qw: (qw.watch(a.pid, "t"), qw.watch(b.pid, "u"))[1])
    assert a.poll() is None, "killed for memory its books hold"
    assert killed(b, 1)
    assert [r["tenant"] for r in recs if r["event"] == "violation"] == ["u"]


def test_a_pid_reused_outside_the_sandbox_is_neither_read_nor_killed(procs):
    """A file outlives its opener (another process of the tenant holds it), and the
    opener's pid is reused by a process of another sandbox or the host. The look checks a
    non-watched opener's pid namespace against the one the file was opened in: that
    process is not the tenant's, so its memory is not added to the tenant's and it is not
    killed."""
    a, stranger = procs(), procs()
    acc = Accounting()
    acc.held = {a.pid: {0: 100 << 20}, stranger.pid: {0: 5 * GiB}}
    t = Tenant("t", GiB, [a.pid, stranger.pid])
    t.opened_in[stranger.pid] = "pid:[4026531000]"  # opened in another sandbox
    qw, recs = run_watch(acc, {"t": t}, 0.6, lambda qw: qw.watch(a.pid, "t"))
    assert a.poll() is None and stranger.poll() is None, recs
    assert not [r for r in recs if r["event"] == "violation"]
    assert all(stranger.pid not in r for r in acc.reads), acc.reads


def test_memory_accounted_to_an_exited_opener_ends_the_tenant(procs):
    """A client's memory is accounted to the pid that created it. Its creator (a file's
    opener) has exited; another process of the tenant holds the file and allocated past
    the books under that client. The look reads the exited opener's pid too (no process
    has it now), finds the tenant over its quota and ends the tenant: its live processes
    are killed, although none of them holds the memory itself."""
    a, d = procs(), procs()
    d.kill()
    d.wait()  # exited and reaped: its pid belongs to no process now
    acc = Accounting()
    acc.held = {a.pid: {0: 0}, d.pid: {0: 2 * GiB}}
    t = Tenant("t", GiB, [a.pid, d.pid])
    t.opened_in[d.pid] = "pid:[4026531836]"
    qw, recs = run_watch(acc, {"t": t}, 0.6, lambda qw: qw.watch(a.pid, "t"))
    assert killed(a, 1), (recs, acc.reads)
    v = [r for r in recs if r["event"] == "violation"]
    assert len(v) == 1 and f"[{d.pid}]" in v[0]["reason"] and f"[{a.pid}] killed" in v[0]["reason"]
    assert d.pid in acc.reads[0]
