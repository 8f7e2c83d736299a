"""The rule tables (broker/rules.py): one typed row per call, handlers as functions, fd
fields from the ABI, the emulator's handlers on the rows, `simple_control`, and that a new
control is one row plus its functions. Driven through the in-process broker (conftest's
inproc_broker: no root, no FUSE)."""
from __future__ import annotations

import dataclasses
import types

import pytest

from devbroker.abi import registry
from devbroker.abi import status as nvs
from devbroker.backends.emulated import EmulatedBackend
from devbroker.backends.emulated_controls import CONTROL_HANDLERS
from devbroker.broker import handlers, rewrite, rules
from devbroker.broker.refusal import Refusal
from devbroker.testing.inproc import InProcTenant
from devbroker.testing.policies import one_h200, tenant

V580 = "580.159.04"
# What the escape rows listed by hand before the fields came from the ABI's fd roles.
FD_FIELDS_BEFORE = {
    "NV_ESC_REGISTER_FD": ("ctl_fd",), "NV_ESC_ALLOC_OS_EVENT": ("fd",),
    "NV_ESC_FREE_OS_EVENT": ("fd",), "NV_ESC_RM_MAP_MEMORY": ("fd",),
    "NV_ESC_RM_ALLOC_MEMORY": ("fd",), "UVM_MM_INITIALIZE": ("uvmFd",),
}
MC_GET_ARCH_INFO = 0x20801701  # an allowed, emulated control with plain parameters
GPU_QUERY_MODE = 0x20800128  # not on the allowlist: {mode}


def _spec(abi, name: str):
    if name.startswith("UVM_"):
        op = next(o for o in abi.uvm_cmds.values() if o.name == name)
    else:
        op = abi.escape(name)
    return op.params if op is not None else None


