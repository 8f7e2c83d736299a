"""Per-driver-version registry.  A version is data: a header table (generated from the
open-gpu-kernel-modules tag closest to it), optionally a diff table on top of another one,
plus the hand-written facts in tables/base.py.  See docs/abi.md, "Adding a version".
"""
from __future__ import annotations

import importlib
import threading

from .driver import DriverABI, OpSpec
from .errors import UnknownVersion
from .spec import StructSpec, parse_fields
from .tables import base as _base

# driver version -> (header table module, diff module or None, escape overrides, note)
VERSIONS: dict[str, dict] = {
    "580.159.04": {"table": "hdr_580_142", "diff": None, "escapes": {},
                   "note": "layouts from tag 580.142, the newest 580 tag published"},
    "535.309.01": {"table": "hdr_580_142", "diff": "hdr_535_288_01",
                   "escapes": _base.ESCAPES_535,
                   "note": "layouts from tag 535.288.01, the newest 535 tag published"},
}

_cache: dict[str, DriverABI] = {}
_lock = threading.Lock()


def versions() -> list[str]:
    return sorted(VERSIONS)


def get(version: str) -> DriverABI:
    abi = _cache.get(version)
    if abi is not None:
        return abi
    if version not in VERSIONS:
        raise UnknownVersion(f"no ABI table for driver {version!r}; known: {', '.join(versions())}")
    with _lock:
        abi = _cache.get(version)
        if abi is None:
            abi = _cache[version] = _build(version, VERSIONS[version])
    return abi


def _load(mod: str):
    return importlib.import_module(f"{__package__}.tables.{mod}")


def _merge(base: dict, changed: dict, removed: list) -> dict:
    out = dict(base)
    out.update(changed)
    for k in removed:
        out.pop(k, None)
    return out


def raw_tables(version: str) -> dict:
    """The merged data tables of a version (before building specs); used by tests."""
    v = VERSIONS[version]
    t = _load(v["table"])
    tabs = {"STRUCTS": t.STRUCTS, "CONTROLS": t.CONTROLS, "CLASSES": t.CLASSES,
            "UVM": t.UVM, "SIZES": t.SIZES}
    tag = t.TAG
    if v["diff"]:
        d = _load(v["diff"])
        tag = d.TAG
        tabs = {k: _merge(tabs[k], getattr(d, k + "_CHANGED"), getattr(d, k + "_REMOVED"))
                for k in tabs}
    tabs["TAG"] = tag
    return tabs


def _annotate(name: str, dsl: str) -> str:
    items = []
    for item in dsl.split():
        fname, _, typ = item.partition(":")
        new = _base.ANNOTATIONS.get((name, fname))
        if new is not None:
            cnt = typ[typ.index("["):] if "[" in typ else ""
            typ = new + cnt
        items.append(f"{fname}:{typ}")
    return " ".join(items)


def _build(version: str, v: dict) -> DriverABI:
    tabs = raw_tables(version)
    raw = dict(tabs["STRUCTS"])
    raw.setdefault("NvU32", ("value:u32", "nvtypes.h"))
    specs: dict[str, StructSpec] = {}

    def lookup(name: str) -> StructSpec:
        s = specs.get(name)
        if s is not None:
            return s
        dsl, src = raw[name]
        if dsl.startswith("="):  # typedef alias of another struct
            s = lookup(dsl[1:])
        elif dsl.startswith("union<"):
            sz, al = dsl[6:-1].split(",")
            from .spec import Field
            s = StructSpec(name, [Field("raw", "union", size=int(sz), align=int(al))], source=src)
        else:
            s = StructSpec(name, parse_fields(_annotate(name, dsl), lookup), source=src)
        specs[name] = s
        return s

    for name in raw:
        lookup(name)

    def spec_or_none(name):
        return lookup(name) if name and name in raw else None

    escapes = {}
    esc_table = dict(_base.ESCAPES)
    for nr, e in v["escapes"].items():
        if e is None:
            esc_table.pop(nr, None)
        else:
            esc_table[nr] = e
    for nr, (ename, sname, extra) in esc_table.items():
        kind = "frontend" if nr >= 200 else "rm"
        variants = {}
        for vn in extra.get("variants", ()):
            vs = spec_or_none(vn)
            if vs is not None:
                variants[vs.size] = vs
        escapes[nr] = OpSpec(kind, nr, ename, spec_or_none(sname), variants=variants,
                             array_of=spec_or_none(extra.get("array_of")), source="nv-ioctl-numbers.h/nv_escape.h")
    controls = {}
    for cmd, (cname, pname, src) in tabs["CONTROLS"].items():
        controls[cmd] = OpSpec("control", cmd, cname, spec_or_none(pname), source=src)
    for cmd, cname in _base.NAMED_FROM_NVOC.items():
        controls.setdefault(cmd, OpSpec("control", cmd, cname, None,
                                        source="src/nvidia/generated/g_subdevice_nvoc.c"))
    for cmd, size in _base.UNPUBLISHED_CONTROLS.items():
        if cmd in controls:
            continue
        prefix = f"NV{cmd >> 16:04X}"
        pname = f"{prefix}_CTRL_UNPUBLISHED_{cmd:08X}_PARAMS"
        ps = StructSpec(pname, parse_fields(f"data:bytes[{size}]", lookup), source="observed")
        controls[cmd] = OpSpec("control", cmd, f"{prefix}_CTRL_CMD_UNPUBLISHED_{cmd:08X}", ps,
                               flags=frozenset({"unpublished"}), source="observed in traces")
    classes = {cid: OpSpec("class", cid, cname, spec_or_none(pname), source="class/cl*.h")
               for cid, (cname, pname) in tabs["CLASSES"].items()}
    uvm = {cmd: OpSpec("uvm", cmd, uname, spec_or_none(pname), source="uvm_ioctl.h")
           for cmd, (uname, pname) in tabs["UVM"].items()}
    return DriverABI(version, tag=tabs["TAG"], escapes=escapes, controls=controls,
                     classes=classes, uvm=uvm, structs=specs)
