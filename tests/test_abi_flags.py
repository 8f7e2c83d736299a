"""Control and class flags from the driver source, and the allowlist that obeys them.

- The tables carry each control's RMCTRL flags (the kernel's exported-method tables), the
  deprecated-control and GSS-legacy rules, and each class's RS flags; OpSpec.driver_refusal
  says what the driver does with an unprivileged caller.
- The flags agree with the real driver: every control and class of the H200 relay
  recording (made by the broker's relay: uid 65534, no capabilities) that the driver
  answered is one the flags let an unprivileged caller send, and the CUDA/NVML recordings
  need nothing the flags reserve.
- The allowlist refuses a control the driver reserves even when a tenant holds the
  capability, with a reason naming the flag and the status the driver would give, through
  the broker core itself; the emulator never sees the call.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from devbroker.abi import nvtrace, registry
from devbroker.abi import status as nvs
from devbroker.abi.nodes import NodeKind
from devbroker.abi.traceview import TraceDecoder
from devbroker.backends.emulated import EmulatedBackend
from devbroker.broker import allow
from devbroker.broker.core import Broker
from devbroker.broker.policy import load_policy_text
from devbroker.testing.inproc import InProcTenant as Tenant
from devbroker.testing.policies import one_h200, tenant

DATA = Path(__file__).parent / "data"
RELAY = DATA / "h200-580.159.04-relay.nvtrace"  # unprivileged: the broker's relay process
RECORDINGS = sorted(DATA.glob("*.nvtrace"))
V580 = "580.159.04"


def test_flags_are_the_drivers():
    abi = registry.get(V580)
    ecc = abi.control(0x20800134)  # SET_ECC_CONFIGURATION
    assert ecc.privileged and ecc.driver_refusal()[0] == "RMCTRL_FLAGS_PRIVILEGED"
    fb = abi.control(0x20801303)
    assert "NON_PRIVILEGED" in fb.driver_flags and fb.driver_refusal() is None
    internal = abi.control(0x730157)  # NV0073_CTRL_CMD_SYSTEM_INTERNAL_ALLOCATE_DISPLAY_BANDWIDTH
    assert internal.driver_refusal()[0] == "RMCTRL_FLAGS_INTERNAL"
    kernel_only = abi.control(0x410122)  # NV0041_CTRL_CMD_MAP_MEMORY_FOR_GPU_ACCESS: flags 0
    assert kernel_only.driver_flags == frozenset()
    assert kernel_only.driver_refusal()[0] == "RMCTRL_FLAGS_KERNEL_PRIVILEGED"
    # a deprecated control runs as its V2 control, with the V2's flags
    dep = abi.control(0x101)
    assert {"DEPRECATED_V2", "NON_PRIVILEGED"} <= dep.driver_flags
    assert registry.raw_tables(V580)["DEPRECATED"][0x101] == 0x13E
    # GSS legacy numbers: 0x8000 forwarded to GSP; with 0xc000 only for root
    assert abi.control_op(0x20809064).driver_refusal() is None
    priv = abi.control_op(0x2080D001)
    assert priv.name == "NV2080_CTRL_CMD_CLK_LEGACY_PRIVILEGED_UNPUBLISHED_01"
    assert priv.driver_refusal()[0] == "RM_GSS_LEGACY_MASK_PRIVILEGED"
    # a published control the kernel has no export entry for: no flags to act on
    assert "NO_EXPORT_ENTRY" in abi.control(0x20808513).driver_flags
    assert abi.control(0x20808513).driver_refusal() is None
    # classes: RS flags of resource_list.h; clients are made without a class check
    assert abi.rm_class(0x40).driver_refusal() is None
    assert abi.rm_class(0x41).driver_refusal() is None and "ROOT_OBJECT" in \
        abi.rm_class(0x41).driver_flags
    # the brief's count: exported controls with RMCTRL_FLAGS_PRIVILEGED at 580.142
    raw = registry.raw_tables(V580)["CONTROLS"]
    assert sum(1 for *_, f in raw.values() if f and "PRIVILEGED" in f) == 264


def _recorded(path: Path):
    abi = registry.get(V580)
    dec = TraceDecoder(abi)
    for rec in nvtrace.read_file(str(path)):
        ev = dec.decode(rec)
        if rec.type != nvtrace.RecordType.IOCTL or ev.error is not None or rec.err:
            continue
        call, out = ev.call_in, (ev.call_out or ev.call_in).value
        if call.name == "NV_ESC_RM_CONTROL":
            yield "control", call.value.cmd, out.status
        elif call.name == "NV_ESC_RM_ALLOC":
            yield "class", call.value.hClass, out.status


def test_flags_agree_with_the_real_driver_on_unprivileged_traffic():
    """What the real driver did for the broker's relay (uid 65534, CapEff 0): each call it
    did not refuse for privilege is one whose flags let an unprivileged caller through."""
    abi = registry.get(V580)
    seen = set()
    for kind, num, status in _recorded(RELAY):
        if status == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS:
            continue
        op = abi.control_op(num) if kind == "control" else abi.rm_class(num)
        assert op.driver_refusal() is None, (kind, hex(num), op.name, op.driver_refusal())
        seen.add((kind, num))
    assert len(seen) > 40


@pytest.mark.parametrize("rec", RECORDINGS, ids=lambda p: p.name)
def test_real_cuda_and_nvml_traffic_needs_nothing_the_driver_reserves(rec):
    abi = registry.get(V580)
    calls = list(_recorded(rec))
    assert calls
    for kind, num, _status in calls:
        op = abi.control_op(num) if kind == "control" else abi.rm_class(num)
        assert op.driver_refusal() is None, (rec.name, kind, hex(num), op.name)
        if kind == "control" and allow.control_rule(num) is not None:
            assert allow.control_rule(num, abi).granted(frozenset(allow.CAPABILITIES))


def test_allowlisted_controls_the_driver_reserves_are_refused_naming_the_flag():
    # 0x208001b2 is GET_RECOVERY_ACTION at 580 but an INTERNAL control at 535
    old, new = registry.get("535.309.01"), registry.get(V580)
    rule = allow.control_rule(0x208001B2, old)
    assert rule is not None and not rule.granted(frozenset(allow.CAPABILITIES))
    reason, status = allow.control_refusal(rule)
    assert "RMCTRL_FLAGS_INTERNAL" in reason and status == nvs.NV_ERR_NOT_SUPPORTED
    assert allow.control_rule(0x208001B2, new).granted(frozenset({"nvml"}))
    # no allowlisted control is reserved by the driver at 580 (the H200's driver)
    for cmd in allow.CONTROLS:
        assert allow.control_rule(cmd, new).driver_flag == "", hex(cmd)
    for cls in allow.CLASSES:
        for v in registry.versions():
            op = registry.get(v).rm_class(cls)
            assert op is not None and op.driver_refusal() is None, (v, hex(cls))


POLICY = one_h200(tenant("alice", memory_quota="1GiB", capabilities=["nvml", "compute"]),
                  uuids=("GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0001",))


class CountingEmulator(EmulatedBackend):
    def __init__(self):
        super().__init__()
        self.controls: list[int] = []

    def NV_ESC_RM_CONTROL(self, f, dc):
        self.controls.append(dc.call.value.cmd)
        return super().NV_ESC_RM_CONTROL(f, dc)


@pytest.mark.parametrize("cmd,flag,status", [
    (0x20800134, "RMCTRL_FLAGS_PRIVILEGED", nvs.NV_ERR_INSUFFICIENT_PERMISSIONS),
    (0x410122, "RMCTRL_FLAGS_KERNEL_PRIVILEGED", nvs.NV_ERR_INSUFFICIENT_PERMISSIONS),
    (0x2080D001, "RM_GSS_LEGACY_MASK_PRIVILEGED", nvs.NV_ERR_INSUFFICIENT_PERMISSIONS),
])
async def test_the_broker_refuses_a_reserved_control_a_policy_would_allow(monkeypatch, cmd,
                                                                         flag, status):
    """Put a control the driver reserves on the allowlist under a capability the tenant
    holds: the broker still refuses it, with the driver's status and the flag in the audit
    reason, and the backend never sees it."""
    monkeypatch.setitem(allow.CONTROLS, cmd, allow.ControlRule("nvml", "test: allowlisted"))
    backend = CountingEmulator()
    broker = Broker(load_policy_text(POLICY, "test"), backend)
    t = Tenant(broker)
    ctl = await t.open(NodeKind.CTL)
    _, out, _ = await t.alloc(ctl, 0, 0, 0x41)
    client = out.hObjectNew
    _, out, _ = await t.alloc(ctl, client, client, 0x80,
                              t.new("NV0080_ALLOC_PARAMETERS", deviceId=0), new=0xA0)
    _, out, _ = await t.alloc(ctl, client, 0xA0, 0x2080, t.new("NV2080_ALLOC_PARAMETERS"),
                              new=0xB0)
    assert out.status == nvs.NV_OK
    hobj = client if cmd >> 16 in (0, 0x41) else 0xB0
    spec = registry.get(V580).control_op(cmd).params
    size = spec.size if spec is not None else 8
    p = t.new("NV0000_CTRL_GPU_GET_ATTACHED_IDS_PARAMS") if spec is None else spec.zero()
    v = t.new("NVOS54_PARAMETERS", hClient=client, hObject=hobj, cmd=cmd, paramsSize=size)
    rep, out, _ = await t.esc(ctl, "NV_ESC_RM_CONTROL", v, p, "params")
    assert out.status == status
    assert cmd not in backend.controls
    denials = [e for e in broker.audit.recent if e.get("event") == "deny"]
    assert denials and flag in denials[-1]["reason"], denials[-1:]
    assert "whatever the policy grants" in denials[-1]["reason"]
    # the same tenant's allowed controls still reach the backend
    _, _, ids = await t.control(ctl, client, client, 0x201)
    assert 0x201 in backend.controls and ids.gpuIds[0] != 0xFFFFFFFF


def test_security_doc_carries_the_generated_allowlist():
    from devbroker.broker.allowdoc import allowlist_markdown

    doc = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    gen = allowlist_markdown()
    assert gen in doc, "docs/security.md is out of date: paste `devbroker policy allowlist`"
    assert "RMCTRL_FLAGS_PRIVILEGED" in gen and "refused whatever a policy grants" in gen
