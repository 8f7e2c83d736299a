"""Channel-group scheduling controls through raw ioctls: what the driver (or the
broker in front of it) answers to SET/GET_TIMESLICE, SET/GET_INTERLEAVE_LEVEL and the other
scheduling controls on a channel group of the caller's own.

    python -m devbroker.tools.sched_probe probe     # one pass over the controls, JSON lines
    python -m devbroker.tools.sched_probe hold N    # N channel groups, then commands on stdin:
        get | set US | level L | race THREADS ROUNDS | realtime | policy
        | channel (a GPFIFO channel in the first group: the emulated driver's)
        | device-channel (a GPFIFO channel right under the device, outside any group: the
          driver makes a group for it) | get-handle H (GET_TIMESLICE on handle H)
        | free H (RM_FREE of handle H) | find-group (the driver's group of the last
          device channel, looked for with GET_HANDLE_INFO as the broker does)
        | disable 0|1 (FIFO_DISABLE_CHANNELS on the tenant's own channels) | quit
    python -m devbroker.tools.sched_probe devchan [GROUP]   # one channel right under the
        device (the parameters the real driver wants, tried in turn), the group the driver
        made for it (GROUP, or looked for), its timeslice, the channel freed, the group gone

Used by the CI tests (tenants of the emulated driver) and by scripts/gpu/compute_shares.sh on
the H200 (a plain process against the real driver, and tenants through devbroker). Every answer
is one JSON object per line; nothing here asserts anything.
"""
from __future__ import annotations

import json
import random
import sys
import threading

from devbroker.abi import status as nvs
from devbroker.tools.probe import Client, NvError

CHANNEL_GROUP = 0xA06C
VASPACE = 0x90F1
ENGINE_GR0 = 1  # NV2080_ENGINE_TYPE_GRAPHICS (the compute runlist; CUDA's first group)
SET_TIMESLICE, GET_TIMESLICE = 0xA06C0103, 0xA06C0104
SET_LEVEL, GET_LEVEL, MAKE_REALTIME = 0xA06C0107, 0xA06C0108, 0xA06C0110
GPFIFO_SCHEDULE = 0xA06C0101
CHANNEL = 0xC86F  # HOPPER_CHANNEL_GPFIFO_A
DISABLE_CHANNELS = 0x2080110B  # NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS
RUNLIST_SET_SCHED_POLICY = 0x20801115
GET_HANDLE_INFO, HANDLE_INFO_PARENT, HANDLE_INFO_CLASSID = 0xD02, 1, 2
UNIQUE_HANDLE_BASE = 0xCAF00000  # the handles the driver picks for a client's objects
GPFIFO_ENTRIES = 1024  # CUDA's (the torch trace)
GPFIFO_VA = 0x200600000  # a GPU address for the ring: the channel is never given work
ENGINE_COPY4 = 13  # NV2080_ENGINE_TYPE_COPY4: one of CUDA's copy-engine groups'

SCHED_POLICY_CHANNEL_INTERLEAVED = 1
SCHED_POLICY_RESTORE = 1


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def status_of(fn, *a, **kw) -> tuple[int, object]:
    try:
        return nvs.NV_OK, fn(*a, **kw)
    except NvError as e:
        return e.status, None
    except OSError as e:
        return -e.errno, None


