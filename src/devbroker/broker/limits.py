"""Per-tenant limits on what a tenant can make the broker do.

Two kinds, both per tenant and both from the policy (`rate_limit`, `limits`; docs/policy.md):

* **Pace**: every request a tenant's file-system or device calls turn into — node opens, page
  reads of node mappings, ioctls, the requests the FUSE front end answers by itself
  (reads of the /proc view, lookups, stat, readdir), and every seccomp notification the
  broker answers without its core (opens and mmaps of other files) — takes a token from the tenant's one
  bucket (`TenantState.limiter`). Over the rate the request *waits* in its own task; other
  tenants' requests are read and served meanwhile. Waiting rather than failing keeps
  unmodified clients correct (the driver never answers EAGAIN) and costs the broker
  nothing while the tenant's thread sleeps in the kernel. Closing (release) is never paced:
  it gives resources back.
* **Count**: open node files, RM root clients and RM objects a tenant may hold at once.
  Over a count the request is *refused* (EMFILE for an open, NV_ERR_INSUFFICIENT_RESOURCES
  for an allocation, as the driver answers when it runs out) with an audit record; the
  audit log's own per-tenant rate keeps a flood of such refusals from filling the disk.

Call sites stay one or two lines each: the core asks `open_refusal` / `alloc_refusal` for a
reason and raises its own refusal; the FUSE front end asks `pace_nowait` / `pace` for the
requests it serves alone. Nothing here walks another tenant's state: every check is O(1) in
what other tenants hold (`alloc_refusal` is O(the tenant's own clients), which the client
count bounds).
"""
from __future__ import annotations

import contextvars
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import trio

# Defaults when the policy says nothing (docs/policy.md says why these numbers). A CUDA
# process opens ~10-20 node files per GPU and NVML a handful; PyTorch's init made a few
# clients and ~100 objects; a training job holding thousands of 2 MiB allocations stays far
# below the object count. Each RM object costs the broker ~0.5 KiB, a client ~1.6 KiB.
DEFAULT_OPEN_FILES = 4096
DEFAULT_RM_CLIENTS = 1024
DEFAULT_RM_OBJECTS = 65536
# The rate every tenant gets when its policy names none: CUDA's initialisation (~700
# requests) and nvidia-smi (~300) fit in one burst, steady CUDA work makes almost none. A
# flood is held to what leaves other tenants their latency: on the 2-core development VM a
# tenant flooding every request kind at 2000/s moved another tenant's NVML start-up p50 by
# 1.6x, unpaced by 3.3x (scripts/bench_noisy.py, docs/benchmarks.md).
DEFAULT_RATE = 2000.0
DEFAULT_BURST = 4000


@dataclass(frozen=True)
class TenantLimits:
    """The counts a tenant may hold at once (policy key `limits`)."""

    open_files: int = DEFAULT_OPEN_FILES
    rm_clients: int = DEFAULT_RM_CLIENTS
    rm_objects: int = DEFAULT_RM_OBJECTS


DEFAULTS = TenantLimits()
KEYS = ("open_files", "rm_clients", "rm_objects")


def of(tenant: Any) -> TenantLimits:
    """The limits of a broker TenantState (a policy without `limits`: the defaults)."""
    lim = getattr(getattr(tenant, "policy", None), "limits", None)
    return lim if isinstance(lim, TenantLimits) else DEFAULTS


# ------------------------------------------------------------------ counts (the core asks)
def open_refusal(tenant: Any) -> str | None:
    """Why the tenant may not open one more node file now (None: it may)."""
    limit = of(tenant).open_files
    held = len(tenant.sessions)
    if held >= limit:
        return (f"tenant {tenant.name} holds {held} open node files, its limit "
                f"(limits.open_files = {limit})")
    return None


def alloc_refusal(tenant: Any, *, root_client: bool) -> str | None:
    """Why the tenant may not allocate one more RM root client (root_client) or object."""
    lim = of(tenant)
    clients = tenant.clients
    if root_client and len(clients) >= lim.rm_clients:
        return (f"tenant {tenant.name} holds {len(clients)} RM clients, its limit "
                f"(limits.rm_clients = {lim.rm_clients})")
    # O(the tenant's own clients), bounded by rm_clients; each client knows its own size.
    objects = sum(len(c.objects) for c in clients.values())
    if objects >= lim.rm_objects:
        return (f"tenant {tenant.name} holds {objects} RM objects, its limit "
                f"(limits.rm_objects = {lim.rm_objects})")
    return None


# ------------------------------------------------------------------ pace (the front end asks)
def _bucket(broker: Any, tenant: str | None):
    if tenant is None:
        return None
    t = getattr(broker, "tenants", {}).get(tenant)
    return getattr(t, "limiter", None)


