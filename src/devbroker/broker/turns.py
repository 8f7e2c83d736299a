"""Compute turns: weighted GPU shares by taking turns, `[broker] compute_turns_ms`.

Why: time-slicing (compute.py) shares an engine through the driver's timeslices, and a
channel group that runs out of work before its slice ends gives the engine up early: two
busy bf16 matmul loops with slices 3:1 measured 2.36–2.71 on the H200, and the shorter
slices that bring the ratio to 3 cost more than 5 % of the GPU in switches
(docs/compute-shares.md, the slice sweep). With turns, the tenants that hold channel groups
on a GPU take turns of `compute_turns_ms` in all, each for its weight's part of it; during a
tenant's turn the other tenants' channels are stopped with the driver's
FIFO_DISABLE_CHANNELS — the mechanism priority preemption uses (compute.py `_stop`,
measured on the H200: work stops at once and goes on when the channels run again, ~1 ms of
the driver's time per 20 channels). The GPU then runs only the current tenant's work, so
the shares follow the weights whatever the tenants' kernels and synchronisations look like,
and a switch every few hundred ms costs far less than one every few ms.

What it costs, said in docs/policy.md: a tenant waits for its turn (up to the others' part
of a round), so latency-bound work sees that wait; a tenant that holds an idle context keeps
its turns, since the broker sees calls, not GPU activity (GPUMON samples could tell,
docs/hardware.md). Off by default (0). Low-priority tenants stopped for a high-priority one
take no turns (compute.preempt_all holds them), and channels either mechanism stopped run
again only when neither holds them.

Books (compute._Books): `turn` (GPU -> the tenant whose turn it is), `turn_members` (GPU ->
the tenants taking turns there), `turn_stopped` ((tenant, GPU) -> the (client, channel)
pairs stopped for turns). A channel a tenant allocates while it is not its turn is stopped
before the tenant has the handle (compute.after_channel_alloc). Like preemption's, these
books are not carried across a live upgrade: the successor's first pass lets every channel
run that no mechanism of its own holds.
"""
from __future__ import annotations

import logging
from typing import Any

from devbroker.broker import compute
from devbroker.broker.effects import Steps, locked, run_async

log = logging.getLogger("devbroker.turns")


def turns_ms(broker: Any) -> int:
    policy = getattr(broker, "policy", None)
    return int(getattr(getattr(policy, "broker", None), "compute_turns_ms", 0) or 0)


def members(broker: Any, gpu: int) -> list[Any]:
    """The tenants taking turns on `gpu`: those holding live channel groups there, in the
    policy, not revoked from it, not stopped for a high-priority tenant, not under
    preemption by checkpoint (the driver's lock waits for the work of its channels, so a
    turn that stopped them would make the checkpoint time out); by name."""
    b = compute.books(broker)
    names = {g.tenant for g in compute.live_groups(broker) if g.gpu == gpu}
    out = []
    for name in sorted(names):
        t = broker.tenants.get(name)
        if (t is not None and not t.revoked and gpu in t.gpus
                and (name, gpu) not in b.preempted
                and not compute._in_checkpoint(broker, name)):
            out.append(t)
    return out


def _live(t: Any, gpu: int) -> set[tuple[int, int]]:
    return {(c, h) for c, hs in compute._channels_on(t, gpu).items() for h in hs}


def _grouped(pairs) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c, h in sorted(pairs):
        out.setdefault(c, []).append(h)
    return out


def _release(broker: Any, t: Any, gpu: int) -> Steps:
    """Let run the channels turns stopped of one tenant on one GPU (not those preemption
    holds)."""
    b = compute.books(broker)
    key = (t.name, gpu)
    held = b.turn_stopped.pop(key, set()) & _live(t, gpu)
    release = held - b.stopped.get(key, set())
    if release:
        yield from compute._stop(broker, t, gpu, _grouped(release), False)


def release_tenant(broker: Any, t: Any) -> Steps:
    """Steps: let run every channel of `t` that turns stopped, on every GPU (a tenant about
    to be checkpointed: `members` no longer counts it, and this does now what the next
    turn would do later)."""
    for gpu in sorted({k[1] for k in compute.books(broker).turn_stopped if k[0] == t.name}):
        yield from _release(broker, t, gpu)