class Groups:
    def __init__(self) -> None:
        self.c = Client()
        self.c.check_version()
        self.c.open_root()
        self.g = self.c.open_gpu(self.c.attached_ids()[0])
        self.vaspace = 0
        self.handles: list[int] = []
        self.channels: list[int] = []
        self.device_channels: list[int] = []
        self.lock = threading.Lock()

    def alloc(self) -> int:
        """A channel group on the compute engine: with the device's default VA space first
        (the emulator and, perhaps, the driver take that), else with one of its own (as CUDA
        does: FERMI_VASPACE_A flags 0x48)."""
        c = self.c
        for attempt in range(2):
            p = c.new("NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=ENGINE_GR0,
                      hVASpace=self.vaspace)
            try:
                h = c.alloc(self.g["hdevice"], CHANNEL_GROUP, p)
                self.handles.append(h)
                return h
            except NvError as e:
                if attempt or self.vaspace:
                    raise
                out(what="alloc-without-vaspace", status=e.status)
                for flags in (0x48, 0x0):  # CUDA's first VA space, then a plain one
                    try:
                        self.vaspace = c.alloc(self.g["hdevice"], VASPACE, c.new(
                            "NV_VASPACE_ALLOCATION_PARAMETERS", flags=flags))
                        break
                    except NvError as e2:
                        out(what="vaspace-failed", flags=flags, status=e2.status)
                if not self.vaspace:
                    raise
        raise AssertionError("unreachable")

    def device_channel(self) -> tuple[int, int | None, dict]:
        """A GPFIFO channel right under the device: (status, handle, what the answer said).
        The emulator takes any parameters; the real driver needs a valid engine and the VA
        space the group it makes will use (kchangrpapiConstruct_IMPL), so the variants are
        tried in turn: the first that the driver takes stands."""
        if not self.handles:
            self.alloc()  # (finds the VA space this device wants, as CUDA's groups need)
        tried = []
        for engine, vaspace in ((ENGINE_GR0, self.vaspace), (ENGINE_COPY4, self.vaspace),
                                (ENGINE_GR0, 0), (ENGINE_COPY4, 0)):
            p = self.c.new("NV_CHANNEL_ALLOC_PARAMS", hVASpace=vaspace,
                           gpFifoOffset=GPFIFO_VA, gpFifoEntries=GPFIFO_ENTRIES,
                           engineType=engine)
            st, h = status_of(self.c.alloc, self.g["hdevice"], CHANNEL, p)
            tried.append({"engine": engine, "vaspace": vaspace, "status": st})
            if st == nvs.NV_OK:
                self.device_channels.append(h)
                answer = self.c.last_alloc_params
                return st, h, {"tried": tried,
                               "hPhysChannelGroup": int(answer.hPhysChannelGroup),
                               "engine": engine}
        return tried[-1]["status"], None, {"tried": tried}

    def handle_info(self, h: int, index: int) -> tuple[int, int | None]:
        st, p = status_of(self.c.control, self.c.hclient, GET_HANDLE_INFO,
                          self.c.params(GET_HANDLE_INFO, hObject=h, index=index))
        if p is None:
            return st, None
        return st, int.from_bytes(bytes(p.data.raw)[:8], "little")

    def find_group(self, limit: int = 4096) -> tuple[int, int | None]:
        """(status of the last question, handle of a channel group under the device that the
        driver picked and this process did not allocate): as compute.driver_group_of asks."""
        misses, st = 0, nvs.NV_OK
        for i in range(limit):
            h = UNIQUE_HANDLE_BASE + i
            st, cls = self.handle_info(h, HANDLE_INFO_CLASSID)
            if st != nvs.NV_OK:
                misses += 1
                if misses >= 256:
                    break
                continue
            misses = 0
            if cls == CHANNEL_GROUP and h not in self.handles:
                pst, parent = self.handle_info(h, HANDLE_INFO_PARENT)
                if pst == nvs.NV_OK and parent == self.g["hdevice"]:
                    return pst, h
        return st, None

    def control(self, h: int, cmd: int, **fields):
        return self.c.control(h, cmd, self.c.params(cmd, **fields))

    def get(self, h: int) -> tuple[int, int | None]:
        st, p = status_of(self.control, h, GET_TIMESLICE)
        return st, (int(p.timesliceUs) if p is not None else None)

    def set(self, h: int, us: int) -> int:
        return status_of(self.control, h, SET_TIMESLICE, timesliceUs=us)[0]

    def level(self, h: int, lv: int) -> int:
        return status_of(self.control, h, SET_LEVEL, tsgInterleaveLevel=lv)[0]


def probe() -> None:
    """One pass over the controls on a fresh channel group (part (a) of the GPU script)."""
    gs = Groups()
    try:
        h = gs.alloc()
    except NvError as e:
        out(what="alloc-failed", status=e.status)
        return
    st, default = gs.get(h)
    out(what="get-default", status=st, timeslice_us=default)
    # Sane values first; the extremes last (the hardware's longest slice is an 8-bit timeout
    # << a 4-bit scale, about 8.4 s; nothing beyond is sent).
    for us in (1024, 2048, 4096, 512, 256, 128, 100, 64, 1, 65536, 1 << 20, 8 << 20, 0):
        st = gs.set(h, us)
        gst, got = gs.get(h)
        out(what="set-timeslice", asked=us, status=st, get_status=gst, timeslice_us=got)
    gs.set(h, default or 1024)
    for lv in (0, 1, 2, 3):
        out(what="set-interleave", level=lv, status=gs.level(h, lv))
    st, p = status_of(gs.control, h, GET_LEVEL)
    out(what="get-interleave", status=st,
        level=int(p.tsgInterleaveLevel) if p is not None else None)
    gs.level(h, 1)
    st, _ = status_of(gs.control, h, MAKE_REALTIME, bRealtime=1)
    out(what="make-realtime", status=st)
    if st == nvs.NV_OK:
        out(what="make-realtime-undo", status=status_of(gs.control, h, MAKE_REALTIME,
                                                        bRealtime=0)[0])
    sub = gs.g["hsubdevice"]
    st, _ = status_of(gs.c.control, sub, RUNLIST_SET_SCHED_POLICY,
                      gs.c.params(RUNLIST_SET_SCHED_POLICY,
                                  schedPolicy=SCHED_POLICY_CHANNEL_INTERLEAVED))
    out(what="runlist-sched-policy-interleaved", status=st)
    if st == nvs.NV_OK:
        out(what="runlist-sched-policy-restore",
            status=status_of(gs.c.control, sub, RUNLIST_SET_SCHED_POLICY,
                             gs.c.params(RUNLIST_SET_SCHED_POLICY,
                                         flags=SCHED_POLICY_RESTORE))[0])


