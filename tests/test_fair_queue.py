"""Per-tenant fair queuing of the requests a front end has read (broker/limits.py).

The FUSE front end's reader threads read everything the kernel has pending into a FairQueue
and serve from it; these tests pin down the order it gives: one request per tenant per turn,
each tenant's own requests in arrival order, whatever one tenant has queued.
"""
from __future__ import annotations

import threading

from devbroker.broker.limits import FairQueue


def drain(q: FairQueue) -> list:
    out = []
    while (item := q.get()) is not None:
        out.append(item)
    return out


def test_a_quiet_tenant_waits_for_one_request_of_a_flooding_one_not_all():
    q = FairQueue()
    for i in range(15):
        q.put("noisy", ("noisy", i))
    q.put("quiet", ("quiet", 0))
    order = drain(q)
    assert order.index(("quiet", 0)) == 1  # after the one request already first in line
    assert [x for x in order if x[0] == "noisy"] == [("noisy", i) for i in range(15)]


def test_turns_go_round_between_every_waiting_tenant():
    q = FairQueue()
    for t in "abc":
        for i in range(3):
            q.put(t, (t, i))
    assert drain(q) == [(t, i) for i in range(3) for t in "abc"]
    assert q.pending == 0 and q.waiting() == {}


def test_a_tenant_that_comes_back_joins_at_the_end_of_the_turns():
    q = FairQueue()
    q.put("a", 1)
    q.put("b", 2)
    assert q.get() == 1  # a has nothing more: it leaves the turns
    q.put("a", 3)
    q.put("b", 4)
    assert q.waiting() == {"b": 2, "a": 1}
    assert drain(q) == [2, 3, 4]


def test_threads_putting_and_getting_lose_nothing():
    q = FairQueue()
    got = []
    lock = threading.Lock()
    n, producers = 2000, 4

    def put(t):
        for i in range(n):
            q.put(t, (t, i))

    def get():
        while True:
            item = q.get()
            if item is None:
                if all(not p.is_alive() for p in ps):
                    item = q.get()
                    if item is None:
                        return
                continue
            with lock:
                got.append(item)

    ps = [threading.Thread(target=put, args=(t,)) for t in range(producers)]
    cs = [threading.Thread(target=get) for _ in range(2)]
    for th in ps + cs:
        th.start()
    for th in ps + cs:
        th.join()
    assert sorted(got) == sorted((t, i) for t in range(producers) for i in range(n))
    assert q.pending == 0
