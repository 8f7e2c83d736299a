"""Managed (UVM) memory in a tenant's books: what its nvidia-uvm mappings may hold on a GPU.

A managed allocation (cudaMallocManaged, cupy.cuda.malloc_managed) is one mmap of the
process's nvidia-uvm file, of the allocation's size, at an address equal to its offset (the
driver refuses any other: uvm.c, uvm_mmap). Its device memory is allocated inside the
kernel as pages migrate, and no ioctl of the tenant shows it; but it can never be more than
the mapped range on any one GPU (one copy of a page per processor). So the range is charged
whole, at map time, against the quota of **every** GPU the tenant may use (residency, and
read-duplication, can put it on any of them), before the kernel maps anything.

The charge must follow the mappings while the broker sees only the mmap: munmap, mremap and
process exit are not its notifications. The truth is the process's own `/proc/PID/maps`
(lines whose device and inode are the tenant's nvidia-uvm files), read again whenever the
charge matters (`reconcile`: the next managed mmap of the process, a refusal about to be
made, `status`), plus the mappings decided but perhaps not made yet (**pending**: the
kernel runs the mmap after the broker's answer). A pending charge is dropped only when its
thread is seen past that mmap (its next notification, its current system call not mmap,
or the thread gone) and the maps read *after* that show what the call left: so a racing
thread can never make the broker forget a mapping in flight, and an unmapped range is given
back on the next look. What the kernel itself guarantees (docs/security.md, "Managed
memory"): UVM marks each mapping VM_DONTEXPAND (mremap cannot grow it), a moved or forked
copy is disabled (no pages, and still counted here while it is mapped), and a mapping at
an address other than its offset fails.

Sans-IO except `read_process`, which reads /proc (the caller holds the state lock: the
reads are a few small files of one process).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

# /proc/<tid>/syscall says this while the thread is on a CPU: it may be inside the mmap
MMAP_NR = 9  # x86_64


@dataclass
class Pending:
    tid: int
    start: int  # the mmap's offset: the address the driver requires (uvm_mmap)
    length: int


@dataclass
class ProcessCharge:
    """One process's managed mappings, as last read, and those decided since."""

    keys: set = field(default_factory=set)  # (st_dev, st_ino) of its nvidia-uvm files
    mapped: int = 0  # bytes of nvidia-uvm mappings in its maps at the last look
    pending: list = field(default_factory=list)  # Pending
    start_time: str | None = None  # /proc/PID/stat field 22: a reused pid is another process

    def charged(self) -> int:
        return self.mapped + sum(p.length for p in self.pending)