def test_rows_are_frozen_records_with_function_handlers():
    for table in (rules.ESCAPES, rules.UVM_COMMANDS):
        for name, row in table.items():
            assert isinstance(row, rules.EscapeRule), name
            assert isinstance(row.handler, types.FunctionType), name
            assert row.handler.__module__ == handlers.__name__, name
    assert all(isinstance(r, rules.ControlRule) for r in rules.CONTROLS.values())
    assert all(isinstance(r, rules.ClassRule) for r in rules.CLASSES.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        rules.CONTROLS[MC_GET_ARCH_INFO].capability = "admin"
    # the UVM commands are in their own table, and nothing is in both
    assert all(n.startswith("UVM_") for n in rules.UVM_COMMANDS)
    assert not set(rules.ESCAPES) & set(rules.UVM_COMMANDS)


@pytest.mark.parametrize("version", registry.versions())
def test_fd_fields_are_the_abis_fd_roles(version):
    abi = registry.get(version)
    for table in (rules.ESCAPES, rules.UVM_COMMANDS):
        for name, row in table.items():
            spec = _spec(abi, name)
            got = row.fd_fields(spec)
            if row.carries_fds:
                assert got == FD_FIELDS_BEFORE[name], (version, name)
                assert all(spec.by_name[f].kind == "fd" for f in got)
            else:
                assert got == (), (version, name)
    assert {n for t in (rules.ESCAPES, rules.UVM_COMMANDS) for n, r in t.items()
            if r.carries_fds} == set(FD_FIELDS_BEFORE)


def test_the_emulators_handlers_are_on_allowed_rows():
    """Every control the emulator models is one a row allows, or
    one the broker sends itself and tenants may not (BROKER_CONTROLS, refused to them)."""
    for cmd in CONTROL_HANDLERS:
        if cmd in rules.BROKER_CONTROLS:
            assert cmd in rules.REFUSED_CONTROLS and cmd not in rules.CONTROLS, hex(cmd)
            continue
        assert cmd in rules.CONTROLS, f"the emulator models {cmd:#x}, which no row allows"


@pytest.mark.parametrize("version", registry.versions())
def test_simple_controls(version):
    abi = registry.get(version)
    simple = {c for c in rules.CONTROLS if rules.simple_control(abi, c)}
    assert simple, version
    for cmd, row in rules.CONTROLS.items():
        assert row.simple == (not (row.pre or row.post or row.relay_if or row.run
                                   or row.charge)), hex(cmd)
        if not row.simple:
            assert cmd not in simple, hex(cmd)
    for cmd in simple:
        rule = rules.control_rule(cmd, abi)
        assert not rule.driver_flag
        for _path, f, _off in abi.control(cmd).params.walk():
            assert f.kind not in ("ptr", "fd"), hex(cmd)
            assert f.name not in rules.CLIENT_HANDLE_FIELDS, hex(cmd)
            assert f.name not in rewrite.GPU_ID_FIELD_NAMES, hex(cmd)
    assert not rules.simple_control(abi, 0x101)  # embedded buffers (pointers)
    assert not rules.simple_control(abi, 0x21B)  # names a GPU id
    assert not rules.simple_control(abi, 0x20801303)  # post hook: the tenant's quota
    assert not rules.simple_control(abi, 0x2080200A)  # answered by the broker
    assert not rules.simple_control(abi, 0x20800134)  # refused
    assert not rules.simple_control(abi, 0x12345678)  # unknown
    if abi.control(0x3D0B) is not None:  # its own run: fds in the parameters
        assert not rules.simple_control(abi, 0x3D0B)
    assert rules.simple_control(abi, MC_GET_ARCH_INFO)
    # the full path decodes exactly the parameters of the controls that are not simple
    for cmd, row in rules.CONTROLS.items():
        op = abi.control(cmd)
        if op is not None and op.params is not None and not rules.control_rule(cmd, abi).driver_flag:
            assert rules.reads_params(row, op.params) == (cmd not in simple), hex(cmd)
    assert rules.simple_control(abi, MC_GET_ARCH_INFO) is rules.simple_control(abi, MC_GET_ARCH_INFO)


class Recording(EmulatedBackend):
    """The emulator, noting the parameter blocks each control went in and came out with."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[int, bytes, bytes]] = []

    def NV_ESC_RM_CONTROL(self, f, dc):
        result = super().NV_ESC_RM_CONTROL(f, dc)
        self.seen.append((dc.call.value.cmd, bytes(dc.nested or b""), bytes(result.nested or b"")))
        return result


async def test_a_simple_control_is_copied_in_and_out_unchanged(inproc_broker):
    """What `simple` promises the fast lane: the full path hands a simple control's
    parameters to the driver exactly as sent and the driver's answer back exactly."""
    broker = inproc_broker(one_h200(tenant("alice")), backend=Recording())
    t = InProcTenant(broker)
    ctl, client, _dev, sub = await t.subdevice()
    sent = t.params(MC_GET_ARCH_INFO)
    sent = sent.spec.decode(bytes(range(1, sent.spec.size + 1)))  # every byte set, padding too
    rep, out, got = await t.control(ctl, client, sub, MC_GET_ARCH_INFO, params=sent)
    assert rep.errno == 0 and out.status == nvs.NV_OK
    cmd, went_in, came_out = broker.backend.seen[-1]
    assert cmd == MC_GET_ARCH_INFO
    assert went_in == sent.encode()
    assert got.encode() == came_out and came_out != went_in


async def test_a_new_control_is_one_row_and_two_functions(inproc_broker, monkeypatch):
    """docs/design.md's example: a row with a pre hook and a post hook, and the emulator's
    handler for it; nothing else in the broker changes."""
    calls = []

    def refuse_mode_7(ctx, params):  # pre: runs on the tenant's private copy
        calls.append(("pre", ctx.cmd, params.mode))
        if params.mode == 7:
            raise Refusal("mode 7 is not for tenants", status=nvs.NV_ERR_INVALID_ARGUMENT)
        return params.replace(mode=params.mode + 1)

    def hide_high_bits(ctx, out):  # post: runs on the driver's answer
        calls.append(("post", ctx.gpu, ctx.params_in.mode, out.mode))
        return out.replace(mode=out.mode & 0xFF)

    def emulate(backend, client, obj, p):  # the emulator's answer
        calls.append(("emulate", p.mode))
        return nvs.NV_OK, p.replace(mode=0x1200 | p.mode)

    monkeypatch.setitem(rules.CONTROLS, GPU_QUERY_MODE, rules.ControlRule(
        "nvml", "test: a new control", pre=refuse_mode_7, post=hide_high_bits))
    monkeypatch.setitem(CONTROL_HANDLERS, GPU_QUERY_MODE, emulate)
    broker = inproc_broker(one_h200(tenant("alice")))
    t = InProcTenant(broker)
    ctl, client, _dev, sub = await t.subdevice()
    rep, out, got = await t.control(ctl, client, sub, GPU_QUERY_MODE, mode=2)
    assert out.status == nvs.NV_OK and got.mode == 3
    assert calls == [("pre", GPU_QUERY_MODE, 2), ("emulate", 3), ("post", 0, 3, 0x1203)]
    rep, out, got = await t.control(ctl, client, sub, GPU_QUERY_MODE, mode=7)
    assert out.status == nvs.NV_ERR_INVALID_ARGUMENT and got.mode == 7
    assert len(calls) == 4  # refused before the emulator
    assert "mode 7 is not for tenants" in broker.audit.recent[-1]["reason"]
    # without the row, the same call is refused as before
    monkeypatch.delitem(rules.CONTROLS, GPU_QUERY_MODE)
    rep, out, got = await t.control(ctl, client, sub, GPU_QUERY_MODE, mode=2)
    assert out.status == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS and len(calls) == 4


def test_controls_without_a_layout_in_the_callers_abi_are_refused_unless_a_row_says_why():
    """A row allows a control by number; where the caller's driver ABI has no layout for it
    (535 defines neither GET_ACTIVE_DEVICE_IDS nor ASYNC_ATTACH_ID) nothing in its
    parameters can be checked (ASYNC_ATTACH_ID names a GPU id): refused NOT_SUPPORTED, as
    that driver answers. The unpublished GSP queries have no layout anywhere and say why."""
    from devbroker.abi import registry
    from devbroker.abi import status as nvs
    from devbroker.broker import rules

    old, new = registry.get("535.309.01"), registry.get("580.159.04")
    for cmd in (0x288, 0x289):
        rule = rules.control_rule(cmd, old)
        assert not rule.granted(frozenset(rules.CAPABILITIES))
        why, status = rules.control_refusal(rule)
        assert status == nvs.NV_ERR_NOT_SUPPORTED and "defines no layout" in why
        assert rules.control_rule(cmd, new).granted(frozenset(rules.CAPABILITIES))
    gsp = [c for c, r in rules.CONTROLS.items() if new.control(c) is None]
    assert gsp and all(rules.CONTROLS[c].no_layout for c in gsp)
    assert all(rules.control_rule(c, old).granted(frozenset(rules.CAPABILITIES)) for c in gsp)
