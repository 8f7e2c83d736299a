"""The managed-memory books (broker/managed.py) on given /proc views: what a racing thread
can and cannot make them forget."""
from __future__ import annotations

import os

from devbroker.broker.managed import ManagedBook, ProcessView, covered, parse_maps, past_mmap

GiB = 1 << 30
KEY = (os.makedev(0, 5), 1234)  # the tenant's nvidia-uvm file, as fstat shows it
BASE = 0x7F0000000000


def maps(*ranges: tuple[int, int], other: bool = False) -> str:
    lines = [f"{lo:x}-{hi:x} rw-s {lo:x} 00:05 1234 /dev/nvidia-uvm" for lo, hi in ranges]
    if other:
        lines.append(f"{BASE - GiB:x}-{BASE:x} rw-s 00000000 00:05 999 /dev/zero")
    return "\n".join(lines) + "\n"


class FakeProc:
    """What read_process would see: the threads' states, then the maps."""

    def __init__(self):
        self.alive, self.start, self.text = True, "100", ""
        self.threads: dict[int, str | None] = {}

    def __call__(self, tgid, tids):
        if not self.alive:
            return ProcessView(alive=False)
        return ProcessView(True, self.start,
                           {t: past_mmap(self.threads.get(t)) for t in tids}, self.text)


def test_parse_maps_counts_only_the_tenants_uvm_files():
    text = maps((BASE, BASE + GiB), other=True)
    assert parse_maps(text, [KEY]) == [(BASE, BASE + GiB)]
    assert parse_maps(text, [(os.makedev(0, 5), 1)]) == []


def test_covered_and_past_mmap():
    assert covered([(0, 10), (10, 20)], 5, 15)
    assert not covered([(0, 10), (11, 20)], 5, 15)
    assert past_mmap(None) and past_mmap("202 0x1 0x2") and not past_mmap("9 0x1 0x2")
    assert not past_mmap("running")


def test_a_range_in_flight_stays_charged_until_its_thread_is_past_it():
    proc, book = FakeProc(), None
    book = ManagedBook(reader=proc)
    book.charge(1, 11, KEY, BASE, 6 * GiB)
    # thread 11 is still inside (or on a CPU in) its mmap; nothing in the maps yet
    for state in ("9 0x7f 0x180000000", "running"):
        proc.threads[11] = state
        assert book.would_hold(1, 12, 6 * GiB) == 12 * GiB
    # past it, and the maps show the range: counted once, from the maps
    proc.threads[11], proc.text = "202 0x0", maps((BASE, BASE + 6 * GiB))
    book.reconcile(1)
    assert book.total() == 6 * GiB and book.procs[1].pending == []


def test_an_unmapped_range_is_given_back_and_a_moved_one_still_counts():
    proc = FakeProc()
    book = ManagedBook(reader=proc)
    book.charge(1, 11, KEY, BASE, 4 * GiB)
    proc.text = maps((BASE, BASE + 4 * GiB))
    book.reconcile(1)
    assert book.total() == 4 * GiB
    proc.text = maps((BASE + 64 * GiB, BASE + 68 * GiB))  # mremap moved it: still mapped
    book.reconcile(1)
    assert book.total() == 4 * GiB
    proc.text = ""  # unmapped
    assert book.would_hold(1, 11, GiB) == GiB


def test_the_same_thread_calling_again_is_past_its_earlier_mmap():
    proc = FakeProc()
    book = ManagedBook(reader=proc)
    book.charge(1, 11, KEY, BASE, 6 * GiB)
    proc.threads[11] = "9 0x0"  # (it is in an mmap again: this new one)
    assert book.would_hold(1, 11, 6 * GiB) == 6 * GiB  # the first failed or was unmapped


def test_an_ended_process_or_a_reused_pid_is_dropped():
    proc = FakeProc()
    book = ManagedBook(reader=proc)
    book.charge(1, 11, KEY, BASE, 2 * GiB)
    proc.threads[11], proc.text = "9 0x0", ""
    book.reconcile(1)
    assert book.total() == 2 * GiB  # (start time now known)
    proc.start = "200"  # another process under the same pid
    book.reconcile(1)
    assert book.total() == 0
    book.charge(1, 11, KEY, BASE, 2 * GiB)
    proc.alive = False
    book.reconcile_all()
    assert book.total() == 0 and book.procs == {}


def test_export_and_load_keep_the_books():
    proc = FakeProc()
    book = ManagedBook(reader=proc)
    book.charge(7, 8, KEY, BASE, GiB)
    again = ManagedBook(reader=proc)
    again.load(book.export())
    assert again.total() == GiB and again.by_process() == {7: GiB}