def step(broker: Any, gpu: int) -> Steps:
    """Steps: give the turn on `gpu` to the next tenant (round robin by name) — its channels
    run, every other member's are stopped — and return how long the turn lasts (s); None
    when there are no turns on this GPU (turns off, fewer than two members), after letting
    run everything turns stopped there. Runs under the state lock (locked())."""
    b = compute.books(broker)
    ms = turns_ms(broker)
    mem = members(broker, gpu) if ms else []
    names = [t.name for t in mem]
    # tenants that no longer take turns here (exited, preempted, revoked, turns off)
    for key in [k for k in b.turn_stopped if k[1] == gpu and k[0] not in names]:
        t = broker.tenants.get(key[0])
        if t is None:
            b.turn_stopped.pop(key, None)
            continue
        yield from _release(broker, t, gpu)
    if len(mem) < 2:
        for t in mem:  # the one left runs whenever it likes
            yield from _release(broker, t, gpu)
        if gpu in b.turn:
            broker.audit.write("turns", what="compute turns",
                               reason=f"GPU {gpu}: no turns ({len(mem)} tenant(s) with "
                                      f"channel groups, compute_turns_ms {ms})")
        b.turn.pop(gpu, None)
        b.turn_members.pop(gpu, None)
        return None
    cur = b.turn.get(gpu)
    nxt = names[(names.index(cur) + 1) % len(names)] if cur in names else names[0]
    weights = {t.name: max(1, int(getattr(t.policy, "compute_weight", 1))) for t in mem}
    if b.turn_members.get(gpu) != set(names):
        broker.audit.write("turns", what="compute turns",
                           reason=f"GPU {gpu}: turns of {ms} ms among "
                                  + ", ".join(f"{n} ({weights[n]})" for n in names))
    b.turn[gpu] = nxt
    b.turn_members[gpu] = set(names)
    # The next tenant's channels run first (the GPU is never left without work), then the
    # others' stop. A first look at a member also lets run what a predecessor broker may
    # have left stopped (these books are not carried across a live upgrade).
    for t in mem:
        key = (t.name, gpu)
        if key not in b.turn_seen:
            b.turn_seen.add(key)
            if t.name != nxt:
                continue  # stopped just below
            release = _live(t, gpu) - b.stopped.get(key, set())
            if release:
                yield from compute._stop(broker, t, gpu, _grouped(release), False)
    yield from _release(broker, broker.tenants[nxt], gpu)
    for t in mem:
        if t.name == nxt:
            continue
        key = (t.name, gpu)
        live = _live(t, gpu)
        have = b.turn_stopped.get(key, set()) & live
        todo = live - have
        if todo:
            have |= yield from compute._stop(broker, t, gpu, _grouped(todo), True)
        b.turn_stopped[key] = have
    return ms * weights[nxt] / sum(weights.values()) / 1000.0


def first_look(broker: Any) -> Steps:
    """At broker start: let run every channel of the tenants the broker holds (a live
    upgrade's successor) that no mechanism of this broker holds — a predecessor may have
    stopped them for turns, and these books are not carried over. Nothing for a fresh
    broker (no tenant holds objects yet)."""
    b = compute.books(broker)
    compute._discover(broker)  # the channel groups a predecessor's tenants allocated
    for t in list(broker.tenants.values()):
        for gpu in t.gpus:
            key = (t.name, gpu)
            if key in b.turn_seen:
                continue
            live = _live(t, gpu)
            if not live:
                continue
            b.turn_seen.add(key)
            release = live - b.stopped.get(key, set()) - b.turn_stopped.get(key, set())
            if release:
                yield from compute._stop(broker, t, gpu, _grouped(release), False)


def schedule(broker: Any, startup: bool = False) -> None:
    """Keep turns going on every GPU where two or more tenants hold channel groups, in a
    background task (one for all GPUs): started at broker start (`startup`: with the first
    look, turns on or off), by channel groups and by policy changes; it ends when no GPU
    has turns and turns stopped nothing."""
    b = compute.books(broker)
    if b.turning or broker.spawn is None:
        return
    if not startup and not turns_ms(broker) and not b.turn_stopped and not b.turn:
        return
    b.turning = True

    async def task() -> None:
        import trio

        due: dict[int, float] = {}
        try:
            if startup:
                await run_async(locked(first_look(broker)), broker.perform)
            while True:
                gpus = ({g.gpu for g in compute.live_groups(broker) if g.gpu is not None}
                        | {k[1] for k in b.turn_stopped} | set(b.turn))
                now = trio.current_time()
                for gpu in sorted(gpus):
                    if due.get(gpu, 0.0) > now:
                        continue
                    slot = await run_async(locked(step(broker, gpu)), broker.perform)
                    if slot is None:
                        due.pop(gpu, None)
                    else:
                        due[gpu] = trio.current_time() + slot
                for gpu in [g for g in due if g not in gpus]:
                    due.pop(gpu)
                if not due:
                    return
                await trio.sleep_until(min(due.values()))
        except Exception as e:  # a bug must cost the turns, never the broker
            log.exception("compute: turns failed")
            broker.audit.write("error", what="compute turns",
                               reason=f"internal error: {type(e).__name__}: {e}; turns start "
                                      "again at the next channel group or policy change")
        finally:
            b.turning = False

    broker._start_soon(task)
