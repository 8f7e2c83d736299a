"""The broker core as steps: decisions in plain code, every wait named as an effect.

Why: the same decision code must run in two places. On the trio thread it
serves the FUSE, CUSE and kernel-module front ends, where tenant memory is read through the
memory gate and the relay is awaited. On a seccomp listener's own thread it serves a CUDA
tenant, where a trio round trip per ioctl (~100 µs, measured) would cost more than the call
itself. Written once as generators in the sans-IO style (h11's: the core says *what* it
needs, the caller does it), the core yields an effect whenever it needs the outside world and
is resumed with the result:

    reply = yield ReadMemory(memory, addr, n, what)     # bytes
    result = yield DriverIoctl(backend, file, call)      # DriverResult

A *driver* runs the steps. :func:`run_async` performs every effect the trio way (memory
through the gate, the backend awaited). :func:`run_blocking` performs them on the calling
thread and, when one cannot be done there (a relayed file, a rate limit that must wait), hands
the half-run steps to the trio thread with :class:`HandOver` — the generator object moves;
nothing is decided twice.

Shared state: the broker's steps of different requests interleave only at effects (as
coroutines interleave only at awaits), because :func:`locked` holds :data:`STATE_LOCK` while
the core's own code runs and releases it while an effect is performed. Code that changes broker
state outside steps (open, release, a policy change) holds it too. Never hold it across an
await, and never across a syscall that a tenant can hold up (a front end's steps, which stat
the tenant's fds and read its /proc files, run outside it).
"""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generator

# Raised by a blocking performer (or a backend's ioctl_blocking) for an effect it cannot
# perform on its thread. Defined with the backends, the lowest layer that raises it.
from devbroker.backends.base import NotHere

# One lock for the broker's books (sessions, tenants, clients, quota). Held only while
# decision code runs: microseconds, never across I/O.
STATE_LOCK = threading.RLock()


class Effect:
    __slots__ = ()


@dataclass(slots=True)
class ReadMemory(Effect):
    memory: Any  # a TenantMemory
    addr: int
    length: int
    tenant: str
    what: str


@dataclass(slots=True)
class WriteMemory(Effect):
    memory: Any
    addr: int
    data: bytes
    tenant: str
    what: str


@dataclass(slots=True)
class DriverIoctl(Effect):
    backend: Any
    file: Any
    call: Any  # backends.base.DriverCall


@dataclass(slots=True)
class ResolveFd(Effect):
    resolve: Callable  # async (fd) -> session id | None
    fd: int


@dataclass(slots=True)
class RateLimit(Effect):
    limiter: Any  # ratelimit.TokenBucket


@dataclass(slots=True)
class Blocking(Effect):
    """Plain blocking work (a duplicate of a tenant fd, an fstat): run as is on a listener
    thread, through the memory gate's worker on the trio thread."""
    fn: Callable
    args: tuple
    tenant: str
    what: str


@dataclass(slots=True)
class Await(Effect):
    """A call only the trio thread can make (an async method of a broker that has no
    blocking form, a relayed page read): handed over when met on a listener thread."""
    fn: Callable
    args: tuple


Steps = Generator[Effect, Any, Any]


def perform_blocking(eff: Effect, gate: Any) -> Any:
    """Perform an effect on the calling (listener) thread, or raise NotHere. Tenant memory
    goes through gate.direct (stall accounting, own-mount faults refused); the deadline is
    kept by the listener's watchdog (frontends/seccomp.py)."""
    if isinstance(eff, ReadMemory):
        return gate.direct(eff.tenant, eff.memory.read, eff.addr, eff.length, what=eff.what)
    if isinstance(eff, WriteMemory):
        if getattr(eff.memory, "deferred", False):
            # Only queued (a seccomp listener writes everything at the end, through the
            # gate): no tenant memory is touched now.
            return eff.memory.write(eff.addr, eff.data)
        return gate.direct(eff.tenant, eff.memory.write, eff.addr, eff.data, what=eff.what)
    if isinstance(eff, DriverIoctl):
        return eff.backend.ioctl_blocking(eff.file, eff.call)
    if isinstance(eff, ResolveFd):
        got = eff.resolve(eff.fd)
        if inspect.isawaitable(got):
            got.close()  # an async lookup (FUSE's): only the trio thread can make it
            raise NotHere
        return got
    if isinstance(eff, Blocking):
        return eff.fn(*eff.args)
    raise NotHere  # RateLimit (must wait), Await


