"""Priority preemption by checkpoint (broker/preemption.py, docs/preemption.md): the victim
choice (sans-IO), the emulated driver's checkpoint model, and the whole sequence in a broker
in this process — a high tenant's allocation waits while a low tenant is checkpointed, the
low tenant's calls wait while it is preempted, and it comes back when room frees."""
from __future__ import annotations

import json

import pytest
import trio

from devbroker.abi import status as nvs
from devbroker.abi.nodes import NodeKind
from devbroker.backends.checkpoint import CHECKPOINTED, LOCKED, RUNNING, CheckpointError
from devbroker.backends.emulated import EmulatedBackend, EmulatedGpu
from devbroker.broker.interface import MapReadRequest, ReleaseRequest
from devbroker.broker.preemption import Candidate, choose_victims
from devbroker.testing.inproc import InProcTenant
from devbroker.testing.policies import h200s, tenant

GiB = 1 << 30


# ------------------------------------------------------------------------ victim choice
def cand(name, rank=0, on_gpu=1, total=None, started=0.0, refusal=None):
    return Candidate(name, rank, on_gpu * GiB, (total or on_gpu) * GiB, started, refusal)


def test_lowest_priority_first_then_the_fewest_bytes_that_suffice():
    cands = [cand("normal", rank=1, on_gpu=2), cand("big", on_gpu=8), cand("small", on_gpu=3),
             cand("tiny", on_gpu=1)]
    plan = choose_victims(cands, 3 * GiB, 100 * GiB)
    assert [v.tenant for v in plan.victims] == ["small"] and plan.refusal is None
    # none alone suffices: the largest first (fewest victims), then the smallest that fits
    plan = choose_victims(cands, 11 * GiB + 1, 100 * GiB)
    assert [v.tenant for v in plan.victims] == ["big", "small", "tiny"]
    # the low tenants are not enough: the normal one too
    plan = choose_victims(cands, 13 * GiB, 100 * GiB)
    assert [v.tenant for v in plan.victims] == ["big", "small", "tiny", "normal"]


def test_ties_go_to_the_most_recently_started():
    plan = choose_victims([cand("old", on_gpu=2, started=1), cand("new", on_gpu=2, started=9)],
                          GiB, 100 * GiB)
    assert [v.tenant for v in plan.victims] == ["new"]


def test_host_budget_and_refusals_give_reasons_and_no_victims():
    plan = choose_victims([cand("big", on_gpu=8, total=12), cand("uvm", on_gpu=8,
                                                                   refusal="uses UVM")],
                          4 * GiB, 10 * GiB)
    assert plan.victims == ()
    assert "tenant uvm: uses UVM" in plan.refusal
    assert "tenant big: its 12884901888 bytes exceed the host memory left" in plan.refusal
    # not enough room even with every candidate: nobody is preempted for nothing
    plan = choose_victims([cand("a", on_gpu=1)], 2 * GiB, 100 * GiB)
    assert plan.victims == () and "2147483648 bytes needed, 1073741824 could be made" in plan.refusal
    assert "no lower-priority preemptible tenant" in choose_victims([], 1, 1).refusal


# ------------------------------------------------------------------------ the emulated model
POLICY = "\n".join([
    h200s(1, memory="8GiB", extra=""),
    "[broker.preemption]\nenabled = true\nwait = 20\nlock_timeout = 2\n",
    tenant("low", memory_quota="8GiB", priority="low", preemptible=True),
    tenant("mid", memory_quota="8GiB", priority="normal", preemptible=True),
    tenant("high", memory_quota="8GiB", priority="high"),
])


async def setup(t: InProcTenant, gpu: int = 0) -> tuple[int, int]:
    ctl = await t.open(NodeKind.CTL)
    _, out, _ = await t.alloc(ctl, 0, 0, 0x41)
    client = out.hObjectNew
    _, out, _ = await t.alloc(ctl, client, client, 0x80,
                              t.new("NV0080_ALLOC_PARAMETERS", deviceId=gpu), new=0xA0)
    assert out.status == nvs.NV_OK
    return ctl, client


