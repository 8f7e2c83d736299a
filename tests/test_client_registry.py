"""The client registry (broker/objects.py: ClientRegistry): the one place root
clients are added and removed. Which tenant holds a client (what _check_clients and the
root-client RM_ALLOC ask), the tenant's clients (TenantState.clients: quota, limits, status)
and the clients of one ctl file (what closing it frees) must agree after every call that
makes or ends a client: allocation, export holder, RM_FREE of the client, file close, a
tenant's process ending (all its files closed), a tenant removed from the policy, and a live
upgrade's hand-over. Driven through the in-process broker (conftest's inproc_broker)."""
from __future__ import annotations

import json

import pytest

from devbroker.abi import status as nvs
from devbroker.abi.nodes import NodeKind
from devbroker.broker import handover
from devbroker.broker.interface import ReleaseRequest
from devbroker.broker.policy import load_policy_text
from devbroker.testing.inproc import InProcTenant
from devbroker.testing.policies import tenant, two_h200

MiB = 1 << 20
ALICE = tenant("alice", gpus=[0], memory_quota="1GiB", capabilities=["nvml", "compute"])
POLICY = two_h200(ALICE, tenant("bob", gpus=[1], memory_quota="1GiB",
                                capabilities=["nvml", "compute"]))
EXPORT_OBJECTS_TO_FD = 0x3D0B


def views(broker) -> dict:
    """Each client as the registry, its tenant's books and its session's set see it, after
    checking that the three agree (and that nothing is held by a closed or foreign file)."""
    reg = broker.clients
    seen = {}
    for t in broker.tenants.values():
        assert dict(reg.of_tenant(t)) == t.clients
        for h, c in t.clients.items():
            assert reg.owner(h) == t.name, hex(h)
            assert c.session in t.sessions, (hex(h), c.session)  # an open file of its tenant
            assert h in reg.of_session(c.session)
            assert h not in seen  # one tenant per client
            seen[h] = (t.name, c.session)
    assert dict(reg.owners()) == {h: name for h, (name, _) in seen.items()}
    assert len(reg) == len(seen)
    for s in broker.sessions.values():
        assert reg.of_session(s.id) == {h for h, (_, sid) in seen.items() if sid == s.id}
    return seen


async def root_client(t: InProcTenant, ctl: int) -> int:
    _, out, _ = await t.alloc(ctl, 0, 0, 0x41)
    assert out.status == nvs.NV_OK
    return out.hObjectNew


async def memory(t: InProcTenant, ctl: int, client: int, gpu: int, size: int) -> None:
    """A device on `gpu` (0xA0) in `client` and `size` bytes of video memory (0xC0) on it."""
    _, out, _ = await t.alloc(ctl, client, client, 0x80,
                              t.new("NV0080_ALLOC_PARAMETERS", deviceId=gpu), new=0xA0)
    assert out.status == nvs.NV_OK
    mem = t.new("NV_MEMORY_ALLOCATION_PARAMS", owner=client, flags=0x1C101, attr=0x18000000,
                size=size, alignment=2 << 20)
    _, out, _ = await t.alloc(ctl, client, 0xA0, 0x40, mem, new=0xC0)
    assert out.status == nvs.NV_OK


async def free_client(t: InProcTenant, ctl: int, client: int) -> int:
    v = t.new("NVOS00_PARAMETERS", hRoot=client, hObjectParent=0, hObjectOld=client)
    _, out, _ = await t.esc(ctl, "NV_ESC_RM_FREE", v)
    return out.status


