"""Per-tenant limits on every kind of request, with real brokers and real
`devbroker exec` tenants (FUSE front end), and the indexes that keep other tenants' objects
out of every call's work.

- Counts: open node files, RM clients, RM objects, /proc-view handles are refused past the
  tenant's limits (EMFILE / NV_ERR_INSUFFICIENT_RESOURCES), each refusal audited.
- Pace: opens, page reads, /proc reads, lookups and readdirs take the tenant's tokens like
  its ioctls (seen in `status`: the flooder's requests waited; not a timing).
- The noisy neighbour: while one tenant floods with every request kind, another tenant's
  NVML-style sequence completes with the right answers every time (the benchmark,
  scripts/bench_noisy.py, measures the latency; this test asserts completion only).
- The emulator's indexes (in-use flag, processes, memory per process, a file's clients) give
  what a walk over every client gives, through allocations, frees and closes.
"""
from __future__ import annotations

import errno

import random
import subprocess
import sys

import pytest

from devbroker.abi import status as nvs
from devbroker.abi.nodes import NodeKind
from devbroker.testing.policies import one_h200, tenant
from tenant_io import lines, readline_json

NOISY = [sys.executable, "-m", "devbroker.tools.noisy"]

POLICY = one_h200(
    tenant("quiet"),
    tenant("noisy", rate_limit={"requests_per_second": 100, "burst": 10},
           limits={"open_files": 16, "rm_clients": 8, "rm_objects": 64}))

LIMITS_PROG = r'''
import errno, json, os, sys
from devbroker.tools.probe import Client, NvError
def out(**kw): print(json.dumps(kw), flush=True)
c = Client(); c.check_version(); c.open_root()
g = c.open_gpu(c.attached_ids()[0])
# open files: 3 are held (nvidiactl, nvidia0, and this one's ctl); open until refused
held, err = [], None
while len(held) < 100:
    try:
        held.append(os.open("/dev/nvidiactl", os.O_RDWR))
    except OSError as e:
        err = errno.errorcode[e.errno]; break
out(what="open-files", opened=len(held), errno=err)
for fd in held:
    os.close(fd)
views, err = [], None
while len(views) < 100:
    try:
        views.append(open("/proc/driver/nvidia/version"))
    except OSError as e:
        err = errno.errorcode[e.errno]; break
out(what="proc-view-files", opened=len(views), errno=err)
for f in views:
    f.close()
clients, status = 0, 0
while clients < 100:
    try:
        c.alloc(0, 0x41, handle=0, root=0); clients += 1
    except NvError as e:
        status = e.status; break
out(what="rm-clients", allocated=clients, status=status)
objects, status = 0, 0
while objects < 1000:
    try:
        c.alloc(g["hsubdevice"], 0xDE, c.new("NV00DE_ALLOC_PARAMETERS")); objects += 1
    except NvError as e:
        status = e.status; break
out(what="rm-objects", allocated=objects, status=status)
'''


