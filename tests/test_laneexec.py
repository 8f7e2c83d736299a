"""The lane's one decision (broker/decision.py) and its one Python executor
(broker/laneexec.py), on an in-process broker with the emulated backend: the tenant is this
process, so its parameter blocks are real memory read through their addresses."""
from __future__ import annotations

import ctypes

import trio

from devbroker.broker import decision, laneexec
from devbroker.testing.inproc import InProcTenant, make_broker
from devbroker.testing.policies import one_h200, tenant

FB_GET_INFO_V2 = 0x20801303
FB_TOTAL_RAM_SIZE = 0x08  # NV2080_CTRL_FB_INFO_INDEX_TOTAL_RAM_SIZE (KiB)
MEMORY_LOCAL_USER = 0x40


def _setup(pid: int):
    b = make_broker(one_h200(tenant("t", memory_quota="8GiB",
                                    capabilities=["nvml", "compute", "uvm"])))
    t = InProcTenant(b, "t", pid=pid)
    ctl, client, dev, sub = trio.run(t.subdevice)
    return b, t, ctl, client, dev, sub


def _fb_info_call(t, client: int, sub: int, keep: list):
    abi = t.abi
    spec = abi.control(FB_GET_INFO_V2).params
    v = spec.decode(bytes(spec.size))
    entries = list(v.fbInfoList)
    entries[0] = entries[0].replace(index=FB_TOTAL_RAM_SIZE)
    params = v.replace(fbInfoListSize=1, fbInfoList=entries).encode()
    buf = ctypes.create_string_buffer(params, len(params))
    keep.append(buf)
    hdr = t.new("NVOS54_PARAMETERS", hClient=client, hObject=sub, cmd=FB_GET_INFO_V2,
                params=ctypes.addressof(buf), paramsSize=spec.size).encode()
    cmd = abi.escape_cmd("NV_ESC_RM_CONTROL", abi.struct("NVOS54_PARAMETERS").size)
    return cmd, hdr, spec


def test_the_decision_reads_the_books_and_changes_nothing():
    """decision.decide on a header: the call as the general path would run it, or None; it
    takes no rate token and counts nothing (ControlLane.admit does both, once)."""
    b, t, ctl, client, _dev, sub = _setup(7001)
    keep: list = []
    cmd, hdr, spec = _fb_info_call(t, client, sub, keep)
    lane, limiter = b.control_lane, b.tenants["t"].limiter
    limiter.rate, limiter.tokens = 1e-9, 5.0  # (limited, no refill while the test runs)
    counts = (lane.admitted, lane.passed, b.tenants["t"].requests)
    adm = decision.decide(b, lane.tables, t.fds[ctl], t.caller, cmd, hdr)
    assert adm is not None and adm.cmd == FB_GET_INFO_V2 and adm.params_size == spec.size
    assert adm.post is not None and not adm.checked  # (its post-hook: the quota)
    assert int(limiter.tokens) == 5 and (lane.admitted, lane.passed,
                                      b.tenants["t"].requests) == counts
    # another tenant's client (here: one the tenant does not hold): the general way
    other = t.new("NVOS54_PARAMETERS", hClient=0xC1D0BEEF, hObject=sub, cmd=FB_GET_INFO_V2,
                  params=1, paramsSize=spec.size).encode()
    assert decision.decide(b, lane.tables, t.fds[ctl], t.caller, cmd, other) is None
    assert lane.admit(t.fds[ctl], t.caller, cmd, hdr) is not None
    assert int(limiter.tokens) == 4 and lane.admitted == counts[0] + 1
    limiter.tokens = 0.0  # no token: the general way (which waits for one)
    assert lane.admit(t.fds[ctl], t.caller, cmd, hdr) is None
    assert lane.passed == counts[1] + 1