async def memory(t: InProcTenant, ctl: int, client: int, size: int, new: int) -> int:
    mem = t.new("NV_MEMORY_ALLOCATION_PARAMS", owner=client, flags=0x1C101, attr=0x18000000,
                size=size, alignment=2 << 20)
    _, out, _ = await t.alloc(ctl, client, 0xA0, 0x40, mem, new=new)
    return out.status


async def free(t: InProcTenant, ctl: int, client: int, handle: int) -> int:
    v = t.new("NVOS00_PARAMETERS", hRoot=client, hObjectParent=0xA0, hObjectOld=handle)
    _, out, _ = await t.esc(ctl, "NV_ESC_RM_FREE", v)
    return out.status


def metrics(b) -> set:
    """(family, label values, value) of the preemption's Prometheus families."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from devbroker.broker.preemption import metric_families

    def gauge(name, doc, labels):
        return GaugeMetricFamily(name, doc, labels=labels)

    return {(f.name, tuple(s.labels.values()), s.value)
            for f in metric_families(b.preemption.snapshot(), gauge, CounterMetricFamily)
            for s in f.samples if not s.name.endswith("_created")}


def records(tmp_path, event):
    log = tmp_path / "audit.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    return [r for r in map(json.loads, lines) if r["event"] == event]


async def test_emulated_checkpoint_moves_exactly_the_processes_bytes(inproc_broker):
    b = inproc_broker(POLICY)
    low = InProcTenant(b, "low", pid=501)
    ctl, client = await setup(low)
    assert await memory(low, ctl, client, 3 * GiB, 0xC0) == nvs.NV_OK
    be, ck = b.backend, b.backend.checkpointer
    before = be.used[0]
    with pytest.raises(CheckpointError, match="process 777 holds no GPU state"):
        ck.lock(777, 1)
    with pytest.raises(CheckpointError, match="it is running, not locked"):
        ck.checkpoint(501, 1)
    ck.lock(501, 1)
    assert ck.state(501, 1) == LOCKED and be.used[0] == before
    ck.checkpoint(501, 1)
    assert ck.state(501, 1) == CHECKPOINTED and be.used[0] == before - 3 * GiB
    # its handles stay valid (the objects never leave the books)
    assert 0xC0 in be.clients[client].objects
    # no room: the restore fails and leaves it checkpointed
    be.used[0] += 6 * GiB
    with pytest.raises(CheckpointError, match="GPU 0 has .* bytes free, the process needs"):
        ck.restore(501, (), 1)
    assert ck.state(501, 1) == CHECKPOINTED
    be.used[0] -= 6 * GiB
    ck.restore(501, (), 1)
    ck.unlock(501, 1)
    assert ck.state(501, 1) == RUNNING and be.used[0] == before


def test_emulated_checkpoint_state_survives_the_hand_over():
    from devbroker.broker import handover

    be = EmulatedBackend([EmulatedGpu(index=0, uuid="GPU-11111111-2222-3333-4444-555555555555",
                                      memory_bytes=8 * GiB)])
    be.checkpointer.states[4242] = CHECKPOINTED
    state = json.loads(json.dumps(handover.export_emulated(be)))
    fresh = EmulatedBackend([EmulatedGpu(index=0, uuid="GPU-11111111-2222-3333-4444-555555555555",
                                         memory_bytes=8 * GiB)])
    handover.import_emulated(fresh, state)
    assert fresh.checkpointer.states == {4242: CHECKPOINTED}


# ------------------------------------------------------------------------ the whole sequence
async def test_high_allocation_waits_for_the_low_tenant_to_leave_and_it_comes_back(
        inproc_broker, tmp_path):
    b = inproc_broker(POLICY)
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.preemption.restoring)
        # 4 GiB fit the quota, not the GPU: the low tenant is checkpointed, then it fits
        assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_OK
        assert b.preemption.state_of("low") == "preempted"
        assert b.backend.used[0] == 4 * GiB
        rec, = records(tmp_path, "checkpoint")
        assert (rec["tenant"], rec["by"], rec["bytes"], rec["pids"]) == ("low", "high",
                                                                          6 * GiB, [501])
        assert metrics(b) >= {("devbroker_tenant_preempted", ("low", "preempted"), 1),
                              ("devbroker_preemption_host_bytes", ("used",), 6 * GiB),
                              ("devbroker_preemptions", ("low", "preempted"), 1),
                              ("devbroker_preempted_bytes", ("low",), 6 * GiB)}
        # the preempted tenant's calls wait (they do not fail) while it is in host memory
        done = trio.Event()

        async def low_call():
            assert await memory(low, lctl, lclient, 2 << 20, 0xC1) == nvs.NV_OK
            done.set()

        nursery.start_soon(low_call)
        await trio.sleep(0.5)
        assert not done.is_set() and b.preemption.calls_held == {"low": 1}
        # the high tenant frees: the low tenant's room is reserved, it is restored, and
        # its waiting call is answered
        assert await free(high, hctl, hclient, 0xC0) == nvs.NV_OK
        with trio.fail_after(10):
            await done.wait()
        assert b.preemption.state_of("low") is None
        assert b.backend.used[0] == 6 * GiB + (2 << 20)
        assert records(tmp_path, "restore")[0]["tenant"] == "low"
        nursery.cancel_scope.cancel()


async def test_a_victim_using_managed_memory_is_not_preempted(inproc_broker, tmp_path):
    b = inproc_broker(POLICY)
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    # CUDA's own 2 MiB mapping and one managed allocation of 1 MiB
    b.tenants["low"].uvm_mapped[501] = (2 << 20) + (1 << 20)
    assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_ERR_NO_MEMORY
    assert b.preemption.entries == {}
    rec, = records(tmp_path, "checkpoint_refused")
    assert "tenant low: it uses managed (UVM) memory" in rec["reason"]


async def test_cuda_own_uvm_mapping_does_not_keep_a_victim_from_preemption(inproc_broker,
                                                                          tmp_path):
    """Every CUDA process maps 2 MiB of nvidia-uvm at init, and the driver checkpoints it:
    only mappings beyond that are managed memory."""
    b = inproc_broker(POLICY)
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    b.tenants["low"].uvm_mapped[501] = 2 << 20
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.preemption.restoring)
        assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_OK
        assert b.preemption.state_of("low") == "preempted"
        assert records(tmp_path, "checkpoint_refused") == []
        nursery.cancel_scope.cancel()


async def test_the_waiting_allocation_is_not_counted_as_used_when_the_books_decide(
        inproc_broker, tmp_path):
    """A backend without its own count of the GPU's memory (the real driver's case) leaves
    the room to the broker's books, which hold the waiting allocation's bytes while it
    waits: they are not on the GPU and must not inflate what the victims must free."""
    b = inproc_broker(POLICY)
    b.backend.memory_in_use = lambda: None  # the real backend keeps no count of its own
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.preemption.restoring)
        # 5 GiB: 3 GiB short on the 8 GiB GPU, which low's 6 GiB cover
        assert await memory(high, hctl, hclient, 5 * GiB, 0xC0) == nvs.NV_OK
        assert b.preemption.state_of("low") == "preempted"
        assert records(tmp_path, "checkpoint_refused") == []
        nursery.cancel_scope.cancel()


async def test_a_restore_needs_what_the_tenant_held_when_it_was_checkpointed(inproc_broker,
                                                                             tmp_path):
    """The driver's checkpoint frees and remakes objects through the process's own calls,
    so the books of a checkpointed tenant can show less than it will take back: the
    restore waits for the room it held (on the H200 a restore sized from the books ran
    while the high tenant held that room, and the trainer hung)."""
    b = inproc_broker(POLICY)
    b.backend.memory_in_use = lambda: None  # the books decide, as with the real driver
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.preemption.restoring)
        assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_OK
        assert b.preemption.state_of("low") == "preempted"
        # what the checkpoint's own frees do to the books (the emulator keeps them)
        for c in b.tenants["low"].clients.values():
            c.charged.clear()
        assert not any(b.tenants["low"].used().values())
        await trio.sleep(1.0)  # several looks of the restoring task
        assert b.preemption.state_of("low") == "preempted"
        assert records(tmp_path, "restore") == records(tmp_path, "restore_failed") == []
        nursery.cancel_scope.cancel()


async def test_an_equal_or_higher_priority_tenant_is_never_a_victim(inproc_broker, tmp_path):
    b = inproc_broker(POLICY)
    mid, low = InProcTenant(b, "mid", pid=502), InProcTenant(b, "low", pid=501)
    mctl, mclient = await setup(mid)
    lctl, lclient = await setup(low)
    assert await memory(mid, mctl, mclient, 6 * GiB, 0xC0) == nvs.NV_OK
    # the low tenant may not preempt the normal one: the driver's answer stands
    assert await memory(low, lctl, lclient, 4 * GiB, 0xC0) == nvs.NV_ERR_NO_MEMORY
    assert b.preemption.entries == {} and not records(tmp_path, "checkpoint_refused")


async def test_preemption_off_keeps_the_drivers_answer_until_a_policy_turns_it_on(
        inproc_broker):
    from devbroker.broker.policy import load_policy_text

    b = inproc_broker(POLICY.replace("enabled = true", "enabled = false"))
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_ERR_NO_MEMORY
    assert b.preemption.entries == {}
    b.apply_policy(load_policy_text(POLICY, "reloaded.toml"))  # (hot reload)
    assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_OK
    assert set(b.preemption.entries) == {"low"}


async def test_room_is_reserved_in_the_books_before_the_restore(inproc_broker, tmp_path):
    """While a preempted tenant's restore runs, the room it will take is not given to
    another allocation (answered NV_ERR_NO_MEMORY, as the driver would, with the reason)."""
    import threading

    from devbroker.backends.emulated_ckpt import EmulatedCheckpointer

    gate = threading.Event()
    entered = threading.Event()

    class Gated(EmulatedCheckpointer):
        def restore(self, pid, pairs, timeout_s):
            entered.set()
            gate.wait(30)
            super().restore(pid, pairs, timeout_s)

    b = inproc_broker(POLICY)
    b.backend.checkpointer = Gated(b.backend)
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    mid = InProcTenant(b, "mid", pid=502)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    mctl, mclient = await setup(mid)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    async with trio.open_nursery() as nursery:
        nursery.start_soon(b.preemption.restoring)
        assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_OK
        assert await free(high, hctl, hclient, 0xC0) == nvs.NV_OK
        with trio.fail_after(10):
            await trio.to_thread.run_sync(entered.wait)
        assert b.preemption.reserved == {0: 6 * GiB} and b.backend.used[0] == 0
        # the GPU's heap is empty, but 6 of its 8 GiB are the low tenant's
        assert await memory(mid, mctl, mclient, 4 * GiB, 0xC0) == nvs.NV_ERR_NO_MEMORY
        assert await memory(mid, mctl, mclient, 2 * GiB, 0xC1) == nvs.NV_OK
        gate.set()
        with trio.fail_after(10):
            while b.preemption.state_of("low") is not None:
                await trio.sleep(0.05)
        assert b.preemption.reserved == {} and b.backend.used[0] == 8 * GiB
        nursery.cancel_scope.cancel()
    deny = [r for r in records(tmp_path, "deny") if "reserved for restoring" in r["reason"]]
    assert deny and deny[0]["tenant"] == "mid"


async def test_a_victim_sharing_memory_between_processes_is_not_preempted(inproc_broker,
                                                                         tmp_path):
    """Memory one process duplicated from another's (CUDA IPC): the checkpoint would not
    carry it, so the high tenant gets the driver's out-of-memory answer, with the reason."""
    b = inproc_broker(POLICY)
    a, c = InProcTenant(b, "low", pid=501), InProcTenant(b, "low", pid=511)
    high = InProcTenant(b, "high", pid=503)
    actl, aclient = await setup(a)
    cctl, cclient = await setup(c)
    hctl, hclient = await setup(high)
    assert await memory(a, actl, aclient, 6 * GiB, 0xC0) == nvs.NV_OK
    v = a.new("NVOS57_PARAMETERS", hClient=aclient, hObject=0xC0,
              sharePolicy=dict(type=1, target=0, accessMask={"limbs": [1]}, action=0))
    rep, out, _ = await a.esc(actl, "NV_ESC_RM_SHARE", v)  # RS_SHARE_TYPE_ALL
    assert out.status == nvs.NV_OK
    v = c.new("NVOS55_PARAMETERS", hClient=cclient, hParent=0xA0, hObject=0xE0,
              hClientSrc=aclient, hObjectSrc=0xC0, flags=0)
    rep, out, _ = await c.esc(cctl, "NV_ESC_RM_DUP_OBJECT", v)
    assert out.status == nvs.NV_OK
    assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_ERR_NO_MEMORY
    assert b.preemption.entries == {}
    rec, = records(tmp_path, "checkpoint_refused")
    assert "shares device memory between processes (CUDA IPC)" in rec["reason"]


