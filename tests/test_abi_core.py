"""devbroker.abi: layouts against header numbers, trace decoding, round trips, malformed input."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

from devbroker.abi import (DecodeError, NodeKind, UnknownVersion, iowr, nvtrace, registry,
                           status)
from devbroker.abi.traceview import TraceDecoder, stats

REPO = Path(__file__).resolve().parents[1]
# Copies of ../shared/traces (recorded on the H200), kept in the repository so CI has them.
TRACES = REPO / "tests" / "data"
NVML = TRACES / "h200-580.159.04-nvml.nvtrace"
TORCH = TRACES / "h200-580.159.04-torch.nvtrace"
V580, V535 = "580.159.04", "535.309.01"


def _traces():
    return [NVML, TORCH]


@pytest.fixture(scope="module")
def abi():
    return registry.get(V580)


# ---------------------------------------------------------------- layout parity
# Numbers written down by reading the headers (tags 580.142 and 535.288.01), independent of
# the generated tables: (struct, size, {field: offset}).
HEADER_NUMBERS = {
    V580: [
        ("NVOS54_PARAMETERS", 32, {"hClient": 0, "hObject": 4, "cmd": 8, "flags": 12,
                                   "params": 16, "paramsSize": 24, "status": 28}),
        ("NVOS21_PARAMETERS", 32, {"hClass": 12, "pAllocParms": 16, "paramsSize": 24,
                                   "status": 28}),
        ("NVOS64_PARAMETERS", 48, {"hRoot": 0, "hObjectParent": 4, "hObjectNew": 8, "hClass": 12,
                                   "pAllocParms": 16, "pRightsRequested": 24,
                                   "paramsSize": 32, "flags": 36, "status": 40}),
        ("NVOS00_PARAMETERS", 16, {"hRoot": 0, "hObjectParent": 4, "hObjectOld": 8,
                                   "status": 12}),
        ("nv_ioctl_nvos33_parameters_with_fd", 56, {"params": 0, "fd": 48}),
        ("NVOS33_PARAMETERS", 48, {"hClient": 0, "hDevice": 4, "hMemory": 8, "offset": 16,
                                   "length": 24, "pLinearAddress": 32, "status": 40,
                                   "flags": 44}),
        ("nv_ioctl_nvos02_parameters_with_fd", 56, {"params": 0, "fd": 48}),
        ("NVOS02_PARAMETERS", 48, {"pMemory": 24}),
        ("nv_ioctl_register_fd_t", 4, {"ctl_fd": 0}),
        ("nv_ioctl_card_info_t", 72, {"valid": 0, "gpu_id": 16, "reg_address": 24,
                                      "fb_size": 48, "minor_number": 56, "dev_name": 60}),
        ("nv_ioctl_rm_api_version_t", 72, {"cmd": 0, "reply": 4, "versionString": 8}),
        ("nv_ioctl_xfer_t", 16, {"cmd": 0, "size": 4, "ptr": 8}),
        ("nv_ioctl_sys_params_t", 8, {"memblock_size": 0}),
        ("nv_ioctl_numa_info_t", 560, {}),
        ("nv_ioctl_wait_open_complete_t", 8, {"rc": 0, "adapterStatus": 4}),
        ("NV_MEMORY_ALLOCATION_PARAMS", 128, {"owner": 0, "type": 4, "flags": 8, "attr": 24,
                                              "attr2": 28, "size": 64, "alignment": 72,
                                              "hVASpace": 108}),
        ("NV2080_CTRL_FB_GET_INFO_V2_PARAMS", 1028, {"fbInfoListSize": 0, "fbInfoList": 4}),
        ("NV0000_CTRL_GPU_GET_ATTACHED_IDS_PARAMS", 128, {"gpuIds": 0}),
        ("NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS", 32, {"gpuId": 0}),
        ("NV0080_ALLOC_PARAMETERS", 56, {"deviceId": 0, "hClientShare": 4}),
        ("NV2080_ALLOC_PARAMETERS", 4, {"subDeviceId": 0}),
        ("UVM_INITIALIZE_PARAMS", 16, {"flags": 0, "rmStatus": 8}),
        ("UVM_MM_INITIALIZE_PARAMS", 8, {"uvmFd": 0, "rmStatus": 4}),
        ("UVM_REGISTER_GPU_PARAMS", 40, {"numaEnabled": 16, "numaNodeId": 20, "rmCtrlFd": 24,
                                     "hClient": 28, "hSmcPartRef": 32, "rmStatus": 36}),
    ],
    V535: [
        ("NVOS54_PARAMETERS", 32, {"params": 16, "paramsSize": 24, "status": 28}),
        ("NVOS64_PARAMETERS", 48, {"pAllocParms": 16, "paramsSize": 32, "status": 40}),
        ("nv_ioctl_card_info_t", 72, {"gpu_id": 16, "minor_number": 56}),
        ("nv_ioctl_rm_api_version_t", 72, {"versionString": 8}),
        ("NV2080_CTRL_FB_GET_INFO_V2_PARAMS", 436, {"fbInfoList": 4}),
        ("NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS", 32, {"gpuId": 0}),
        ("NV_MEMORY_ALLOCATION_PARAMS", 120, {"size": 64, "alignment": 72}),
        ("NV0000_CTRL_GPU_GET_PROBED_IDS_PARAMS", 256, {}),
    ],
}


@pytest.mark.parametrize("version", [V580, V535])
def test_layouts_match_header_numbers(version):
    a = registry.get(version)
    for name, size, offsets in HEADER_NUMBERS[version]:
        s = a.struct(name)
        assert s.size == size, (version, name)
        for f, off in offsets.items():
            assert s.by_name[f].offset == off, (version, name, f)


def test_roles_are_declared(abi):
    nvos54 = abi.struct("NVOS54_PARAMETERS")
    p = nvos54.by_name["params"]
    assert (p.kind, p.points_to, p.size_field) == ("ptr", "control", "paramsSize")
    assert abi.struct("nv_ioctl_nvos33_parameters_with_fd").by_name["fd"].kind == "fd"
    assert abi.struct("nv_ioctl_register_fd_t").by_name["ctl_fd"].kind == "fd"
    assert abi.struct("NVOS64_PARAMETERS").by_name["hClass"].kind == "class"
    assert abi.struct("NVOS64_PARAMETERS").fields_of_kind("handle") == [
        "hRoot", "hObjectParent", "hObjectNew"]
    assert "rmCtrlFd" in abi.struct("UVM_REGISTER_GPU_PARAMS").fields_of_kind("fd")


def test_names_and_versions(abi):
    assert set(registry.versions()) >= {V580, V535}
    with pytest.raises(UnknownVersion):
        registry.get("1.2.3")
    assert abi.escape(0x2A).name == "NV_ESC_RM_CONTROL"
    assert abi.escape(200).name == "NV_ESC_CARD_INFO"
    assert abi.control(0x20801303).name == "NV2080_CTRL_CMD_FB_GET_INFO_V2"
    assert abi.rm_class(0x40).name == "NV01_MEMORY_LOCAL_USER"
    assert abi.rm_class(0x40).params.name == "NV_MEMORY_ALLOCATION_PARAMS"
    assert abi.uvm(0x25).name == "UVM_REGISTER_GPU"
    old = registry.get(V535)
    assert abi.escape(218).name == "NV_ESC_WAIT_OPEN_COMPLETE"
    assert old.escape(218) is None  # no such escape in the 535 headers
    assert old.escape(0x5F).name == "NV_ESC_RM_NVLOG_CTRL"
    assert old.control(0x20801303).size == 436 and abi.control(0x20801303).size == 1028


@pytest.mark.parametrize("version", registry.versions())
def test_op_names_are_the_built_specs_names(version):
    """registry.op_names reads names from the tables alone (a broker's start): the same
    names, for the same numbers, as the specs get() builds."""
    a, names = registry.get(version), registry.op_names(version)
    for table, specs in (("escapes", a.escapes), ("controls", a.controls),
                         ("classes", a.classes), ("uvm", a.uvm_cmds)):
        assert names[table] == {k: spec.name for k, spec in specs.items()}, (version, table)
    assert any("_UNPUBLISHED_" in n for n in names["controls"].values())


def test_status_codes():
    assert (status.NV_OK, status.NV_ERR_GENERIC) == (0, 0xFFFF)
    assert status.NV_ERR_INSUFFICIENT_PERMISSIONS == 0x1B
    assert status.NV_ERR_INVALID_ARGUMENT == 0x1F
    assert status.NV_ERR_NO_MEMORY == 0x51
    assert status.NV_ERR_NOT_SUPPORTED == 0x56
    assert status.name(0x51) == "NV_ERR_NO_MEMORY"
    assert status.name(0x12345678) == "NV_STATUS(0x12345678)"
    assert status.code("NV_ERR_INVALID_CLIENT") == status.NV_ERR_INVALID_CLIENT


# ---------------------------------------------------------------- the shared traces
@pytest.mark.parametrize("which", ["nvml", "torch"])
def test_traces_decode_without_unknowns(which, abi):
    path = {"nvml": NVML, "torch": TORCH}[which]
    _traces()
    recs = nvtrace.read_file(str(path))
    s = stats(abi, recs)
    assert s["errors"] == []
    # only controls NVIDIA publishes no header for, each named by its range
    assert set(s["unknown"]) == s["unpublished"], s["unknown"]
    assert all("_UNPUBLISHED_" in k for k in s["unpublished"])
    assert s["escapes"]["NV_ESC_RM_CONTROL"] > 30
    if which == "nvml":
        assert len(s["controls"]) == 25 and len(s["classes"]) == 6
    else:
        assert len(s["controls"]) >= 74 and len(s["classes"]) == 22


@pytest.mark.parametrize("path", ["nvml", "torch"])
def test_exact_round_trip_of_every_argument_and_nested_buffer(path, abi):
    _traces()
    p = {"nvml": NVML, "torch": TORCH}[path]
    dec = TraceDecoder(abi)
    n_nested = 0
    for rec in nvtrace.read_file(str(p)):
        ev = dec.decode(rec)
        if rec.type != nvtrace.RecordType.IOCTL:
            continue
        assert ev.error is None
        assert ev.call_in.encode() == rec.in_
        if rec.out:
            assert ev.call_out.encode() == rec.out
        for nv, buf in ((ev.nested_in, rec.xin), (ev.nested_out, rec.xout)):
            if buf:
                assert nv is not None, (ev.call_in.name, ev.op_name)
                assert nv.encode() == buf
                n_nested += 1
    assert n_nested > 40


def test_fb_info_decodes_known_values(abi):
    _traces()
    dec = TraceDecoder(abi)
    seen = {}
    for rec in nvtrace.read_file(str(NVML)):
        ev = dec.decode(rec)
        if ev.op_name == "NV2080_CTRL_CMD_FB_GET_INFO_V2":
            v = ev.nested_out
            for e in v.fbInfoList[: v.fbInfoListSize]:
                seen[e.index] = e.data
        if ev.op_name == "NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS":
            assert ev.nested_out.gpuIds[0] == 0x6
    assert seen[0x08] == 147221504  # total RAM in KiB (BRIEF §2)


# ---------------------------------------------------------------- typed values
def test_replace_and_encode(abi):
    spec = abi.struct("NV_MEMORY_ALLOCATION_PARAMS")
    v = spec.zero().replace(owner=0xC1D00001, flags=0x1C101, attr=0x18000000, size=64 << 20,
                            alignment=2 << 20)
    b = v.encode()
    assert len(b) == 128
    assert struct.unpack_from("<Q", b, 64)[0] == 64 << 20
    w = spec.decode(b)
    assert (w.size, w.owner, w.alignment) == (64 << 20, 0xC1D00001, 2 << 20)
    assert dict(w)["attr"] == 0x18000000
    fb = abi.struct("NV2080_CTRL_FB_GET_INFO_V2_PARAMS")
    info = fb.by_name["fbInfoList"].elem
    x = fb.zero().replace(fbInfoListSize=1, fbInfoList=[info.zero().replace(index=8, data=42)])
    y = fb.decode(x.encode())
    assert y.fbInfoList[0].index == 8 and y.fbInfoList[0].data == 42 and y.fbInfoList[1].data == 0
    with pytest.raises(ValueError):
        spec.zero().replace(owner=-1)
    with pytest.raises(AttributeError):
        spec.zero().replace(nosuch=1)


def test_padding_bytes_survive_round_trip(abi):
    spec = abi.struct("nv_ioctl_card_info_t")  # has padding after `valid` and after dev_name
    raw = bytes(range(72))
    assert spec.decode(raw).encode() == raw
    assert spec.decode(raw).replace(gpu_id=7).encode()[:16] == raw[:16]


def test_decode_ioctl_and_nested(abi):
    arg = struct.pack("<IIIIQII", 0xC1D00001, 0x5C000003, 0x20801303, 0, 0x7000, 1028, 0)
    call = abi.decode_ioctl(NodeKind.CTL, iowr(0x2A, 32), arg)
    assert (call.kind, call.name, call.value.cmd) == ("rm", "NV_ESC_RM_CONTROL", 0x20801303)
    ref = abi.nested(call)
    assert (ref.ptr, ref.size, ref.field, ref.spec.name) == (
        0x7000, 1028, "params", "NV2080_CTRL_FB_GET_INFO_V2_PARAMS")
    assert call.replace(status=0x51).encode()[28:32] == b"\x51\0\0\0"
    # RM_ALLOC with paramsSize 0 takes the size from the class
    alloc = struct.pack("<IIIIQQIII4x", 1, 1, 2, 0x40, 0x9000, 0, 0, 0, 0)
    c = abi.decode_ioctl(NodeKind.CTL, iowr(0x2B, 48), alloc)
    r = abi.nested(c)
    assert (r.size, r.size_field, r.spec.name) == (128, "", "NV_MEMORY_ALLOCATION_PARAMS")
    # NVOS21 form
    c21 = abi.decode_ioctl(NodeKind.CTL, iowr(0x2B, 32), alloc[:32])
    assert c21.value.spec.name == "NVOS21_PARAMETERS"
    # unknown commands are values, not exceptions
    u = abi.decode_ioctl(NodeKind.CTL, iowr(0x7F, 8), bytes(8))
    assert u.spec is None and u.name.startswith("UNKNOWN(") and u.encode() == bytes(8)
    assert abi.decode_ioctl(NodeKind.UVM, 0x12345, b"").spec is None


# ---------------------------------------------------------------- malformed input
def test_malformed_ioctls_raise_decode_error(abi):
    with pytest.raises(DecodeError) as e:  # buffer shorter than _IOC_SIZE
        abi.decode_ioctl(NodeKind.CTL, iowr(0x2A, 32), bytes(20))
    assert e.value.field == "<arg>" and e.value.offset == 20
    with pytest.raises(DecodeError) as e:  # a size the escape does not accept
        abi.decode_ioctl(NodeKind.CTL, iowr(0x2A, 24), bytes(24))
    assert "not one of" in e.value.reason
    with pytest.raises(DecodeError) as e:  # truncated UVM argument
        abi.decode_ioctl(NodeKind.UVM, 0x25, bytes(10))
    assert e.value.offset == 0 or e.value.field  # names the first missing field
    assert e.value.field == "gpu_uuid" or e.value.offset <= 10
    arg = struct.pack("<IIIIQII", 1, 1, 0x20801303, 0, 0x7000, 1028, 0)
    call = abi.decode_ioctl(NodeKind.CTL, iowr(0x2A, 32), arg)
    with pytest.raises(DecodeError) as e:  # paramsSize beyond the buffer that was read
        abi.decode_nested(call, bytes(100))
    assert e.value.field == "params" and e.value.offset == 100
    bad = struct.pack("<IIIIQII", 1, 1, 0x20801303, 0, 0x7000, 1000, 0)
    with pytest.raises(DecodeError) as e:  # paramsSize != the control's size
        abi.decode_nested(abi.decode_ioctl(NodeKind.CTL, iowr(0x2A, 32), bad), bytes(1000))
    assert (e.value.field, e.value.offset) == ("paramsSize", 24)
    huge = struct.pack("<IIIIQII", 1, 1, 0x20801303, 0, 0x7000, 0xFFFFFFF0, 0)
    with pytest.raises(DecodeError) as e:  # absurd length
        abi.nested(abi.decode_ioctl(NodeKind.CTL, iowr(0x2A, 32), huge))
    assert e.value.field == "paramsSize"
    assert "offset 24" in str(e.value) and "paramsSize" in str(e.value)


def test_nvtrace_malformed_and_round_trip():
    r1 = nvtrace.Record(type=1, fd=-1, cmd=1, ret=3, in_=b"/dev/nvidiactl\0")
    r2 = nvtrace.Record(type=2, fd=3, cmd=iowr(0x2A, 32), in_=bytes(32), out=bytes(32),
                        xin=b"ab", xout=b"cd", ts_ns=5, arg=0x1000)
    data = nvtrace.encode_records([r1, r2])
    back = list(nvtrace.iter_records(data))
    assert back == [r1, r2] and back[0].path == "/dev/nvidiactl"
    import io
    buf = io.BytesIO()
    nvtrace.Writer(buf).write_all(back)
    assert buf.getvalue() == data
    with pytest.raises(DecodeError) as e:
        list(nvtrace.iter_records(data[:-1]))
    assert e.value.field == "n_xout" and e.value.offset == len(r1.encode()) + 60
    with pytest.raises(DecodeError) as e:
        list(nvtrace.iter_records(data[:30]))
    assert e.value.field == "header" and e.value.offset == 0
    with pytest.raises(DecodeError) as e:
        list(nvtrace.iter_records(b"XXXX" + data[4:]))
    assert e.value.field == "magic"
    absurd = bytearray(r1.encode())
    struct.pack_into("<I", absurd, 48, 0xFFFFFFFF)
    with pytest.raises(DecodeError) as e:
        list(nvtrace.iter_records(bytes(absurd)))
    assert e.value.field == "n_in" and e.value.offset == 48


def test_535_table_rejects_580_layouts():
    # decoding a 580 trace with the 535 table must flag the controls whose size changed
    _traces()
    s = stats(registry.get(V535), nvtrace.read_file(str(NVML)))
    assert any("NV0000_CTRL_CMD_GPU_GET_PROBED_IDS: paramsSize 384 != " in e for e in s["errors"])
    assert "UNKNOWN(0xc00846da)" in s["unknown"]  # WAIT_OPEN_COMPLETE is not a 535 escape