def test_the_executor_runs_a_control_on_private_copies_and_applies_its_post_hook():
    """laneexec.lane_steps through run_here: one read of the parameter block, the driver on
    the private copies, the post-hook's table patch on NV_OK (the tenant's quota as the
    card's memory), the request counted; the tenant's own block is not touched (writing it
    is the front end's)."""
    b, t, ctl, client, _dev, sub = _setup(7002)
    keep: list = []
    cmd, hdr, spec = _fb_info_call(t, client, sub, keep)
    reads, runs = [], []

    def read(ptr: int, size: int) -> bytes:
        reads.append((ptr, size))
        return ctypes.string_at(ptr, size)

    def run(eff: laneexec.RunDriver):
        runs.append(eff)
        return b.backend.run_control(eff.adm.session.file, -1, eff.hdr, eff.params,
                                     eff.adm.header, eff.adm.abi)

    before = bytes(keep[0].raw[:spec.size])
    requests = b.tenants["t"].requests
    got = laneexec.run_here(laneexec.lane_steps(b.control_lane, t.fds[ctl], t.caller, cmd,
                                                hdr), read, run)
    assert isinstance(got, laneexec.Answer) and got.err == 0
    assert reads == [(ctypes.addressof(keep[0]), spec.size)] and len(runs) == 1
    assert runs[0].hdr == hdr  # (the header as read: the backend names the private copy)
    out = spec.decode(got.out)
    assert out.fbInfoList[0].data == (8 << 30) >> 10  # the quota, in KiB
    assert bytes(keep[0].raw[:spec.size]) == before
    assert b.tenants["t"].requests == requests + 1


def test_the_executor_sends_the_call_the_general_way_and_gives_back_what_it_held():
    """A device-memory allocation admitted and checked holds its bytes against the quota
    until its books are written. When the front end cannot run it after all (the backend
    declines: GENERAL) or its caller is gone (GONE), the executor says so and the hold is
    given back; when the parameter block cannot be read, the call goes the general way
    before anything is held; a header the lane does not take is GENERAL with no read."""
    b, t, ctl, client, dev, _sub = _setup(7003)
    abi = t.abi
    block = abi.rm_class(MEMORY_LOCAL_USER).params
    cmd = abi.escape_cmd("NV_ESC_RM_ALLOC", abi.struct("NVOS64_PARAMETERS").size)
    keep: list = []

    def alloc(handle: int) -> bytes:
        params = block.decode(bytes(block.size)).replace(owner=client, size=6 << 30).encode()
        buf = ctypes.create_string_buffer(params, len(params))
        keep.append(buf)
        return t.new("NVOS64_PARAMETERS", hRoot=client, hObjectParent=dev, hObjectNew=handle,
                     hClass=MEMORY_LOCAL_USER, pAllocParms=ctypes.addressof(buf)).encode()

    used = lambda: b.tenants["t"].used().get(0, 0)  # noqa: E731
    held = []

    def read(ptr: int, size: int) -> bytes:
        return ctypes.string_at(ptr, size)

    for answer in (laneexec.GENERAL, laneexec.GONE):
        def run(eff, answer=answer):
            held.append(used())  # the check held the bytes before the driver call
            return answer

        got = laneexec.run_here(laneexec.lane_steps(b.control_lane, t.fds[ctl], t.caller,
                                                    cmd, alloc(0xE1)), read, run)
        assert got is answer
        assert held[-1] == 6 << 30 and used() == 0

    def unreadable(ptr: int, size: int) -> bytes:
        raise OSError(14, "Bad address")

    def never(eff):
        raise AssertionError("no driver call for a block that could not be read")

    got = laneexec.run_here(laneexec.lane_steps(b.control_lane, t.fds[ctl], t.caller, cmd,
                                                alloc(0xE2)), unreadable, never)
    assert got is laneexec.GENERAL and used() == 0

    def no_read(ptr: int, size: int) -> bytes:
        raise AssertionError("nothing is read for a header the lane does not take")

    foreign = t.new("NVOS64_PARAMETERS", hRoot=0xC1D0BEEF, hObjectParent=dev, hObjectNew=0xE3,
                    hClass=MEMORY_LOCAL_USER, pAllocParms=1).encode()
    got = laneexec.run_here(laneexec.lane_steps(b.control_lane, t.fds[ctl], t.caller, cmd,
                                                foreign), no_read, never)
    assert got is laneexec.GENERAL
    # and a real run books the object with the bytes it held
    got = laneexec.run_here(laneexec.lane_steps(b.control_lane, t.fds[ctl], t.caller, cmd,
                                                alloc(0xE4)), read,
                            lambda eff: b.backend.run_control(eff.adm.session.file, -1,
                                                              eff.hdr, eff.params,
                                                              eff.adm.header, eff.adm.abi))
    assert isinstance(got, laneexec.Answer) and got.err == 0
    assert b.tenants["t"].clients[client].objects[0xE4].charged == 6 << 30
    assert used() == 6 << 30