def hold(n: str) -> None:
    """N channel groups, then commands from stdin, one JSON answer each."""
    gs = Groups()
    for _ in range(int(n)):
        gs.alloc()
    out(what="groups", handles=gs.handles, timeslices=[gs.get(h)[1] for h in gs.handles])
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "get":
            out(what="get", timeslices=[gs.get(h)[1] for h in gs.handles])
        elif cmd == "set":
            sts = [gs.set(h, int(args[0])) for h in gs.handles]
            out(what="set", status=sts, timeslices=[gs.get(h)[1] for h in gs.handles])
        elif cmd == "level":
            out(what="level", status=[gs.level(h, int(args[0])) for h in gs.handles])
        elif cmd == "race":
            threads, rounds = int(args[0]), int(args[1])
            bad: list[int] = []

            def worker(seed: int) -> None:
                rnd = random.Random(seed)
                for _ in range(rounds):
                    h = rnd.choice(gs.handles)
                    if rnd.random() < 0.5:
                        st = gs.set(h, rnd.choice((1 << 20, 1 << 30, 100000, 16384)))
                    else:
                        st = gs.level(h, 2)
                    if st != nvs.NV_OK:
                        with gs.lock:
                            bad.append(st)
            ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            out(what="race", failed=bad[:10], timeslices=[gs.get(h)[1] for h in gs.handles])
        elif cmd == "channel":  # one GPFIFO channel in the first group (emulated driver)
            p = gs.c.new("NV_CHANNEL_ALLOC_PARAMS")
            st, h = status_of(gs.c.alloc, gs.handles[0], CHANNEL, p)
            if st == nvs.NV_OK:
                gs.channels.append(h)
            out(what="channel", status=st, channels=gs.channels)
        elif cmd == "device-channel":  # a channel under the device, outside any group
            st, h, said = gs.device_channel()
            out(what="device-channel", status=st, handle=h, **said)
        elif cmd == "get-handle":
            st, us = gs.get(int(args[0], 0))
            out(what="get-handle", status=st, timeslice_us=us)
        elif cmd == "free":
            out(what="free", status=gs.c.free(gs.g["hdevice"], int(args[0], 0)))
        elif cmd == "find-group":
            st, h = gs.find_group()
            out(what="find-group", status=st, handle=h)
        elif cmd == "disable":  # the tenant's own FIFO_DISABLE_CHANNELS on its channels
            n = len(gs.channels)
            st, _ = status_of(gs.c.control, gs.g["hsubdevice"], DISABLE_CHANNELS,
                              gs.c.params(DISABLE_CHANNELS, bDisable=int(args[0]),
                                          numChannels=n,
                                          hClientList=[gs.c.hclient] * n + [0] * (64 - n),
                                          hChannelList=gs.channels + [0] * (64 - n)))
            out(what="disable", status=st)
        elif cmd == "realtime":
            out(what="realtime", status=status_of(gs.control, gs.handles[0], MAKE_REALTIME,
                                                  bRealtime=1)[0])
        elif cmd == "policy":
            st, _ = status_of(gs.c.control, gs.g["hsubdevice"], RUNLIST_SET_SCHED_POLICY,
                              gs.c.params(RUNLIST_SET_SCHED_POLICY,
                                          schedPolicy=SCHED_POLICY_CHANNEL_INTERLEAVED))
            out(what="policy", status=st)
        elif cmd == "quit":
            break
        else:
            out(what="error", error=f"unknown command {cmd!r}")


def devchan(group: str = "") -> None:
    """One channel right under the device and the group the driver made for it (part 1 of
    scripts/gpu/run-h200-devchannel.sh: natively; the broker's view is part 2's)."""
    gs = Groups()
    gs.alloc()
    out(what="own-group", handle=gs.handles[0], timeslice_us=gs.get(gs.handles[0])[1])
    st, chan, said = gs.device_channel()
    out(what="device-channel", status=st, handle=chan, **said)
    if st != nvs.NV_OK:
        return
    if group:
        g = int(group, 0)
    else:
        fst, g = gs.find_group()
        out(what="find-group", status=fst, handle=g)
        if g is None:
            return
    st, us = gs.get(g)
    out(what="group-timeslice", handle=g, status=st, timeslice_us=us)
    st = gs.set(g, 4096)
    out(what="group-set-timeslice", asked=4096, status=st, read_back=gs.get(g)[1])
    out(what="free-channel", status=gs.c.free(gs.g["hdevice"], chan))
    st, cls = gs.handle_info(g, HANDLE_INFO_CLASSID)
    out(what="group-after-free", get_timeslice_status=gs.get(g)[0], handle_info_status=st)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modes = {"probe": probe, "hold": hold, "devchan": devchan}
    if not argv or argv[0] not in modes:
        print(__doc__, file=sys.stderr)
        return 2
    modes[argv[0]](*argv[1:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
