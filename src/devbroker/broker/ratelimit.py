"""Per-tenant request rate limiting that delays, never drops.

A tenant that floods the broker waits for tokens in its own tasks; other tenants' requests
are handled by other tasks and never queue behind it. Delaying (rather than failing) keeps
unmodified clients correct: the driver never answers EAGAIN to an RM call.
"""
from __future__ import annotations

import trio


class TokenBucket:
    def __init__(self, rate: float, burst: float):
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.updated = trio.current_time() if _in_trio() else 0.0
        self.lock = trio.Lock()
        self.waited = 0  # requests that had to wait (shown by `devbroker status`)

    def _refill(self) -> None:
        now = trio.current_time()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def would_wait(self) -> bool:
        if self.rate <= 0:
            return False
        now = trio.current_time()
        return min(self.burst, self.tokens + (now - self.updated) * self.rate) < 1.0

    async def acquire(self) -> None:
        if self.rate <= 0:  # unlimited
            return
        # The lock makes waiters of one tenant queue in arrival order.
        async with self.lock:
            self._refill()
            if self.tokens < 1.0:
                self.waited += 1
                await trio.sleep((1.0 - self.tokens) / self.rate)
                self._refill()
            self.tokens -= 1.0


def _in_trio() -> bool:
    try:
        trio.lowlevel.current_task()
        return True
    except RuntimeError:
        return False
