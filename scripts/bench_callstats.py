#!/usr/bin/env python3
"""Benchmark (not a test): what the metrics wrapper (broker/callstats.py) adds to each call.

1. The wrapper alone: InstrumentedBroker around a stub broker whose ioctl returns at once,
   against the stub called directly (the difference is the wrapper's own cost per call).
2. In context: an RM_CONTROL (FB_GET_INFO_V2, NVML's memory query) through the real broker
   core and the emulated backend, in process, with and without the wrapper.
Each measure is the best of ROUNDS rounds of N calls (the machine is shared); µs per call.
The second measure is dominated by the core's worker-thread hops and is noisy at the µs level;
the first is the wrapper's cost.
Usage: .venv/bin/python scripts/bench_callstats.py
"""
from __future__ import annotations

import ctypes
import time

import trio

from devbroker.abi import iowr, registry
from devbroker.abi.nodes import NodeKind
from devbroker.backends.emulated import EmulatedBackend
from devbroker.broker.callstats import CallStats, InstrumentedBroker
from devbroker.broker.core import Broker
from devbroker.broker.interface import Caller, IoctlReply, IoctlRequest, OpenRequest
from devbroker.broker.policy import load_policy_text
from devbroker.testing.policies import one_h200, tenant

ROUNDS = 7
ABI = registry.get("535.309.01")
# far above what the loop sends: the default (2000/s) would pace the loop, not measure it
POLICY = one_h200(tenant("alice", memory_quota="1GiB",
                         rate_limit={"requests_per_second": 100000000, "burst": 100000000}),
                  driver_version=None, uuids=("GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0001",))


class _StubTenant:
    name = "alice"


class _StubSession:
    tenant = _StubTenant()
    node = NodeKind.CTL


class StubBroker:
    def __init__(self):
        self.sessions = {1: _StubSession()}
        self.reply = IoctlReply(arg_out=b"")

    async def ioctl(self, req):
        return self.reply


class OwnMemory:
    def read(self, addr: int, n: int) -> bytes:
        return ctypes.string_at(addr, n)

    def write(self, addr: int, data: bytes) -> None:
        ctypes.memmove(addr, data, len(data))


async def per_call(target, req, n: int) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            await target.ioctl(req)
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
    return best


def control_request(caller, session: int, client: int, obj: int, cmd: int):
    p = ABI.control(cmd).params
    params = p.decode(bytes(p.size)).replace(fbInfoListSize=1)
    buf = ctypes.create_string_buffer(params.encode(), p.size)
    s = ABI.struct("NVOS54_PARAMETERS")
    v = s.decode(bytes(s.size)).replace(hClient=client, hObject=obj, cmd=cmd,
                                        paramsSize=p.size, params=ctypes.addressof(buf))
    arg = v.encode()
    req = IoctlRequest(caller, session, iowr(ABI.escape("NV_ESC_RM_CONTROL").number, len(arg)),
                       0, arg, OwnMemory())
    return req, buf


async def main() -> None:
    # 1. the wrapper alone
    stub = StubBroker()
    s = ABI.struct("NVOS54_PARAMETERS")
    arg = s.decode(bytes(s.size)).replace(cmd=0x20801303).encode()
    req = IoctlRequest(Caller(1, 1, 0, 0), 1, iowr(0x2A, len(arg)), 0, arg)
    direct = await per_call(stub, req, 100_000)
    wrapped = await per_call(InstrumentedBroker(stub, CallStats()), req, 100_000)
    print(f"stub broker, direct:        {direct:7.2f} µs/call")
    print(f"stub broker, wrapped:       {wrapped:7.2f} µs/call")
    print(f"wrapper cost:               {wrapped - direct:7.2f} µs/call")

    # 2. a real control through the core + emulated backend
    broker = Broker(load_policy_text(POLICY, "bench"), EmulatedBackend(version="535.309.01"))
    caller = Caller(4242, 4242, 0, 0)
    ctl = (await broker.open(OpenRequest(caller, "alice", NodeKind.CTL, 0))).session
    keep = []

    async def esc(name, value, nested=None, ptr=""):
        if nested is not None:
            buf = ctypes.create_string_buffer(nested.encode(), nested.spec.size)
            keep.append(buf)
            value = value.replace(**{ptr: ctypes.addressof(buf)})
        a = value.encode()
        rep = await broker.ioctl(IoctlRequest(caller, ctl, iowr(ABI.escape(name).number, len(a)),
                                              0, a, OwnMemory()))
        return value.spec.decode(rep.arg_out)

    def new(name, **kw):
        st = ABI.struct(name)
        return st.decode(bytes(st.size)).replace(**kw)

    root = (await esc("NV_ESC_RM_ALLOC", new("NVOS64_PARAMETERS", hClass=0x41))).hObjectNew
    await esc("NV_ESC_RM_ALLOC", new("NVOS64_PARAMETERS", hRoot=root, hObjectParent=root,
                                     hObjectNew=0xA0, hClass=0x80),
              new("NV0080_ALLOC_PARAMETERS", deviceId=0), "pAllocParms")
    await esc("NV_ESC_RM_ALLOC", new("NVOS64_PARAMETERS", hRoot=root, hObjectParent=0xA0,
                                     hObjectNew=0xB0, hClass=0x2080),
              new("NV2080_ALLOC_PARAMETERS"), "pAllocParms")
    req, buf = control_request(caller, ctl, root, 0xB0, 0x20801303)
    # Interleaved rounds: the core's tenant-memory accesses hop to worker threads, whose
    # scheduling on this shared machine varies more than the wrapper costs.
    wrapper = InstrumentedBroker(broker, CallStats())
    direct = wrapped = float("inf")
    for _ in range(3):
        direct = min(direct, await per_call(broker, req, 1_000))
        wrapped = min(wrapped, await per_call(wrapper, req, 1_000))
    print(f"FB_GET_INFO_V2, core:       {direct:7.2f} µs/call")
    print(f"FB_GET_INFO_V2, wrapped:    {wrapped:7.2f} µs/call")
    print(f"difference:                 {wrapped - direct:7.2f} µs/call "
          f"({100 * (wrapped - direct) / direct:.1f} %)")


if __name__ == "__main__":
    trio.run(main)