async def test_a_process_that_does_not_answer_the_lock_is_left_running(inproc_broker,
                                                                        tmp_path):
    from devbroker.backends.emulated_ckpt import EmulatedCheckpointer

    class Deaf(EmulatedCheckpointer):
        def lock(self, pid, timeout_s):
            raise CheckpointError(f"process {pid} did not answer the lock within "
                                  f"{timeout_s:g} s")

    b = inproc_broker(POLICY)
    b.backend.checkpointer = Deaf(b.backend)
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_ERR_NO_MEMORY
    assert b.preemption.entries == {} and b.preemption.held == set()
    assert await memory(low, lctl, lclient, 2 << 20, 0xC1) == nvs.NV_OK  # not held
    rec, = records(tmp_path, "checkpoint_refused")
    assert "process 501 did not answer the lock within 2 s" in rec["reason"]
    assert records(tmp_path, "checkpoint_failed")[0]["tenant"] == "low"


async def test_a_driver_without_the_checkpoint_api_refuses_with_why(inproc_broker, tmp_path):
    from devbroker.backends.checkpoint import NotSupported

    class Without(NotSupported):
        def away(self, pid):  # (the emulator's books ask its executor what is away)
            return False

    b = inproc_broker(POLICY)
    b.backend.checkpointer = Without("driver 535 has no checkpoint API")
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_ERR_NO_MEMORY
    rec, = records(tmp_path, "checkpoint_refused")
    assert "the driver cannot checkpoint: driver 535 has no checkpoint API" in rec["reason"]