def pace_nowait(broker: Any, tenant: str | None) -> bool:
    """Take one of the tenant's tokens if one is there now: True when the request may be
    served at once (also for requests of no tenant, or a broker without tenants); False
    when it must wait (`await pace(...)`)."""
    bucket = _bucket(broker, tenant)
    return bucket is None or bucket.try_acquire()


async def pace(broker: Any, tenant: str | None) -> None:
    """Take one of the tenant's tokens, waiting for it if none is there."""
    await take(getattr(broker, "tenants", {}).get(tenant) if tenant is not None else None)


class PaceSkips:
    """Waits for a tenant's token that a live upgrade ends early (FUSE: the pause must not
    wait for a tenant's queue). A task that sets PACE_SKIPS to one of these has its waits in
    `take` registered there; `skip_all` ends them, and the requests go on without their
    token, and no wait starts until `stop`. Only for requests that cost little to decide:
    a front end hands its expensive ones (ioctls) over undecided instead."""

    def __init__(self) -> None:
        self.now = False
        self.scopes: set = set()

    def skip_all(self) -> None:
        self.now = True
        for scope in list(self.scopes):
            scope.cancel()

    def stop(self) -> None:
        self.now = False


PACE_SKIPS: contextvars.ContextVar[PaceSkips | None] = contextvars.ContextVar(
    "PACE_SKIPS", default=None)


async def take(tenant: Any) -> None:
    """Take one of a broker TenantState's tokens, waiting for it if none is there (the
    waits are what `devbroker status` counts as rate_limited), unless the task's PaceSkips
    ends the wait."""
    bucket = getattr(tenant, "limiter", None)
    if bucket is None or bucket.try_acquire():
        return
    skips = PACE_SKIPS.get()
    if skips is None:
        await bucket.acquire()
        return
    if skips.now:
        return
    with trio.CancelScope() as scope:
        skips.scopes.add(scope)
        try:
            await bucket.acquire()
        finally:
            skips.scopes.discard(scope)


def front_end_open_refusal(broker: Any, tenant: str | None, held: int, *, pid: int,
                           what: str) -> bool:
    """For handles a front end keeps by itself (the FUSE front end's /proc view files and
    directories): refuse (with an audit record) when the tenant already holds `held` of
    them and that reaches its open-files limit. True: refused."""
    t = getattr(broker, "tenants", {}).get(tenant) if tenant is not None else None
    if t is None:
        return False
    limit = of(t).open_files
    if held < limit:
        return False
    if hasattr(t, "refusals"):
        t.refusals += 1
    audit = getattr(broker, "audit", None)
    if audit is not None:
        audit.deny(tenant=tenant, pid=pid, what=what,
                   reason=f"tenant {tenant} holds {held} open /proc view files and "
                          f"directories, its limit (limits.open_files = {limit})")
    return True


# ------------------------------------------------------------------ fair queuing
class FairQueue:
    """Requests read but not yet served, served round-robin between tenants.

    Why: the kernel hands a front end its requests in arrival order, whoever sent them. A
    tenant with 15 busy processes then always has ~15 requests ahead of a quiet tenant's one,
    and the quiet one waits for all of them (measured before this: 0.47 ms alone, 7.5 ms next
    to such a flood). A front end that reads everything pending into this queue and takes
    the next request from here serves each tenant with requests waiting in turn, one request
    per turn: a quiet tenant's request waits for at most one request of each other busy
    tenant, however many requests those have queued. Pacing (the token bucket) still bounds
    how much a tenant may ask for; this decides whose request goes next.

    Thread-safe (the FUSE front end's reader threads share one); O(1) per put and get.
    """

    def __init__(self) -> None:
        self._queues: dict[Any, deque] = {}
        self._turns: deque = deque()  # tenants with requests waiting, next turn first
        self._lock = threading.Lock()
        self.pending = 0

    def put(self, tenant: Any, item: Any) -> None:
        with self._lock:
            q = self._queues.get(tenant)
            if q is None:
                q = self._queues[tenant] = deque()
                self._turns.append(tenant)
            q.append(item)
            self.pending += 1

    def get(self) -> Any:
        """The next request (the tenant whose turn it is), or None when none waits."""
        with self._lock:
            if not self._turns:
                return None
            tenant = self._turns.popleft()
            q = self._queues[tenant]
            item = q.popleft()
            if q:
                self._turns.append(tenant)  # its next request waits for the others' turns
            else:
                del self._queues[tenant]
            self.pending -= 1
            return item

    def waiting(self) -> dict[Any, int]:
        """Requests waiting per tenant (for status and tests)."""
        with self._lock:
            return {t: len(q) for t, q in self._queues.items()}