async def test_the_three_views_agree_through_every_change(inproc_broker):
    broker = inproc_broker(POLICY)
    alice, bob = InProcTenant(broker, "alice", pid=1001), InProcTenant(broker, "bob", pid=1002)
    a = broker.tenants["alice"]
    ctl1, ctl2 = await alice.open(NodeKind.CTL), await alice.open(NodeKind.CTL)
    c1, c2, c3 = (await root_client(alice, ctl1), await root_client(alice, ctl2),
                  await root_client(alice, ctl2))
    await memory(alice, ctl1, c1, 0, 64 * MiB)
    await memory(alice, ctl2, c2, 0, 128 * MiB)
    bctl = await bob.open(NodeKind.CTL)
    b1 = await root_client(bob, bctl)
    s1, s2, sb = alice.fds[ctl1], alice.fds[ctl2], bob.fds[bctl]
    assert views(broker) == {c1: ("alice", s1), c2: ("alice", s2), c3: ("alice", s2),
                             b1: ("bob", sb)}
    assert a.used() == {0: 192 * MiB}

    # What the registry says is what the refusals go by: another tenant's client handle is
    # answered as a duplicate (root alloc) or as no client at all (anything else).
    _, out, _ = await bob.alloc(bctl, 0, 0, 0x41, new=c1)
    assert out.status == nvs.NV_ERR_INSERT_DUPLICATE_NAME
    _, out, _ = await bob.alloc(bctl, c1, c1, 0x80,
                                bob.new("NV0080_ALLOC_PARAMETERS", deviceId=1), new=0xA5)
    assert out.status == nvs.NV_ERR_INVALID_CLIENT
    assert len(views(broker)) == 4

    # An export into a third file: the books' holder of its slots is a client of that file.
    xfd = await alice.open(NodeKind.CTL)
    sx = alice.fds[xfd]
    rep, out, _ = await alice.control(ctl1, c1, c1, EXPORT_OBJECTS_TO_FD, fd=xfd, hDevice=0xA0,
                                      maxObjects=4, numObjects=1, index=1, objects=[0xC0])
    assert rep.errno == 0 and out.status == nvs.NV_OK
    [holder] = set(views(broker)) - {c1, c2, c3, b1}
    assert views(broker)[holder] == ("alice", sx)
    assert broker.clients.owner(holder) == "alice" and broker.clients.of_session(sx) == {holder}

    # RM_FREE of a root client: gone from all three, its memory given back.
    assert await free_client(alice, ctl2, c2) == nvs.NV_OK
    assert set(views(broker)) == {c1, c3, b1, holder}
    assert broker.clients.owner(c2) is None and c2 not in a.clients
    assert broker.clients.of_session(s2) == {c3}
    assert a.used() == {0: 64 * MiB}
    # ... after which the handle is nobody's: naming it is refused as not this tenant's.
    _, out, _ = await alice.alloc(ctl2, c2, c2, 0x80,
                                  alice.new("NV0080_ALLOC_PARAMETERS", deviceId=0), new=0xA6)
    assert out.status == nvs.NV_ERR_INVALID_CLIENT

    # Closing a file frees the clients made through it, and only those; the export slot's
    # holder keeps the 64 MiB (the driver's hidden client holds it) until its file closes.
    await broker.release(ReleaseRequest(session=s1))
    assert set(views(broker)) == {c3, b1, holder}
    assert broker.clients.of_session(s1) == frozenset()
    assert a.used() == {0: 64 * MiB}
    await broker.release(ReleaseRequest(session=sx))
    assert set(views(broker)) == {c3, b1}
    assert a.used() == {0: 0}

    # The tenant's process is killed: the kernel closes all its files, and with them goes
    # everything it held; the other tenant keeps its own.
    c4 = await root_client(alice, ctl2)
    await memory(alice, ctl2, c4, 0, 32 * MiB)
    for sid in list(a.sessions):
        await broker.release(ReleaseRequest(session=sid))
    assert views(broker) == {b1: ("bob", sb)}
    assert a.clients == {} and a.used() == {0: 0} and a.sessions == {}

    # A tenant removed from the policy keeps its clients (under "bob (revoked)", still bob's)
    # until its files close.
    broker.apply_policy(load_policy_text(two_h200(ALICE)))
    assert "bob (revoked)" in broker.tenants
    assert views(broker) == {b1: ("bob", sb)}
    await broker.release(ReleaseRequest(session=sb))
    assert views(broker) == {} and len(broker.clients) == 0


