"""Per-tenant request rate limiting that delays, never drops.

A tenant that floods the broker waits for tokens in its own tasks; other tenants' requests
are handled by other tasks and never queue behind it. Delaying (rather than failing) keeps
unmodified clients correct: the driver never answers EAGAIN to an RM call.

Tokens are taken from any thread (a seccomp listener thread takes one with try_acquire and
hands the request to the trio thread only when it would have to wait), so the bucket's
arithmetic is under a thread lock and its clock is time.monotonic.
"""
from __future__ import annotations

import threading
import time

import trio


class TokenBucket:
    def __init__(self, rate: float, burst: float):
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.updated = time.monotonic()
        self._math = threading.Lock()
        self.lock = trio.Lock()  # waiters of one tenant queue in arrival order
        self.waited = 0  # requests that had to wait (shown by `devbroker status`)

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def try_acquire(self) -> bool:
        """Take a token if one is there now (any thread); False: acquire() must wait."""
        if self.rate <= 0:  # unlimited
            return True
        with self._math:
            self._refill()
            if self.tokens >= 1.0 and not self.lock.locked():
                self.tokens -= 1.0
                return True
            return False

    def take_up_to(self, n: int) -> int:
        """Take up to n tokens there now, for calls admitted later without asking (the
        native loop's settled controls, which spend them one per call): how many were
        taken. Never one a waiter is queued for."""
        if self.rate <= 0:
            return n
        with self._math:
            self._refill()
            if self.lock.locked():
                return 0
            got = min(n, int(self.tokens))
            self.tokens -= got
            return got

    def acquire_within(self, max_s: float) -> bool:
        """(A listener thread, never trio's.) Wait here up to `max_s` for a token, when no
        request of the tenant queues for one in trio: True once taken, False to wait in
        trio (acquire) instead. A paced call that sleeps on its own listener thread costs
        the broker one sleep; handed to trio it cost a task and the GIL going back and
        forth (~1 ms of CPU per call, which a flood of paced calls turned into the other
        tenants' latency)."""
        if self.rate <= 0:
            return True
        deadline = time.monotonic() + max_s
        slept = False
        while True:
            with self._math:
                self._refill()
                if self.lock.locked():
                    return False
                if self.tokens >= 1.0:
                    self.tokens -= 1.0
                    if slept:
                        self.waited += 1
                    return True
                wait = (1.0 - self.tokens) / self.rate
            if time.monotonic() + wait > deadline:
                return False
            time.sleep(wait)
            slept = True

    async def acquire(self) -> None:
        if self.rate <= 0:
            return
        async with self.lock:
            self.waited += 1
            while True:
                with self._math:
                    self._refill()
                    if self.tokens >= 1.0:
                        self.tokens -= 1.0
                        return
                    wait = (1.0 - self.tokens) / self.rate
                await trio.sleep(wait)