# ------------------------------------------------------------------------ the tenant's own
async def test_gpfifo_schedule_only_on_the_tenants_own_channels(inproc_broker, tmp_path):
    """NVA06F_CTRL_CMD_GPFIFO_SCHEDULE, which the driver's checkpoint sends in the process:
    on the tenant's own channel it reaches the driver; on any other object it is refused;
    enabling a channel the broker holds stopped (a high-priority tenant on the GPU) is
    refused, disabling it is not."""
    from devbroker.broker import compute
    from devbroker.broker.effects import locked, perform_blocking, run_blocking

    caps = ["nvml", "compute", "uvm"]
    b = inproc_broker("\n".join([h200s(1), tenant("hi", priority="high", capabilities=caps),
                                 tenant("lo", priority="low", capabilities=caps)]))
    hi, lo = InProcTenant(b, "hi", pid=5001), InProcTenant(b, "lo", pid=5002)

    async def group_and_channel(t):
        ctl, client, dev, sub = await t.subdevice()
        _, out, _ = await t.alloc(ctl, client, dev, 0xA06C,
                                  t.new("NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=1),
                                  new=0xC0)
        assert out.status == nvs.NV_OK
        _, out, _ = await t.alloc(ctl, client, 0xC0, 0xC86F, t.new("NV_CHANNEL_ALLOC_PARAMS"),
                                  new=0xD0)
        assert out.status == nvs.NV_OK
        return ctl, client

    def refusals():
        return [r for r in records(tmp_path, "deny") if "GPFIFO_SCHEDULE" in r.get("what", "")]

    ctl, client = await group_and_channel(lo)
    _, out, _ = await lo.control(ctl, client, 0xD0, 0xA06F0103, bEnable=1)
    assert out.status != nvs.NV_ERR_INSUFFICIENT_PERMISSIONS and not refusals()
    _, out, _ = await lo.control(ctl, client, 0xC0, 0xA06F0103, bEnable=1)  # the group
    assert out.status == nvs.NV_ERR_INVALID_OBJECT_HANDLE
    assert "object 0xc0 is not one of the tenant's channels" in refusals()[-1]["reason"]
    await group_and_channel(hi)
    run_blocking(locked(compute.preempt_all(b)), lambda e: perform_blocking(e, b.memgate))
    _, out, _ = await lo.control(ctl, client, 0xD0, 0xA06F0103, bEnable=1)
    assert out.status == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
    assert "enabling one is refused" in refusals()[-1]["reason"]
    n = len(refusals())
    _, out, _ = await lo.control(ctl, client, 0xD0, 0xA06F0103, bEnable=0)
    assert out.status != nvs.NV_ERR_INSUFFICIENT_PERMISSIONS and len(refusals()) == n


async def test_the_smallest_tenant_that_makes_enough_room_is_the_one_preempted(
        inproc_broker, tmp_path):
    b = inproc_broker("\n".join([
        h200s(1, memory="8GiB"), "[broker.preemption]\nenabled = true\n",
        tenant("small", memory_quota="8GiB", priority="low", preemptible=True),
        tenant("large", memory_quota="8GiB", priority="low", preemptible=True),
        tenant("high", memory_quota="8GiB", priority="high")]))
    small, large = InProcTenant(b, "small", pid=601), InProcTenant(b, "large", pid=602)
    high = InProcTenant(b, "high", pid=603)
    sctl, sclient = await setup(small)
    lctl, lclient = await setup(large)
    hctl, hclient = await setup(high)
    assert await memory(small, sctl, sclient, 2 * GiB, 0xC0) == nvs.NV_OK
    assert await memory(large, lctl, lclient, 4 * GiB, 0xC0) == nvs.NV_OK
    # 2 GiB free, 3 GiB asked: either would do; the one with fewer bytes goes
    assert await memory(high, hctl, hclient, 3 * GiB, 0xC0) == nvs.NV_OK
    assert set(b.preemption.entries) == {"small"}
    # 5 GiB more (1 GiB free): the large one is left, and its 4 GiB make the room
    assert await memory(high, hctl, hclient, 5 * GiB, 0xC1) == nvs.NV_OK
    assert [r["tenant"] for r in records(tmp_path, "checkpoint")] == ["small", "large"]
    assert b.backend.used[0] == 8 * GiB


# ------------------------------------------------------------------------ migration
async def test_a_tenant_moves_to_another_gpu_with_its_objects_and_books(inproc_broker,
                                                                       tmp_path):
    """Checkpointed on GPU 0, restored onto GPU 1: the emulated heap and the broker's books
    move, its device object is GPU 1's (so what it asks of it is GPU 1's), and its next
    allocation lands on GPU 1. A GPU outside its policy, or without the room, is refused."""
    b = inproc_broker("\n".join([
        h200s(2, memory="8GiB"), "[broker.preemption]\nenabled = true\n",
        tenant("mover", gpus=[0, 1], memory_quota="8GiB"),
        tenant("pinned", gpus=[0], memory_quota="8GiB"),
        tenant("big", gpus=[1], memory_quota="8GiB")]))
    mover = InProcTenant(b, "mover", pid=701)
    ctl, client = await setup(mover)
    assert await memory(mover, ctl, client, 3 * GiB, 0xC0) == nvs.NV_OK
    assert "is not one of tenant pinned's GPUs" in await b.preemption.migrate("pinned", 1)
    big = InProcTenant(b, "big", pid=702)
    bctl, bclient = await setup(big, gpu=1)
    assert await memory(big, bctl, bclient, 6 * GiB, 0xC0) == nvs.NV_OK
    assert "GPU 1 lacks the room" in await b.preemption.migrate("mover", 1)
    assert b.backend.used == {0: 3 * GiB, 1: 6 * GiB} and b.preemption.entries == {}
    assert await free(big, bctl, bclient, 0xC0) == nvs.NV_OK
    assert await b.preemption.migrate("mover", 1) is None
    assert b.backend.used == {0: 0, 1: 3 * GiB}
    assert b.tenants["mover"].used() == {0: 0, 1: 3 * GiB}
    assert b.backend.clients[client].objects[0xA0].gpu == 1  # its device: GPU 1's now
    # a subdevice of it names GPU 1 by UUID, and a GID query of the tenant's says so
    _, out, _ = await mover.alloc(ctl, client, 0xA0, 0x2080,
                                  mover.new("NV2080_ALLOC_PARAMETERS"), new=0xB0)
    assert out.status == nvs.NV_OK
    _, out, got = await mover.control(ctl, client, 0xB0, 0x2080014A, flags=2)  # (binary)
    assert out.status == nvs.NV_OK
    assert bytes(got.data)[:got.length] == b.backend.gpus()[1].uuid_bytes
    assert b.backend.checkpointer.states == {} and b.preemption.entries == {}
    assert await memory(mover, ctl, client, 1 * GiB, 0xC1) == nvs.NV_OK
    assert b.backend.used == {0: 0, 1: 4 * GiB}
    assert "on GPU 1 already" in await b.preemption.migrate("mover", 1)
    rec, = records(tmp_path, "migrate")
    assert (rec["tenant"], rec["from_gpu"], rec["gpu"], rec["bytes"]) == ("mover", 0, 1,
                                                                          3 * GiB)


async def test_an_executor_that_breaks_leaves_nobody_locked(inproc_broker, tmp_path):
    """An executor's bug (any exception, not its CheckpointError) is a refused preemption:
    the processes already locked are unlocked, the tenant is not held."""
    from devbroker.backends.emulated_ckpt import EmulatedCheckpointer

    class Broken(EmulatedCheckpointer):
        def checkpoint(self, pid, timeout_s):
            raise OSError(5, "helper crashed")

    b = inproc_broker(POLICY)
    b.backend.checkpointer = Broken(b.backend)
    low, high = InProcTenant(b, "low", pid=501), InProcTenant(b, "high", pid=503)
    lctl, lclient = await setup(low)
    hctl, hclient = await setup(high)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    assert await memory(high, hctl, hclient, 4 * GiB, 0xC0) == nvs.NV_ERR_NO_MEMORY
    assert b.preemption.entries == {} and b.preemption.held == set()
    assert b.backend.checkpointer.states == {}  # unlocked again
    assert "checkpoint failed: OSError" in records(tmp_path, "checkpoint_failed")[0]["reason"]


async def test_a_restore_that_maps_cudas_range_again_leaves_the_tenant_preemptible(
        inproc_broker, tmp_path):
    """The driver's restore runs inside the process and maps CUDA's own nvidia-uvm range
    again (H200): the restored process counts what it had mapped when it was checkpointed,
    so a second preemption is not refused as managed memory."""
    b = inproc_broker(POLICY)
    low = InProcTenant(b, "low", pid=501)
    lctl, lclient = await setup(low)
    assert await memory(low, lctl, lclient, 6 * GiB, 0xC0) == nvs.NV_OK
    b.tenants["low"].uvm_mapped[501] = 2 << 20
    for _ in range(2):
        assert await b.preemption.preempt("low") is None
        b.tenants["low"].uvm_mapped[501] += 2 << 20  # (what the restore maps)
        assert await b.preemption.resume("low") is None
        assert b.tenants["low"].uvm_mapped[501] == 2 << 20
    assert records(tmp_path, "checkpoint_refused") == []


async def test_a_process_whose_uvm_file_is_released_leaves_no_mapping_count(inproc_broker):
    """A process's nvidia-uvm count ends with its last nvidia-uvm file (the kernel releases
    it only after its last mapping): a later process of the tenant starts from nothing."""
    b = inproc_broker(POLICY)
    low = InProcTenant(b, "low", pid=501)
    ufd = await low.open(NodeKind.UVM)
    rep = b.map_check_now(MapReadRequest(low.caller, low.fds[ufd], 0, 4 << 20))
    assert rep.errno == 0 and b.tenants["low"].uvm_mapped == {501: 4 << 20}
    b.release_now(ReleaseRequest(low.fds[ufd]))
    assert b.tenants["low"].uvm_mapped == {}
