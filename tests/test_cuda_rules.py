"""Every call of the real PyTorch / CUDA 13 and pynvml traffic (the shared H200 traces,
driver 580.159.04) is decided by the rule tables the way the seccomp front end with real
driver files needs it: allowed and executable by the broker on private copies, or one of the
calls the driver binds to the caller (with why a racing rewrite stays inside the policy), or
refused for a reason CUDA survives. This is the table-level half of "CUDA runs through
devbroker"; the run itself is on the lent H200 (docs/hardware.md, "The CUDA run")."""
from __future__ import annotations

import collections

import pytest

from devbroker.abi import nvtrace, registry
from devbroker.abi.nvtrace import RecordType
from devbroker.abi.traceview import TraceDecoder
from devbroker.backends.base import DriverCall
from devbroker.backends.real import Unrelayable, prepare_ioctl
from devbroker.backends.tenantfile import FdRef
from devbroker.broker import allow
from devbroker.broker.handlers import embedded_buffers

ABI = registry.get("580.159.04")
ROOT = frozenset({0x0, 0x41})
# Refused, and CUDA/NVML go on without them: MIG capability sessions need the cap nodes,
# which no tenant gets (docs/security.md).
REFUSED_AND_SURVIVED = {("class", 0xC639), ("class", 0xC640)}


def _calls(path):
    d = TraceDecoder(ABI)
    for rec in nvtrace.read_file(path):
        ev = d.decode(rec)
        if rec.type == RecordType.IOCTL and ev.call_in is not None:
            yield ev


def _decide(ev) -> tuple[str, object]:
    call = ev.call_in
    rule = allow.escape_rule(call)
    if rule is None:
        return "refused", ("escape", call.name)
    v = call.value
    cls = None
    if call.name == "NV_ESC_RM_ALLOC":
        cls = v.hClass
        if cls in ROOT:
            return "root", None
        if allow.class_rule(cls) is None:
            return "refused", ("class", cls)
    if call.name == "NV_ESC_RM_ALLOC_MEMORY":
        cls = v.params.hClass
        if allow.class_rule(cls) is None:
            return "refused", ("class", cls)
    if call.name == "NV_ESC_RM_CONTROL":
        if v.cmd in allow.ANSWERED_CONTROLS:
            return "answered-or-relayed", v.cmd
        if allow.control_rule(v.cmd) is None:
            return "refused", ("control", v.cmd)
    if allow.in_caller_reason(call, cls):
        return "in-caller", call.name
    return "broker", call.name


@pytest.fixture(scope="module", params=["torch", "nvml"])
def trace(request, traces_dir):
    return traces_dir / f"h200-580.159.04-{request.param}.nvtrace"


def test_every_call_is_decided_and_only_survivable_ones_are_refused(trace):
    verdicts = collections.Counter()
    refused = set()
    for ev in _calls(trace):
        verdict, what = _decide(ev)
        verdicts[verdict] += 1
        if verdict == "refused":
            refused.add(what)
    assert refused <= REFUSED_AND_SURVIVED, refused
    assert verdicts["broker"] > verdicts["in-caller"] > 0


def test_calls_the_broker_executes_carry_every_pointer(trace):
    """The broker runs these on its own duplicate of the tenant's file with private copies:
    every pointer the driver would follow must be one the broker copies (no call would be
    answered NOT_SUPPORTED for an uncarried pointer)."""
    failed = collections.Counter()
    for ev in _calls(trace):
        if _decide(ev)[0] not in ("broker", "answered-or-relayed"):
            continue
        emb = {}
        if ev.nested_in is not None:
            emb = {n: bytearray(size) for n, size in embedded_buffers(ABI, ev.nested_in)}
        nested = ev.nested_in.encode() if ev.nested_in is not None else None
        try:
            prepare_ioctl(FdRef(3), DriverCall(ev.call_in, nested, {}, abi=ABI, embedded=emb))
        except Unrelayable as e:
            failed[str(e)] += 1
    assert not failed, failed


def test_every_call_that_runs_in_the_tenant_says_why_a_race_cannot_escape():
    rows = [(n, r) for n, r in allow.ESCAPES.items() if r.in_caller]
    rows += [(hex(c), r) for c, r in allow.CLASSES.items() if r.in_caller]
    assert rows
    for name, r in rows:
        assert r.race.strip(), f"{name}: no race reasoning"
    # What CUDA needs from the caller itself (BRIEF §8; measured on the H200).
    for name in ("NV_ESC_RM_MAP_MEMORY", "UVM_INITIALIZE", "UVM_REGISTER_GPU_VASPACE",
                 "UVM_MAP_EXTERNAL_ALLOCATION", "NV_ESC_ALLOC_OS_EVENT"):
        assert allow.ESCAPES[name].in_caller, name
    assert "NV_ESC_RM_ALLOC_MEMORY" in allow.CLASSES[0x71].in_caller_via
    # ... and what it must never get to run unchecked in itself: allocations of device
    # memory, controls, frees are the broker's.
    for name in ("NV_ESC_RM_CONTROL", "NV_ESC_RM_ALLOC", "NV_ESC_RM_FREE",
                 "NV_ESC_REGISTER_FD", "NV_ESC_CARD_INFO"):
        assert not allow.ESCAPES[name].in_caller, name
    assert not allow.CLASSES[0x40].in_caller
