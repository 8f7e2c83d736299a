"""Record mode (devbroker run --record): what the backend was asked, in the nvtrace format.

1. A tenant session against the emulated backend, driven through the broker core itself
   (the calls NVML and the probe make, plus refused ones), recorded and read back with the
   trace decoder: every record decodes, nothing unknown, refused calls absent.
2. Replay of the session recorded on the H200 through the real backend
   (tests/data/h200-580.159.04-relay.nvtrace, scripts/gpu/run-h200.sh, docs/hardware.md):
   every record decodes, every call in it passes the allowlists, and none of the refused
   operations the run sent (ECC controls, registry access, debugger class, SYS_PARAMS)
   reached the driver.
"""
from __future__ import annotations

import errno
from pathlib import Path

from devbroker.abi import nvtrace, registry
from devbroker.abi import status as nvs
from devbroker.abi.nodes import NodeKind
from devbroker.abi.traceview import TraceDecoder, stats
from devbroker.backends.emulated import EmulatedBackend
from devbroker.broker import allow
from devbroker.broker.core import Broker
from devbroker.broker.interface import ReleaseRequest
from devbroker.broker.policy import load_policy_text
from devbroker.broker.record import Recorder
from devbroker.testing.inproc import InProcTenant as Tenant
from devbroker.testing.policies import one_h200, tenant

ABI = registry.get("580.159.04")
H200 = Path(__file__).parent / "data" / "h200-580.159.04-relay.nvtrace"
REFUSED_CONTROLS = {0x20800134, 0x20800136, 0x20803403}
REFUSED_ESCAPES = {"NV_ESC_RM_ACCESS_REGISTRY", "NV_ESC_SYS_PARAMS", "NV_ESC_RM_I2C_ACCESS"}
REFUSED_CLASSES = {0x83DE}
# The tables hold every published control: what nvidia-smi 580 sent on the
# H200 that they cannot lay out is only controls NVIDIA publishes no header for (named by
# their range, stats' `unpublished`).
KNOWN_ABI_GAPS: set = set()

POLICY = one_h200(tenant("alice", memory_quota="1GiB", capabilities=["nvml", "compute"]),
                  uuids=("GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0001",))


