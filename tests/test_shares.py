"""Share policies kept inside the tenant (broker/shares.py): a broad grant never reaches the
driver, a duplicate by one of the tenant's own clients gets a grant naming that client only,
and a policy naming another tenant's client is refused. In the broker's own process with the
emulated backend (inproc_broker), whose RM_SHARE keeps the policies the driver was given."""
from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest

from devbroker.abi import status as nvs
from devbroker.broker import shares
from devbroker.testing.inproc import InProcTenant
from devbroker.testing.policies import one_h200, tenant

LOCAL_USER, DEVICE = 0x40, 0xA0
CUDA_MEM = dict(owner=0, type=0, flags=0x1C101, attr=0x18000000, size=2 << 20,
                alignment=2 << 20)


def _policy(type_, target=0, mask=1, action=0):
    return NS(type=type_, target=target, accessMask=NS(limbs=[mask]), action=action)


@pytest.mark.parametrize("policy,own,want", [
    (_policy(shares.TYPE_ALL), False, "confine"),
    (_policy(shares.TYPE_OS_SECURITY_TOKEN), False, "confine"),
    (_policy(shares.TYPE_CLIENT, 0xC1D00002), True, "pass"),
    (_policy(shares.TYPE_CLIENT, 0xC1D00002), False, "refuse"),
    (_policy(shares.TYPE_PID, 0xC1D0001F), False, "pass"),  # CUDA's inherited policy
    (_policy(shares.TYPE_FM_CLIENT), False, "refuse"),
    (_policy(9), False, "refuse"),
    (_policy(shares.TYPE_ALL, action=shares.ACTION_REVOKE), False, "pass"),
    (_policy(shares.TYPE_ALL, action=shares.ACTION_REQUIRE), False, "pass"),
    (_policy(shares.TYPE_GPU), False, "pass"),
    (_policy(shares.TYPE_NONE), False, "pass"),
])
def test_each_kind_of_policy_has_one_verdict(policy, own, want):
    assert shares.judge(policy, lambda h: own).action == want


async def _two_processes(broker):
    """alice's two processes, each with its own client, device and subdevice."""
    a = InProcTenant(broker, "alice", pid=4242)
    b = InProcTenant(broker, "alice", pid=4343)
    ctl_a, client_a, _, _ = await a.subdevice()
    ctl_b, client_b, _, _ = await b.subdevice()
    _, out, _ = await a.alloc(ctl_a, client_a, DEVICE, LOCAL_USER,
                              a.new("NV_MEMORY_ALLOCATION_PARAMS", **CUDA_MEM), new=0xD0)
    assert out.status == nvs.NV_OK
    return a, b, (ctl_a, client_a), (ctl_b, client_b)


async def _share(t, ctl, client, obj, **policy):
    v = t.new("NVOS57_PARAMETERS", hClient=client, hObject=obj, sharePolicy=policy)
    rep, out, _ = await t.esc(ctl, "NV_ESC_RM_SHARE", v)
    return rep, out


def _emulated(broker, client, handle):
    return broker.backend.clients[client].objects[handle]


async def test_a_broad_grant_stays_in_the_books_and_a_duplicate_gets_its_own(inproc_broker,
                                                                               tmp_path):
    """CUDA's legacy IPC shares memory with RS_SHARE_TYPE_ALL: the tenant is told NV_OK, the
    driver is given nothing; when the tenant's other process duplicates the memory through
    the broker, the driver is first given a grant of the duplicate right to exactly that
    client (composed with the object's other policies), and the duplicate works."""
    broker = inproc_broker(one_h200(tenant("alice"), tenant("bob")))
    a, b, (ctl_a, client_a), (ctl_b, client_b) = await _two_processes(broker)
    rep, out = await _share(a, ctl_a, client_a, 0xD0, type=shares.TYPE_ALL,
                            accessMask={"limbs": [1]}, action=0)
    assert rep.errno == 0 and out.status == nvs.NV_OK
    assert _emulated(broker, client_a, 0xD0).policies == []  # never passed to the driver
    v = b.new("NVOS55_PARAMETERS", hClient=client_b, hParent=DEVICE, hObject=0xE0,
              hClientSrc=client_a, hObjectSrc=0xD0, flags=0)
    rep, out, _ = await b.esc(ctl_b, "NV_ESC_RM_DUP_OBJECT", v)
    assert rep.errno == 0 and out.status == nvs.NV_OK
    assert _emulated(broker, client_a, 0xD0).policies == [
        (shares.TYPE_CLIENT, client_b, shares.ACCESS_DUP_OBJECT, 0)]
    audit = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert any(r["event"] == "notice" and "RS_SHARE_TYPE_ALL" in r.get("message", "")
               and "kept inside the tenant" in r["message"] for r in audit), audit


async def test_a_grant_to_another_tenants_client_is_refused_own_and_narrow_ones_pass(
        inproc_broker, tmp_path):
    broker = inproc_broker(one_h200(tenant("alice"), tenant("bob")))
    a, _b, (ctl_a, client_a), (_ctl_b, client_b) = await _two_processes(broker)
    bob = InProcTenant(broker, "bob", pid=5151)
    _, bob_client, _, _ = await bob.subdevice()
    rep, out = await _share(a, ctl_a, client_a, 0xD0, type=shares.TYPE_CLIENT,
                            target=bob_client, accessMask={"limbs": [1]}, action=0)
    assert out.status == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
    assert _emulated(broker, client_a, 0xD0).policies == []
    # the tenant's own other client, and a same-process policy, reach the driver as sent
    rep, out = await _share(a, ctl_a, client_a, 0xD0, type=shares.TYPE_CLIENT,
                            target=client_b, accessMask={"limbs": [1]},
                            action=shares.ACTION_COMPOSE)
    assert out.status == nvs.NV_OK
    rep, out = await _share(a, ctl_a, client_a, 0xD0, type=shares.TYPE_PID, target=4242,
                            accessMask={"limbs": [1]}, action=shares.ACTION_COMPOSE)
    assert out.status == nvs.NV_OK
    assert _emulated(broker, client_a, 0xD0).policies == [
        (shares.TYPE_CLIENT, client_b, 1, 0), (shares.TYPE_PID, 4242, 1, 0)]
    denied = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()
              if '"deny"' in x]
    assert any("which is not this tenant's" in r["reason"] for r in denied), denied


async def test_an_inherited_policy_beyond_the_process_is_refused(inproc_broker):
    """NV0000_CTRL_CMD_CLIENT_SET_INHERITED_SHARE_POLICY: CUDA's PID policies pass; a grant
    to every client, which every later object of the client would carry, is refused."""
    broker = inproc_broker(one_h200(tenant("alice")))
    t = InProcTenant(broker, "alice")
    ctl, client, _, _ = await t.subdevice()
    pid_policy = {"target": client, "accessMask": {"limbs": [1]}, "type": shares.TYPE_PID,
                  "action": 0}
    _, out, _ = await t.control(ctl, client, client, 0xD04, sharePolicy=pid_policy)
    assert out.status == nvs.NV_ERR_NOT_SUPPORTED  # the emulator's own answer: it got there
    _, out, _ = await t.control(ctl, client, client, 0xD04,
                                sharePolicy=dict(pid_policy, type=shares.TYPE_ALL))
    assert out.status == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
