"""The ABI tables against the compiler, for every supported driver version.

scripts/abigen/abigen.py compiled a C probe against each tag's headers and stored gcc's
sizeof, _Alignof, offsetof and member sizes of every struct in the tables
(tests/data/abi/parity-<tag>.json.gz). Here devbroker's runtime layout engine (abi/spec.py,
with the role annotations of tables/base.py applied) must reproduce every one of them, from
the committed tables alone: no headers and no network in CI. Also: every control, class and
UVM command of the tables decodes by name with its layout, and the tables of a tag that are
written as differences were made against the base table that is committed.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import struct
from pathlib import Path

import pytest

from devbroker.abi import NodeKind, iowr, registry

DATA = Path(__file__).parent / "data" / "abi"
TAGS = registry.tags()
VERSION_OF_TAG = {registry.VERSIONS[v]["tag"]: v for v in registry.versions()}


def _parity(tag: str) -> dict:
    with gzip.open(DATA / f"parity-{tag}.json.gz") as f:
        doc = json.load(f)
    assert doc["tag"] == tag
    return doc["structs"]


def test_supported_versions_cover_each_production_branch():
    branches = {t.split(".")[0] for t in TAGS}
    assert {"535", "550", "570", "575", "580"} <= branches
    for tag in TAGS:
        assert (DATA / f"parity-{tag}.json.gz").exists(), tag
        importlib.import_module(f"devbroker.abi.tables.{registry.table_module(tag)}")


@pytest.mark.parametrize("tag", TAGS)
def test_every_struct_matches_gcc(tag):
    abi = registry.get(VERSION_OF_TAG[tag])
    raw = registry.raw_tag_tables(tag)["STRUCTS"]
    measured = _parity(tag)
    checked_fields = 0
    for name, (size, align, fields) in measured.items():
        spec = abi.struct(name)
        assert (spec.size, spec.align) == (size, align), (tag, name)
        for fname, off, fsize in fields:
            f = spec.by_name[fname]
            assert f.offset == off, (tag, name, fname, f.offset, off)
            if fsize:  # 0: an unnamed member, reached through its first field
                assert f.size == fsize, (tag, name, fname, f.size, fsize)
            checked_fields += 1
    # every struct of the tables was measured, except the types of unnamed members (checked
    # through their parents) and typedef aliases (checked as their targets)
    unmeasured = {n for n, (dsl, _src) in raw.items()
                  if not dsl.startswith("=") and n not in measured}
    assert all("___anon" in n for n in unmeasured), sorted(unmeasured)[:10]
    assert len(measured) > 1500 and checked_fields > 5000


@pytest.mark.parametrize("tag", [t for t in TAGS if t != registry.BASE_TAG])
def test_difference_tables_were_made_against_the_committed_base(tag):
    mod = importlib.import_module(f"devbroker.abi.tables.{registry.table_module(tag)}")
    base = Path(importlib.import_module(
        f"devbroker.abi.tables.{registry.table_module(registry.BASE_TAG)}").__file__)
    assert mod.BASE == registry.BASE_TAG
    assert mod.BASE_SHA256 == hashlib.sha256(base.read_bytes()).hexdigest(), (
        f"{base.name} changed after {tag}'s table was written: regenerate with "
        "scripts/abigen/abigen.py --all (docs/abi.md)")


@pytest.mark.parametrize("version", registry.versions())
def test_every_control_class_and_uvm_command_decodes_by_name(version):
    """Each published control goes through decode_ioctl/nested/decode_nested as a client's
    call would, with a parameter block of its size; each class's allocation parameters and
    each UVM command's too."""
    abi = registry.get(version)
    n = 0
    for cmd, op in abi.controls.items():
        assert op.name and not op.name.startswith("UNKNOWN"), hex(cmd)
        size = op.params.size if op.params is not None else 0
        arg = struct.pack("<IIIIQII", 1, 2, cmd, 0, 0x7000 if size else 0, size, 0)
        call = abi.decode_ioctl(NodeKind.CTL, iowr(0x2A, 32), arg)
        ref = abi.nested(call)
        if op.params is None:
            assert ref is None
            continue
        assert ref.op is op and ref.spec is op.params
        value = abi.decode_nested(call, bytes(size), ref)
        assert value.encode() == bytes(size)
        n += 1
    assert n > 1200
    for cid, op in abi.classes.items():
        assert op.name and not op.name.startswith("UNKNOWN")
        alloc = struct.pack("<IIIIQQIII4x", 1, 1, 2, cid, 0x9000, 0, 0, 0, 0)
        call = abi.decode_ioctl(NodeKind.CTL, iowr(0x2B, 48), alloc)
        ref = abi.nested(call)
        if op.params is not None:
            assert ref.size == op.params.size and ref.size_field == ""
            assert abi.decode_nested(call, bytes(ref.size), ref).encode() == bytes(ref.size)
    for cmd, op in abi.uvm_cmds.items():
        if op.params is not None:
            call = abi.decode_ioctl(NodeKind.UVM, cmd, bytes(op.params.size))
            assert call.name == op.name and call.value.encode() == bytes(op.params.size)