@pytest.mark.root
def test_counts_are_refused_past_the_limits_and_audited(start_broker):
    b = start_broker(POLICY)
    b.frontend = "fuse"
    r = b.exec("noisy", sys.executable, "-c", LIMITS_PROG, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {x["what"]: x for x in lines(r.stdout)}
    # 16 open node files: nvidiactl and nvidia0 of the client, then 14 more.
    assert got["open-files"] == {"what": "open-files", "opened": 14, "errno": "EMFILE"}
    # The sandbox's /proc/driver/nvidia is a copy in its own tmpfs: opening it
    # costs the broker nothing, so nothing counts it.
    assert got["proc-view-files"] == {"what": "proc-view-files", "opened": 100,
                                      "errno": None}
    # The broker's own /proc view (its FUSE mount, which a process outside a sandbox may
    # open) counts its handles apart from node files, against the same number.
    view = b.run_dir / "nodes" / "noisy" / "proc" / "driver" / "nvidia" / "version"
    held, err = [], None
    try:
        while len(held) < 100:
            try:
                held.append(open(view))
            except OSError as e:
                err = errno.errorcode[e.errno]
                break
        assert (len(held), err) == (16, "EMFILE")
    finally:
        for f in held:
            f.close()
    # 8 clients: the first one's, then 7.
    assert got["rm-clients"] == {"what": "rm-clients", "allocated": 7,
                                 "status": nvs.NV_ERR_INSUFFICIENT_RESOURCES}
    # 64 objects in all: 8 root clients, device and subdevice, then 54 more.
    assert got["rm-objects"] == {"what": "rm-objects", "allocated": 54,
                                 "status": nvs.NV_ERR_INSUFFICIENT_RESOURCES}
    reasons = [a["reason"] for a in b.audit() if a["event"] == "deny" and a["tenant"] == "noisy"]
    for key in ("limits.open_files = 16", "limits.rm_clients = 8", "limits.rm_objects = 64"):
        assert any(key in x for x in reasons), (key, reasons)
    assert any("open /proc view files" in x for x in reasons)
    t = b.tenant("noisy")
    assert t["refusals"] >= 4
    # Everything it opened was closed and the limits do not linger: the counts went back.
    assert t["open_files"] == 0


@pytest.mark.root
def test_noisy_neighbour_flood_of_every_kind_the_quiet_tenant_still_completes(start_broker):
    b = start_broker(POLICY)
    b.frontend = "fuse"
    flood = b.exec_popen("noisy", *NOISY, "flood", "--seconds", "6", "--threads-per-kind", "2",
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert readline_json(flood)["what"] == "flood-start"
        r = b.exec("quiet", *NOISY, "quiet", "--n", "15", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        q = lines(r.stdout)[0]
        assert q["all_right"], q["wrong"]
        assert len(q["latencies_us"]) == 15
        first = q["first"]
        assert first["gpus"] == [{"name": "NVIDIA H200",
                                  "uuid": "GPU-11111111-2222-3333-4444-555555555555",
                                  "minor": 0, "memory": 16 << 30}]
        assert "580.159.04" in first["version"]
        done = readline_json(flood, timeout=120)
    finally:
        flood.wait(timeout=120)
    counts, errors = done["counts"], done["errors"]
    # Every kind was sent, and the limits refused what is counted.
    assert set(counts) == {"open", "ioctl", "page-read", "proc-read", "lookup", "readdir",
                           "poll", "rm-client", "rm-object"}, counts
    assert "status 0x1a" in errors.get("rm-client", {}), errors  # NV_ERR_INSUFFICIENT_RESOURCES
    assert "status 0x1a" in errors.get("rm-object", {}), errors
    noisy, quiet = b.tenant("noisy"), b.tenant("quiet")
    # The flooder waited for its tokens (every kind takes them); the quiet tenant never did.
    assert noisy["rate_limited"] > 0 and quiet["rate_limited"] == 0
    # All of the flood is paced: at 100/s (burst 10) for ~6 s, not the thousands per second
    # each kind makes unpaced — counted, not timed.
    assert sum(counts.values()) < 100 * 6 * 3, counts
    records = [a for a in b.audit() if a.get("tenant") == "noisy"]
    assert any(a["event"] == "deny" and "limits.rm_clients" in a["reason"] for a in records)


def test_emulator_indexes_match_a_walk_over_every_client():
    """The in-use flag, the process list and memory per process, and the clients closed
    with a file come from indexes kept at each allocation and free: after any sequence of
    allocations, frees (of clients, devices, memory) and closes they say what a walk over
    every client and object says."""
    import trio

    from devbroker.abi import iowr, registry
    from devbroker.backends.base import DriverCall
    from devbroker.backends.emulated import EmulatedBackend

    be = EmulatedBackend(version="580.159.04")
    abi = registry.get("580.159.04")
    rng = random.Random(13)

    def escape(f, name: str, params=None, **fields) -> object:
        spec = abi.escape(name)
        value = spec.params.decode(bytes(spec.params.size)).replace(**fields)
        call = abi.decode_ioctl(NodeKind.CTL, iowr(spec.number, spec.params.size),
                                value.encode())
        nested = params.encode() if params is not None else None
        dc = DriverCall(call, nested, {}, abi=abi, tgid=1000 + f.id)
        return spec.params.decode(trio.run(be.ioctl, f, dc).arg)

    def struct(name: str, **fields):
        st = abi.struct(name)
        return st.decode(bytes(st.size)).replace(**fields)

    def walk_in_use(gpu):
        return any(o.rm_class == 0x80 and o.gpu == gpu
                   for c in be.clients.values() for o in c.objects.values())

    def walk_held(gpu):
        out = {}
        for c in be.clients.values():
            n = sum(o.size for o in c.objects.values() if o.gpu == gpu)
            if n:
                out[c.tgid] = out.get(c.tgid, 0) + n
        return out

    files, live = [], []  # live: (file, client, device, memory) handles
    for step in range(300):
        op = rng.random()
        if op < 0.15 or not files:
            files.append(be.open(NodeKind.CTL, 0))
        elif op < 0.55:
            f = rng.choice(files)
            h = escape(f, "NV_ESC_RM_ALLOC", hClass=0x41).hObjectNew
            dev = 0x5000 + step
            escape(f, "NV_ESC_RM_ALLOC", struct("NV0080_ALLOC_PARAMETERS",
                                                deviceId=rng.randrange(2)),
                   hRoot=h, hObjectParent=h, hObjectNew=dev, hClass=0x80)
            escape(f, "NV_ESC_RM_ALLOC", struct(
                "NV_MEMORY_ALLOCATION_PARAMS", owner=h, flags=0x1C101, attr=0x18000000,
                size=rng.choice([2, 4, 8]) << 20, alignment=2 << 20),
                hRoot=h, hObjectParent=dev, hObjectNew=dev + 1, hClass=0x40)
            live.append((f, h, dev, dev + 1))
        elif op < 0.65 and len(live) > 1:
            # a duplicate of one client's memory in another client (RM_DUP_OBJECT): one
            # charge for both handles, kept by whichever is left
            (_, ha, _, mema), (fb, hb, devb, _) = rng.sample(live, 2)
            escape(fb, "NV_ESC_RM_DUP_OBJECT", hClient=hb, hParent=devb,
                   hObject=0x9000 + step, hClientSrc=ha, hObjectSrc=mema)
        elif op < 0.8 and live:
            f, h, dev, mem = live.pop(rng.randrange(len(live)))
            # the client, the device with its memory, or the memory alone
            escape(f, "NV_ESC_RM_FREE", hRoot=h, hObjectOld=rng.choice([h, dev, mem]))
        elif len(files) > 1:
            f = files.pop(rng.randrange(len(files)))
            be.close(f)
            live = [x for x in live if x[0] is not f]
        for gpu in (0, 1):
            assert be.device_in_use(gpu) == walk_in_use(gpu), step
            assert be.memory_by_pid(gpu) == walk_held(gpu), step
            assert be.pids_on(gpu) == sorted(walk_held(gpu)), step
            assert be.used[gpu] == sum(walk_held(gpu).values()), step
        for f in files:
            assert be._clients_of_file.get(f.id, set()) == {
                h for h, c in be.clients.items() if c.file_id == f.id}, step
    assert any(be.device_in_use(g) for g in (0, 1)) and be.clients  # not trivially empty
    assert any(o.share for c in be.clients.values() for o in c.objects.values())


def test_broker_running_totals_match_a_walk_with_duplicates():
    """The broker's books: each client's charged bytes and device count per GPU are running
    totals (the quota check and the in-use rewrite read them). Through adds, removes,
    duplicates sharing one charge (RM_DUP_OBJECT) and drops of whole clients, they equal a
    walk over the objects."""
    from devbroker.broker.objects import RmClient, drop_objects, share

    rng = random.Random(8)
    clients = {h: RmClient(h, 0, 100 + h) for h in range(1, 5)}
    live: list[tuple[RmClient, int]] = []
    for step in range(600):
        c = rng.choice(list(clients.values()))
        op = rng.random()
        if op < 0.3:
            dev = 0x100 + step
            c.add(dev, 0x80, c.handle, gpu=rng.randrange(2))
            mem = 0x10000 + step
            c.add(mem, 0x40, dev, charged=rng.choice([2, 4, 8]) << 20)
            live.append((c, mem))
        elif op < 0.5 and live:
            src, h = rng.choice(live)
            if h in src.objects:
                obj = src.objects[h]
                d = c.add(0x20000 + step, obj.rm_class, c.handle, gpu=obj.gpu)
                share(obj, d)
                live.append((c, d.handle))
        elif op < 0.8 and live:
            owner, h = live.pop(rng.randrange(len(live)))
            if h in owner.objects:
                drop_objects(owner.remove(h))
        elif op < 0.85:
            gone = clients.pop(c.handle)
            drop_objects(gone.objects.values())
            clients[c.handle] = RmClient(c.handle, 0, 100 + c.handle)
            live = [x for x in live if x[0] is not gone]
        for cl in clients.values():
            walk: dict[int, int] = {}
            for o in cl.objects.values():
                if o.charged and o.gpu is not None:
                    walk[o.gpu] = walk.get(o.gpu, 0) + o.charged
            assert cl.charged_by_gpu() == walk, step
            for g in (0, 1):
                assert cl.holds_device(g) == any(o.rm_class == 0x80 and o.gpu == g
                                                 for o in cl.objects.values()), step


OTHER_FILES_PROG = r"""
import json, mmap, os, sys
n = int(sys.argv[1])
fd = os.open(sys.executable, os.O_RDONLY)
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
for _ in range(n):  # opens of a file that is none of the broker's nodes
    os.close(os.open(sys.executable, os.O_RDONLY))
for _ in range(n):  # file-backed mmaps (the filter notifies every one)
    mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ).close()
print(json.dumps({"done": 2 * n}), flush=True)
"""


@pytest.mark.root
@pytest.mark.parametrize("loop", ["native", "python"])
def test_opens_and_mmaps_of_other_files_are_paced_through_seccomp(start_broker, monkeypatch,
                                                                  loop):
    """A tenant paced at 100 requests/s drove 41k opens/s of other files,
    or 20k mmaps/s, through the seccomp listener (each a notification: a receive, a read of
    the path or a statx, an answer), none of them counted. Each now takes a token of the
    tenant's pace — in the native loop from the credit Python takes ahead, handed back to
    Python to wait when it runs out; in the Python listener directly. Counted, not timed:
    600 such calls past a burst of 20 made the tenant's requests wait (the waits before
    them, from the interpreter's start, are taken off), and nothing failed."""
    monkeypatch.setenv("DEVBROKER_NATIVE_LANE", "1" if loop == "native" else "0")
    b = start_broker(one_h200(tenant("paced", rate_limit={"requests_per_second": 400,
                                                          "burst": 20})))
    b.frontend = "seccomp"
    p = b.exec_popen("paced", sys.executable, "-c", OTHER_FILES_PROG, "300",
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)
    try:
        assert readline_json(p, timeout=120) == {"ready": True}
        before = b.tenant("paced")["rate_limited"]
        p.stdin.write("go\n")
        p.stdin.flush()
        assert readline_json(p, timeout=120) == {"done": 600}
    finally:
        p.stdin.close()
        assert p.wait(timeout=60) == 0, p.stderr.read()
    t = b.tenant("paced")
    assert t["rate_limited"] - before > 0, (before, t)
    assert t["refusals"] == 0, t