async def test_hand_over_rebuilds_the_registry_and_refuses_books_that_disagree(inproc_broker):
    """The hand-over's format is unchanged (client_owner and each session's clients are still
    written); the successor rebuilds the registry from the tenants' clients, and refuses a
    state whose three records disagree rather than pick one."""
    broker = inproc_broker(POLICY)
    alice, bob = InProcTenant(broker, "alice", pid=1001), InProcTenant(broker, "bob", pid=1002)
    ctl1, ctl2, bctl = (await alice.open(NodeKind.CTL), await alice.open(NodeKind.CTL),
                        await bob.open(NodeKind.CTL))
    c1, b1, c2 = (await root_client(alice, ctl1), await root_client(bob, bctl),
                  await root_client(alice, ctl2))
    await memory(alice, ctl2, c2, 0, 64 * MiB)
    before = views(broker)
    state = json.loads(json.dumps({"broker": handover.export_broker(broker),
                                   "backend": handover.export_emulated(broker.backend)}))
    assert state["broker"]["client_owner"] == [[c1, "alice"], [b1, "bob"], [c2, "alice"]]
    assert {s["id"]: s["clients"] for s in state["broker"]["sessions"]} == {
        alice.fds[ctl1]: [c1], alice.fds[ctl2]: [c2], bob.fds[bctl]: [b1]}

    def successor(broker_state):
        fresh = inproc_broker(POLICY)
        files = handover.import_emulated(fresh.backend, json.loads(json.dumps(state["backend"])))
        handover.import_broker(fresh, broker_state, files)
        return fresh

    fresh = successor(json.loads(json.dumps(state["broker"])))
    assert views(fresh) == before
    assert list(fresh.clients.owners()) == [(c1, "alice"), (b1, "bob"), (c2, "alice")]
    assert fresh.tenants["alice"].used() == {0: 64 * MiB}
    assert json.loads(json.dumps(handover.export_broker(fresh))) == state["broker"]
    # ... and goes on: closing the file frees the client there too.
    await fresh.release(ReleaseRequest(session=alice.fds[ctl2]))
    assert set(views(fresh)) == {c1, b1}

    for spoil in (lambda s: s["client_owner"].__setitem__(0, [c1, "bob"]),
                  lambda s: s["client_owner"].pop(),
                  lambda s: s["sessions"][0]["clients"].append(b1)):
        bad = json.loads(json.dumps(state["broker"]))
        spoil(bad)
        with pytest.raises(handover.HandoverError, match="exported books disagree"):
            successor(bad)


def test_nothing_else_writes_the_client_books():
    """The registry is the only writer: no module of the broker (but objects.py, where it
    lives) adds or removes a client in a tenant's books by hand."""
    import re
    from pathlib import Path

    import devbroker.broker as pkg

    # (self/b/broker.clients is the registry itself; backend.clients the emulator's own)
    write = re.compile(r"(?<!\bself)(?<!\bb)(?<!\bbroker)(?<!\bbackend)\.clients"
                       r"(\[[^\]]*\]\s*=[^=]|\.(pop|popitem|add|discard|clear|setdefault|"
                       r"update|remove)\(|\s*=[^=])")
    found = [f"{path.name}:{n}: {line.strip()}"
             for path in sorted(Path(pkg.__path__[0]).glob("*.py")) if path.name != "objects.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if write.search(line)]
    assert found == []


async def test_squatting_the_drivers_next_client_handles_fails_no_one_and_is_recorded(
        inproc_broker, tmp_path):
    """The driver numbers the client handles it chooses in order (0xc1d00001, ...). A tenant
    that allocates root clients with the next few of those handles used to make another
    tenant's root client (asked for with handle 0, as NVML and CUDA ask) fail with a
    duplicate name, unrecorded. The emulator now skips handles in use as the driver's
    search does, and the squat is in the audit log."""
    broker = inproc_broker(POLICY)
    bob, alice = InProcTenant(broker, "bob", pid=5001), InProcTenant(broker, "alice", pid=5002)
    bctl = await bob.open(NodeKind.CTL)
    squatted = [0xC1D00000 | n for n in range(1, 9)]
    for h in squatted:
        _, out, _ = await bob.alloc(bctl, 0, 0, 0x41, new=h)
        assert out.status == nvs.NV_OK and out.hObjectNew == h
    actl = await alice.open(NodeKind.CTL)
    rep, out, _ = await alice.alloc(actl, 0, 0, 0x41)
    assert rep.errno == 0 and out.status == nvs.NV_OK, out
    assert out.hObjectNew not in squatted and out.hObjectNew in broker.tenants["alice"].clients
    squats = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()
              if '"client-squat"' in x]
    assert [r["handle"] for r in squats] == [f"{h:#x}" for h in squatted]
    assert {r["tenant"] for r in squats} == {"bob"}