async def perform_async(eff: Effect, gate: Any) -> Any:
    """Perform an effect the trio way: tenant memory and other blocking work through the
    memory gate's worker threads (deadline, stall limit), the backend awaited."""
    if isinstance(eff, ReadMemory):
        return await gate.run(eff.tenant, eff.memory.read, eff.addr, eff.length, what=eff.what)
    if isinstance(eff, WriteMemory):
        return await gate.run(eff.tenant, eff.memory.write, eff.addr, eff.data, what=eff.what)
    if isinstance(eff, DriverIoctl):
        return await eff.backend.ioctl(eff.file, eff.call)
    if isinstance(eff, ResolveFd):
        got = eff.resolve(eff.fd)
        return await got if inspect.isawaitable(got) else got
    if isinstance(eff, RateLimit):
        return await eff.limiter.acquire()
    if isinstance(eff, Blocking):
        return await gate.run(eff.tenant, eff.fn, *eff.args, what=eff.what, memory=False)
    if isinstance(eff, Await):
        return await eff.fn(*eff.args)
    raise TypeError(f"unknown effect {eff!r}")



class HandOver(Exception):
    """run_blocking stopped at an effect it cannot perform: resume the steps with
    run_async(steps, perform, pending=effect) on the trio thread."""

    def __init__(self, steps: Steps, pending: Effect):
        super().__init__(type(pending).__name__)
        self.steps, self.pending = steps, pending


def _step(steps: Steps, value: Any = None, exc: BaseException | None = None) -> Effect:
    if exc is not None:
        return steps.throw(exc)
    return steps.send(value)


def around_each_step(steps: Steps, around: Callable[[], Any]) -> Steps:
    """The same steps, each stretch of their own code (and their closing) run inside the
    context manager around() returns; the effects in between pass through untouched."""
    value: Any = None
    exc: BaseException | None = None
    try:
        while True:
            with around():
                try:
                    eff = _step(steps, value, exc)
                except StopIteration as stop:
                    return stop.value
            try:
                value, exc = (yield eff), None
            except GeneratorExit:
                raise
            except Exception as e:
                value, exc = None, e
    finally:
        with around():
            steps.close()  # a no-op when they ended; runs their cleanups when abandoned


class _LockedWith:
    """STATE_LOCK, then another context manager inside it (one wrapper layer for both)."""

    __slots__ = ("inner",)

    def __init__(self, inner: Any):
        self.inner = inner

    def __enter__(self) -> None:
        STATE_LOCK.acquire()
        try:
            self.inner.__enter__()
        except BaseException:
            STATE_LOCK.release()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            STATE_LOCK.release()


def locked(steps: Steps, around: Callable[[], Any] | None = None) -> Steps:
    """The same steps, their own code run under STATE_LOCK (released at each effect), and
    inside around() too when given (the call counters' marker: one wrapper layer instead of
    two, as each layer costs every effect a generator hop)."""
    if around is None:
        return around_each_step(steps, lambda: STATE_LOCK)
    return around_each_step(steps, lambda: _LockedWith(around()))


def run_blocking(steps: Steps, perform: Callable[[Effect], Any]) -> Any:
    """Run steps to their end on this thread; perform(effect) does each effect here or raises
    NotHere, and then HandOver carries the rest to the trio thread."""
    value: Any = None
    exc: BaseException | None = None
    while True:
        try:
            eff = _step(steps, value, exc)
        except StopIteration as stop:
            return stop.value
        try:
            value, exc = perform(eff), None
        except NotHere:
            raise HandOver(steps, eff) from None
        except Exception as e:  # delivered into the steps, as an await would raise it
            value, exc = None, e


async def run_async(steps: Steps, perform: Callable[[Effect], Any],
                    pending: Effect | None = None) -> Any:
    """Run steps to their end on the trio thread; `await perform(effect)` does each effect.
    pending: the effect a HandOver stopped at (performed first)."""
    value: Any = None
    exc: BaseException | None = None
    eff = pending
    try:
        while True:
            if eff is None:
                try:
                    eff = _step(steps, value, exc)
                except StopIteration as stop:
                    return stop.value
            try:
                value, exc = await perform(eff), None
            except Exception as e:
                value, exc = None, e
            eff = None
    except BaseException:
        # Cancelled (or worse) while an effect was pending: close the steps now, so that
        # their cleanups (a quota reservation) run here and not in the GC.
        steps.close()
        raise