def parse_maps(text: str, keys: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (start, end) of every mapping in a /proc/PID/maps text whose file is one of
    `keys` ((st_dev, st_ino) pairs)."""
    want = {(os.major(d), os.minor(d), ino) for d, ino in keys}
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        try:
            maj, _, mnr = parts[3].partition(":")
            dev = (int(maj, 16), int(mnr, 16), int(parts[4]))
            if dev not in want:
                continue
            lo, _, hi = parts[0].partition("-")
            out.append((int(lo, 16), int(hi, 16)))
        except ValueError:
            continue
    return out


def covered(ranges: list[tuple[int, int]], start: int, length: int) -> bool:
    """Whether [start, start+length) lies wholly inside the union of `ranges`."""
    pos, end = start, start + length
    for lo, hi in sorted(ranges):
        if lo > pos:
            break
        pos = max(pos, hi)
        if pos >= end:
            return True
    return pos >= end


def past_mmap(syscall_line: str | None) -> bool:
    """From /proc/<tid>/syscall (None: the thread is gone): is the thread certainly past an
    mmap it was let through to make? Only when it is in another system call, or gone;
    'running' (on a CPU) or an mmap (this one, or another) is not certain."""
    if syscall_line is None:
        return True
    head = syscall_line.split(None, 1)[0] if syscall_line.strip() else "running"
    if head == "running":
        return False
    try:
        return int(head) != MMAP_NR
    except ValueError:
        return False


@dataclass
class ProcessView:
    """What `read_process` saw of one process, in the order that keeps a charge safe: the
    threads first, then the maps (a thread seen past its mmap has its mapping in these
    maps, or never made it / unmapped it since)."""

    alive: bool
    start_time: str | None = None
    threads: dict = field(default_factory=dict)  # tid -> past_mmap(...)
    maps: str = ""


def read_process(tgid: int, tids: Iterable[int]) -> ProcessView:
    try:
        with open(f"/proc/{tgid}/stat") as f:
            stat = f.read()
        start_time = stat.rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return ProcessView(alive=False)
    threads = {}
    for tid in set(tids):
        try:
            with open(f"/proc/{tgid}/task/{tid}/syscall") as f:
                threads[tid] = past_mmap(f.read())
        except OSError:
            threads[tid] = True  # gone: past whatever it did
    try:
        with open(f"/proc/{tgid}/maps") as f:
            maps = f.read()
    except OSError:
        return ProcessView(alive=False)
    return ProcessView(alive=True, start_time=start_time, threads=threads, maps=maps)


class ManagedBook:
    """One tenant's managed-memory charges, by process (tgid). `total()` is what
    TenantState.used() adds on each of the tenant's GPUs."""

    def __init__(self, reader: Callable[[int, Iterable[int]], ProcessView] = read_process):
        self.procs: dict[int, ProcessCharge] = {}
        self._read = reader
        self._total = 0

    def total(self) -> int:
        return self._total

    def _sum(self) -> None:
        self._total = sum(p.charged() for p in self.procs.values())

    def reconcile(self, tgid: int, now_tid: int | None = None) -> None:
        """Look at one process again: its mappings as they are, its pending charges kept
        until their threads are past them. `now_tid`: a thread of it that is making a new
        call now (so is past any mmap it made before)."""
        pc = self.procs.get(tgid)
        if pc is None:
            return
        view = self._read(tgid, [p.tid for p in pc.pending if p.tid != now_tid])
        if not view.alive or (pc.start_time is not None and view.start_time != pc.start_time):
            del self.procs[tgid]  # ended (or its pid is another process's now)
            self._sum()
            return
        pc.start_time = view.start_time
        ranges = parse_maps(view.maps, pc.keys)
        pc.mapped = sum(hi - lo for lo, hi in ranges)
        pc.pending = [p for p in pc.pending
                      if not covered(ranges, p.start, p.length)
                      and not (p.tid == now_tid or view.threads.get(p.tid, False))]
        if not pc.mapped and not pc.pending:
            del self.procs[tgid]
        self._sum()

    def reconcile_all(self) -> None:
        for tgid in list(self.procs):
            self.reconcile(tgid)

    def would_hold(self, tgid: int, tid: int, length: int) -> int:
        """The tenant's managed total if this mapping is let through, after looking at the
        process again (its earlier mappings as they are now)."""
        self.reconcile(tgid, now_tid=tid)
        return self._total + length

    def charge(self, tgid: int, tid: int, key: tuple[int, int] | None, start: int,
               length: int) -> None:
        pc = self.procs.setdefault(tgid, ProcessCharge())
        if key is not None:
            pc.keys.add(key)
        pc.pending.append(Pending(tid, start, length))
        self._sum()

    def forget(self, tgid: int) -> None:
        if self.procs.pop(tgid, None) is not None:
            self._sum()

    def by_process(self) -> dict[int, int]:
        return {tgid: p.charged() for tgid, p in self.procs.items()}

    # live upgrade (broker/handover.py): the successor reads the same /proc
    def export(self) -> list:
        return [[tgid, sorted(map(list, p.keys)), p.mapped,
                 [[q.tid, q.start, q.length] for q in p.pending], p.start_time]
                for tgid, p in self.procs.items()]

    def load(self, rows: list) -> None:
        self.procs = {}
        for tgid, keys, mapped, pending, start_time in rows:
            self.procs[int(tgid)] = ProcessCharge(
                keys={(int(d), int(i)) for d, i in keys}, mapped=int(mapped),
                pending=[Pending(int(t), int(s), int(n)) for t, s, n in pending],
                start_time=start_time)
        self._sum()
