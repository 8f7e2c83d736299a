"""The one executor of the control lane's decisions in Python.

A call the control lane (fastlane.ControlLane) admits runs the same sequence in every
front end that runs it in Python — the seccomp listener's Python loop, the FUSE readers'
Python loop and the FUSE readers' native loop:

    admit on the header → read the parameter block once → check the private copy →
    run the driver on the private copies → the books and the answer's post-hook

Written once here, sans-IO: `lane_steps` is a generator that yields what it needs of the
outside — `ReadBlock` (the tenant's parameter block, read once into the broker's memory)
and `RunDriver` (the driver call on the private copies) — and returns an `Answer`,
`GENERAL` (the general steps decide the call from the start: every refusal and its audit
record are theirs) or `GONE` (the caller went away before the driver ran: nothing to
answer). A front end is then an adapter: it performs those two effects its own way
(`run_here` on its own thread, `run_in_steps` inside the general steps' effects), writes
the answer into the tenant's memory and answers the kernel.

The native seccomp loop (native/lane.c) is the other executor: it reads, runs and writes
in C and asks the same lane through callbacks (frontends/nativelane.py); the books and
post-hook half of an answer (`settle_answer`) is shared with it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator

if TYPE_CHECKING:
    from .fastlane import Admitted, ControlLane
    from .interface import Caller

# "Not for the lane: decide it the general way" (a front end's answer to its kernel is then
# the general steps'), and "the caller is gone: nothing to answer".
GENERAL = object()
GONE = object()


# (Plain slotted records, not frozen ones: three per call on the hot path, and a frozen
# dataclass's __init__ costs four times as much.)
@dataclass(slots=True)
class ReadBlock:
    """Read `size` bytes of the caller's memory at `ptr` (its parameter block), once. An
    OSError thrown back sends the call the general way (which reads again and answers with
    its record)."""
    ptr: int
    size: int


@dataclass(slots=True)
class RunDriver:
    """Run the admitted call on the driver with the private header and parameters: the
    front end answers (result, errno, the header as the driver left it), or GENERAL (the
    file at the caller's fd is not the session's any more, or the backend cannot run it
    here), or GONE (the caller is not the one that made the call any more)."""
    adm: Admitted
    hdr: bytes
    params: bytearray


@dataclass(slots=True)
class Answer:
    """What the driver answered, and the parameter block to write back (on no errno)."""
    adm: Admitted
    ret: int
    err: int
    hdr_out: bytes
    out: bytes


Steps = Generator["ReadBlock | RunDriver", Any, "Answer | object"]


def lane_steps(lane: ControlLane, session_id: int, caller: Caller, cmd: int,
               hdr: bytes) -> Steps:
    """One call through the control lane (module docstring)."""
    adm = lane.admit(session_id, caller, cmd, hdr)
    if adm is None:
        return GENERAL
    try:
        params_in = b""  # (a call whose header is its whole argument has no block)
        if adm.params_size:
            try:
                params_in = yield ReadBlock(adm.params_ptr, adm.params_size)
            except OSError:
                return GENERAL
        params = bytearray(params_in)
        if adm.checked and not lane.check(adm, params):
            return GENERAL
        ran = yield RunDriver(adm, hdr, params)
        if ran is GENERAL or ran is GONE:
            return ran
        ret, err, hdr_out = ran
        out = settle_answer(lane, adm, hdr, params_in, params, ret, err, hdr_out)
        return Answer(adm, ret, err, hdr_out, out)
    finally:
        lane.release(adm)  # (a no-op once the books took it: an allocation's quota hold)


def settle_answer(lane: ControlLane, adm: Admitted, hdr: bytes, params_in: bytes,
                  params: bytearray, ret: int, err: int, hdr_out: bytes) -> bytes:
    """After the driver answered an admitted call: the books, and the parameter block the
    tenant gets back. The row's post-hook runs as data when it has that form (a
    rewrite.TablePatch: FB info, the quota) — on the block's bytes, no decode, no second
    lock — else through `ControlLane.finish`, which also keeps a recording."""
    patch = lane.table_patch(adm) if adm.post is not None else None
    if lane.needs_finish(adm, patch is not None):
        return lane.finish(adm, hdr, params_in, ret, err, hdr_out, params)
    lane.book(adm)
    st = adm.header.status_offset
    if patch is not None and not err and not any(hdr_out[st:st + 4]):  # NV_OK
        patch.apply_block(params)
    lane.answered(adm, err, time.perf_counter_ns())
    return bytes(params)


def run_here(steps: Steps, read: Callable[[int, int], bytes],
             run: Callable[[RunDriver], Any]) -> Answer | object:
    """Drive `steps` on this thread: `read(ptr, size)` the caller's memory, `run(effect)`
    the driver call. The answer, GENERAL or GONE."""
    try:
        eff = next(steps)
        while True:
            if type(eff) is ReadBlock:
                try:
                    got = read(eff.ptr, eff.size)
                except OSError as e:
                    eff = steps.throw(e)
                    continue
            else:
                got = run(eff)
            eff = steps.send(got)
    except StopIteration as stop:
        return stop.value
    except BaseException:
        steps.close()  # (its books first: an allocation's quota hold given back)
        raise


def run_in_steps(steps: Steps, read: Callable[[ReadBlock], Any],
                 run: Callable[[RunDriver], Any]) -> Generator[Any, Any, Answer | object]:
    """Drive `steps` inside a front end's own effect steps (effects.py): each read becomes
    the effect `read(effect)` makes (a ReadMemory through the memory gate), yielded to
    whoever performs them; the driver call is made here with `run`."""
    send: Any = None
    thrown: BaseException | None = None
    try:
        while True:
            try:
                eff = steps.throw(thrown) if thrown is not None else steps.send(send)
            except StopIteration as stop:
                return stop.value
            send, thrown = None, None
            if type(eff) is ReadBlock:
                try:
                    send = yield read(eff)
                except BaseException as e:  # (OSError: the general way; else raised in order)
                    thrown = e
            else:
                send = run(eff)
    except BaseException:
        steps.close()
        raise
