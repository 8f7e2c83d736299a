"""Share policies kept inside the tenant (NV_ESC_RM_SHARE, and the inherited policy a client
gives its future objects: NV0000_CTRL_CMD_CLIENT_SET_INHERITED_SHARE_POLICY).

Why (found on the H200, 2026-12-02; docs/security.md, "An escape through the driver's share
policies"): an object's share policy is what the driver checks when a client of *another*
process duplicates it, and the broker is not the only door to such a duplicate. UVM_MAP_EXTERNAL_ALLOCATION (and the other
UVM calls that take RM handles) duplicate the named client's object into UVM's own client
inside the kernel, under the same share check, and those calls run in the tenant's process
(calls the kernel runs alone, or continued, which a racing thread can rewrite). So memory a
victim shared with RS_SHARE_TYPE_ALL — what CUDA's legacy IPC handles do — could be mapped by
any other tenant that names the victim's client and memory handles (the escape harness's
`uvm-external-foreign` escaped on the H200 with the policy passed through). The broker
therefore never lets a policy that reaches beyond the tenant get to the driver:

* grants that reach clients of other processes the broker cannot tell apart from other
  tenants' — RS_SHARE_TYPE_ALL (any client), RS_SHARE_TYPE_OS_SECURITY_TOKEN (any client of
  the same user, and tenants may share a uid) — are *confined*: the broker answers NV_OK,
  keeps the grant in its own books (RmObject.tenant_share) and gives it, at the moment one of
  the tenant's own clients duplicates the object through the broker (RM_DUP_OBJECT, already
  refused between tenants), as a grant naming exactly that client (RS_SHARE_TYPE_CLIENT,
  composed with the object's other policies) — `grant_for_dup`. CUDA IPC between the
  tenant's processes goes on working; no other client is ever named;
* RS_SHARE_TYPE_CLIENT naming a client that is not the tenant's, RS_SHARE_TYPE_FM_CLIENT (the
  fabric manager, a host service) and unknown types are refused;
* what grants nothing to another process passes unchanged: revocations and REQUIRE
  conditions (the driver's rule: a right needs at least one allowing policy that matches,
  and REQUIRE policies only narrow), RS_SHARE_TYPE_PID (the driver compares the source
  client's process with the other client's, or with the calling process: same process only),
  SMC_PARTITION and GPU (grant only as REQUIRE conditions), NONE, and CLIENT naming one of the
  tenant's own clients.
A broad *inherited* policy (every future object of the client shared) is refused: CUDA sets
only PID policies there (the recorded PyTorch trace), and confining it would need the books
to follow every later allocation of the client.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from devbroker.abi import status as nvstatus
from devbroker.abi.nodes import NodeKind
from devbroker.broker.effects import Blocking, Steps

# rs_access.h (driver headers)
TYPE_NONE, TYPE_ALL, TYPE_OS_SECURITY_TOKEN, TYPE_CLIENT, TYPE_PID = 0, 1, 2, 3, 4
TYPE_SMC_PARTITION, TYPE_GPU, TYPE_FM_CLIENT = 5, 6, 7
ACTION_REVOKE, ACTION_REQUIRE, ACTION_COMPOSE = 1, 2, 4
ACCESS_DUP_OBJECT = 1 << 0  # RS_ACCESS_DUP_OBJECT, bit 0 of the mask's first limb

# Grants that reach clients of other processes which may be other tenants': confined.
BROAD = {TYPE_ALL: "RS_SHARE_TYPE_ALL (every client)",
         TYPE_OS_SECURITY_TOKEN: "RS_SHARE_TYPE_OS_SECURITY_TOKEN (every client of the same "
                                 "user: tenants may share a uid)"}
# Grants nothing to another process (see the module's docstring).
HARMLESS = {TYPE_NONE, TYPE_PID, TYPE_SMC_PARTITION, TYPE_GPU}


@dataclass(frozen=True)
class Verdict:
    """What the broker does with one policy: "pass" it to the driver, "confine" it (books
    only), or "refuse" it (`why`)."""
    action: str
    why: str = ""


def judge(policy: Any, own_client: Any) -> Verdict:
    """`policy`: a decoded RS_SHARE_POLICY (the broker's private copy); `own_client(h)`:
    True when h is one of the tenant's clients."""
    kind, action = int(policy.type), int(policy.action)
    if action & (ACTION_REVOKE | ACTION_REQUIRE):
        return Verdict("pass")  # takes a grant away, or narrows: grants nothing
    if kind in HARMLESS:
        return Verdict("pass")
    if kind == TYPE_CLIENT:
        if own_client(int(policy.target)):
            return Verdict("pass")
        return Verdict("refuse", f"RS_SHARE_TYPE_CLIENT naming client {int(policy.target):#x}, "
                                 "which is not this tenant's")
    if kind in BROAD:
        return Verdict("confine", BROAD[kind])
    if kind == TYPE_FM_CLIENT:
        return Verdict("refuse", "RS_SHARE_TYPE_FM_CLIENT (the fabric manager, a host service)")
    return Verdict("refuse", f"share type {kind} (unknown)")


def judge_for(b: Any, s: Any, policy: Any) -> Verdict:
    """`judge` for session `s`'s tenant: its clients are the ones the registry gives it."""
    return judge(policy, lambda h: b.clients.owner(h) == s.tenant.name)


def access_mask(policy: Any) -> int:
    limbs = list(policy.accessMask.limbs)
    return int(limbs[0]) if limbs else 0


def grant_for_dup(b: Any, s: Any, req: Any, src: Any, handle: int, to_client: int) -> Steps:
    """Before the broker makes RM_DUP_OBJECT of `handle` (client `src`, whose object the tenant
    shared broadly: confined in the books) for the tenant's client `to_client`: a grant of the
    duplicate right to exactly that client, composed with the object's other policies, sent
    on the source client's own ctl file (the driver validates a client through the file it was
    allocated on). Returns the driver's status (None when the file could not be had); the
    caller's duplicate then meets the driver's own check either way."""
    from devbroker.broker.compute import lend_tenant_file

    src_session = b.sessions.get(src.session)
    if src_session is None or src_session.closed:
        return None
    abi = b.abi_of(src_session)
    spec = abi.struct("NVOS57_PARAMETERS")
    value = spec.decode(bytes(spec.size)).replace(
        hClient=src.handle, hObject=handle,
        sharePolicy={"target": to_client, "accessMask": {"limbs": [ACCESS_DUP_OBJECT]},
                     "type": TYPE_CLIENT, "action": ACTION_COMPOSE})
    call = abi.decode_ioctl(NodeKind.CTL, abi.escape_cmd("NV_ESC_RM_SHARE", spec.size),
                            value.encode())
    lent, use = None, (req if src_session is s else None)
    if use is None and getattr(src_session.file, "runs_in_caller", False):
        # The exporter's own driver file: no call of its lends it now (compute shares take a
        # group's file the same way).
        lent = yield Blocking(lend_tenant_file, (src_session,), s.tenant.name,
                              f"find the file of client {src.handle:#x}")
        if lent is None:
            return None
        use = lent
    try:
        result = yield from b._call_backend(src_session, call, req=use)
    finally:
        if lent is not None:
            lent.close()
    if result.errno:
        return None
    return abi.decode_ioctl(NodeKind.CTL, call.cmd, result.arg).value.status


def inherited_policy(ctx: Any, params: Any) -> Any:
    """The pre hook of NV0000_CTRL_CMD_CLIENT_SET_INHERITED_SHARE_POLICY (rules.CONTROLS): the
    policy every later object of the client starts with. Only what grants nothing beyond the
    tenant passes (CUDA sets PID policies here); a broad one is refused, not confined (the
    books would have to follow every later allocation of the client)."""
    from devbroker.broker.refusal import Refusal

    b, s = ctx.broker, ctx.session
    verdict = judge_for(b, s, params.sharePolicy)
    if verdict.action != "pass":
        why = verdict.why or ""
        raise Refusal(f"NV0000_CTRL_CMD_CLIENT_SET_INHERITED_SHARE_POLICY: {why}: a share "
                      "policy may not reach beyond the tenant",
                      status=nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS,
                      what="NV0000_CTRL_CMD_CLIENT_SET_INHERITED_SHARE_POLICY")
    return params