def test_escapes_follow_each_tags_headers():
    old, new = registry.get("535.309.01"), registry.get("580.159.04")
    assert old.escape(218) is None and new.escape(218).name == "NV_ESC_WAIT_OPEN_COMPLETE"
    assert old.escape(0x5F).name == "NV_ESC_RM_NVLOG_CTRL"
    assert new.escape(0x5F).name == "NV_ESC_RM_LOCKLESS_DIAGNOSTIC"
    for v in registry.versions():
        abi = registry.get(v)
        for nr in (0x2A, 0x2B, 0x29, 0x4E, 200, 201, 210):
            assert abi.escape(nr).params is not None or abi.escape(nr).array_of is not None


def test_unpublished_controls_are_named_by_their_range():
    abi = registry.get("580.159.04")
    op = abi.control_op(0x20809064)  # NV2080 category 0x90, in no header
    assert op.name == "NV2080_CTRL_CMD_CLK_LEGACY_NON_PRIVILEGED_UNPUBLISHED_64"
    assert op.unpublished and "GSS_LEGACY" in op.driver_flags
    # no published layout: opaque bytes of the size clients were seen to send, or none
    assert [f.name for f in op.params.fields] == ["data"] and op.params.source == "observed"
    assert abi.control_op(0x2080A612).params is None
    assert abi.control_name(0x20810108) == "NV2081_CTRL_CMD_UNPUBLISHED_0108"
    assert abi.control_name(0xDEAD0102) == "NVDEAD_CTRL_CMD_UNPUBLISHED_0102"
    # the same number is named the same in every version that does not publish it
    assert {registry.get(v).control_name(0x2080A612) for v in registry.versions()} == {
        "NV2080_CTRL_CMD_PMGR_LEGACY_NON_PRIVILEGED_UNPUBLISHED_12"}
    # published in 580 (with a layout), unpublished before
    assert abi.control_name(0x20801830) == "NV2080_CTRL_CMD_BUS_GET_PCIE_CPL_ATOMICS_CAPS"
    assert registry.get("535.309.01").control_op(0x20801830).unpublished


def test_published_controls_nvidia_smi_sends_are_named_with_their_layout():
    """The published controls `nvidia-smi -q` sent on the H200 are named with their layout,
    not UNKNOWN_CONTROL."""
    abi = registry.get("580.159.04")
    for cmd, name, size in ((0x20800133, "NV2080_CTRL_CMD_GPU_QUERY_ECC_CONFIGURATION", 8),
                            (0x20801830, "NV2080_CTRL_CMD_BUS_GET_PCIE_CPL_ATOMICS_CAPS", 4),
                            (0x20803404, "NV2080_CTRL_CMD_ECC_GET_REPAIR_STATUS", 2)):
        op = abi.control(cmd)
        assert (op.name, op.params.size) == (name, size)
        assert "NON_PRIVILEGED" in op.driver_flags


def test_unknown_driver_versions_are_refused_with_the_supported_ones_named():
    from devbroker.abi import UnknownVersion

    assert registry.require_supported("580.159.04") == "580.159.04"
    with pytest.raises(UnknownVersion) as e:
        registry.require_supported("999.1.2", "NVIDIA driver")
    msg = str(e.value)
    assert "999.1.2" in msg and "docs/abi.md" in msg
    assert all(v in msg for v in registry.versions())
