"""The ABI owns where a call's NV status lives and how an escape's request number is made
(abi/driver.py: IoctlCall.with_status, DriverABI.with_status, DriverABI.escape_cmd); the
broker core, the real backend and the emulator use them instead of their own copies."""
import errno

import pytest

from devbroker.abi import NodeKind, iowr, registry
from devbroker.abi import status as nvs
from devbroker.backends.base import DriverCall
from devbroker.backends.real import not_supported


def _old_status_reply(call, status):
    """broker/core.py _status_reply before the ABI had with_status (bytes, or None for
    the errno answer)."""
    field_name = "rmStatus" if call.kind == "uvm" else "status"
    value = call.value
    inner = getattr(value, "params", None)
    if value is None or not (hasattr(value, field_name) or hasattr(inner, field_name)):
        return None
    if hasattr(value, "params") and not hasattr(value, field_name):
        value = value.replace(params=value.params.replace(**{field_name: status}))
    else:
        value = value.replace(**{field_name: status})
    return value.encode()


def _calls(abi):
    """Every escape layout and UVM command of the tables, decoded from a patterned buffer."""
    for nr, op in abi.escapes.items():
        for ps in {id(p): p for p in (op.params, *op.variants.values()) if p}.values():
            if ps.size:
                arg = bytes((i * 7 + 3) & 0xFF for i in range(ps.size))
                yield NodeKind.CTL, iowr(nr, ps.size), arg
    for cmd, op in abi.uvm_cmds.items():
        size = op.size
        yield NodeKind.UVM, cmd, bytes((i * 5 + 1) & 0xFF for i in range(size))


# Where the old rule (a field *named* status/rmStatus) and the driver differ: the OS events
# keep their NV status in `Status`, and NUMA_INFO / SET_NUMA_STATUS's `status` is a NUMA
# state the driver never sets to an NV error (it answers those with an errno).
BY_ROLE_NOT_NAME = {"NV_ESC_ALLOC_OS_EVENT": "Status", "NV_ESC_FREE_OS_EVENT": "Status",
                    "NV_ESC_NUMA_INFO": None, "NV_ESC_SET_NUMA_STATUS": None}


@pytest.mark.parametrize("version", registry.versions())
def test_with_status_is_the_old_status_reply_but_where_the_driver_differs(version):
    abi = registry.get(version)
    seen = {"set": 0, "none": 0}
    for node, cmd, arg in _calls(abi):
        try:
            call = abi.decode_ioctl(node, cmd, arg)
        except Exception:
            continue  # a layout this pattern does not decode (checked elsewhere)
        for st in (nvs.NV_OK, nvs.NV_ERR_NOT_SUPPORTED, nvs.NV_ERR_INVALID_ARGUMENT):
            got = call.with_status(st)
            assert abi.with_status(node, cmd, arg, st) == got, (call.name, st)
            if call.name in BY_ROLE_NOT_NAME:
                field = BY_ROLE_NOT_NAME[call.name]
                if field is None:
                    assert got is None, call.name
                else:
                    assert getattr(abi.decode_ioctl(node, cmd, got).value, field) == st
                continue
            want = _old_status_reply(call, st)
            assert got == want, (call.name, st)
        seen["set" if got is not None else "none"] += 1
    assert seen["set"] > 20 and seen["none"] > 0, seen


def test_with_status_where_the_status_lives():
    abi = registry.get("580.159.04")
    # Top level (NVOS21, RM_FREE's NVOS00), wrapped (RM_MAP_MEMORY's params.status), UVM's
    # rmStatus, and none (REGISTER_FD: the driver answers with an errno).
    free = abi.escape("NV_ESC_RM_FREE").params
    arg = free.decode(bytes(free.size)).replace(hRoot=1, hObjectOld=2).encode()
    out = abi.decode_ioctl(NodeKind.CTL, abi.escape_cmd("NV_ESC_RM_FREE"),
                           abi.with_status(NodeKind.CTL, abi.escape_cmd("NV_ESC_RM_FREE"), arg,
                                           nvs.NV_ERR_INVALID_CLIENT)).value
    assert (out.hRoot, out.hObjectOld, out.status) == (1, 2, nvs.NV_ERR_INVALID_CLIENT)
    mm = abi.escape("NV_ESC_RM_MAP_MEMORY")
    cmd = abi.escape_cmd("NV_ESC_RM_MAP_MEMORY")
    got = abi.with_status(NodeKind.CTL, cmd, bytes(mm.size), nvs.NV_ERR_NOT_SUPPORTED)
    assert abi.decode_ioctl(NodeKind.CTL, cmd, got).value.params.status == \
        nvs.NV_ERR_NOT_SUPPORTED
    reg = abi.escape_cmd("NV_ESC_REGISTER_FD")
    assert abi.with_status(NodeKind.CTL, reg, bytes(abi.escape("NV_ESC_REGISTER_FD").size),
                           nvs.NV_OK) is None


def test_escape_cmd_is_iowr_of_the_number():
    abi = registry.get("580.159.04")
    for name in ("NV_ESC_RM_CONTROL", "NV_ESC_RM_ALLOC", "NV_ESC_CARD_INFO",
                 "NV_ESC_CHECK_VERSION_STR"):
        spec = abi.escape(name)
        assert abi.escape_cmd(name) == iowr(spec.number, spec.size)
        assert abi.escape_cmd(name, 40) == iowr(spec.number, 40)


def test_real_backend_not_supported_answers():
    abi = registry.get("580.159.04")
    ctl = abi.escape("NV_ESC_RM_CONTROL").params
    call = abi.decode_ioctl(NodeKind.CTL, abi.escape_cmd("NV_ESC_RM_CONTROL"), bytes(ctl.size))
    r = not_supported(DriverCall(call, b"nested"))
    assert r.errno == 0 and r.nested == b"nested"
    assert abi.decode_ioctl(NodeKind.CTL, call.cmd, r.arg).value.status == \
        nvs.NV_ERR_NOT_SUPPORTED
    reg = abi.decode_ioctl(NodeKind.CTL, abi.escape_cmd("NV_ESC_REGISTER_FD"),
                           bytes(abi.escape("NV_ESC_REGISTER_FD").size))
    r = not_supported(DriverCall(reg))
    assert r.errno == errno.EINVAL and r.arg == reg.encode()