async def test_record_an_emulated_session_and_read_it_back(tmp_path):
    path = tmp_path / "session.nvtrace"
    rec = Recorder(path)
    broker = Broker(load_policy_text(POLICY, "test"), EmulatedBackend(), recorder=rec)
    t = Tenant(broker)
    ctl = await t.open(NodeKind.CTL)
    rep, out, _ = await t.esc(ctl, "NV_ESC_CHECK_VERSION_STR", t.new(
        "nv_ioctl_rm_api_version_t", versionString=b"580.159.04".ljust(64, b"\0")))
    assert rep.errno == 0
    _, out, _ = await t.alloc(ctl, 0, 0, 0x41)
    client = out.hObjectNew
    _, _, ids = await t.control(ctl, client, client, 0x201)
    gid = [i for i in ids.gpuIds if i != 0xFFFFFFFF][0]
    gpu = await t.open(NodeKind.GPU, 0)
    rep, _, _ = await t.esc(gpu, "NV_ESC_REGISTER_FD", t.new("nv_ioctl_register_fd_t",
                                                              ctl_fd=ctl))
    assert rep.errno == 0
    _, out, _ = await t.alloc(ctl, client, client, 0x80,
                              t.new("NV0080_ALLOC_PARAMETERS", deviceId=0), new=0xA0)
    _, out, _ = await t.alloc(ctl, client, 0xA0, 0x2080, t.new("NV2080_ALLOC_PARAMETERS"),
                              new=0xB0)
    assert out.status == nvs.NV_OK
    mem = t.new("NV_MEMORY_ALLOCATION_PARAMS", owner=client, flags=0x1C101, attr=0x18000000,
                size=64 << 20, alignment=2 << 20)
    _, out, _ = await t.alloc(ctl, client, 0xA0, 0x40, mem, new=0xC0)
    assert out.status == nvs.NV_OK
    # refused by the broker: over quota, an ECC control, a debugger object, registry access
    big = mem.replace(size=4 << 30)
    _, out, _ = await t.alloc(ctl, client, 0xA0, 0x40, big, new=0xC1)
    assert out.status == nvs.NV_ERR_NO_MEMORY
    _, out, _ = await t.control(ctl, client, 0xB0, 0x20800134)
    assert out.status == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
    _, out, _ = await t.alloc(ctl, client, 0xB0, 0x83DE, t.new("NV83DE_ALLOC_PARAMETERS"),
                              new=0xD0)
    assert out.status == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
    rep, _, _ = await t.esc(ctl, "NV_ESC_RM_ACCESS_REGISTRY",
                            t.new("NVOS38_PARAMETERS", hClient=client, hObject=client))
    assert rep.errno == errno.EPERM
    _, out, _ = await t.esc(ctl, "NV_ESC_RM_FREE", t.new("NVOS00_PARAMETERS", hRoot=client,
                                                         hObjectParent=0xA0, hObjectOld=0xC0))
    assert out.status == nvs.NV_OK
    for sid in list(t.fds.values()):
        await broker.release(ReleaseRequest(sid))
    rec.close_file()

    recs = nvtrace.read_file(str(path))
    st = stats(ABI, recs)
    assert st["errors"] == [] and not st["unknown"]
    assert st["records"]["open"] == 2 and st["records"]["ioctl"] == 8
    dec = TraceDecoder(ABI)
    seen = []
    for r in recs:
        ev = dec.decode(r)
        if r.type == nvtrace.RecordType.IOCTL:
            seen.append((ev.call_in.name, ev.op_name))
            assert ev.call_out is not None and r.err == 0
    assert ("NV_ESC_RM_ALLOC", "NV01_MEMORY_LOCAL_USER") in seen
    assert ("NV_ESC_RM_CONTROL", "NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS") in seen
    names = {n for n, _ in seen}
    assert "NV_ESC_RM_ACCESS_REGISTRY" not in names
    assert not any("ECC" in op or "DEBUGGER" in op for _, op in seen)
    # exactly one local-memory allocation reached the backend (the refused one did not)
    assert seen.count(("NV_ESC_RM_ALLOC", "NV01_MEMORY_LOCAL_USER")) == 1
    # the nested buffers were recorded, before and after
    allocs = [r for r in recs if r.type == 2 and (r.cmd & 0xFF) == 0x2B and r.xin]
    assert all(len(r.xin) == len(r.xout) for r in allocs)


def test_h200_recording_decodes_and_passes_the_policy():
    recs = nvtrace.read_file(str(H200))
    st = stats(ABI, recs)
    assert st["errors"] == []
    gaps = set(st["unknown"]) - st["unpublished"]
    assert gaps <= KNOWN_ABI_GAPS, gaps - KNOWN_ABI_GAPS
    assert st["records"]["ioctl"] > 2000 and st["records"]["open"] > 200
    dec = TraceDecoder(ABI)
    caps = frozenset({"nvml", "compute"})
    for r in recs:
        ev = dec.decode(r)
        if r.type != nvtrace.RecordType.IOCTL:
            continue
        c = ev.call_in
        assert c.name not in REFUSED_ESCAPES, f"#{r.offset}: {c.name} reached the driver"
        rule = allow.escape_rule(c)
        assert rule is not None and rule.granted(caps), c.name
        if c.name == "NV_ESC_RM_CONTROL":
            assert c.value.cmd not in REFUSED_CONTROLS
            assert allow.control_rule(c.value.cmd) is not None, hex(c.value.cmd)
        if c.name == "NV_ESC_RM_ALLOC" and c.value.hClass not in (0x0, 0x41):
            assert c.value.hClass not in REFUSED_CLASSES
            assert allow.class_rule(c.value.hClass) is not None, hex(c.value.hClass)


def test_h200_recording_shows_the_quota_refusal_never_reached_the_driver():
    """The run allocated 64 MiB and asked for 17 GiB in a 16 GiB tenant; only the first (and
    the 1 GiB hold) reached the driver, and all of them succeeded there."""
    dec = TraceDecoder(ABI)
    sizes = []
    for r in nvtrace.read_file(str(H200)):
        ev = dec.decode(r)
        if r.type == 2 and ev.op_name == "NV01_MEMORY_LOCAL_USER":
            sizes.append((ev.nested_in.size, ev.call_out.value.status))
    assert (64 << 20, nvs.NV_OK) in sizes and (1 << 30, nvs.NV_OK) in sizes
    assert all(s <= 16 << 30 for s, _ in sizes)
